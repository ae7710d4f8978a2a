"""Evaluation on the common clock: the model at time t is the average of every replica's state at t.

All workers start training at one agreed instant (:func:`start_together`), so their training clocks
agree. Each keeps its model state at the kept points of one grid on that clock (:class:`SnapshotLog`):
the state kept for t is one the worker held at t, the state after its last step that ended at or before
t, whatever its speed. After training the states of each point are averaged over the ranks and scored
(:func:`accuracy_history`): accuracy and held-out cross-entropy loss, what a user would have got by
stopping the job at t. Evaluation runs after training, so it never takes time from it, and the same
procedure serves every method: the time to a target no longer waits for the slowest worker to reach some
step. At the end each rank also scores its own final replica (:func:`replica_scores`), so a run reports
its best and worst replica beside their average.

The grid (:mod:`prague.metrics.grid`) is fixed in seconds: index j is the instant ``j * --eval-every-s``,
and whether it is kept depends on j alone (every j up to :data:`MAX_POINTS`, or fewer for models whose
states would take more than :data:`SNAPSHOT_BYTES`, then at an interval that doubles each time j
doubles), so every job of a bench keeps the same instants whatever its length, and memory grows with the
logarithm of the job's length. Which points are scored, the time order of the scan for the targets, its
one assumption and the smoothed time to target are :func:`prague.metrics.grid.scan`'s.
"""

from __future__ import annotations

import copy
import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from prague.comm.flat import state_tensors, unflatten_into, views_of
from prague.metrics.grid import (  # noqa: F401 - the grid's names, used here and by the training loop
    COARSE, CURVE_POINTS, DEFAULT_EVAL_EVERY_S, MAX_POINTS, Score, grid_points, kept, next_kept, scan,
)
from prague.train.closing import Closing
from prague.workload.data import Dataset

#: The most memory the dense points' states may take (for models too large for it, fewer dense points,
#: at least 8); the points beyond them add half as many again each time the job's length doubles.
SNAPSHOT_BYTES = 256 << 20
CLOCK_READY_KEY = "prague/clock/ready"
CLOCK_START_KEY = "prague/clock/t0"
#: Time between the last rank's arrival and the common start, s: enough for every rank to read it.
START_MARGIN_S = 0.05


def start_together(store: Any, rank: int, nproc: int, *, poll_s: float = 0.005) -> float:
    """Block until every rank has called this, then until one agreed wall-clock instant, which it
    returns (``time.time()`` seconds). Rank 0 picks the instant once all have arrived; across machines the
    instant is as common as their clocks (NTP: milliseconds)."""
    store.add(CLOCK_READY_KEY, 1)
    if rank == 0:
        while store.add(CLOCK_READY_KEY, 0) < nproc:
            time.sleep(poll_s)
        store.set(CLOCK_START_KEY, repr(time.time() + START_MARGIN_S))
    start = float(store.get(CLOCK_START_KEY))
    delay = start - time.time()
    if delay > 0:
        time.sleep(delay)
    return start


class TrainClock:
    """Training time since the common start (plus ``offset_s``, the time a resumed run had already
    trained). Never paused: it is the job's clock, the same on every rank, and what a rank spends on a
    checkpoint is time the user waits too."""

    def __init__(self, offset_s: float = 0.0) -> None:
        self._start = time.perf_counter() - offset_s

    def now(self) -> float:
        return time.perf_counter() - self._start

    def at(self, perf_s: float) -> float:
        """The clock's reading at ``time.perf_counter()`` = ``perf_s``."""
        return perf_s - self._start


def host_state(model: nn.Module, into: torch.Tensor | None = None) -> torch.Tensor:
    """``model``'s flat state (:func:`~prague.comm.flat.state_tensors`) copied into ``into``, a CPU buffer
    of that size (a new one when None), which it returns. Kept on the host: a CUDA model's snapshots would
    otherwise hold device memory until the end."""
    tensors = state_tensors(model)
    if into is None:
        dtype = functools.reduce(torch.promote_types, [t.dtype for t in tensors]) if tensors else torch.float32
        into = torch.empty(sum(t.numel() for t in tensors), dtype=dtype)
    with torch.no_grad():
        for view, t in zip(views_of(into, tensors), tensors):
            view.copy_(t)
    return into


class SnapshotLog:
    """This rank's model states at the kept grid points of the common clock (see the module docstring).

    ``entries`` maps a kept grid index j (its instant is ``j * every_s``; :func:`~prague.metrics.grid.kept`
    with ``dense``) to a CPU copy of the flat state the rank held then; points given the same state share
    one tensor. The rank calls :meth:`observe` before each step and once after its last (any other call,
    between steps, is harmless). The model changes only inside steps, between calls, so the state held at
    t is the one at the last call at or before t: each call records the points passed since the last one
    with the copy it kept then, and keeps a copy of the current state (in a CPU buffer reused while no
    point took it) for the points that pass before the next call. ``sink`` is also handed each recorded
    point's state (``--stop-at-target``'s files)."""

    def __init__(self, every_s: float, dense: int = MAX_POINTS,
                 sink: Callable[[int, torch.Tensor], None] | None = None) -> None:
        self.every_s = every_s
        self.dense = dense
        self.sink = sink
        self.entries: dict[int, torch.Tensor] = {}
        self._next = 0  # the least kept index not yet recorded
        self._held: torch.Tensor | None = None  # the state at the last call
        self._lent = False  # whether an entry took ``_held`` (then the next copy needs a buffer of its own)

    def observe(self, model: nn.Module, now_s: float) -> None:
        """Record every kept point up to ``now_s`` not recorded yet: one before ``now_s`` gets the state at
        the last call (at the first call, which precedes any step, the current state), one at ``now_s`` the
        current state. Then keep a copy of the current state."""
        last = math.floor(now_s / self.every_s) if math.isfinite(now_s / self.every_s) else -1
        before: list[int] = []
        current: list[int] = []
        j = self._next
        while j <= last:
            (before if self._held is not None and j * self.every_s < now_s else current).append(j)
            j = next_kept(j, self.dense)
        self._next = max(self._next, j)
        held = self._held
        if before and held is not None:
            self._record(before, held)
        self._held = host_state(model, None if self._lent else held)
        self._lent = False
        if current:
            self._record(current, self._held)

    def _record(self, points: list[int], state: torch.Tensor) -> None:
        for j in points:
            self.entries[j] = state
            if self.sink is not None:
                self.sink(j, state)
        self._lent = self._lent or state is self._held

    def restore(self, entries: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Take a checkpoint's ``entries`` (those of kept points) as this log's; recording goes on after
        the newest of them."""
        self.entries = {j: state for j, state in entries if kept(j, self.dense)}
        self._next = next_kept(max(self.entries), self.dense) if self.entries else 0

    def states(self, points: list[int], final: torch.Tensor, end_s: float = math.inf) -> list[torch.Tensor]:
        """This rank's state at each grid index of ``points``: the recorded one; for a point after its
        last call but before its end ``end_s`` (while it closed its method) the state at that call; for
        a point at or after its end ``final``, its state at the end."""
        out = []
        for j in points:
            if j in self.entries:
                out.append(self.entries[j])
            elif self._held is not None and j * self.every_s < end_s:
                out.append(self._held)
            else:
                out.append(final)
        return out


@torch.no_grad()
def tally(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device,
          batch_size: int = 1000) -> tuple[int, float]:
    """(how many of the targets ``y`` the model predicts from the samples ``x``, the sum of their
    cross-entropy losses), in evaluation mode; the model's mode is restored after. A target is a sample's
    class, or for text each token's next one (``y`` of shape ``(N, T)``: N x T targets)."""
    training = model.training
    model.eval()
    correct, loss = 0, 0.0
    for i in range(0, len(y), batch_size):
        batch_x, batch_y = x[i:i + batch_size].to(device), y[i:i + batch_size].to(device)
        out = model(batch_x)
        correct += int((out.argmax(dim=1) == batch_y).sum())
        loss += float(F.cross_entropy(out.double(), batch_y, reduction="sum"))
    model.train(training)
    return correct, loss


def score(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device, batch_size: int = 1000) -> int:
    """How many of the samples ``x`` the model classifies as ``y`` (in evaluation mode)."""
    return tally(model, x, y, device, batch_size)[0]


def evaluate(model: nn.Module, data: Dataset, closing: Closing) -> Score:
    """(test accuracy, mean test cross-entropy loss) of ``model`` (the same on every closing rank); each
    scores a slice of the samples, the counts and sums are summed. Collective."""
    ctx = closing.ctx
    n = len(data.test_y)
    index, size = closing.ranks.index(ctx.rank), closing.size
    lo, hi = n * index // size, n * (index + 1) // size
    correct, loss = tally(model, data.test_x[lo:hi], data.test_y[lo:hi], ctx.device)
    sums = torch.tensor([correct, loss], dtype=torch.float64, device=ctx.device)
    closing.all_reduce(sums)
    return float(sums[0].item()) / data.test_targets, float(sums[1].item()) / data.test_targets


def finite_or_none(value: float) -> float | None:
    """``value``, or None when it is not finite (a diverged model's loss: JSON has no NaN)."""
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class Evaluation:
    """The average of the replicas on the common clock: ``history`` holds ``{wall_s, accuracy, loss}`` of
    the scored points and of the job's end (``job_s``), in time order (loss None when not finite); the
    times to the targets (None: not reached, or no target), the smoothed one as
    :func:`prague.metrics.grid.scan` defines it."""

    history: list[dict[str, float | None]]
    job_s: float
    time_to_target_s: float | None = None
    time_to_target_smoothed_s: float | None = None
    time_to_target_loss_s: float | None = None

    @property
    def test_accuracy(self) -> float | None:
        """The accuracy of the average of every rank's final state (the job's end)."""
        return self.history[-1]["accuracy"] if self.history else None


def accuracy_history(final: nn.Module, log: SnapshotLog, end_s: float, data: Dataset, closing: Closing,
                     target_accuracy: float | None, target_loss: float | None = None,
                     known_points: Sequence[int] = ()) -> Evaluation:
    """The :class:`Evaluation` of the replicas' average at the kept grid points up to the job's end (the
    latest rank's end, ``end_s`` being this rank's on its clock) and at that end, where ``final`` is
    this rank's model at its end. Each point's state is the average over the closing ranks of each rank's
    state then (:meth:`SnapshotLog.states`). ``known_points``: grid indices found elsewhere to reach the
    target (``--stop-at-target``), scored too (:func:`~prague.metrics.grid.scan`'s ``known``). Collective over the closing ranks: every rank scores the same
    points (:func:`~prague.metrics.grid.scan`)."""
    job_s = max(closing.all_gather_floats(end_s))
    points = grid_points(job_s, log.every_s, log.dense)
    final_flat = host_state(final)
    states = log.states(points, final_flat, end_s) + [final_flat]
    times = [j * log.every_s for j in points] + [job_s]
    probe = copy.deepcopy(final)

    def averaged(i: int) -> Score:
        flat = states[i].to(closing.ctx.device, copy=True)  # the backend's device (NCCL: the GPU)
        closing.all_reduce(flat)
        flat /= closing.size
        unflatten_into(flat, state_tensors(probe))
        return evaluate(probe, data, closing)

    known = [position for position, j in enumerate(points) if j in known_points]  # grid indices j
    found = scan(averaged, times, target_accuracy, target_loss, known=known)
    history: list[dict[str, float | None]] = [
        {"wall_s": times[i], "accuracy": found.scores[i][0], "loss": finite_or_none(found.scores[i][1])}
        for i in sorted(found.scores)]
    return Evaluation(
        history, job_s,
        time_to_target_s=None if found.accuracy_hit is None else times[found.accuracy_hit],
        time_to_target_smoothed_s=found.smoothed_s,
        time_to_target_loss_s=None if found.loss_hit is None else times[found.loss_hit],
    )


def replica_scores(model: nn.Module, data: Dataset, closing: Closing) -> tuple[list[float], list[float]]:
    """(accuracies, mean cross-entropy losses) of every closing rank's own replica on the whole test set, in
    the closing ranks' order: each rank scores its ``model`` (one pass each, in parallel), then the results
    are gathered. Collective."""
    correct, loss = tally(model, data.test_x, data.test_y, closing.ctx.device)
    n = data.test_targets
    return closing.all_gather_floats(correct / n), closing.all_gather_floats(loss / n)
