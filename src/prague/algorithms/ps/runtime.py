"""``ps``: a classic parameter server, synchronous or asynchronous, with K server shards.

After Li et al., "Scaling Distributed Machine Learning with the Parameter Server", OSDI 2014 (and the
Downpour SGD of Dean et al., NIPS 2012, for ``async``). The model's flat state (parameters, then
BatchNorm buffers) is split into K contiguous ranges; each range lives on a server shard, a process of
its own (:mod:`prague.algorithms.ps.server`), which also holds the optimizer state and applies every update.
Workers compute gradients, push them to every shard and pull the new values back; their local optimizer
is never stepped (its hyperparameters are read once, in :meth:`setup`, and handed to the shards, so an
LR scheduler has no effect). Each worker talks to each shard over a two-member gloo communicator: no
collective over all workers is ever needed, and shards serve workers from one thread each.

Modes (``--ps-mode``):

* ``sync``: a shard applies the mean of all n gradients with SGD-momentum, then everyone receives the
  new values. Numerically this is DDP's all-reduce plus ``optimizer.step()``: same parameters to float
  rounding.
* ``async``: each push is applied on arrival and answered with the current values (the pusher's pull).
  Each shard records every update's staleness tau (versions since the values the gradient was computed
  on); ``--max-staleness`` bounds it (updates beyond are rejected and counted) and ``--staleness-lr``
  scales the step: by default lr/max(n - 1, tau) (the 1/tau rule of Zhang, Gupta, Lian, Liu,
  "Staleness-aware Async-SGD", IJCAI 2016, with tau floored at n - 1:
  :func:`prague.algorithms.ps.rules.staleness_scale`), which makes a
  round of n pushes (tau about n - 1 each) move as far as one synchronous step; the shard keeps one momentum buffer per worker for the same reason (see
  :mod:`prague.algorithms.ps.server`). ``none`` is plain Downpour-style asynchronous SGD, n times the step
  of a synchronous round: measured here with the CNN on MNIST at 8 workers it diverged (10% accuracy).

``ps-eager`` (:mod:`prague.algorithms.ps_eager.runtime`) reuses all of this with the pull decoupled from the push.

Processes: ``prague run`` starts the shards through the launcher (``job_resources``: one service per
shard; a shard that exits early fails the job with its name and output). Without our launcher
(torchrun, ``prague launch``) worker rank 0 starts them as subprocesses, which die with it. Worker rank 0
publishes the layout and the SGD hyperparameters in the job's store and sends its initial values; every
worker then pulls them, so all start from rank 0's model (as DDP does).

Devices: the worker-shard communicators are gloo (:data:`~prague.algorithms.ps.protocol.PAIR_BACKEND`),
whatever the job's backend, so with a model on CUDA every transfer goes through host buffers
(:func:`prague.comm.flat.staging_device`, :class:`prague.comm.flat.StagingBuffer`): the values are
received into a host copy and then copied to the model, the gradients are gathered on the device and
copied to the host once per push. On the CPU those buffers are the model's own (no copies).

Failure: an operation on a dead shard raises :class:`prague.errors.CommError` naming it (gloo reports the
closed connection at once; a silent shard is caught by ``--ps-timeout-s``). :meth:`close` during a
failure skips the goodbye handshake, so a failing worker exits at once.

Stats (``algorithm_stats`` in ``summary.json``): the mode, the staleness histogram of this worker's
applied updates as recorded by the shards (``{tau: count}``; with K shards each push counts once per
shard), applied and rejected counts, and the final server version.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from prague.algorithms.api import Algorithm, JobResources, StepTimes
from prague.algorithms.ps import PSOptions
from prague.algorithms.ps.client import PendingReplies, ShardClients
from prague.algorithms.ps.protocol import (
    DECISIONS_KEY, LAYOUT_KEY, PAIR_BACKEND, Layout, Reply, shard_argv, shard_bounds,
)
from prague.algorithms.ps.rules import update_scale
from prague.comm.flat import StagingBuffer, bind_flat, staging_device
from prague.errors import CommError, ConfigError
from prague.metrics.decisions import Decision
from prague.runtime.services import ServiceSpec, services_managed, start_service, stop_process

# Emulated compute has no optimizer; the shards then run SGD-momentum with lr 0: the same arithmetic as
# a real run, values unchanged.
EMULATED_MOMENTUM = 0.9


def layout_for(model: nn.Module, optimizer: torch.optim.Optimizer | None, total: int, n_params: int) -> Layout:
    """The layout and update rule the shards apply, read from ``optimizer`` (``torch.optim.SGD`` over
    exactly the model's parameters, one set of hyperparameters). Raises ConfigError otherwise."""
    if optimizer is None:
        return Layout(total, n_params, lr=0.0, momentum=EMULATED_MOMENTUM, dampening=0.0, weight_decay=0.0,
                      nesterov=False)
    if not isinstance(optimizer, torch.optim.SGD):
        raise ConfigError(f"the parameter server applies updates itself with SGD's rule, but the optimizer is "
                          f"{type(optimizer).__name__}; pass a torch.optim.SGD")
    ids = [id(p) for g in optimizer.param_groups for p in g["params"]]
    if ids != [id(p) for p in model.parameters()]:
        raise ConfigError("the parameter server needs an optimizer over exactly the model's parameters, in "
                          "model.parameters() order; build it with torch.optim.SGD(model.parameters(), ...)")
    keys = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")
    settings = {tuple(float(g[k]) if k == "lr" else g[k] for k in keys) for g in optimizer.param_groups}
    if len(settings) != 1:
        raise ConfigError(f"the parameter server applies one update rule, but the optimizer's parameter groups "
                          f"differ: {sorted(settings)}; use a single parameter group")
    lr, momentum, dampening, weight_decay, nesterov, maximize = settings.pop()
    if maximize:
        raise ConfigError("the parameter server does not support SGD(maximize=True); negate the loss instead")
    return Layout(total, n_params, float(lr), float(momentum), float(dampening), float(weight_decay), bool(nesterov))


def shard_services(options: Any, mode: str, nproc: int, folder: Path, exit_when_done: bool) -> tuple[ServiceSpec, ...]:
    """One service per shard, each announcing itself in ``folder``."""
    return tuple(
        ServiceSpec(f"ps-shard-{k}", shard_argv(k, options.ps_shards, nproc, mode, options.staleness_lr,
                                                options.max_staleness, options.ps_momentum, options.ps_timeout_s,
                                                folder / f"ps-shard-{k}.ready", exit_when_done),
                    ready_file=folder / f"ps-shard-{k}.ready", ready_timeout_s=120.0)
        for k in range(options.ps_shards)
    )


def start_own_shards(options: Any, mode: str, nproc: int, resources: contextlib.ExitStack,
                     grace_s: Callable[[], float]) -> None:
    """No launcher manages the job (torchrun, ``prague launch``): rank 0 runs the shards itself, as its
    children (each asks to die with this worker). Registered on ``resources``: on close each shard is
    given ``grace_s()`` seconds to exit by itself (after the goodbyes), then killed; the folder of
    ready files is removed."""
    folder = Path(tempfile.mkdtemp(prefix="prague-ps-"))
    resources.callback(shutil.rmtree, folder, ignore_errors=True)
    for spec in shard_services(options, mode, nproc, folder, exit_when_done=True):
        proc, _ = start_service(spec)
        resources.callback(_stop_shard, proc, grace_s)


def _stop_shard(proc: subprocess.Popen[bytes], grace_s: Callable[[], float]) -> None:
    stop_process(proc, grace_s())


class ParameterServerBase(Algorithm):
    """What ``ps`` and ``ps-eager`` share: shard processes, connections, pushing and pulling, closing.

    Subclasses choose the shard's mode (:meth:`shard_mode`) and what happens after backward.
    """

    sends_gradients_in_step = True

    def __init__(self, ctx: Any, options: Any, namespace: str | None = None) -> None:
        super().__init__(ctx, options, namespace)
        self._broken = False  # a communication failed: close() only releases

    @classmethod
    def shard_mode(cls, options: Any) -> str:
        raise NotImplementedError

    @classmethod
    def job_resources(cls, options: Any, nproc: int, out_dir: Path, host: str = "127.0.0.1") -> JobResources:
        services = shard_services(options, cls.shard_mode(options), nproc, out_dir, exit_when_done=False)
        return JobResources(services=services)

    # -- set-up

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> nn.Module:
        ctx, opts = self.ctx, self.options
        self.flat = bind_flat(model)
        self.n_params = sum(p.numel() for p in model.parameters())
        total = self.flat.numel()
        layout = self.layout = layout_for(model, optimizer, total, self.n_params)
        self.pushes = 0
        self.shard_records: list[dict[str, Any]] = []
        self.final_versions: list[int] = []
        if not services_managed(self.ctx.job):
            # The shards rank 0 starts find the job through store keys that are the job's, not this
            # object's: a second parameter server in the same job would meet the first one's keys.
            if not ctx.first_of_job("ps-own-shards"):
                raise ConfigError("a parameter-server method was already set up in this job without a launcher "
                                  "that manages its shards; a job (a prague launch or torchrun script) runs one: "
                                  "prepare it once, or start each run with prague run")
        if ctx.is_main:
            if not services_managed(self.ctx.job):
                start_own_shards(opts, self.shard_mode(opts), ctx.world_size, self.resources,
                                 lambda: 0.0 if self.failed else 30.0)
            # Before the layout: a shard reads the layout first, then where to write its trace.
            ctx.store.set(DECISIONS_KEY, "" if self.decisions is None else str(self.decisions.folder.resolve()))
            ctx.store.set(LAYOUT_KEY, layout.encode())
        else:
            published = Layout.decode(ctx.store.get(LAYOUT_KEY))
            if (published.total, published.n_params) != (total, self.n_params):
                raise ConfigError(f"rank {ctx.rank}'s model has {self.n_params} parameters in a state of {total}, "
                                  f"rank 0's has {published.n_params} in {published.total}; every rank must build "
                                  f"the same model")
        bounds = shard_bounds(total, opts.ps_shards)
        clients = self.clients = self._guard(
            lambda: ShardClients(ctx.store, ctx.rank, bounds, timedelta(seconds=opts.ps_timeout_s)))
        self.resources.callback(clients.close)
        # Where the shards' values are received and the pushes sent from (the model's own buffers on the CPU).
        self.stage_on = staging_device(PAIR_BACKEND, self.flat.device)
        self.state_wire = StagingBuffer(self.flat, self.stage_on)
        if ctx.is_main:
            self._guard(lambda: clients.init(self.state_wire.outgoing()))
        self.versions = [r.version for r in self._guard(lambda: clients.pull(self.state_wire.wire))]
        self.state_wire.land()
        self.push_buf = torch.zeros(total, device=self.flat.device)
        self.push_wire = StagingBuffer(self.push_buf, self.stage_on)
        self._grad_views: list[tuple[nn.Parameter, torch.Tensor]] = []
        offset = 0
        for p in model.parameters():
            self._grad_views.append((p, self.push_buf[offset:offset + p.numel()]))
            offset += p.numel()
        return model

    def _guard(self, op: Any) -> Any:
        """Run ``op``; a communication failure marks this worker broken (close() then skips the goodbye)."""
        try:
            return op()
        except CommError:
            self._broken = True
            raise

    # -- per step

    def _fill_push(self) -> None:
        """Gradients into the parameter part of the push buffer, current buffer values after them."""
        for p, view in self._grad_views:
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad.reshape(-1))
        self.push_buf[self.n_params:].copy_(self.flat[self.n_params:])

    def _push(self, step: int, bases: list[int], into: torch.Tensor, background: bool = False) -> PendingReplies:
        """Fill the push buffer and push it (from its host copy if staged); the answer lands in ``into``,
        which must be on the wire's device (:attr:`stage_on`, else the model's); ``background``: see
        :meth:`ShardClients.push`."""
        self._fill_push()
        self.pushes += 1
        payload = self.push_wire.outgoing()
        return self._guard(lambda: self.clients.push(payload, bases, step, into, background))

    def _log_push(self, step: int, replies: list[Reply]) -> None:
        """Log the shards' answers to the push of ``step`` (one decision per shard), if logging."""
        if self.decisions is None:
            return
        mode, rule, n = self.shard_mode(self.options), self.options.staleness_lr, self.ctx.world_size
        for shard, r in enumerate(replies):
            self.decisions.write(Decision.of_push(step, shard, r.tau, update_scale(mode, rule, r.tau, n, r.accepted),
                                                  r.accepted))

    def _took(self, replies: list[Reply]) -> float:
        """Record the shards' versions; return the longest time a shard made this push wait, in s."""
        self.versions = [r.version for r in replies]
        return max(r.wait_us for r in replies) / 1e6

    def apply_update(self, optimizer: torch.optim.Optimizer | None, step: int) -> None:
        """Nothing: the shards own the update."""

    # -- the end

    def _drain(self) -> None:
        """Receive whatever is still in flight before saying goodbye (ps-eager's pending pull)."""

    def finish(self) -> None:
        """Say goodbye to every shard and take the final server values (all workers end equal). Returns
        once every worker has."""
        self._drain()
        self.final_versions = [r.version for r in self._guard(lambda: self.clients.finish(self.state_wire.wire))]
        self.state_wire.land()
        self.shard_records = self.clients.shard_stats()

    def close(self, failed: bool = False) -> None:
        """After a failed operation this worker only releases (no goodbye), whatever the caller says."""
        super().close(failed or self._broken)

    def stats(self) -> dict[str, Any]:
        hist: Counter[int] = Counter()
        for rec in self.shard_records:
            hist.update({int(t): int(c) for t, c in rec["staleness_histogram"].items()})
        applied = sum(hist.values())
        return {
            "mode": self.shard_mode(self.options),
            "shards": self.options.ps_shards,
            "pushes": self.pushes,
            "staleness_histogram": {str(t): hist[t] for t in sorted(hist)},
            "mean_staleness": sum(t * c for t, c in hist.items()) / applied if applied else 0.0,
            "max_staleness_seen": max(hist) if hist else 0,
            "applied": applied,
            "rejected": sum(int(rec["rejected"]) for rec in self.shard_records),
            "max_staleness": self.options.max_staleness,
            "staleness_lr": self.options.staleness_lr,
            "momentum": self.options.ps_momentum,
            "server_versions": self.final_versions,
        }


class ParameterServer(ParameterServerBase):
    """Push gradients, wait for the shards' answer (the new values); see the module docstring."""

    options: PSOptions

    @classmethod
    def shard_mode(cls, options: Any) -> str:
        return str(options.ps_mode)

    def after_backward(self, step: int, times: StepTimes) -> None:
        pending = self._push(step, list(self.versions), self.state_wire.wire)
        replies = self._guard(pending.wait)
        self.state_wire.land()
        self._log_push(step, replies)
        times.wait_s += self._took(replies)
