"""Evaluation on the common clock: the grid, the states kept at its points, the points every rank
scores, and the time-order search for the first point at each target."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import cast

import pytest
import torch
import torch.distributed as dist
from torch import nn

from prague.comm.flat import flatten, state_tensors
from prague.errors import ConfigError
from prague.metrics.grid import (
    COARSE, CURVE_POINTS, coarse_positions, curve_indices, grid_points, kept, next_kept, scan, smoothed_crossing,
)
from prague.train.closing import Closing
from prague.train.config import RunConfig
from prague.train.evaluation import SnapshotLog, start_together, tally
from prague.train.evaluator import eval_dir
from prague.train.loop import agreed_stop_point
from prague_testing import join_all, start_thread


def _model(value: float) -> nn.Module:
    model = nn.Linear(2, 1)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def _value(state: torch.Tensor) -> float:
    return float(state[0])


# The grid


def test_every_index_up_to_dense_is_kept_then_the_interval_doubles_with_the_index() -> None:
    assert [j for j in range(41) if kept(j, 8)] == [*range(9), 10, 12, 14, 16, 20, 24, 28, 32, 40]
    assert kept(64, 64) and not kept(65, 64) and kept(66, 64) and not kept(130, 64) and kept(132, 64)
    for dense in (1, 5, 8, 64):
        walked, j = [], 0
        while j <= 2000:
            walked.append(j)
            j = next_kept(j, dense)
        assert walked == [j for j in range(2001) if kept(j, dense)], dense


def test_jobs_of_any_length_keep_the_same_instants_and_memory_grows_with_the_log_of_the_length() -> None:
    short, long = grid_points(100.0, 0.5), grid_points(10_000.0, 0.5)
    assert long[:len(short)] == short and long[len(short)] > 200  # the short job's instants, then later ones
    assert short[-1] == 200
    # 0..64 every interval, then 32 more points each time the elapsed time doubles
    assert [len(grid_points(64.0 * 2 ** k, 1.0)) for k in range(6)] == [65 + 32 * k for k in range(6)]
    assert grid_points(3.5, 1.0) == [0, 1, 2, 3]
    assert grid_points(math.inf, 1.0) == [0]  # a log that is never observed (no evaluation)


def test_two_jobs_of_different_lengths_record_and_score_the_same_instants() -> None:
    """A 40 s job and a 300 s job, each stepping every 0.25 s, keep states at the same instants up to the
    shorter one's end, and the time-order scan finds the same time to target on the same curve (accuracy
    as a function of time: the same training, one stopped earlier)."""
    logs = {}
    for job_s in (40.0, 300.0):
        log, t = SnapshotLog(1.0, dense=16), 0.0
        while t <= job_s:
            log.observe(_model(t), t)
            t += 0.25
        logs[job_s] = log
    shared = [j for j in logs[300.0].entries if j <= 40]
    assert sorted(logs[40.0].entries) == sorted(shared) == grid_points(40.0, 1.0, 16)

    def time_to_target(job_s: float) -> tuple[float | None, list[float]]:
        points = grid_points(job_s, 1.0, 16)
        times = [j * 1.0 for j in points] + [job_s]
        found = scan(lambda i: (min(1.0, times[i] / 30.0), 1.0), times, 0.7)
        coarse = [times[i] for i in coarse_positions(len(times))[:-1]]
        return None if found.accuracy_hit is None else times[found.accuracy_hit], coarse

    (short, short_coarse), (long, long_coarse) = time_to_target(40.0), time_to_target(300.0)
    assert short == long == 22.0  # 21 s is not kept: every 2 s from 16 s (dense=16) to 32 s
    assert long_coarse[:len(short_coarse)] == short_coarse  # the coarse instants: one grid for every job


# The states kept


def test_a_worker_keeps_the_state_it_had_at_each_point_whatever_its_speed() -> None:
    """A slow worker (steps of 2.5 s) and a fast one (0.375 s), each observing before its steps: the state
    kept for point t is the one after its last step that ended at or before t."""
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


def test_a_long_step_among_short_ones_records_the_state_before_it_for_the_point_it_crosses() -> None:
    """Steps of 0.1 s, then one of 0.5 s from 0.6 s to 1.1 s across the point at 1.0 s, then 0.1 s again:
    at 1.0 s the worker held the state after its 6th step (the long 7th had not ended). Guessing from the
    recent step lengths whether a point may pass before the next call (and otherwise recording the state
    found at the next call) records the 7th step's state there, a state from after the instant."""
    log, model, steps = SnapshotLog(1.0), _model(0.0), 0
    ends = [0.1 * k for k in range(1, 7)] + [1.1] + [1.1 + 0.1 * k for k in range(1, 10)]
    now = 0.0
    for end in ends:
        log.observe(model, now)
        steps += 1
        with torch.no_grad():
            model.weight.fill_(steps)  # in place: the log's copies must not follow the model
        now = end
    log.observe(model, now)
    assert sorted(log.entries) == [0, 1, 2]
    assert [_value(log.entries[j]) for j in (0, 1, 2)] == [0, 6, 16]


def test_points_passed_in_one_long_step_share_one_state_and_a_stopped_worker_gives_its_final_state() -> None:
    log = SnapshotLog(1.0, dense=8)
    for t in range(0, 8):
        log.observe(_model(t), float(t))
    assert sorted(log.entries) == list(range(8))
    log.observe(_model(99), 20.0)  # one step from 7 s to 20 s
    assert sorted(log.entries) == [*range(9), 10, 12, 14, 16, 20]
    assert all(log.entries[j] is log.entries[8] for j in (10, 12, 14, 16))  # one copy for the long step
    final = flatten(state_tensors(_model(-1)))
    # This worker's last call was at 20 s and it ended (closed its method) at 22.5 s: 24 s and later are
    # after its end (its final state); a point in between takes the state at its last call.
    states = log.states([0, 7, 8, 16, 20, 22, 24, 28], final, end_s=22.5)
    assert [_value(s) for s in states] == [0, 7, 7, 7, 99, 99, -1, -1]


def test_a_resumed_log_keeps_the_checkpoint_s_points_and_hands_each_new_one_to_its_sink() -> None:
    handed: list[tuple[int, float]] = []
    log = SnapshotLog(1.0, dense=4, sink=lambda j, state: handed.append((j, _value(state))))
    old = flatten(state_tensors(_model(1)))
    log.restore([(0, old), (1, old), (3, old), (5, old)])  # 5 is not on the grid of 4 dense points
    assert sorted(log.entries) == [0, 1, 3]
    log.observe(_model(7), 3.5)  # the first call after the resume: no step ran since the checkpoint
    log.observe(_model(8), 6.0)
    assert [_value(log.entries[j]) for j in (0, 1, 3, 4, 6)] == [1, 1, 1, 7, 8]
    assert handed == [(4, 7), (6, 8)]


# Scoring: the time-order scan


def test_the_scan_finds_the_first_crossing_where_a_spike_is_followed_by_a_dip_below_the_target() -> None:
    """Below the target until position 30, above it for a short spike (30-33), below again in a dip
    (34-59), above from 60. The evenly spread curve of the old search scores 36, in the dip, and a
    bisection between its last point below and first above finds 60; scoring in time order finds 30."""
    target = 0.8

    def accuracy(i: int) -> float:
        return 0.85 if 30 <= i < 34 else 0.75 if 34 <= i < 60 else 0.9 if i >= 60 else 0.5

    assert 36 in curve_indices(100) and accuracy(36) < target  # where the evenly spread curve looks
    calls: list[int] = []

    def evaluate(i: int) -> tuple[float, float]:
        calls.append(i)
        return accuracy(i), 1.0

    found = scan(evaluate, [float(i) for i in range(100)], target)
    assert found.accuracy_hit == 30
    assert calls[:10] == [0, 4, 8, 12, 16, 20, 24, 28, 32, 29] and calls[10] == 30  # coarse, then back
    assert len(calls) == len(set(calls)) <= 100 // COARSE + COARSE + CURVE_POINTS
    assert found.curve == sorted(found.curve) and set(found.curve) <= set(coarse_positions(100))
    assert 99 in found.scores  # the job's end


def test_the_scan_misses_only_an_excursion_between_two_coarse_points_below_the_target() -> None:
    """The documented assumption: a crossing that is over before the next coarse point is not seen."""
    def evaluate(i: int) -> tuple[float, float]:
        return (0.9 if i in (5, 6) or i >= 41 else 0.5), 1.0

    found = scan(evaluate, [float(i) for i in range(100)], 0.8)
    assert found.accuracy_hit == 41 and 5 not in found.scores
    assert scan(evaluate, [float(i) for i in range(CURVE_POINTS)], 0.8).accuracy_hit == 5  # few points: all


def test_a_known_point_that_reached_the_target_is_scored_when_the_coarse_points_straddle_it() -> None:
    """A job stopped by --stop-at-target right after its evaluator saw the target at position 70 (71, the
    job's end, dipped below): the coarse points 68 and 71 are both short of it, so without the evaluator's
    point the target is not found at all; with it, the positions between 68 and 70 are refined too. The
    coarse curve stays the coarse points."""
    def evaluate(i: int) -> tuple[float, float]:
        return (0.9 if i in (69, 70) else 0.5 + i / 1000), 1.0

    times = [float(i) for i in range(72)]
    assert scan(evaluate, times, 0.8).accuracy_hit is None
    found = scan(evaluate, times, 0.8, known=[70])
    assert found.accuracy_hit == 69 and 70 in found.scores
    assert set(found.curve) <= set(coarse_positions(72)) and 70 not in found.curve
    assert scan(evaluate, times, 0.8, known=[70, 500, -1]).accuracy_hit == 69  # out of range: ignored


def test_the_scan_looks_for_both_targets_in_one_time_order_pass() -> None:
    """Accuracy reaches 0.8 at position 30; the loss falls to 0.5 at 50: the scan goes on, coarse, past
    the first hit, then scores the positions before the coarse point that reached the loss target."""
    def evaluate(i: int) -> tuple[float, float]:
        return (0.9 if i >= 30 else 0.5), (0.4 if i >= 50 else 1.0)

    times = [0.5 * i for i in range(200)]
    found = scan(evaluate, times, 0.8, 0.5)
    assert (found.accuracy_hit, found.loss_hit) == (30, 50)
    assert not any(i in found.scores for i in range(53, 199) if i % COARSE)  # coarse and sparse after the hits
    assert len([i for i in found.scores if i > 52]) <= CURVE_POINTS
    assert scan(evaluate, times, None, 0.5).loss_hit == 50 and scan(evaluate, times, None, 0.5).accuracy_hit is None
    never = scan(lambda i: (0.5, 2.0), times, 0.8, 0.5)
    assert never.accuracy_hit is None and never.loss_hit is None and never.smoothed_s is None
    assert set(never.scores) == set(coarse_positions(200))  # coarse to the end
    untargeted = scan(evaluate, times)
    assert sorted(untargeted.scores) == curve_indices(200)


def test_the_smoothed_time_is_where_the_mean_of_three_coarse_points_crosses_interpolated() -> None:
    times = [0.0, 1.0, 2.0, 3.0, 4.0]
    assert smoothed_crossing(times, [0.0, 0.0, 0.9, 0.9, 0.9], 0.6) == 2.0  # smoothed: 0, .3, .6, .9, .9
    assert smoothed_crossing(times, [0.0, 0.0, 0.9, 0.9, 0.9], 0.45) == pytest.approx(1.5)
    assert smoothed_crossing(times, [0.0, 0.0, 0.9, 0.0, 0.0], 0.5) is None  # one point's spike
    assert smoothed_crossing(times, [0.9, 0.9, 0.0, 0.0, 0.0], 0.5) == 0.0

    # In a scan: a one-point spike at coarse position 20 is the raw hit; the smoothed curve crosses when
    # the accuracy stays up, from 60 (the scan went on, coarse, until it did).
    def evaluate(i: int) -> tuple[float, float]:
        return (0.9 if i == 20 or i >= 60 else 0.5), 1.0

    found = scan(evaluate, [float(i) for i in range(100)], 0.8)
    assert found.accuracy_hit == 20
    assert found.smoothed_s is not None and 60 < found.smoothed_s <= 64  # smoothed (56, .63), (60, .77), (64, .9)
    assert found.smoothed_s == pytest.approx(60 + (0.8 - 2.3 / 3) / (0.9 - 2.3 / 3) * 4)  # 61 s


def test_target_loss_must_be_a_positive_finite_loss(tmp_path: Path) -> None:
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ConfigError, match="--target-loss"):
            RunConfig(target_loss=bad, out=tmp_path / "r")
    assert RunConfig(target_loss=0.5, out=tmp_path / "r").target_loss == 0.5


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


class _Echo(nn.Module):
    """Predicts each token itself, for the next one: logits (B, 256, T) peaked at the input token."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot(tokens, 256).float().transpose(1, 2) * 10


def test_a_text_model_is_scored_on_every_next_token_not_once_per_window() -> None:
    x = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    y = torch.tensor([[1, 9, 3, 9], [9, 9, 9, 8]])  # 3 of the 8 next tokens equal the input
    correct, loss = tally(_Echo(), x, y, torch.device("cpu"), batch_size=1)
    assert correct == 3
    per_token = torch.nn.functional.cross_entropy(_Echo()(x).double(), y, reduction="none")
    assert per_token.shape == (2, 4) and math.isclose(loss, float(per_token.sum()))


class _Peers:
    """A closing group whose other ranks read ``others`` (-1: no file) when this rank reads its own."""

    def __init__(self, others: list[float]) -> None:
        self.others = others

    def all_gather_floats(self, value: float) -> list[float]:
        return [value, *self.others]


@pytest.mark.parametrize(("written", "others", "agreed"), [
    (None, [-1.0, -1.0], None),  # no rank saw a stop
    (None, [-1.0, 140.0], 140),  # written while this rank closed, after it read: it scores the point too
    (140, [-1.0, -1.0], 140),  # written after the others read
    (140, [140.0, 140.0], 140),
])
def test_the_stop_point_is_agreed_by_every_closing_rank(tmp_path: Path, written: int | None, others: list[float],
                                                        agreed: int | None) -> None:
    """The evaluator can write its STOP file while the ranks close (a job that ended on its budget while the
    evaluator, behind, reached the target): every rank scores the same points, the latest any rank read."""
    if written is not None:
        eval_dir(tmp_path).mkdir(parents=True)
        (eval_dir(tmp_path) / "STOP").write_text(f"point {written} accuracy 0.986000\n")
    assert agreed_stop_point(tmp_path, cast(Closing, _Peers(others))) == agreed
