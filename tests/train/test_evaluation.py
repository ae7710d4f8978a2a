"""Evaluation on the common clock: the grid, the states kept at its points, the points every rank
scores, and the search for the first point at the target."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from prague.comm.flat import flatten, state_tensors
from prague.train.evaluation import (
    SnapshotLog, common_points, curve_indices, first_reaching, grid_level, start_together,
)
from prague_testing import join_all, start_thread


def _model(value: float) -> nn.Module:
    model = nn.Linear(2, 1)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def _value(state: torch.Tensor) -> float:
    return float(state[0])


def test_grid_doubles_its_interval_to_keep_at_most_max_points() -> None:
    assert grid_level(10.0, 1.0, 64) == 0
    assert grid_level(64.0, 1.0, 64) == 0
    assert grid_level(64.5, 1.0, 64) == 1
    assert grid_level(300.0, 1.0, 64) == 3  # 300 / 8 = 37.5 intervals of 8 s
    assert common_points(3.5, 1.0) == [0, 1, 2, 3]
    assert common_points(130.0, 1.0, 64) == list(range(0, 131, 4))


def test_a_worker_keeps_the_state_it_had_at_each_point_whatever_its_speed() -> None:
    """A slow worker (steps of 2.5 s) and a fast one (0.375 s), each observing before its steps: the state
    kept for point t is the one after its last step that ended before t (a point at a step's end sees
    that step done)."""
    for step_s in (2.5, 0.375):  # exact in binary: the step ends fall where the arithmetic says
        log, model, now, k = SnapshotLog(1.0), _model(0.0), 0.0, 0
        while now < 6.0:
            log.observe(model, now)
            now += step_s
            k += 1
            with torch.no_grad():
                model.weight.fill_(k)  # the state after step k, reached at k * step_s
        log.observe(model, now)
        for j, state in log.entries.items():
            assert _value(state) == int(j / step_s + 1e-9), (step_s, j)  # steps finished by time j
        assert sorted(log.entries) == list(range(0, int(now) + 1))


def test_points_after_a_worker_stopped_take_its_final_state_and_thinning_keeps_the_coarse_grid() -> None:
    log = SnapshotLog(1.0, max_points=8)
    for t in range(0, 8):
        log.observe(_model(t), float(t))
    assert sorted(log.entries) == list(range(8))
    log.observe(_model(99), 20.0)  # one step from 7 s to 20 s; the grid is every 4 s now
    assert sorted(log.entries) == [0, 4, 8, 12, 16, 20]
    final = flatten(state_tensors(_model(-1)))
    states = log.states(common_points(30.0, 1.0, 8), final)
    # Points 0..28 every 4 s: during the long step the state it started from, at its end (20 s) the new one,
    # after the worker stopped its final state.
    assert [_value(s) for s in states] == [0, 4, 7, 7, 7, 99, -1, -1]


def test_curve_indices_spread_evenly_with_both_ends() -> None:
    assert curve_indices(5, 12) == [0, 1, 2, 3, 4]
    picked = curve_indices(100, 12)
    assert len(picked) == 12 and picked[0] == 0 and picked[-1] == 99


@pytest.mark.parametrize("crossing", [0, 1, 17, 50, 98, 99])
def test_first_reaching_finds_the_crossing_of_a_rising_curve_with_few_scores(crossing: int) -> None:
    calls: list[int] = []

    def accuracy(i: int) -> float:
        calls.append(i)
        return 0.9 if i >= crossing else 0.5

    scores, hit = first_reaching(accuracy, 100, 0.8)
    assert hit == crossing
    assert len(calls) == len(set(calls)) <= 12 + 7  # the curve, then a bisection of at most log2(100 / 11)
    assert first_reaching(accuracy, 100, None)[1] is None
    assert first_reaching(lambda i: 0.1, 100, 0.8)[1] is None


def test_every_rank_starts_at_one_instant() -> None:
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    starts: dict[int, tuple[float, float]] = {}

    def rank(r: int) -> None:
        time.sleep(0.05 * r)  # arriving one after another
        agreed = start_together(store.clone(), r, 3)
        starts[r] = (agreed, time.time())

    join_all([start_thread(rank, r) for r in range(3)], 30)
    assert len({a for a, _ in starts.values()}) == 1
    agreed = starts[0][0]
    assert all(agreed <= woke < agreed + 0.05 for _, woke in starts.values())


def test_the_evaluator_scores_the_newest_point_every_rank_can_give() -> None:
    from prague.train.evaluator import newest_complete

    assert newest_complete({}, set(), 2) is None
    assert newest_complete({0: {0, 1, 2}, 1: {0, 1}}, set(), 2) == 1  # rank 1 has not written point 2 yet
    # Rank 1 ended after point 1: its final state stands for the later points, not for a gap before its end.
    assert newest_complete({0: {0, 1, 2, 3}, 1: {0, 1}}, {1}, 2) == 3
    assert newest_complete({0: {2, 3}, 1: {1, 3}}, {1}, 2) == 3
    assert newest_complete({0: {2}, 1: {1, 3}}, {1}, 2) is None  # point 2: rank 1 skipped it before its end
