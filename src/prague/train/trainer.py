"""The user-facing training API: wrap a model and optimizer with a method, call :meth:`step` in a loop.

Shaped like DDP and Horovod's ``DistributedOptimizer``::

    import prague
    prague.init()                                     # from `prague launch` or torchrun's environment
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    trainer = prague.wrap(model, opt, algorithm="allreduce")
    for x, y in batches:
        record = trainer.step(lambda m: F.cross_entropy(m(x), y))  # a StepRecord: times and loss
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
from prague.algorithms.spec import Method
from prague.comm.flat import average_into, consensus_distance
from prague.comm.streams import Streams, streams_for
from prague.errors import ConfigError
from prague.hetero.spec import InjectedCrash, Scenario, parse_scenario
from prague.metrics.decisions import DecisionLog
from prague.runtime.context import DistContext, context
from prague.runtime.stall import StallWatch

Closure = Callable[[nn.Module], torch.Tensor]


class Pace:
    """Paced compute: each step's forward and backward pass, real, padded to the nominal time ``pace_s``
    times the step's slowdown factor, so that a worker sharing this machine's cores behaves like one with
    an accelerator of its own (its step takes the nominal time, and background communication runs in the
    padding instead of taking compute from it).

    The padding comes before the real pass: :meth:`before` sleeps the nominal time less the real pass's
    recent median, :meth:`pad_rest` whatever is still short. So the gradients are ready at the step's end, as
    on an accelerator, and communication that starts from them (DDP's buckets) is not hidden in the
    padding. After :data:`FIT_STEPS` steps, a median real pass (without what the method communicated inside
    the backward pass, as DDP does) longer than ``pace_s`` means the pace cannot
    be held: :class:`~prague.errors.ConfigError` naming the measured time."""

    FIT_STEPS = 8

    def __init__(self, pace_s: float, rank: int) -> None:
        self.pace_s, self.rank = pace_s, rank
        self._real: list[float] = []

    def _median(self) -> float:
        recent = sorted(self._real[-self.FIT_STEPS:])
        return recent[len(recent) // 2] if recent else 0.0

    def before(self, factor: float) -> None:
        pad = self.pace_s * factor - self._median()
        if pad > 0:
            time.sleep(pad)

    def pad_rest(self, t0: float, factor: float) -> None:
        """Sleep until the step started at ``t0`` (``time.perf_counter``) has taken its nominal time."""
        rest = t0 + self.pace_s * factor - time.perf_counter()
        if rest > 0:
            time.sleep(rest)

    def record(self, real_s: float) -> None:
        """The step's real forward and backward pass took ``real_s``; raise once the first steps show
        that the pace cannot be held."""
        self._real.append(real_s)
        if len(self._real) == self.FIT_STEPS and self._median() > self.pace_s:
            raise ConfigError(
                f"--compute paced: rank {self.rank}'s real forward and backward pass takes "
                f"{self._median() * 1e3:.1f} ms (median of its first {self.FIT_STEPS} steps), more than the pace "
                f"of {self.pace_s * 1e3:g} ms; raise --compute-ms to at least {self._median() * 1.2e3:.0f} or run "
                "fewer workers on this machine")


def step_clock(device: torch.device, streams: Streams | None = None) -> Callable[[], float]:
    """The clock that times a step's phases on ``device``: ``time.perf_counter``, and on CUDA after the
    work queued so far on the compute stream (an event recorded there and waited for; ``streams``
    default :func:`~prague.comm.streams.streams_for`). CUDA kernels run asynchronously, so without it a
    phase would be charged for the queued work of the one before (backward's kernels to the
    communication hooks). Not ``torch.cuda.synchronize()``: that would also wait for a background
    average on its side stream and charge it to the step."""
    if device.type != "cuda":
        return time.perf_counter
    ops = streams_for(device) if streams is None else streams

    def now() -> float:
        ops.finish(ops.mark())
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
    batch: int | None = None  # the job-wide batch index under a --budget (set by the loop), else not written

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for optional in ("dropped", "batch"):
            if out[optional] is None:
                del out[optional]
        return out


def make_algorithm(ctx: DistContext, algorithm: str, seed: int | None,
                   options: dict[str, Any]) -> tuple[Method, str | None, Algorithm]:
    """The method named ``algorithm`` (``NAME`` or ``NAME:VARIANT``) with ``options`` (keyword names of
    its options; ConfigError naming the valid ones otherwise), checked against the job: (its
    description, its variant, its runtime object, not yet set up)."""
    method, variant = parse_method(algorithm)
    unknown = sorted(set(options) - {o.name for o in method.option_infos})
    if unknown:
        valid = ", ".join(o.name for o in method.option_infos) or "none"
        raise ConfigError(f"method {method.name!r} has no option(s) {unknown}; its options: {valid}")
    method_options = method.make_options(options, variant, seed)
    method.check_job(method_options, ctx.world_size)
    return method, method.variant_of(method_options), method.runtime_class()(ctx, method_options)


def setup_algorithm(algorithm: Algorithm, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> nn.Module:
    """``algorithm.setup``; on failure, release what it acquired before raising."""
    try:
        return algorithm.setup(model, optimizer)
    except BaseException:
        algorithm.close(failed=True)
        raise


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
        compute_ms: float | None = None,
        paced: bool = False,
        **options: Any,
    ) -> None:
        self.ctx = ctx or context()
        self.scenario = scenario if isinstance(scenario, Scenario) else parse_scenario(scenario or "homogeneous")
        self.scenario.check_world(self.ctx.world_size)
        self.method, self.variant, self.algorithm = make_algorithm(self.ctx, algorithm, seed, options)
        self.algorithm.decisions = decisions
        self.model = model.to(self.ctx.device)
        self._clock = step_clock(self.ctx.device)
        self.optimizer = optimizer
        self.module = setup_algorithm(self.algorithm, self.model, optimizer)
        self.steps_done = 0
        self._failed = False
        self.phase = self.algorithm.phase
        self.stall_watch: StallWatch | None = None
        if self.ctx.world_size > 1:
            self.stall_watch = StallWatch(self.ctx.private_store(), self.ctx.rank, self.ctx.world_size, self.phase,
                                          self.algorithm.peers, stall_warn_s,
                                          background=self.algorithm.background_phase)
        # Nominal per-iteration compute time that slowdowns scale: known for emulated compute and given
        # (compute_ms) for paced; otherwise given, or an exponential moving average of measured compute.
        self._nominal_s: float | None = getattr(model, "nominal_compute_s", None)
        self._emulated = self._nominal_s is not None
        if self._nominal_s is None and compute_ms is not None:
            self._nominal_s = compute_ms / 1e3
        if paced and not self._nominal_s:
            raise ConfigError("paced compute needs compute_ms > 0: the nominal step time each step is padded to")
        self._pace = Pace(self._nominal_s, self.ctx.rank) if paced and self._nominal_s else None
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
        if self._pace is not None:
            self._pace.before(factor)
        elif delay > 0:
            time.sleep(delay)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=False)
        self.algorithm.before_compute(step)
        real_start = self._clock()
        loss = closure(self.module)
        loss.backward()
        real_end = t1 = self._clock()
        self.phase.communicate()
        self.algorithm.after_backward(step, times)
        t2 = self._clock()
        if self._pace is not None:  # after the method's hook, which measures what it waited for since backward
            self._pace.pad_rest(t0, factor)
        self.algorithm.apply_update(self.optimizer, step)
        t3 = self._clock()
        self.algorithm.after_step(step, times)
        t4 = self._clock()

        if self._pace is not None:  # the real pass, less what the method communicated inside backward (DDP)
            self._pace.record(real_end - real_start - times.inner_comm_s)
        hooks_s = (t2 - t1) + (t4 - t3)
        compute_s = (t1 - t0) + (t3 - t2) - times.inner_comm_s
        comm_s = hooks_s + times.inner_comm_s - times.wait_s
        base = compute_s - delay
        self._ema_s = base if self._ema_s is None else 0.8 * self._ema_s + 0.2 * base
        self.steps_done += 1
        if self.stall_watch is not None:
            self.stall_watch.step_done(t4 - t0)
        loss_value = None if self._emulated else float(loss.detach())
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
