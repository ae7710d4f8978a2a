"""Stall warnings: a worker that has waited too long for others says whom it waits for.

Each worker's trainer keeps its :class:`Phase`: the step it is in, and whether it is still computing
that step or has moved on to the method's communication (``allreduce`` counts the launch of DDP's
last bucket as that moment). A :class:`StallWatch` thread publishes the phase in the job's store
when it changes (at most every :data:`POLL_S`, on a store connection of its own, so the training
thread never pays for it) and watches how long the worker has been communicating in its current
step. Once that wait is longer than the threshold, and again each time it doubles, it writes a warning on the worker's stderr and
publishes it under ``prague/stall/RANK`` (the launcher prints it on its own stderr):

    prague: warning: rank 0 has waited 3.1 s in step 41 for rank 2 (last reported computing step 41)

A method that communicates on background threads (:class:`~prague.runtime.background.BackgroundWork`:
``prague``'s overlapped averages, ``eager-sgd``'s rounds, ...) has each thread's operation watched the
same way while it is ``communicating``, named by the work:

    prague: warning: rank 0's background average has waited 3.1 s in step 41 for rank 2 (...)

The ranks named are the method's current peers (:attr:`prague.algorithms.api.Algorithm.peers`: a
P-Reduce group, an AD-PSGD partner; every other rank by default) that are still computing, or else
those communicating in an earlier step. A frozen peer's phase stops moving,
so it is named too. The threshold is ``--stall-warn-s``, or by default :data:`FACTOR` times the
median duration of the recent steps, at least :data:`MIN_WARN_S` (no default warning before
:data:`MIN_STEPS` steps were measured: the first steps include set-up).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import IO

import torch.distributed as dist

from prague.runtime.background import COMMUNICATING, BackgroundWork, PeriodicWork, live_works
from prague.runtime.liveness import read_keys

PHASE_KEY = "prague/phase/"
STALL_KEY = "prague/stall/"
POLL_S = 0.25
FACTOR = 10.0
MIN_WARN_S = 1.0
MIN_STEPS = 3
COMPUTE, COMM = "compute", "comm"


class Phase:
    """Where one worker is: ``(step, kind, since)``, in ``step`` (0-based), computing it or
    communicating, since ``since`` (``time.monotonic``). Written by the training thread, read by the
    watch; one tuple, replaced whole, so a reader never sees half an update."""

    def __init__(self) -> None:
        self.state: tuple[int, str, float] = (0, COMPUTE, 0.0)

    def compute(self, step: int) -> None:
        """``step`` begins."""
        self.state = (step, COMPUTE, time.monotonic())

    def communicate(self) -> None:
        """The current step's compute is over (the first call per step counts)."""
        step, kind, _ = self.state
        if kind != COMM:
            self.state = (step, COMM, time.monotonic())


def holding_up(step: int, peers: Sequence[int], phases: dict[int, tuple[int, str]]) -> list[int]:
    """The peers that keep a worker in ``step`` waiting: those still computing (or that never reported a
    phase); if none is, those communicating in an earlier step (busy with an earlier collective). Peers
    communicating in this step or a later one are waiting too, not the cause."""
    computing = [p for p in peers if phases.get(p, (-1, COMPUTE))[1] != COMM]
    return computing or [p for p in peers if phases[p][0] < step]


def _decode(raw: bytes) -> tuple[int, str]:
    step, _, kind = raw.decode().partition(",")
    return int(step), kind


class StallWatch(PeriodicWork):
    """The per-worker watch described in the module docstring, a :class:`PeriodicWork` (every
    :data:`POLL_S`); :meth:`stop` ends it."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, phase: Phase,
                 peers: Callable[[], Sequence[int] | None], warn_s: float | None = None,
                 out: IO[str] | None = None, background: Sequence[BackgroundWork] = ()) -> None:
        if warn_s is not None and not warn_s > 0:
            raise ValueError(f"stall warning threshold must be > 0 s, got {warn_s!r}")
        super().__init__("stall watch", "prague-stall-watch", POLL_S)
        self.store, self.rank, self.world_size = store, rank, world_size
        self.phase, self.peers, self.warn_s = phase, peers, warn_s
        self.background = list(background)
        self.out = out if out is not None else sys.stderr
        self.durations: deque[float] = deque(maxlen=50)
        self.warnings: list[dict[str, object]] = []
        self._published = ""
        self._due: dict[str, tuple[float, float]] = {}  # per watched phase: (the wait's start, the next warning's wait)
        self.start()

    def threshold_s(self) -> float | None:
        """The wait after which a warning is due; None while the default has too few steps to go by."""
        if self.warn_s is not None:
            return self.warn_s
        if len(self.durations) < MIN_STEPS:
            return None
        return max(MIN_WARN_S, FACTOR * statistics.median(self.durations))

    def step_done(self, duration_s: float) -> None:
        """Called by the training thread after each step with its duration."""
        self.durations.append(duration_s)

    def tick(self) -> bool:
        try:
            step, kind, _ = self.phase.state
            encoded = f"{step},{kind}"
            if encoded != self._published:
                self.store.set(f"{PHASE_KEY}{self.rank}", encoded)
                self._published = encoded
            limit = self.threshold_s()
            for key, what, step, waiting, since in self._watched():
                if limit is None or not waiting:  # computing: this worker is the one being waited for
                    continue
                start, next_warn = self._due.get(key, (-1.0, 0.0))
                if start != since:
                    start, next_warn = since, limit
                waited = time.monotonic() - since
                if waited >= next_warn:
                    self._warn(what, step, waited)
                    next_warn = 2 * waited
                self._due[key] = (start, next_warn)
        except (RuntimeError, ValueError):  # the store is gone: the job is ending
            return False
        return True

    def _watched(self) -> list[tuple[str, str, int, bool, float]]:
        """What may wait on peers: (key, name in the warning, step, whether it waits now, since): the
        training thread's phase, then each background thread's operation: the method's works given, and
        every other work of this process still running (a communicator's rendezvous, the Group
        Generator's watch: any that communicates)."""
        step, kind, since = self.phase.state
        out = [("", "", step, kind == COMM, since)]
        works = list(dict.fromkeys([*self.background, *(w for w in live_works() if w is not self)]))
        for work in works:
            for index, (step, stage, since) in enumerate(work.stages()):
                out.append((f"{work.what}/{index}", f"{work.what} ", step, stage == COMMUNICATING, since))
        return out

    def _warn(self, what: str, step: int, waited: float) -> None:
        peers = self.peers()
        peers = [r for r in (range(self.world_size) if peers is None else peers) if r != self.rank]
        phases = {r: _decode(v) for r, v in read_keys(self.store, PHASE_KEY, peers).items()}
        ranks = holding_up(step, peers, phases)
        report = {"rank": self.rank, "what": what, "step": step, "waited_s": round(waited, 3), "ranks": ranks,
                  "phases": {str(r): list(phases.get(r, (-1, COMPUTE))) for r in ranks}}
        self.warnings.append(report)
        self.store.set(f"{STALL_KEY}{self.rank}", json.dumps(report))
        self.out.write(stall_message(report) + "\n")
        self.out.flush()

    def stop(self) -> None:
        """End the watch and wait for its thread (at most 5 s)."""
        super().stop()
        self.join(5.0)


def stall_message(report: dict) -> str:
    """The one-line warning for a published stall ``report``."""
    ranks = report["ranks"]
    if not ranks:
        whom = "no peer that is behind (a service, or a message in flight)"
    else:
        parts = []
        for r in ranks:
            step, kind = report["phases"].get(str(r), (-1, COMPUTE))
            where = ("no phase reported yet" if step < 0 else
                     f"last reported {'computing' if kind == COMPUTE else 'communicating in'} step {step}")
            parts.append(f"{r} ({where})")
        whom = ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)
    what = report.get("what", "")
    who = f"rank {report['rank']}'s {what}" if what else f"rank {report['rank']} "
    return f"prague: warning: {who}has waited {report['waited_s']:.1f} s in step {report['step']} for {whom}"
