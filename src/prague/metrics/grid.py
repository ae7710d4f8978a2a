"""The common clock's grid of evaluation points, and which of them to score: pure functions shared by
real runs (:mod:`prague.train.evaluation`) and the simulator (:mod:`prague.sim.math`).

**The grid.** Grid index j stands for the instant ``j * every_s`` of the common clock (``--eval-every-s``),
and whether a state is kept for it depends on j alone (:func:`kept`): every j up to ``dense`` (the
memory-derived number of dense points, :data:`MAX_POINTS` or fewer for large models), then every second
index up to ``2 * dense``, every fourth up to ``4 * dense``, and so on: beyond ``dense``, j is kept iff
``j % 2**ceil(log2(j / dense)) == 0``. So every job of one bench with the same ``--eval-every-s`` and
model keeps exactly the same instants, whatever its length, and a job of length T keeps about
``dense * (1 + log2(T / (dense * every_s)) / 2)`` points: memory grows with the logarithm of its length.

**Scoring** (:func:`scan`). Scoring a point is a pass over the test set, so not every kept point is
scored. The positions of a history are its kept points in time order, then the job's end. With at most
:data:`CURVE_POINTS` of them every one is scored. Otherwise, when a target is given, the *coarse* points
(every :data:`COARSE`-th position and the last, :func:`coarse_positions`: the same instants for every job)
are scored in time order until the first one that reaches a target; then the positions between the
previous coarse point and it, in time order. The time to a target is the first scored point that reaches
it, in time order. The scan goes on, coarse, until every given target is reached (and the smoothed curve
has crossed the accuracy target) or the points run out; then at most :data:`CURVE_POINTS` more coarse
points of the rest are scored, evenly, the job's end last. Without a target, :data:`CURVE_POINTS`
positions are scored evenly (:func:`curve_indices`).

The one assumption: the curve makes no excursion to the target between two consecutive coarse points
that are both short of it. A point there that reaches the target is not seen, and the time to target is
then that of a later crossing (never an earlier one: no point before the reported one is skipped except
between two coarse points that were both scored below the target). A job that ``--stop-at-target`` ended
stops right after its evaluator saw the target, often before the next coarse point and with the job's end
dipping below it again: the evaluator's point is then scored in time order among the coarse ones, with the
same refinement before it (``scan``'s ``known``), so that crossing is always found.

**The smoothed time to target** (:func:`smoothed_crossing`) is read on the coarse curve (the coarse
points scored, in time order): each point's accuracy is replaced by the mean of itself and its two
neighbours on that curve (one neighbour at either end), and the time is the first instant at which that
smoothed accuracy reaches the target, linearly interpolated between the two scored instants around the
crossing (the first coarse point's instant if its smoothed accuracy already reaches it). The coarse
curve is every :data:`COARSE`-th position also when every position is scored, so its instants are the
same for every job.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prague.errors import ConfigError

#: The most grid points kept at the dense interval ``every_s`` (fewer for large models: see
#: ``SNAPSHOT_BYTES`` in :mod:`prague.train.evaluation`); beyond them the interval doubles.
MAX_POINTS = 64
#: The grid's first interval (``--eval-every-s``), s.
DEFAULT_EVAL_EVERY_S = 1.0
#: The most points scored evenly: the curve without a target, the rest of it after the targets were
#: reached; and a history of at most this many positions is scored in full.
CURVE_POINTS = 12
#: The scan scores every COARSE-th position (kept point) of a history, the same for every job.
COARSE = 4

#: One scored point: (accuracy, mean cross-entropy loss) of the averaged model on the test set.
Score = tuple[float, float]


def interval(j: int, dense: int = MAX_POINTS) -> int:
    """The grid's interval, in units of ``every_s``, at index ``j`` (>= 0): 1 up to ``dense``, then
    ``2**ceil(log2(j / dense))``, the least power of two ``s`` with ``j <= dense * s``."""
    if dense < 1:
        raise ConfigError(f"the evaluation grid needs at least one dense point, got dense={dense}; give 1 or more")
    step = 1
    while j > dense * step:
        step *= 2
    return step


def kept(j: int, dense: int = MAX_POINTS) -> bool:
    """Whether grid index ``j`` (the instant ``j * every_s``) is kept: every ``j <= dense``, beyond it
    every ``interval(j, dense)``-th. Depends on ``j`` and ``dense`` alone, never on the job's length."""
    return j >= 0 and j % interval(j, dense) == 0


def next_kept(j: int, dense: int = MAX_POINTS) -> int:
    """The least kept index above ``j``."""
    candidate = max(j + 1, 0)
    step = interval(candidate, dense)
    # dense * step is a multiple of step and >= candidate: rounding up stays within this interval's range
    return -(-candidate // step) * step


def grid_points(until_s: float, every_s: float, dense: int = MAX_POINTS) -> list[int]:
    """The kept indices from 0 to ``until_s`` (``j * every_s <= until_s``), in order: the same prefix for
    every job, whatever ``until_s``."""
    last = math.floor(until_s / every_s) if math.isfinite(until_s / every_s) else 0
    points, j = [], 0
    while j <= last:
        points.append(j)
        j = next_kept(j, dense)
    return points


def curve_indices(n: int, most: int = CURVE_POINTS) -> list[int]:
    """At most ``most`` positions of ``0..n-1``, evenly spread, the first and the last included."""
    if n <= most:
        return list(range(n))
    return sorted({round(i * (n - 1) / (most - 1)) for i in range(most)})


def coarse_positions(n: int, coarse: int = COARSE) -> list[int]:
    """The coarse positions of a history of ``n``: every ``coarse``-th from 0, and the last (the job's end)."""
    positions = list(range(0, n, coarse))
    if n and positions[-1] != n - 1:
        positions.append(n - 1)
    return positions


def smoothed(accuracies: Sequence[float]) -> list[float]:
    """The centred mean of three consecutive ``accuracies`` (of two at either end)."""
    windows = [accuracies[max(0, m - 1):m + 2] for m in range(len(accuracies))]
    return [sum(w) / len(w) for w in windows]


def smoothed_crossing(times: Sequence[float], accuracies: Sequence[float], target: float) -> float | None:
    """The first instant at which the :func:`smoothed` ``accuracies`` reach ``target``, linearly
    interpolated between the scored ``times`` (rising) around the crossing; None if they never do."""
    smooth = smoothed(accuracies)
    for m, value in enumerate(smooth):
        if value >= target:
            if m == 0:
                return float(times[0])
            before = smooth[m - 1]  # below the target: the crossing lies in (times[m-1], times[m]]
            return float(times[m - 1] + (target - before) / (value - before) * (times[m] - times[m - 1]))
    return None


@dataclass(frozen=True)
class Scan:
    """What :func:`scan` scored and found: ``scores`` by position; ``curve`` the coarse positions scored
    (the smoothed curve's), in time order; the first scored position reaching each target (None: not
    reached, or no target); the smoothed time to the accuracy target, s (None: not reached)."""

    scores: dict[int, Score]
    curve: list[int]
    accuracy_hit: int | None
    loss_hit: int | None
    smoothed_s: float | None


def scan(evaluate: Callable[[int], Score], times: Sequence[float], target_accuracy: float | None = None,
         target_loss: float | None = None, *, coarse: int = COARSE, most: int = CURVE_POINTS,
         known: Sequence[int] = ()) -> Scan:
    """Score positions ``0..len(times)-1`` of a history (``times``: their instants, rising; the last is the
    job's end) with ``evaluate`` (each at most once, in time order within each pass) as the module
    docstring says, and find when the accuracy first reached ``target_accuracy`` (accuracy >= it) and the
    loss ``target_loss`` (loss <= it). ``known``: positions found elsewhere to reach a target (the point at
    which ``--stop-at-target``'s evaluator stopped the job), scored in time order among the coarse points
    with the same refinement before them, but left off the coarse curve (whose instants stay those of every
    job): a crossing the coarse points straddle is not missed when the job stopped right after it.

    Pure given ``evaluate``: every rank that calls it with the same scores scores the same positions, so
    ``evaluate`` may be collective."""
    n = len(times)
    scores: dict[int, Score] = {}

    def score(i: int) -> Score:
        if i not in scores:
            scores[i] = evaluate(i)
        return scores[i]

    checks: list[Callable[[Score], bool]] = []
    if target_accuracy is not None:
        checks.append(lambda s: s[0] >= target_accuracy)
    if target_loss is not None:
        checks.append(lambda s: s[1] <= target_loss)

    def first(check: Callable[[Score], bool]) -> int | None:
        return next((i for i in sorted(scores) if check(scores[i])), None)

    grid = coarse_positions(n, coarse)
    if n <= most:
        for i in range(n):
            score(i)
        curve = grid
    elif not checks:
        curve = curve_indices(n, most)
        for i in curve:
            score(i)
    else:
        curve = []
        on_grid = set(grid)
        last = -1  # the last position scored in this pass: a coarse one or a known one
        for c in sorted(on_grid | {k for k in known if 0 <= k < n}):  # in time order
            unmet = [check for check in checks if first(check) is None]
            here = score(c)
            reached = [check for check in unmet if check(here)]
            for i in range(last + 1, c):  # between the last coarse (or known) point and this one
                if all(first(check) != c for check in reached):  # each found before c
                    break
                score(i)
            last = c
            if c not in on_grid:
                continue
            curve.append(c)
            if all(first(check) is not None for check in checks) and (
                    target_accuracy is None or _smoothed_settled(curve, scores, target_accuracy, n)):
                rest = [g for g in grid if g > c]
                tail = [rest[i] for i in curve_indices(len(rest), most)]
                for i in tail:
                    score(i)
                curve += tail
                break
    accuracy_hit = first(checks[0]) if target_accuracy is not None else None
    loss_hit = first(checks[-1]) if target_loss is not None else None
    smoothed_s = None
    if target_accuracy is not None:
        smoothed_s = smoothed_crossing([times[i] for i in curve], [scores[i][0] for i in curve], target_accuracy)
    return Scan(scores, curve, accuracy_hit, loss_hit, smoothed_s)


def _smoothed_settled(curve: list[int], scores: dict[int, Score], target: float, n: int) -> bool:
    """Whether the coarse curve scored so far fixes the smoothed crossing: the smoothed accuracy of some
    point whose whole window is scored (its next coarse point too, or it is the job's end) reaches it."""
    smooth = smoothed([scores[i][0] for i in curve])
    complete = len(curve) if curve[-1] == n - 1 else len(curve) - 1
    return any(value >= target for value in smooth[:complete])
