"""Your loop, your optimizer: ``prague.prepare`` wraps a model and an optimizer, and the loop stays yours.

::

    prague.init()
    model, optimizer = prague.prepare(model, optimizer, algorithm="prague:smart")
    for x, y in batches:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # anything between backward and step
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()                                          # any LR scheduler on the prepared optimizer
    final = model.averaged_model()                                # collective: the mean of the replicas
    prague.shutdown()                                             # ends the method too

As with ``DistributedDataParallel``, ``Horovod``'s ``DistributedOptimizer`` and Accelerate's ``prepare``,
the method runs inside the two calls a training loop makes anyway. The returned model runs the forward
pass through the method's module (DDP for ``allreduce``; a wrapper that installs a server's values for
the parameter servers; the model itself otherwise). The returned optimizer's :meth:`PreparedOptimizer.step`
is the method's iteration (:class:`prague.algorithms.api.Algorithm`'s hooks, in the order
:class:`prague.train.trainer.DistributedTrainer` calls them): ``after_backward`` (send gradients, average
with a partner), ``apply_update`` (the wrapped optimizer's own step, unless a server owns the update),
``after_step`` (average parameters with a group). Gradient methods whose gradients travel inside
backward (``allreduce``) give the loop averaged gradients, so clipping between backward and step clips
the average, as with DDP; the others clip each worker's own gradients before they travel.

Gradient accumulation: ``with model.no_sync():`` around the forward (and backward) pass of every
micro-batch but the last, then the last one's outside it and ``optimizer.step()``. DDP's rule decides: a
backward pass accumulates when its forward pass ran inside the block, wherever the backward runs
(``allreduce`` skips its all-reduce for it), so every accumulation pattern DDP accepts is accepted.

Mixed precision: ``torch.autocast`` works as it does anywhere. With ``torch.amp.GradScaler`` the prepared
optimizer takes the scaler's verdict (``_step_supports_amp_scaling``: the scaler hands it ``grad_scale``
and ``found_inf``): gradients are unscaled before they travel, and a step the scaler skips is skipped
for the method too: the local update is not applied and, for a method whose gradients leave in the step
(a server push), nothing is sent; parameter averaging still runs. Methods that need every rank's
gradients in every step and send them in the step (``eager-sgd``, ``lossy``, ``ps:sync``) would then
receive one rank's skip as a missing push or round, so the scaler is refused for them with the reason.

Calling things in the wrong order raises :class:`~prague.errors.ConfigError` naming the fix: a step with
no backward since the last one, a step after only accumulating backward passes (no gradient would
travel), a model or optimizer used after ``prague.shutdown()``. ``optimizer.zero_grad()`` forgets the
backward passes counted so far (the gradients are gone with them).
"""

from __future__ import annotations

import contextlib
import copy
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from prague.algorithms.api import Algorithm, StepTimes
from prague.comm.collectives import average_live, pause_while_waiting
from prague.comm.flat import average_into, consensus_distance
from prague.errors import ConfigError
from prague.io import JsonLines
from prague.metrics.decisions import DecisionLog
from prague.metrics.timeline import BACKGROUND_DIR, write_background
from prague.metrics.writers import Writers, parse_report_to
from prague.runtime.background import spans_since
from prague.runtime.context import DistContext, context, on_shutdown, report_steps
from prague.runtime.every_call import EveryCall
from prague.train.trainer import StepHooks, StepRecord, make_algorithm, method_step, setup_algorithm

NO_HOOKS = StepHooks()  # a script's steps have no harness around them


class _Session:
    """What the prepared model and optimizer share: the method, the step count and the order checks."""

    def __init__(self, ctx: DistContext, algorithm: Algorithm, lockstep: bool, label: str,
                 survives: bool = False) -> None:
        self.ctx = ctx
        self.algorithm = algorithm
        self.survives = survives and ctx.world_size > 1  # averaged_model() goes over the living ranks
        # while this rank waits in one of the script's own collectives, the method's rounds go on
        self._unpause = pause_while_waiting(algorithm.outside_steps) if ctx.world_size > 1 else None
        self.lockstep = lockstep  # the method needs every rank in every step
        self.label = label
        self.step = 0
        self.closed = False
        self.no_sync = 0  # depth of model.no_sync() blocks
        self.forward_no_sync = False  # the last forward pass ran inside no_sync(): its backward accumulates
        self.synced: set[int] = set()  # parameters whose gradient arrived outside no_sync since the last step
        self.accumulated: set[int] = set()  # ... inside no_sync
        self.forward_ready = False  # before_compute ran for the coming step
        self.handles: list[Any] = []
        self.t0 = self.step_start = time.perf_counter()
        out = self.out = ctx.job.out  # prague launch --log-dir / prague guard --out: the records
        self.records = JsonLines(out / "metrics" / f"rank{ctx.rank}.jsonl") if out is not None else None
        self.writers = _writers(out, ctx) if out is not None else None  # and --report-to's

    def check_open(self, what: str) -> None:
        if self.closed:
            raise ConfigError(f"{what} after prague.shutdown() (or close()) ended the {self.label} method; "
                              "prepare the model again after prague.init()")

    def on_gradient(self, param: torch.Tensor) -> None:
        """A gradient arrived: it accumulates when the forward pass it comes from ran inside no_sync()
        (DDP's rule: the forward decides, wherever the backward runs), else it is the step's."""
        key = id(param)
        if self.forward_no_sync:
            self.accumulated.add(key)
            return
        self.synced.add(key)

    def before_forward(self, grad: bool) -> None:
        """Before a forward pass (``grad``: under grad mode): the method's hook before the coming step's
        first pass, once per step, and only for a pass that will be trained on (not an evaluation under
        ``torch.no_grad``); and whether this pass's backward accumulates (DDP's rule: the forward decides)."""
        self.check_open("the prepared model was called")
        if not grad:  # an evaluation decides nothing
            return
        if not self.forward_ready:
            self.step_start = time.perf_counter()
            self.algorithm.before_compute(self.step)
            self.forward_ready = True
        self.forward_no_sync = self.no_sync > 0

    def close(self, failed: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        if self.records is not None:
            self.records.close()
        if self.writers is not None:
            self.writers.flush()
        if self._unpause is not None:
            self._unpause()
        for handle in self.handles:
            handle.remove()
        self.algorithm.close(failed=failed)
        if self.out is not None:  # what the background threads did (the method's and the others), for the timeline
            write_background(self.out / "metrics" / BACKGROUND_DIR / f"rank{self.ctx.rank}.jsonl",
                             spans_since(self.t0), -self.t0)


class PreparedModel(nn.Module):
    """The user's model, run through the method (see the module docstring). As with DDP, :attr:`module`
    is the user's model, under every method; ``state_dict`` and ``load_state_dict`` are its own (the same
    keys as without ``prepare``)."""

    module: nn.Module
    model: nn.Module
    _runner: nn.Module
    _session: _Session
    _before_forward: EveryCall

    def __init__(self, model: nn.Module, module: nn.Module, session: _Session) -> None:
        super().__init__()
        self.module = model  # the user's model (DDP's contract), registered
        if module is not model:  # the method's wrapper (DDP, a server's installer): registered too, so
            self._method_module = module  # .train(), .to() and the like reach it; parameters are counted once
        object.__setattr__(self, "model", model)  # an alias of module
        object.__setattr__(self, "_runner", module)  # what the forward pass runs: the method's module
        object.__setattr__(self, "_session", session)
        # torch.compile of the prepared model: the method's work before each pass (a clock read, the method's
        # hook) is an operator of the graph, not a graph break (EveryCall)
        object.__setattr__(self, "_before_forward", EveryCall(session.before_forward))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._before_forward()
        return self._runner(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, by DDP's rule: the backward pass of a forward pass run inside the
        block (wherever that backward runs) accumulates; the step takes the gradients once a backward of a
        forward outside it has run (``allreduce``: DDP skips its all-reduce for the others)."""
        session = self._session
        session.check_open("model.no_sync()")
        ddp_no_sync = getattr(self._runner, "no_sync", None)
        session.no_sync += 1
        try:
            with ddp_no_sync() if callable(ddp_no_sync) else contextlib.nullcontext():
                yield
        finally:
            session.no_sync -= 1

    def averaged_model(self) -> nn.Module:
        """A new copy of the model holding the mean of every rank's parameters and buffers. Collective:
        every rank calls it at the same point."""
        self._session.check_open("model.averaged_model()")
        target = copy.deepcopy(self.model)
        algorithm = self._session.algorithm
        ranks, group = algorithm.replica_group()
        if algorithm.ctx.rank not in ranks:  # this rank left the job (allreduce:drop): its own replica
            return target
        if self._session.survives and group is None:  # a method that survives failures: the living ranks
            average_into(self.model, target, average=average_live)  # (its rounds pause inside)
            return target
        with algorithm.outside_steps():
            average_into(self.model, target, group)
        return target

    def batch_share(self) -> int | None:
        """How many samples this rank should take in its next step, when the method sets it
        (``allreduce:balanced``: in proportion to this rank's measured speed); None: the loop's own batch."""
        share = self._session.algorithm.batch_share()
        return None if share is None else share[1]

    def close(self) -> None:
        """End the method on this rank (every rank calls it; :func:`prague.shutdown` does it otherwise).
        The model then runs as the plain model (the method's module, DDP's hold on the process group
        with it, is let go)."""
        self._session.close()
        if "_method_module" in self._modules:
            del self._modules["_method_module"]
        object.__setattr__(self, "_runner", self.model)

    def consensus_distance(self) -> float:
        """Mean distance of the replicas from their average (0 for all-reduce). Collective."""
        self._session.check_open("model.consensus_distance()")
        with self._session.algorithm.outside_steps():
            return consensus_distance(self.model)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        if assign:
            raise ConfigError("load_state_dict(assign=True) would replace the parameters the method holds views "
                              "of; load with assign=False (the default)")
        return self.model.load_state_dict(state_dict, strict=strict)


class PreparedOptimizer(torch.optim.Optimizer):
    """The user's optimizer; :meth:`step` is the method's iteration (see the module docstring). Its
    ``param_groups`` and ``state`` are the wrapped optimizer's, so LR schedulers, ``state_dict`` and
    ``load_state_dict`` act on it."""

    _step_supports_amp_scaling = True  # torch.amp.GradScaler hands over grad_scale and found_inf

    def __init__(self, optimizer: torch.optim.Optimizer, session: _Session) -> None:
        super().__init__(optimizer.param_groups, dict(optimizer.defaults))
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.optimizer = optimizer
        self._session = session

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's; the backward passes counted since the last step are forgotten too."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        session = self._session
        session.synced.clear()
        session.accumulated.clear()

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The wrapped optimizer's; it replaces its groups and state, so they are shared again (an LR
        scheduler on this optimizer must keep moving the wrapped one's learning rate)."""
        self.optimizer.load_state_dict(state_dict)
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "_session"):  # Optimizer.__init__ adds the wrapped optimizer's groups
            raise ConfigError("add_param_group on a prepared optimizer: the method has bound the parameters it "
                              "was prepared with; add the group before prague.prepare")
        super().add_param_group(param_group)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One iteration of the method after ``loss.backward()``; returns the closure's loss if given."""
        session = self._session
        session.check_open("optimizer.step()")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_order()
        # torch.amp.GradScaler's verdict: grad_scale unless the loop already called scaler.unscale_
        scale: torch.Tensor | None = getattr(self, "grad_scale", None)
        found_inf: torch.Tensor | None = getattr(self, "found_inf", None)
        skip = False
        if scale is not None or found_inf is not None:
            skip = self._unscale(scale, found_inf)
        algorithm, step, times = session.algorithm, session.step, StepTimes()
        t_hooks = time.perf_counter()
        _, _, t_end = method_step(algorithm, self.optimizer, step, times, NO_HOOKS, time.perf_counter, skip)
        if session.records is not None:  # what prague run's workers write, for a script
            record = StepRecord(
                step=step, rank=session.ctx.rank, t_end_s=t_end - session.t0,
                compute_s=max(0.0, t_hooks - session.step_start - times.inner_comm_s),
                comm_s=(t_end - t_hooks) + times.inner_comm_s, wait_s=times.wait_s, slowdown=1.0, loss=None,
                dropped=times.dropped)
            session.records.write(record.as_dict())
            if session.writers is not None:
                session.writers.step(record)
        session.step += 1
        report_steps(session.step)
        session.forward_ready = False
        session.synced.clear()
        session.accumulated.clear()
        return loss

    def _check_order(self) -> None:
        session = self._session
        if not session.synced and not session.accumulated:
            raise ConfigError("optimizer.step() with no loss.backward() since the last step: call loss.backward() "
                              "first")
        if session.accumulated and not session.synced:
            raise ConfigError("optimizer.step() after backward passes all of forward passes inside model.no_sync(): "
                              "run the last micro-batch's forward outside the block, then its backward, then step")

    def _unscale(self, scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> bool:
        """Unscale the gradients in place if the scaler left them scaled (``scale``); whether it found a
        non-finite gradient (this step is then skipped)."""
        session = self._session
        if session.lockstep and session.algorithm.sends_gradients_in_step:
            for name in ("grad_scale", "found_inf"):  # the scaler, interrupted, leaves them set
                self.__dict__.pop(name, None)
            raise ConfigError(f"torch.amp.GradScaler with {session.label}: its gradients travel in optimizer.step() "
                              "and every rank must send them each step, but the scaler decides on one rank's "
                              "gradients alone; use bf16 autocast without a scaler, or a method that averages "
                              "parameters or all-reduces in backward (allreduce, prague, adpsgd, dssync)")
        if scale is not None:
            inv = scale.double().reciprocal().float()
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(inv.to(p.grad.device))
        return bool(found_inf is not None and float(found_inf.sum()) > 0)


def prepare(model: nn.Module, optimizer: torch.optim.Optimizer, algorithm: str = "allreduce", *,
            ctx: DistContext | None = None, seed: int | None = None, decisions: DecisionLog | None = None,
            name: str | None = None, **options: Any) -> tuple[PreparedModel, PreparedOptimizer]:
    """Wrap ``model`` and ``optimizer`` for ``algorithm`` (any name ``prague methods`` lists, with its
    options as keywords, e.g. ``group_size=2``), after :func:`prague.init`, on every rank, with models of
    the same architecture and initial values. ``model`` is moved to the rank's device. Returns the model
    to train and the optimizer to step (see the module docstring); :func:`prague.shutdown` ends the
    method (or call the model's ``close`` first, on every rank). ``seed``: the method's seed options left
    at 0 take it (default 0). ``decisions``: this rank's decision log
    (:class:`~prague.metrics.decisions.DecisionLog`), where the method writes its groups, partners or
    rounds as the built-in loop's ``--log-decisions`` does. ``name``: where the method keys the job's store;
    a script that prepares several methods in one job may name each (unnamed ones are numbered in the
    order each rank prepares them, which must then be the same on every rank, as DDP's is)."""
    ctx = ctx or context()
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"prague.prepare needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, PreparedOptimizer) or isinstance(model, PreparedModel):
        raise ConfigError("this model or optimizer is already prepared; prepare the originals once")
    method, variant, runtime = make_algorithm(ctx, algorithm, seed, options, name)
    runtime.decisions = decisions
    label = method.name + (f":{variant}" if variant else "")
    model = model.to(ctx.device)
    module = setup_algorithm(runtime, model, optimizer)
    session = _Session(ctx, runtime, method_lockstep(runtime), label, method.survives_failures)
    for param in model.parameters():
        if param.requires_grad:
            session.handles.append(param.register_post_accumulate_grad_hook(session.on_gradient))
    prepared = PreparedModel(model, module, session)
    _LATEST[:] = [weakref.ref(session)]  # log_metrics' default step; never keeps a closed method alive
    on_shutdown(prepared.close)
    return prepared, PreparedOptimizer(optimizer, session)


def method_lockstep(algorithm: Algorithm) -> bool:
    """Whether ``algorithm`` needs every rank in every step (its options' ``equal_shares``)."""
    equal = getattr(algorithm.options, "equal_shares", None)
    return bool(equal()) if callable(equal) else True


_METRICS: dict[tuple[Path, int], JsonLines] = {}  # the open user-metrics file of each (folder, rank)


def log_metrics(values: dict[str, Any], step: int | None = None, out: str | Path | None = None) -> None:
    """Record ``values`` (name -> number: a loss, an accuracy, a learning rate) for this rank, beside the
    steps prague records: one JSON line ``{"step", "rank", "time_s", **values}`` in
    ``OUT/metrics/user-rankR.jsonl``, where OUT is ``out``, or ``prague launch --log-dir``'s or ``prague
    guard --out``'s folder. ``step``: the step they belong to (default: the steps this rank's prepared
    optimizer has taken). Not collective."""
    ctx = context()
    folder = Path(out) if out is not None else ctx.job.out
    if folder is None:
        raise ConfigError("prague.log_metrics has no folder to write to: start the job with prague launch "
                          "--log-dir DIR or torchrun ... prague guard --out DIR, or pass out=DIR")
    if not isinstance(values, dict) or not values:
        raise ConfigError(f"prague.log_metrics takes a dict of name -> number, got {values!r}")
    line: dict[str, Any] = {"step": step, "rank": ctx.rank, "time_s": round(time.time(), 3)}
    for name, value in values.items():
        if name in line or not isinstance(name, str):
            raise ConfigError(f"prague.log_metrics: {name!r} is not a metric name (step, rank and time_s are "
                              "taken); name each metric with a string of your own")
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"prague.log_metrics: metric {name!r} must be a number, got {value!r}")
        line[name] = value
    if step is None:
        latest = _LATEST[0]() if _LATEST else None
        line["step"] = latest.step if latest is not None else None
    key = (folder.resolve(), ctx.rank)
    if key not in _METRICS:
        _METRICS[key] = JsonLines(folder / "metrics" / f"user-rank{ctx.rank}.jsonl", append=True)
    _METRICS[key].write(line)
    writers = _writers(folder, ctx)
    if writers.kinds:
        writers.scalars({f"user/{name}": line[name] for name in values}, line["step"] or 0, line["time_s"])
        writers.flush()


_WRITERS: dict[tuple[Path, int], Writers] = {}  # one rank's TensorBoard and CSV writers per folder


def _writers(folder: Path, ctx: DistContext) -> Writers:
    """The writers ``--report-to`` of ``prague launch`` or ``prague guard`` asks for, for this rank's
    records in ``folder`` (the steps and :func:`log_metrics` share them)."""
    key = (folder.resolve(), ctx.rank)
    if key not in _WRITERS:
        if not _WRITERS:
            on_shutdown(_close_writers)
        _WRITERS[key] = Writers(folder, ctx.rank, parse_report_to(ctx.job.report_to))
    return _WRITERS[key]


def _close_writers() -> None:
    """At ``prague.shutdown()``: flush and close every writer (TensorBoard's last events reach the disk)."""
    for writers in _WRITERS.values():
        writers.close()
    _WRITERS.clear()


_LATEST: list[weakref.ref[_Session]] = []  # the latest prepared session (whose steps log_metrics counts)
