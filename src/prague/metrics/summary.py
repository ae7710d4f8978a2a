"""Throughput and the no-wait limit from per-iteration records (docs/ARCHITECTURE.md, "The run record").

Pure functions over the records every worker writes, so the runtime, the simulator and tests compute
them the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import median

import numpy as np


@dataclass(frozen=True)
class WorkerTiming:
    """One worker's timeline: training-clock time at the end of each step, and its compute times."""

    end_s: Sequence[float]
    compute_s: Sequence[float]
    comm_s: Sequence[float]
    wait_s: Sequence[float]
    start_s: float = 0.0
    slowdown: Sequence[float] = ()  # the injected slowdown factor of each step (1.0: none)


def warmup_steps(total_steps: int, requested: int | None) -> int:
    """Steps excluded from the throughput window: the request, capped so that a window remains."""
    default = min(5, total_steps // 5)
    w = default if requested is None else requested
    return max(0, min(w, total_steps - 1))


def worker_rate(t: WorkerTiming, batch_size: int, warmup: int) -> float:
    """Samples per second of one worker over the steps after ``warmup`` (all but its last step's worth of
    warm-up when it stopped within it: a run that diverged or was stopped early)."""
    n = len(t.end_s)
    if n == 0:
        return 0.0
    warmup = min(warmup, n - 1)
    start = t.start_s if warmup == 0 else t.end_s[warmup - 1]
    span = t.end_s[-1] - start
    return (n - warmup) * batch_size / span if span > 0 else 0.0


def common_window(timings: Sequence[WorkerTiming], warmup: int) -> tuple[float, float] | None:
    """The time every worker is past warm-up and none has finished: from the latest end of a warm-up
    to the earliest last step. None when there is no such time (a worker finished before another was
    warm), or a worker has no steps."""
    if not timings or any(len(t.end_s) == 0 for t in timings):
        return None
    start = max(t.start_s if warmup == 0 else t.end_s[min(warmup, len(t.end_s)) - 1] for t in timings)
    end = min(t.end_s[-1] for t in timings)
    return (start, end) if end > start else None


def throughput(timings: Sequence[WorkerTiming], batch_size: int, warmup: int) -> float:
    """Samples per second of all workers together, over one common time window (:func:`common_window`):
    the steps that ended inside it, over its length. Every method is measured over the time all its
    workers were training at full speed, never over per-worker windows that a fast worker's early
    finish or a slow worker's late start would stretch. Without a common window (extreme stragglers)
    it falls back to the sum of per-worker rates, each after its own warm-up."""
    window = common_window(timings, warmup)
    if window is None:
        return sum(worker_rate(t, batch_size, warmup) for t in timings)
    start, end = window
    steps = 0
    for t in timings:  # counted in C: a large simulation logs millions of steps
        ends = np.asarray(t.end_s, dtype=np.float64)
        steps += int(np.count_nonzero((ends > start) & (ends <= end)))
    return steps * batch_size / (end - start)


def nominal_compute_s(compute_mode: str | None, compute_ms: float | None) -> float | None:
    """The nominal compute per step, s, that an injected slowdown multiplies: ``compute_ms`` when the run
    had one (emulated and paced always; real when given or measured by the launcher, the slowdown then a
    sleep of ``(factor - 1)`` of it); None for a real run without (the slowdown then scaled what each
    worker measured)."""
    del compute_mode  # every mode with a nominal time injects slowdowns the same way
    return compute_ms / 1e3 if compute_ms else None


def base_compute_s(timings: Sequence[WorkerTiming], warmup: int, nominal_s: float | None) -> float:
    """The compute of one step without its injected slowdown, median over workers and steps after
    warm-up: ``compute - (factor - 1) * nominal_s`` with emulated compute (the slowdown is a sleep of
    that many nominal computes), ``compute / factor`` with real compute (``nominal_s`` None)."""
    parts = []
    for t in timings:  # the same arithmetic element by element, in C (a large simulation logs millions of steps)
        compute = np.asarray(t.compute_s, dtype=np.float64)
        if len(t.slowdown):
            factors = np.asarray(t.slowdown, dtype=np.float64)
            steps = min(len(compute), len(factors))
            compute, factors = compute[warmup:steps], factors[warmup:steps]
            parts.append(compute - (factors - 1.0) * nominal_s if nominal_s is not None else compute / factors)
        else:  # no slowdown logged: a factor of 1 leaves the compute as it is
            parts.append(compute[warmup:])
    values = np.concatenate(parts) if parts else np.empty(0)
    # The middle value, or the mean of the two middle ones, as statistics.median takes it (the same float).
    return float(np.median(values)) if len(values) else 0.0


def mean_slowdowns(timings: Sequence[WorkerTiming], warmup: int) -> list[float]:
    """Per worker: the mean injected slowdown factor over the steps after warm-up."""
    return [mean_after(t.slowdown if len(t.slowdown) else (1.0,), warmup) for t in timings]


def scenario_limit(slowdowns: Sequence[float], base_s: float, nominal_s: float | None, batch_size: int) -> float:
    """Throughput if communication cost nothing and nobody waited: every worker computes back to back,
    a step taking ``base_s + (factor - 1) * nominal_s`` (emulated) or ``base_s * factor`` (real), with
    each worker's mean factor ``slowdowns``. The steps' times are linear in the factor, so the mean
    factor gives the mean step."""
    total = 0.0
    for f in slowdowns:
        step = base_s + (f - 1.0) * nominal_s if nominal_s is not None else base_s * f
        total += batch_size / step if step > 0 else 0.0
    return total


def no_wait_limit(timings: Sequence[WorkerTiming], batch_size: int, warmup: int,
                  nominal_s: float | None = None, base_s: float | None = None) -> float:
    """One run's no-wait limit (:func:`scenario_limit` with this run's own base compute, ``base_s`` when already
    taken, else :func:`base_compute_s`). A benchmark replaces it by one limit per scenario for all its methods
    (:func:`prague.metrics.report.harmonize_limits`)."""
    if base_s is None:
        base_s = base_compute_s(timings, warmup, nominal_s)
    return scenario_limit(mean_slowdowns(timings, warmup), base_s, nominal_s, batch_size)


def mean_after(values: Sequence[float], warmup: int) -> float:
    """The mean of ``values`` after the first ``warmup`` (all of them when none is left; 0.0 when empty), summed
    exactly as :func:`statistics.fmean` sums (``math.fsum``), over the sequence as it is (no list made of it)."""
    window = values[warmup:]
    if not len(window):
        window = values
    return math.fsum(window) / len(window) if len(window) else 0.0


#: A worker is named in the speed report when its rate is below this share of the median worker's.
SLOW_SHARE = 0.9


def speed_report(ranks: Sequence[int], samples_per_s: Sequence[float], compute_s: Sequence[float],
                 comm_s: Sequence[float], wait_s: Sequence[float], batch_size: int) -> str:
    """The end-of-run speed report: per worker, steps per second and the mean compute, communication and
    wait per step; then the slow ranks, slowest first: those whose rate is below :data:`SLOW_SHARE` of
    the median worker's, or, where the method keeps every worker at one pace (all-reduce, a synchronous
    parameter server), those whose compute alone runs below that share of the median worker's speed
    (their peers' waiting is the time they cost)."""
    if not ranks:
        return "speed: no worker reported"
    rates = [s / batch_size if batch_size else 0.0 for s in samples_per_s]
    lines = ["rank  steps/s  compute ms  comm ms  wait ms"]
    for rank, rate, comp, comm, wait in zip(ranks, rates, compute_s, comm_s, wait_s):
        lines.append(f"{rank:>4}  {rate:7.2f}  {1e3 * comp:10.1f}  {1e3 * comm:7.1f}  {1e3 * wait:7.1f}")
    typical = median(rates)
    slow = sorted((rate, rank) for rank, rate in zip(ranks, rates) if typical > 0 and rate < SLOW_SHARE * typical)
    if slow:
        named = ", ".join(f"rank {rank} ({rate / typical:.2f}x)" for rate, rank in slow)
        lines.append(f"slowest: {named} of the median worker's {typical:.2f} steps/s")
        return "\n".join(lines)
    usual = median(compute_s)
    heavy = sorted(((usual / c, r) for r, c in zip(ranks, compute_s) if c > 0 and usual / c < SLOW_SHARE))
    if heavy:
        named = ", ".join(f"rank {rank} ({share:.2f}x)" for share, rank in heavy)
        lines.append(f"slowest: {named} of the median worker's compute speed ({1e3 * usual:.1f} ms a step); "
                     "the others waited for it")
    else:
        lines.append(f"no worker below {SLOW_SHARE:.0%} of the median worker's {typical:.2f} steps/s")
    return "\n".join(lines)
