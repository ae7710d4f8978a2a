"""``prague``'s control flow at a step's end and after the last step (:mod:`prague.algorithms.prague.flow`):
the one sequence of effects the runtime and the simulator both perform."""

from __future__ import annotations

import pytest

from prague.algorithms.prague.flow import (
    ASK, CATCH_UP, COMMITTED, DONE, DRAIN, FINAL, REDUCE, SETTLE, SUBMIT, TAKE_OLDEST, TAKE_READY, OverlapCounts,
    averaging, finishing, overlapped_step,
)


def _effects(out: list[int], max_in_flight: int, policy: str, counts: OverlapCounts, ready: int = 0) -> list[str]:
    """Drive one step's end over ``out`` averages in flight, ``ready`` of which have come back."""
    seen = []
    state = {"out": out[0]}
    for effect in overlapped_step(lambda: state["out"], max_in_flight, policy, counts):
        seen.append(effect)
        if effect == TAKE_READY:
            state["out"] -= ready
        elif effect == TAKE_OLDEST:
            state["out"] -= 1
        elif effect == SUBMIT:
            state["out"] += 1
    out[0] = state["out"]
    return seen


def test_a_step_takes_what_came_back_then_submits_while_there_is_room() -> None:
    counts = OverlapCounts()
    out = [0]
    assert _effects(out, 1, "local", counts) == [TAKE_READY, SUBMIT] and out == [1]


def test_with_the_limit_out_a_step_goes_local_or_waits_for_the_oldest_by_its_policy() -> None:
    counts = OverlapCounts()
    assert _effects([1], 1, "local", counts) == [TAKE_READY] and counts.busy_local_steps == 1
    assert _effects([1], 1, "wait", counts) == [TAKE_READY, TAKE_OLDEST, SUBMIT] and counts.average_waits == 1
    # one came back meanwhile: the room is read after the ready ones were taken
    assert _effects([1], 1, "local", counts, ready=1) == [TAKE_READY, SUBMIT] and counts.busy_local_steps == 1


def test_after_the_last_step_every_average_then_the_committed_groups_then_the_final_average() -> None:
    assert list(finishing(False)) == [DRAIN, COMMITTED]
    assert list(finishing(True)) == [DRAIN, COMMITTED, FINAL]


def _request(group_size: int, averages: object = True) -> list[tuple[str, object]]:
    """Drive one request of the averaging thread whose group has ``group_size`` members; REDUCE answers
    ``averages``."""
    from prague.groups import Group

    flow = averaging()
    seen = []
    effect = next(flow)
    while effect[0] != DONE:
        seen.append(effect)
        reply = {ASK: Group(seq=7, members=tuple(range(group_size))), REDUCE: averages}.get(effect[0])
        effect = flow.send(reply)
    assert effect == (DONE, None)
    with pytest.raises(StopIteration):  # DONE is the last effect: nothing follows it
        flow.send(None)
    return seen


def test_a_request_asks_catches_up_reduces_then_settles_its_correction() -> None:
    seen = _request(3)
    assert [e for e, _ in seen] == [ASK, CATCH_UP, REDUCE, SETTLE]
    assert seen[1][1].members == (0, 1, 2) and seen[-1] == (SETTLE, True)


def test_a_group_of_one_settles_a_zero_correction_without_averaging() -> None:
    assert _request(1) == [(ASK, None), (SETTLE, False)]


def test_a_group_whose_other_members_all_failed_settles_a_zero_correction() -> None:
    assert _request(3, averages=False)[-1] == (SETTLE, False)
    assert _request(3, averages=None)[-1] == (SETTLE, True)  # None: it averaged (a runner that returns nothing)
