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
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import setproctitle
import torch
from torch import nn

from prague.algorithms.api import Algorithm, StepTimes
from prague.algorithms.registry import get_method, method_of, parse_method
from prague.algorithms.spec import Method
from prague.comm.flat import average_into, consensus_distance
from prague.comm.streams import Streams, streams_for
from prague.errors import ConfigError
from prague.metrics.decisions import DecisionLog
from prague.runtime.context import DistContext, context
from prague.runtime.guard import publish_survival
from prague.runtime.stall import StallWatch

Closure = Callable[[nn.Module], torch.Tensor]


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
    slowdown: float  # the injected slowdown factor (the built-in loop's harness sets it; 1.0 otherwise)
    loss: float | None
    dropped: float | None = None  # share of the gradient dropped (lossy), else None and not written
    batch: int | None = None  # the job-wide batch index under a --budget (set by the loop), else not written
    samples: int | None = None  # the step's samples when the method set them (allreduce:balanced), else not written

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for optional in ("dropped", "batch", "samples"):
            if out[optional] is None:
                del out[optional]
        return out


def method_step(algorithm: Algorithm, optimizer: torch.optim.Optimizer | None, step: int, times: StepTimes,
                hooks: StepHooks, clock: Callable[[], float], skip: bool = False) -> tuple[float, float, float]:
    """The method's part of a step once backward is done, in its one order, for both forms of the API
    (:meth:`DistributedTrainer.step` and ``prague.prepare``'s optimizer step): the method's gradient
    communication (``after_backward``), ``hooks.before_update``, the update (``apply_update``), the
    method's averaging (``after_step``). ``skip``: a mixed-precision step whose gradients were not finite
    (no update; a method that sends its gradients in the step still sends none). Returns the clock after
    the communication, after the update and at the end."""
    if not (skip and algorithm.sends_gradients_in_step):
        algorithm.after_backward(step, times)
    t_communicated = clock()
    hooks.before_update(step, times)
    if not skip:
        algorithm.apply_update(optimizer, step)
    t_updated = clock()
    algorithm.after_step(step, times)
    return t_communicated, t_updated, clock()


class StepHooks:
    """Callbacks at the boundaries of one :meth:`DistributedTrainer.step` (every one a no-op here: a
    subclass overrides those it needs). In order: :meth:`before_compute` (the step's clock has started),
    the method's own preparation of the step, :meth:`before_forward`, the forward and backward pass,
    :meth:`after_backward` (gradients ready, before the method sends or
    averages them), the method's gradient communication, :meth:`before_update` (``times``: what the method
    waited for and communicated so far), the optimizer's update, then the method's parameter
    averaging. A hook that raises fails the step (and the trainer: :meth:`DistributedTrainer.close` then
    only releases). The built-in loop's experiment harness (:mod:`prague.train.harness`: injected
    faults, slowdowns, paced compute) is one."""

    def before_compute(self, step: int) -> None:
        """At the start of the step, before the method prepares it (and before the gradients are zeroed)."""

    def before_forward(self, step: int) -> None:
        """Right before the forward pass (after the method prepared the step: a server's values installed)."""

    def after_backward(self, step: int) -> None:
        """After the step's backward pass, before the method's gradient communication."""

    def before_update(self, step: int, times: StepTimes) -> None:
        """After the method's gradient communication, before the optimizer's update."""


#: DDP's own options, which a script moving from DDP passes to ``prepare``: ``allreduce`` hands them to DDP.
DDP_OPTIONS = ("find_unused_parameters", "static_graph", "broadcast_buffers", "gradient_as_bucket_view")


def _ddp_options(method: Method, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` without DDP's options where ``method`` has no DDP: checked by type, then honoured by what
    the method does anyway (a parameter no forward pass used has a zero gradient or none, and keeps its
    value; a static graph and bucket views are DDP's own plans), or refused with the reason
    (``broadcast_buffers``: such a method keeps the buffers its own way)."""
    declared = {o.name for o in method.option_infos}
    given = [k for k in options if k in DDP_OPTIONS and k not in declared]
    if not given:
        return options
    ddp = {o.name: o for o in get_method("allreduce").option_infos}
    for name in given:
        ddp[name].check_value("allreduce", options[name])
    if "broadcast_buffers" in given:
        raise ConfigError(f"broadcast_buffers is DDP's option (method 'allreduce'); method {method.name!r} keeps "
                          "every rank's buffers (BatchNorm statistics) its own way (parameter averages average the "
                          "floating buffers with the parameters): drop the option")
    return {k: v for k, v in options.items() if k not in given}


def make_algorithm(ctx: DistContext, algorithm: Any, seed: int | None,
                   options: dict[str, Any], name: str | None = None) -> tuple[Method, str | None, Algorithm]:
    """The method ``algorithm`` names (``NAME`` or ``NAME:VARIANT``, with ``options``: keyword names of its
    options, ConfigError naming the valid ones otherwise), or whose typed options it is (a job
    description's, :attr:`prague.train.config.RunConfig.options`; then ``options`` must be empty), with
    seed options left at 0 set to ``seed``, checked against the job: (its description, its variant, its
    runtime object, not yet set up). The runtime keys the job's store under ``name``, or the job's next
    namespace for the method (:meth:`DistContext.namespace`)."""
    if isinstance(algorithm, str):
        method, variant = parse_method(algorithm)
        options = _ddp_options(method, options)
        unknown = sorted(set(options) - {o.name for o in method.option_infos})
        if unknown:
            valid = ", ".join(o.name for o in method.option_infos) or "none"
            raise ConfigError(f"method {method.name!r} has no option(s) {unknown}; its options: {valid}")
        method_options = method.make_options(options, variant, seed)
    else:
        method = method_of(algorithm)
        if options:
            raise ConfigError(f"options {sorted(options)} given beside {type(algorithm).__name__}; set them in it "
                              "(dataclasses.replace) or name the method as a string")
        method_options = algorithm if seed is None else method.seeded(algorithm, seed)
    method.check_job(method_options, ctx.world_size)
    namespace = ctx.namespace(method.name, name)
    if ctx.world_size > 1:
        publish_survival(ctx.store, ctx.rank, method.survives_failures)  # for a guard or prague launch
    variant = method.variant_of(method_options)
    name_process(ctx, method.label(method_options))
    return method, variant, method.runtime_class(variant)(ctx, method_options, namespace)


def name_process(ctx: DistContext, label: str) -> None:
    """What ``ps`` and ``top`` show for this worker: ``prague rank R/N METHOD: its command``."""
    command = setproctitle.getproctitle()
    if command.startswith("prague rank "):  # named before (a second method in one script)
        command = command.split(": ", 1)[-1]
    setproctitle.setproctitle(f"prague rank {ctx.rank}/{ctx.world_size} {label}: {command}")


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
    step time. ``hooks``: a :class:`StepHooks` called at the step's boundaries (the built-in loop's
    experiment harness is one). ``decisions``: this rank's decision log (:class:`prague.metrics.decisions.DecisionLog`), into which
    the method writes every group, partner and push it decides on; the caller closes it after
    :meth:`close`. None (the default): nothing is logged. ``name``: where the method keys the job's store
    (:meth:`DistContext.namespace`); unnamed methods are numbered in the order each rank makes them.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        algorithm: Any = "allreduce",
        *,
        ctx: DistContext | None = None,
        seed: int | None = None,
        decisions: DecisionLog | None = None,
        stall_warn_s: float | None = None,
        hooks: StepHooks | None = None,
        name: str | None = None,
        **options: Any,
    ) -> None:
        self.ctx = ctx or context()
        self.hooks = hooks or StepHooks()
        self.method, self.variant, self.algorithm = make_algorithm(self.ctx, algorithm, seed, options, name)
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
                                          background=self.algorithm.background)
        self._emulated = getattr(model, "nominal_compute_s", None) is not None  # no loss to report

    def step(self, closure: Closure) -> StepRecord:
        """One iteration: forward/backward through ``closure(module)``, then the method's communication
        and update, with the :class:`StepHooks` at their points. Returns the iteration's record."""
        try:
            return self._step(closure)
        except BaseException:
            self._failed = True
            raise

    def _step(self, closure: Closure) -> StepRecord:
        step, rank, hooks = self.steps_done, self.ctx.rank, self.hooks
        times = StepTimes()

        t0 = self._clock()
        self.phase.compute(step)
        hooks.before_compute(step)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=False)
        self.algorithm.before_compute(step)
        hooks.before_forward(step)
        loss = closure(self.module)
        loss.backward()
        hooks.after_backward(step)  # its time is compute: the harness pads a paced backward pass to its end here
        t1 = self._clock()
        self.phase.communicate()
        t2, t3, t4 = method_step(self.algorithm, self.optimizer, step, times, hooks, self._clock)

        hooks_s = (t2 - t1) + (t4 - t3)
        compute_s = (t1 - t0) + (t3 - t2) - times.inner_comm_s
        comm_s = hooks_s + times.inner_comm_s - times.wait_s
        self.steps_done += 1
        if self.stall_watch is not None:
            self.stall_watch.step_done(t4 - t0)
        loss_value = None if self._emulated else float(loss.detach())
        return StepRecord(step, rank, time.time(), compute_s, comm_s, times.wait_s, 1.0, loss_value, times.dropped)

    def state_dict(self) -> dict[str, Any]:
        """The trainer's own counter (steps done), for a checkpoint; the model and optimizer are saved by
        their own ``state_dict``."""
        return {"steps_done": self.steps_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after ``state["steps_done"]`` steps: the next :meth:`step` is that step."""
        self.steps_done = int(state["steps_done"])

    def averaged_model(self, group: Any = None) -> nn.Module:
        """A new copy of the model holding the mean of all ranks' parameters and buffers (of ``group``'s
        ranks, e.g. the survivors'). Collective."""
        target = copy.deepcopy(self.model)
        with self.algorithm.outside_steps():
            average_into(self.model, target, group)
        return target

    def consensus_distance(self, group: Any = None) -> float:
        """Mean distance of the replicas (of ``group``'s ranks) from their average (0 for all-reduce). Collective."""
        with self.algorithm.outside_steps():
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
