"""Throughput over one common window and one no-wait limit per scenario (the bench's accounting)."""

from __future__ import annotations

import statistics
from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prague.metrics.report import harmonize_limits
from prague.metrics.summary import (
    WorkerTiming, base_compute_s, common_window, mean_after, mean_slowdowns, scenario_limit, throughput,
)


def _timing(ends: list[float], compute: float = 0.1, slowdown: list[float] | None = None) -> WorkerTiming:
    n = len(ends)
    return WorkerTiming(end_s=ends, compute_s=[compute] * n, comm_s=[0.0] * n, wait_s=[0.0] * n,
                        slowdown=slowdown or [1.0] * n)


def test_throughput_counts_the_steps_inside_the_common_window() -> None:
    fast = _timing([float(k) for k in range(1, 11)])  # one step a second, done at 10
    late = _timing([5.0 + k for k in range(1, 11)])  # starts 5 s later, done at 15
    assert common_window([fast, late], warmup=2) == (7.0, 10.0)  # late's 2nd step .. fast's last
    # Inside (7, 10]: fast ends steps at 8, 9, 10 and late at 8, 9, 10: six steps of 32 samples in 3 s.
    assert throughput([fast, late], batch_size=32, warmup=2) == pytest.approx(6 * 32 / 3)
    # Per-worker windows would have credited each worker with its own full rate (2 x 32 samples/s).
    assert throughput([fast, late], batch_size=32, warmup=2) == pytest.approx(64.0)


def test_a_worker_finishing_early_does_not_stretch_anyone_else() -> None:
    fast = _timing([0.5 * k for k in range(1, 21)])  # 2 steps/s, done at 10
    slow = _timing([2.0 * k for k in range(1, 11)])  # 0.5 steps/s, done at 20
    start, end = common_window([fast, slow], warmup=1)  # type: ignore[misc]
    assert (start, end) == (2.0, 10.0)
    # (2, 10]: fast 16 steps, slow 4 steps.
    assert throughput([fast, slow], batch_size=1, warmup=1) == pytest.approx(20 / 8)


def test_without_a_common_window_the_per_worker_rates_are_summed() -> None:
    early = _timing([1.0, 2.0, 3.0])
    late = _timing([10.0, 11.0, 12.0])  # warm only after early finished
    assert common_window([early, late], warmup=1) is None
    assert throughput([early, late], batch_size=1, warmup=1) == pytest.approx(1.0 + 1.0)


def test_a_worker_that_stopped_within_its_warm_up_still_has_a_rate() -> None:
    """A run stopped early (it diverged) can leave a worker with fewer steps than the warm-up: its rate
    is taken after all but one of its steps, never an index error."""
    stopped = _timing([1.0, 2.0, 3.0])
    other = _timing([10.0, 11.0])  # no common window with the first
    assert throughput([stopped, other], batch_size=1, warmup=5) == pytest.approx(1.0 + 1.0)
    assert throughput([_timing([4.0])], batch_size=1, warmup=5) == pytest.approx(0.25)  # from its start


def test_base_compute_removes_the_injected_slowdown() -> None:
    # Emulated: a slowdown f sleeps (f - 1) nominal computes on top of the step.
    t = _timing([1.0, 2.0, 3.0], slowdown=[1.0, 5.0, 1.0])
    t = WorkerTiming(end_s=t.end_s, compute_s=[0.12, 0.52, 0.12], comm_s=t.comm_s, wait_s=t.wait_s, slowdown=t.slowdown)
    assert base_compute_s([t], warmup=0, nominal_s=0.1) == pytest.approx(0.12)
    # Real: the slowdown scales the measured compute.
    r = WorkerTiming(end_s=t.end_s, compute_s=[0.2, 1.0, 0.2], comm_s=t.comm_s, wait_s=t.wait_s, slowdown=t.slowdown)
    assert base_compute_s([r], warmup=0, nominal_s=None) == pytest.approx(0.2)


def test_scenario_limit_is_linear_in_the_mean_factor() -> None:
    # Emulated: a worker with mean factor 2 takes base + nominal per step on average.
    assert scenario_limit([1.0, 2.0], base_s=0.12, nominal_s=0.1, batch_size=32) == pytest.approx(32 / 0.12 + 32 / 0.22)
    assert scenario_limit([1.0, 2.0], base_s=0.1, nominal_s=None, batch_size=32) == pytest.approx(32 / 0.1 + 32 / 0.2)


def test_every_method_of_a_bench_gets_the_same_limit_per_scenario() -> None:
    common = {"nproc": 2, "batch_size": 32, "compute_mode": "emulated", "compute_ms": 100.0}
    records = [
        {**common, "algorithm": "allreduce", "scenario": "paper:5", "throughput_samples_per_s": 300.0,
         "base_compute_s": 0.125, "mean_slowdown": [1.5, 1.0], "no_wait_limit_samples_per_s": 1.0},
        {**common, "algorithm": "prague", "scenario": "paper:5", "throughput_samples_per_s": 400.0,
         "base_compute_s": 0.160, "mean_slowdown": [1.5, 1.0], "no_wait_limit_samples_per_s": 2.0},
        {**common, "algorithm": "prague", "scenario": "homogeneous", "throughput_samples_per_s": 500.0,
         "base_compute_s": 0.130, "mean_slowdown": [1.0, 1.0]},
    ]
    out = harmonize_limits(records)
    paper = 32 / (0.125 + 0.05) + 32 / 0.125  # the least base compute of the bench, the scenario's draws
    assert [r["no_wait_limit_samples_per_s"] for r in out[:2]] == pytest.approx([paper, paper])
    assert out[1]["fraction_of_limit"] == pytest.approx(400.0 / paper)
    assert out[2]["no_wait_limit_samples_per_s"] == pytest.approx(2 * 32 / 0.125)
    assert records[0]["no_wait_limit_samples_per_s"] == 1.0  # inputs untouched


_finite = st.floats(min_value=1e-3, max_value=10.0, allow_nan=False)


@st.composite
def _logs(draw: st.DrawFn) -> tuple[list[WorkerTiming], int]:
    """Workers of unequal step counts (a claimed budget), lists or raw arrays, some without a slowdown log."""
    timings = []
    for _ in range(draw(st.integers(1, 4))):
        steps = draw(st.integers(1, 12))
        compute = draw(st.lists(_finite, min_size=steps, max_size=steps))
        slowdown = draw(st.one_of(st.just([]), st.lists(st.floats(1.0, 5.0), min_size=steps, max_size=steps)))
        ends = sorted(draw(st.lists(st.floats(0.0, 20.0), min_size=steps, max_size=steps)))
        as_array = draw(st.booleans())
        cast = (lambda v: array("d", v)) if as_array else list
        timings.append(WorkerTiming(end_s=cast(ends), compute_s=cast(compute), comm_s=cast(compute),
                                    wait_s=cast(compute), slowdown=cast(slowdown)))
    return timings, draw(st.integers(0, 6))


@given(_logs(), st.sampled_from([None, 0.1]))
def test_the_summaries_are_exactly_the_element_by_element_definitions(logs: tuple[list[WorkerTiming], int],
                                                                      nominal: float | None) -> None:
    """The summaries are taken in C over millions of logged steps; each equals, float for float, the definition
    written one element at a time: the median of the unslowed computes, the fsum mean, the count in the window."""
    timings, warmup = logs
    values = []
    for t in timings:
        factors = list(t.slowdown) or [1.0] * len(t.compute_s)
        for c, f in list(zip(t.compute_s, factors))[warmup:]:
            values.append(c - (f - 1.0) * nominal if nominal is not None else c / f)
    assert base_compute_s(timings, warmup, nominal) == (statistics.median(values) if values else 0.0)
    for t in timings:
        window = list(t.compute_s[warmup:]) or list(t.compute_s)
        assert mean_after(t.compute_s, warmup) == statistics.fmean(window)
    assert mean_slowdowns(timings, warmup) == [statistics.fmean(list(t.slowdown[warmup:]) or list(t.slowdown) or [1.0])
                                               for t in timings]
    window = common_window(timings, warmup)
    if window is not None:
        start, end = window
        steps = sum(sum(1 for e in t.end_s if start < e <= end) for t in timings)
        assert throughput(timings, 1, warmup) == steps / (end - start)
