"""The built-in loop's experiment harness: injected faults, slowdowns and paced compute.

None of this is in the library's training API: :class:`Harness` is a
:class:`~prague.train.trainer.StepHooks`, the same extension point a user has, that ``prague run`` and
``prague bench`` put on their :class:`~prague.train.trainer.DistributedTrainer`. At each step of rank R:

* ``crash:R:STEP`` raises :class:`~prague.hetero.spec.InjectedCrash` at the step's start; ``hang:R:STEP``
  freezes the process there (SIGSTOP: it neither exits nor beats its heartbeat until someone kills or
  continues it). Each fires once per job: it is written down (``fired``, a file of this rank's) before
  it fires, and a job that goes on after it (resumed from a checkpoint, or restarted by torchrun) reads
  the file and does not fire it again; ``failures:P`` crashes the rank at the first step it starts once its
  seeded failure time (:meth:`~prague.hetero.spec.Scenario.failure_time_s`) has passed on the job's clock
  (:attr:`Harness.clock`), also once per job;
* the scenario's slowdown factor f makes the step longer: under emulated or real compute by a sleep of
  (f - 1) x the nominal compute time (the emulated model's, ``compute_ms``, or else this rank's running
  average of its measured compute), before the forward pass;
* under paced compute (:class:`~prague.train.pacing.Pace`) the real forward and backward pass is padded to
  f x the nominal time, the forward part as a whole and the backward part layer by layer in autograd's
  order, so that a worker sharing this machine's cores behaves like one with an accelerator of its own
  (gradients ready when they would be on an accelerator: :mod:`prague.train.pacing`).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from prague.algorithms.api import Algorithm, StepTimes
from prague.errors import ConfigError
from prague.hetero.spec import InjectedCrash, Scenario
from prague.io import atomic_write_json
from prague.train.pacing import DEFAULT_SPLIT, Pace
from prague.train.trainer import StepHooks, StepRecord


class Harness(StepHooks):
    """The built-in loop's faults, slowdowns and pacing for rank ``rank`` of ``world_size`` (see the module
    docstring). ``nominal_s``: the nominal compute time of a step that slowdowns scale (None: this rank's
    running average of its measured compute); ``paced``: pad each real pass to it (needs ``nominal_s``;
    ``split``: ``--pace-split``; the loop hooks the model with :meth:`attach`).
    After each step the loop hands the trainer's record to :meth:`finish_step`. ``fired``: the file that
    records the faults this rank fired (None: none is recorded); ``continued``: the job continues an
    earlier attempt, so faults that file lists do not fire again (otherwise the file is cleared)."""

    def __init__(self, scenario: Scenario, rank: int, world_size: int, nominal_s: float | None = None,
                 paced: bool = False, fired: Path | None = None, continued: bool = False,
                 split: str = DEFAULT_SPLIT) -> None:
        scenario.check_world(world_size)
        if paced and not nominal_s:
            raise ConfigError("paced compute needs compute_ms > 0: the nominal step time each step is padded to")
        self.scenario, self.rank, self.world_size = scenario, rank, world_size
        self.nominal_s = nominal_s
        self.pace = Pace(nominal_s, rank, split) if paced and nominal_s else None
        self._algorithm: Algorithm | None = None
        self.ema_s: float | None = None  # running average of this rank's compute without the injected sleep
        self._factor = 1.0
        self.fraction = 1.0  # the next step's samples over the nominal batch (allreduce:balanced's shares)
        self._delay = 0.0
        self._t0 = 0.0
        self._real_end = 0.0
        self._fired_path = fired
        self._fail_at_s = scenario.failure_time_s(rank)  # failures:P: when this rank fails on the job's clock
        #: The job's clock, s (the loop sets it to its common clock; a failure rate's crash reads it).
        self.clock: Callable[[], float] = lambda: 0.0
        self.fired: set[tuple[str, int]] = set()
        if fired is not None and continued and fired.exists():
            self.fired = {(str(kind), int(step)) for kind, step in json.loads(fired.read_text())}
        elif fired is not None:
            fired.unlink(missing_ok=True)

    def attach(self, model: nn.Module, algorithm: Algorithm) -> None:
        """Under paced compute, hook ``model`` (its forward part, :meth:`Pace.attach`) and give
        ``algorithm`` the pace's gradient gate, so that what it sends from inside backward leaves when it
        would on an accelerator; nothing otherwise. :meth:`detach` before evaluating copies."""
        if self.pace is not None:
            self.pace.attach(model)
            algorithm.gradient_gate = self.pace.gate
            self._algorithm = algorithm

    def detach(self) -> None:
        """Remove the model's pacing hooks and the algorithm's gate (training is over)."""
        if self.pace is not None:
            self.pace.detach()
            if self._algorithm is not None:
                self._algorithm.gradient_gate = None

    def _fires(self, kind: str, step: int) -> bool:
        """Whether the fault ``kind`` at ``step`` fires now: not if it fired before in this job; recorded
        first, since a crash or a hang leaves no chance to record it afterwards."""
        if (kind, step) in self.fired:
            return False
        self.fired.add((kind, step))
        if self._fired_path is not None:
            self._fired_path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self._fired_path, sorted(self.fired))
        return True

    def _delay_s(self, factor: float) -> float:
        base = self.nominal_s if self.nominal_s is not None else self.ema_s
        return (factor - 1.0) * base if base else 0.0

    def before_compute(self, step: int) -> None:
        rank = self.rank
        if self.scenario.crashes_at(rank, step) and self._fires("crash", step):
            raise InjectedCrash(f"injected crash of rank {rank} at step {step} (scenario {self.scenario.text!r})")
        if self.clock() >= self._fail_at_s and self._fires("failure", 0):
            raise InjectedCrash(f"injected failure of rank {rank} at step {step}, {self.clock():.1f} s into the job "
                                f"(its failure time under scenario {self.scenario.text!r})")
        if self.scenario.hangs_at(rank, step) and self._fires("hang", step):
            os.kill(os.getpid(), signal.SIGSTOP)
        self._t0 = time.perf_counter()
        self._factor = self.scenario.slowdown(rank, step, self.world_size)
        self._delay = self._delay_s(self._factor) * self.fraction
        if self.pace is not None:  # a step of other than the nominal samples takes that much longer
            self.pace.begin(self._factor * self.fraction)
        elif self._delay > 0:
            time.sleep(self._delay)

    def after_backward(self, step: int) -> None:
        self._real_end = time.perf_counter()
        if self.pace is not None:  # before the method's gradient communication, which comes after, exposed
            self.pace.pad_rest()

    def before_update(self, step: int, times: StepTimes) -> None:
        if self.pace is not None:
            # the step's compute to the end of its backward pass, less what the method communicated inside
            # it (DDP's buckets that compute did not hide)
            self.pace.record(self._real_end - self._t0 - times.inner_comm_s)

    def finish_step(self, record: StepRecord) -> StepRecord:
        """Put the step's slowdown factor on ``record`` and keep the running average of the compute
        without the injected sleep (the base of the next steps' sleeps when no nominal time is given)."""
        record.slowdown = self._factor
        base = record.compute_s - self._delay
        self.ema_s = base if self.ema_s is None else 0.8 * self.ema_s + 0.2 * base
        return record

    def state_dict(self) -> dict[str, Any]:
        """The running compute average, for a checkpoint."""
        return {"ema_s": self.ema_s}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ema_s = state.get("ema_s")
