"""Evaluation on the common clock: the model at time t is the average of every replica's state at t.

All workers start training at one agreed instant (:func:`start_together`), so their training clocks
agree. Each keeps its model state at the points of one grid on that clock (:class:`SnapshotLog`): the
state kept for t is the one after its last step that ended before t, whatever its speed. After training the states of each
point are averaged over the ranks and scored (:func:`accuracy_history`): what a user would have got by
stopping the job at t. Evaluation runs after training, so it never takes time from it, and the same
procedure serves every method: the time to a target accuracy no longer waits for the slowest worker to
reach some step.

The grid is every ``--eval-every-s`` seconds; once a job has run :data:`MAX_POINTS` intervals the
interval doubles and the points off the coarser grid are dropped (the same on every rank, from the time
alone), so memory stays bounded however long the job runs. Scoring a point costs a pass over the test
set, so the history scores at most :data:`CURVE_POINTS` of them evenly, and then refines the time to the
target by bisection among the kept points between the last scored point below the target and the first
at or above it (assuming the accuracy rises in between).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from prague.comm.flat import flatten, state_tensors, unflatten_into
from prague.metrics.grid import (  # noqa: F401 - the grid's names, used here and by the training loop
    CURVE_POINTS, DEFAULT_EVAL_EVERY_S, MAX_POINTS, common_points, curve_indices, first_reaching, grid_level,
)
from prague.train.closing import Closing
from prague.workload.data import Dataset

#: The most memory the kept states may take (for models too large for it, fewer points, at least 8).
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


class SnapshotLog:
    """This rank's model states at the grid points of the common clock (see the module docstring).

    ``entries`` maps a grid point's index j (its time is ``j * every_s``) to a CPU copy of the flat
    state; points with the same state share one copy. The rank calls :meth:`observe` before each step and
    once after its last. A model changes at its steps' ends, so the state at a point that passed during a
    step is the one the step started from: a copy taken at that step's start when a point may pass
    before it ends (judged from the recent time between calls, with a margin of two); a point that passes
    in a step longer than that gets the state after it."""

    def __init__(self, every_s: float, max_points: int = MAX_POINTS,
                 sink: Callable[[int, torch.Tensor], None] | None = None) -> None:
        self.every_s = every_s
        self.max_points = max_points
        self.sink = sink  # also hands each recorded point's state to it (--stop-at-target's files)
        self.entries: dict[int, torch.Tensor] = {}
        self._next = 0  # the next grid index not yet recorded
        self._held: torch.Tensor | None = None  # the state at the last call, when a point may pass after it
        self._last_s: float | None = None
        self._gaps: list[float] = []

    def observe(self, model: nn.Module, now_s: float) -> None:
        """Record the state of every grid point passed since the last call, and hold a copy of the current
        state if the next point may pass before the next call."""
        level = grid_level(now_s, self.every_s, self.max_points)
        last = int(math.floor(now_s / self.every_s))
        due = [j for j in range(self._next, last + 1) if j % 2 ** level == 0]
        self._next = max(self._next, last + 1)
        if due:
            held = self._held
            for j in due:
                if held is None or j * self.every_s == now_s:  # no copy held, or the point is now
                    held = self._copy(model)
                self.entries[j] = held
                if self.sink is not None:
                    self.sink(j, held)
        self.thin(level)
        if self._last_s is not None:
            self._gaps = (self._gaps + [now_s - self._last_s])[-3:]
        self._last_s = now_s
        ahead = 2 * max(self._gaps, default=math.inf)
        self._held = self._copy(model) if self._next * self.every_s <= now_s + ahead else None

    @staticmethod
    def _copy(model: nn.Module) -> torch.Tensor:
        # Kept on the host: a CUDA model's snapshots would otherwise hold device memory until the end.
        return flatten(state_tensors(model)).to("cpu", copy=True)

    def thin(self, level: int) -> None:
        """Drop the points off the grid of ``level``."""
        step = 2 ** level
        for j in [j for j in self.entries if j % step]:
            del self.entries[j]

    def states(self, points: list[int], final: torch.Tensor) -> list[torch.Tensor]:
        """This rank's state at each grid index of ``points``: the recorded one, or ``final`` (this rank's
        state at the end) for points after it stopped."""
        return [self.entries.get(j, final) for j in points]


@torch.no_grad()
def score(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device, batch_size: int = 1000) -> int:
    """How many of the samples ``x`` the model classifies as ``y`` (in evaluation mode)."""
    model.eval()
    correct = 0
    for i in range(0, len(y), batch_size):
        batch_x, batch_y = x[i:i + batch_size].to(device), y[i:i + batch_size].to(device)
        correct += int((model(batch_x).argmax(dim=1) == batch_y).sum())
    return correct


def evaluate(model: nn.Module, data: Dataset, closing: Closing) -> float:
    """Test accuracy of ``model`` (the same on every closing rank); each scores a slice, counts are summed.
    Collective."""
    ctx = closing.ctx
    n = len(data.test_y)
    index, size = closing.ranks.index(ctx.rank), closing.size
    lo, hi = n * index // size, n * (index + 1) // size
    correct = score(model, data.test_x[lo:hi], data.test_y[lo:hi], ctx.device)
    counts = torch.tensor([correct], dtype=torch.float64, device=ctx.device)
    closing.all_reduce(counts)
    return float(counts.item()) / n


def accuracy_history(final: nn.Module, log: SnapshotLog, end_s: float, data: Dataset, closing: Closing,
                     target: float | None) -> tuple[list[dict[str, float]], float | None, float]:
    """(history, time to target, job time) of the replicas' average on the common clock. ``final`` is
    this rank's model at its end (``end_s`` on its clock). The history holds ``{wall_s, accuracy}`` of the
    scored grid points and of the job's end (the average of every rank's final state), in time order.
    Collective over the closing ranks."""
    job_s = max(closing.all_gather_floats(end_s))
    points = common_points(job_s, log.every_s, log.max_points)
    final_flat = flatten(state_tensors(final)).to("cpu", copy=True)
    states = log.states(points, final_flat) + [final_flat]
    times = [j * log.every_s for j in points] + [job_s]
    probe = copy.deepcopy(final)

    def accuracy(i: int) -> float:
        flat = states[i].to(closing.ctx.device, copy=True)  # the backend's device (NCCL: the GPU)
        closing.all_reduce(flat)
        flat /= closing.size
        unflatten_into(flat, state_tensors(probe))
        return evaluate(probe, data, closing)

    scores, hit = first_reaching(accuracy, len(states), target)
    history = [{"wall_s": times[i], "accuracy": scores[i]} for i in sorted(scores)]
    return history, None if hit is None else times[hit], job_s
