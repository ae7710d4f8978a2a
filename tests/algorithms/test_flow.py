"""``prague``'s control flow at a step's end and after the last step (:mod:`prague.algorithms.prague.flow`):
the one sequence of effects the runtime and the simulator both perform."""

from __future__ import annotations

from prague.algorithms.prague.flow import (
    COMMITTED, DRAIN, SUBMIT, TAKE_OLDEST, TAKE_READY, OverlapCounts, finishing, overlapped_step,
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


def test_after_the_last_step_every_average_then_the_committed_groups() -> None:
    assert list(finishing()) == [DRAIN, COMMITTED]
