"""The user-facing training API: wrap a model and optimizer with a method, call :meth:`step` in a loop.

Shaped like DDP and Horovod's ``DistributedOptimizer``::

    import prague
    prague.init()                                     # from `prague launch` or torchrun's environment
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    trainer = prague.wrap(model, opt, algorithm="allreduce")
    for x, y in batches:
        loss = trainer.step(lambda m: F.cross_entropy(m(x), y))
    final = trainer.averaged_model()                  # collective: the mean of all replicas
    trainer.close()
    prague.shutdown()

``prague run``'s built-in loop uses exactly this class.
"""

from __future__ import annotations

import copy
import os
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from prague.algorithms.api import Algorithm, StepTimes
from prague.algorithms.registry import parse_method
from prague.comm.flat import average_into, consensus_distance
from prague.errors import ConfigError
from prague.hetero.spec import InjectedCrash, Scenario, parse_scenario
from prague.metrics.decisions import DecisionLog
from prague.runtime.context import DistContext, context
from prague.runtime.stall import StallWatch

Closure = Callable[[nn.Module], torch.Tensor]


def step_clock(device: torch.device,
               synchronize: Callable[[torch.device], None] | None = None) -> Callable[[], float]:
    """The clock that times a step's phases on ``device``: ``time.perf_counter``, and on CUDA
    ``synchronize(device)`` (default ``torch.cuda.synchronize``) first. CUDA kernels run asynchronously,
    so without it a phase would be charged for the queued work of the one before (backward's kernels to
    the communication hooks)."""
    if device.type != "cuda":
        return time.perf_counter
    sync = torch.cuda.synchronize if synchronize is None else synchronize

    def now() -> float:
        sync(device)
        return time.perf_counter()

    return now


@dataclass
class StepRecord:
    """Timing and loss of one iteration on one worker (one line of the metrics file)."""

    step: int
    rank: int
    t_end_s: float
    compute_s: float
    comm_s: float
    wait_s: float
    slowdown: float
    loss: float | None
    dropped: float | None = None  # share of the gradient dropped (lossy), else None and not written

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if self.dropped is None:
            del out["dropped"]
        return out


class DistributedTrainer:
    """Runs one iteration of a synchronisation method per :meth:`step` call.

    Every rank of the job constructs one, with models of identical architecture, and calls
    :meth:`step` once per iteration. Collective methods (:meth:`averaged_model`,
    :meth:`consensus_distance`) must be called by every rank at the same point. :meth:`close` must be
    called on every rank, also after an exception, to stop the method's background threads.
    ``seed`` is the run's seed: method seed options left at 0 (``gg_seed``, ``shuffle_seed``,
    ``adpsgd_seed``) take it, as they do under ``prague run`` and in the simulator.
    ``stall_warn_s``: warn (on stderr and through the store) when this rank has waited that long for
    others in one step, naming them (:mod:`prague.runtime.stall`); None: derived from the measured
    step time. ``decisions``: this rank's decision log (:class:`prague.metrics.decisions.DecisionLog`), into which
    the method writes every group, partner and push it decides on; the caller closes it after
    :meth:`close`. None (the default): nothing is logged.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        algorithm: str = "allreduce",
        *,
        scenario: str | Scenario | None = None,
        ctx: DistContext | None = None,
        seed: int | None = None,
        decisions: DecisionLog | None = None,
        stall_warn_s: float | None = None,
        **options: Any,
    ) -> None:
        self.ctx = ctx or context()
        self.method, variant = parse_method(algorithm)
        unknown = sorted(set(options) - {o.name for o in self.method.option_infos})
        if unknown:
            valid = ", ".join(o.name for o in self.method.option_infos) or "none"
            raise ConfigError(f"method {self.method.name!r} has no option(s) {unknown}; its options: {valid}")
        method_options = self.method.make_options(options, variant, seed)
        self.method.check_job(method_options, self.ctx.world_size)
        self.variant = self.method.variant_of(method_options)
        self.algorithm: Algorithm = self.method.runtime_class()(self.ctx, method_options)
        self.algorithm.decisions = decisions
        self.scenario = scenario if isinstance(scenario, Scenario) else parse_scenario(scenario or "homogeneous")
        self.scenario.check_world(self.ctx.world_size)
        self.model = model.to(self.ctx.device)
        self._clock = step_clock(self.ctx.device)
        self.optimizer = optimizer
        try:
            self.module = self.algorithm.setup(self.model, optimizer)
        except BaseException:
            self.algorithm.close(failed=True)
            raise
        self.steps_done = 0
        self._failed = False
        self.phase = self.algorithm.phase
        self.stall_watch: StallWatch | None = None
        if self.ctx.world_size > 1:
            self.stall_watch = StallWatch(self.ctx.private_store(), self.ctx.rank, self.ctx.world_size, self.phase,
                                          self.algorithm.peers, stall_warn_s,
                                          background=self.algorithm.background_phase)
        # Nominal per-iteration compute time that slowdowns scale: known for emulated compute,
        # otherwise an exponential moving average of measured compute.
        self._nominal_s: float | None = getattr(model, "nominal_compute_s", None)
        self._ema_s: float | None = None

    def _slowdown_delay_s(self, factor: float) -> float:
        base = self._nominal_s if self._nominal_s is not None else self._ema_s
        return (factor - 1.0) * base if base else 0.0

    def step(self, closure: Closure) -> StepRecord:
        """One iteration: forward/backward through ``closure(module)``, then the method's communication
        and update. Returns the iteration's record. A ``crash:RANK:STEP`` scenario raises
        :class:`InjectedCrash` here on that rank and step; ``hang:RANK:STEP`` freezes the process here
        (SIGSTOP: it neither exits nor beats its heartbeat until someone kills or continues it)."""
        try:
            return self._step(closure)
        except BaseException:
            self._failed = True
            raise

    def _step(self, closure: Closure) -> StepRecord:
        step, rank = self.steps_done, self.ctx.rank
        if self.scenario.crashes_at(rank, step):
            raise InjectedCrash(f"injected crash of rank {rank} at step {step} (scenario {self.scenario.text!r})")
        if self.scenario.hangs_at(rank, step):
            os.kill(os.getpid(), signal.SIGSTOP)
        factor = self.scenario.slowdown(rank, step, self.ctx.world_size)
        times = StepTimes()

        t0 = self._clock()
        self.phase.compute(step)
        delay = self._slowdown_delay_s(factor)
        if delay > 0:
            time.sleep(delay)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=False)
        loss = closure(self.module)
        loss.backward()
        t1 = self._clock()
        self.phase.communicate()
        self.algorithm.after_backward(step, times)
        t2 = self._clock()
        self.algorithm.apply_update(self.optimizer, step)
        t3 = self._clock()
        self.algorithm.after_step(step, times)
        t4 = self._clock()

        hooks_s = (t2 - t1) + (t4 - t3)
        compute_s = (t1 - t0) + (t3 - t2) - times.inner_comm_s
        comm_s = hooks_s + times.inner_comm_s - times.wait_s
        base = compute_s - delay
        self._ema_s = base if self._ema_s is None else 0.8 * self._ema_s + 0.2 * base
        self.steps_done += 1
        if self.stall_watch is not None:
            self.stall_watch.step_done(t4 - t0)
        loss_value = float(loss.detach()) if self._nominal_s is None else None
        return StepRecord(step, rank, time.time(), compute_s, comm_s, times.wait_s, factor, loss_value, times.dropped)

    def state_dict(self) -> dict[str, Any]:
        """The trainer's own counters (steps done, the compute-time average slowdowns scale), for a
        checkpoint; the model and optimizer are saved by their own ``state_dict``."""
        return {"steps_done": self.steps_done, "ema_s": self._ema_s}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after ``state["steps_done"]`` steps: the next :meth:`step` is that step (its batch,
        slowdown and injected faults)."""
        self.steps_done = int(state["steps_done"])
        self._ema_s = state.get("ema_s")

    def averaged_model(self, group: Any = None) -> nn.Module:
        """A new copy of the model holding the mean of all ranks' parameters and buffers (of ``group``'s
        ranks, e.g. the survivors'). Collective."""
        target = copy.deepcopy(self.model)
        average_into(self.model, target, group)
        return target

    def consensus_distance(self, group: Any = None) -> float:
        """Mean distance of the replicas (of ``group``'s ranks) from their average (0 for all-reduce). Collective."""
        return consensus_distance(self.model, group)

    def stats(self) -> dict[str, Any]:
        return self.algorithm.stats()

    def close(self, failed: bool | None = None) -> None:
        """End the method: run its orderly finish (drain pending group operations, goodbyes; collective
        for some methods), then release its threads, communicators and services. Call on every rank,
        also after a failure: pass ``failed=True`` then (the default is whether a :meth:`step` raised),
        and it only releases, without waiting for peers that may be gone."""
        if self.stall_watch is not None:  # the closing drain is no stall: slow ranks finish later by design
            self.stall_watch.stop()
            self.stall_watch = None
        self.algorithm.close(failed=self._failed if failed is None else failed)
        self.module = self.model  # the method's wrapper (DDP holds the world group) goes with the method

    def __enter__(self) -> DistributedTrainer:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self.close(failed=kind is not None)


def wrap(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    algorithm: str = "allreduce",
    **kwargs: Any,
) -> DistributedTrainer:
    """Wrap ``model`` and ``optimizer`` with a synchronisation method; see :class:`DistributedTrainer`."""
    return DistributedTrainer(model, optimizer, algorithm, **kwargs)
