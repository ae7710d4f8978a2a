"""Throughput and the no-wait limit from per-iteration records (docs/ARCHITECTURE.md, "The run record").

Pure functions over the records every worker writes, so the runtime, the simulator and tests compute
them the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from statistics import fmean


@dataclass(frozen=True)
class WorkerTiming:
    """One worker's timeline: training-clock time at the end of each step, and its compute times."""

    end_s: Sequence[float]
    compute_s: Sequence[float]
    comm_s: Sequence[float]
    wait_s: Sequence[float]
    start_s: float = 0.0


def warmup_steps(total_steps: int, requested: int | None) -> int:
    """Steps excluded from the throughput window: the request, capped so that a window remains."""
    default = min(5, total_steps // 5)
    w = default if requested is None else requested
    return max(0, min(w, total_steps - 1))


def worker_rate(t: WorkerTiming, batch_size: int, warmup: int) -> float:
    """Samples per second of one worker over the steps after ``warmup``."""
    n = len(t.end_s)
    if n == 0:
        return 0.0
    start = t.start_s if warmup == 0 else t.end_s[warmup - 1]
    span = t.end_s[-1] - start
    return (n - warmup) * batch_size / span if span > 0 else 0.0


def throughput(timings: Sequence[WorkerTiming], batch_size: int, warmup: int) -> float:
    """Samples per second summed over workers, after warm-up."""
    return sum(worker_rate(t, batch_size, warmup) for t in timings)


def no_wait_limit(timings: Sequence[WorkerTiming], batch_size: int, warmup: int) -> float:
    """Throughput if communication cost nothing and nobody waited: sum over workers of
    batch / (mean per-iteration compute time, slowdowns included), over the same window."""
    total = 0.0
    for t in timings:
        window = list(t.compute_s[warmup:]) or list(t.compute_s)
        mean = fmean(window) if window else 0.0
        total += batch_size / mean if mean > 0 else 0.0
    return total


def mean_after(values: Sequence[float], warmup: int) -> float:
    window = list(values[warmup:]) or list(values)
    return fmean(window) if window else 0.0
