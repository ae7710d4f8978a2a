"""The common clock's grid of evaluation points, and which of them to score: pure functions shared by
real runs (:mod:`prague.train.evaluation`) and the simulator (:mod:`prague.sim.math`).

States are kept at the points ``j * every_s`` of the clock; once a job has run :data:`MAX_POINTS`
intervals the interval doubles and the points off the coarser grid are dropped (:func:`grid_level`), so
memory stays bounded however long the job runs. Scoring a point costs a pass over the test set, so a
history scores at most :data:`CURVE_POINTS` of them evenly (:func:`curve_indices`) and then refines the
time to the target by bisection (:func:`first_reaching`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

#: The most grid points a rank keeps states for (fewer for large models: see ``SNAPSHOT_BYTES`` in
#: :mod:`prague.train.evaluation`).
MAX_POINTS = 64
#: The grid's first interval (``--eval-every-s``), s.
DEFAULT_EVAL_EVERY_S = 1.0
#: The most points the accuracy curve scores (plus the final state and the refinement).
CURVE_POINTS = 12


def grid_level(now_s: float, every_s: float, max_points: int = MAX_POINTS) -> int:
    """How many times the grid's interval has doubled by ``now_s``: the least L with at most
    ``max_points`` intervals of ``every_s * 2**L`` in ``now_s``."""
    level = 0
    while now_s / (every_s * 2 ** level) > max_points:
        level += 1
    return level


def common_points(job_s: float, every_s: float, max_points: int = MAX_POINTS) -> list[int]:
    """The grid indices every rank scores: the grid of the job's end, from 0 to ``job_s``."""
    step = 2 ** grid_level(job_s, every_s, max_points)
    return list(range(0, int(math.floor(job_s / every_s)) + 1, step))


def curve_indices(n: int, most: int = CURVE_POINTS) -> list[int]:
    """At most ``most`` positions of ``0..n-1``, evenly spread, the first and the last included."""
    if n <= most:
        return list(range(n))
    return sorted({round(i * (n - 1) / (most - 1)) for i in range(most)})


def first_reaching(accuracy: Callable[[int], float], n: int, target: float | None,
                   most: int = CURVE_POINTS) -> tuple[dict[int, float], int | None]:
    """Score positions ``0..n-1`` with ``accuracy`` (each at most once): the curve's positions, then a
    bisection between the last one below ``target`` and the first at or above it. Returns every score
    taken and the first position found at or above the target (None if none). Every rank calls it with
    the same scores, so every rank scores the same positions (``accuracy`` is collective)."""
    scores: dict[int, float] = {}

    def score(i: int) -> float:
        if i not in scores:
            scores[i] = accuracy(i)
        return scores[i]

    curve = curve_indices(n, most)
    for i in curve:
        score(i)
    if target is None:
        return scores, None
    hit = next((i for i in curve if scores[i] >= target), None)
    if hit is None:
        return scores, None
    lo = max((i for i in curve if i < hit), default=-1)  # below the target (or before the first point)
    while hit - lo > 1:
        mid = (lo + hit) // 2
        if score(mid) >= target:
            hit = mid
        else:
            lo = mid
    return scores, hit
