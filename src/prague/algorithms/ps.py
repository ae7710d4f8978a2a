"""``ps``: a classic parameter server, synchronous or asynchronous, with K server shards.

After Li et al., "Scaling Distributed Machine Learning with the Parameter Server", OSDI 2014 (and the
Downpour SGD of Dean et al., NIPS 2012, for ``async``). The model's flat state (parameters, then
BatchNorm buffers) is split into K contiguous ranges; each range lives on a server shard, a process of
its own (:mod:`prague.comm.ps_server`), which also holds the optimizer state and applies every update.
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
  scales the step: by default lr/max(1, tau) (Zhang, Gupta, Lian, Liu, "Staleness-aware Async-SGD",
  IJCAI 2016), with tau floored at n - 1 (:func:`prague.comm.ps_rules.staleness_scale`), which makes a
  round of n pushes (tau about n - 1 each) move as far as one synchronous step; the shard keeps one momentum buffer per worker for the same reason (see
  :mod:`prague.comm.ps_server`). ``none`` is plain Downpour-style asynchronous SGD, n times the step
  of a synchronous round: measured here with the CNN on MNIST at 8 workers it diverged (10% accuracy).

``ps-eager`` (:mod:`prague.algorithms.ps_eager`) reuses all of this with the pull decoupled from the push.

Processes: ``prague run`` starts the shards through the launcher (``job_resources``: one service per
shard; a shard that exits early fails the job with its name and output). Without our launcher
(torchrun, ``prague launch``) worker rank 0 starts them as subprocesses, which die with it. Worker rank 0
publishes the layout and the SGD hyperparameters in the job's store and sends its initial values; every
worker then pulls them, so all start from rank 0's model (as DDP does).

Failure: an operation on a dead shard raises :class:`prague.errors.CommError` naming it (gloo reports the
closed connection at once; a silent shard is caught by ``--ps-timeout-s``). :meth:`close` during a
failure skips the goodbye handshake, so a failing worker exits at once.

Stats (``algorithm_stats`` in ``summary.json``): the mode, the staleness histogram of this worker's
applied updates as recorded by the shards (``{tau: count}``; with K shards each push counts once per
shard), applied and rejected counts, and the final server version.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from prague.algorithms.api import Algorithm, JobResources, StepTimes
from prague.comm.flat import bind_flat
from prague.comm.ps_client import PendingReplies, ShardClients
from prague.comm.ps_protocol import (
    LAYOUT_KEY, MANAGED_ENV, MODES, MOMENTUM_MODES, STALENESS_RULES, Layout, Reply, shard_argv, shard_bounds,
)
from prague.errors import CommError, ConfigError, unknown_choice
from prague.runtime.context import LAUNCHER_PID_ENV
from prague.runtime.launcher import ServiceSpec

# Emulated compute has no optimizer; the shards then run SGD-momentum with lr 0: the same arithmetic as
# a real run, values unchanged.
EMULATED_MOMENTUM = 0.9

_RULE_HELP = "learning rate of an update of staleness tau: inverse (lr/max(1,tau), tau >= n-1), none, exp"
_MOMENTUM_HELP = ("async shards: worker (a momentum buffer per worker; ps default) or folded (no buffer, step "
                  "lr/(1-momentum); ps-eager default)")
_BOUND_HELP = "reject updates staler than this many server versions (0: no bound)"


def _check_common(shards: int, max_staleness: int, staleness_lr: str, momentum: str, timeout_s: float) -> None:
    if shards < 1:
        raise ConfigError(f"--ps-shards must be >= 1, got {shards}")
    if max_staleness < 0:
        raise ConfigError(f"--max-staleness must be >= 0 (0: no bound), got {max_staleness}")
    if staleness_lr not in STALENESS_RULES:
        raise unknown_choice("staleness rule (--staleness-lr)", staleness_lr, STALENESS_RULES)
    if momentum not in MOMENTUM_MODES:
        raise unknown_choice("momentum mode (--ps-momentum)", momentum, MOMENTUM_MODES)
    if not timeout_s > 0:
        raise ConfigError(f"--ps-timeout-s must be > 0, got {timeout_s}")


@dataclass(frozen=True)
class PSOptions:
    ps_mode: str = field(default="sync",
                         metadata={"help": "sync: apply the mean of all n pushes; async: apply each on arrival"})
    ps_shards: int = field(default=1, metadata={"help": "number of server shard processes"})
    max_staleness: int = field(default=0, metadata={"help": _BOUND_HELP})
    staleness_lr: str = field(default="inverse", metadata={"help": _RULE_HELP})
    ps_momentum: str = field(default="worker", metadata={"help": _MOMENTUM_HELP})
    ps_timeout_s: float = field(default=300.0, metadata={"help": "how long a shard or worker waits for the other side"})

    def __post_init__(self) -> None:
        if self.ps_mode not in MODES:
            raise unknown_choice("parameter-server mode (--ps-mode)", self.ps_mode, MODES)
        _check_common(self.ps_shards, self.max_staleness, self.staleness_lr, self.ps_momentum, self.ps_timeout_s)


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


class ParameterServerBase(Algorithm):
    """What ``ps`` and ``ps-eager`` share: shard processes, connections, pushing and pulling, closing.

    Subclasses choose the shard's mode (:meth:`shard_mode`) and what happens after backward.
    """

    @classmethod
    def shard_mode(cls, options: Any) -> str:
        raise NotImplementedError

    @classmethod
    def _shard_argv(cls, options: Any, nproc: int, shard: int, ready: Path, exit_when_done: bool) -> list[str]:
        return shard_argv(shard, options.ps_shards, nproc, cls.shard_mode(options), options.staleness_lr,
                          options.max_staleness, options.ps_momentum, options.ps_timeout_s, ready, exit_when_done)

    @classmethod
    def job_resources(cls, options: Any, nproc: int, out_dir: Path, seed: int) -> JobResources:
        readies = [out_dir / f"ps-shard-{k}.ready" for k in range(options.ps_shards)]
        services = tuple(ServiceSpec(f"ps-shard-{k}", cls._shard_argv(options, nproc, k, ready, False),
                                     ready_file=ready) for k, ready in enumerate(readies))
        return JobResources(services=services, env={MANAGED_ENV: "1"})

    # -- set-up

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> nn.Module:
        ctx, opts = self.ctx, self.options
        self.flat = bind_flat(model)
        self.n_params = sum(p.numel() for p in model.parameters())
        total = self.flat.numel()
        layout = self.layout = layout_for(model, optimizer, total, self.n_params)
        bounds = shard_bounds(total, opts.ps_shards)
        self._spawned: list[subprocess.Popen[bytes]] = []
        self._spawn_dir: Path | None = None
        self.clients: ShardClients | None = None
        self._closed = False
        self._broken = False
        self.pushes = 0
        self.shard_records: list[dict[str, Any]] = []
        self.final_versions: list[int] = []
        if ctx.is_main:
            if os.environ.get(MANAGED_ENV) != "1":
                self._start_shards()
            ctx.store.set(LAYOUT_KEY, layout.encode())
        else:
            published = Layout.decode(ctx.store.get(LAYOUT_KEY))
            if (published.total, published.n_params) != (total, self.n_params):
                raise ConfigError(f"rank {ctx.rank}'s model has {self.n_params} parameters in a state of {total}, "
                                  f"rank 0's has {published.n_params} in {published.total}; every rank must build "
                                  f"the same model")
        clients = self._guard(lambda: ShardClients(ctx.store, ctx.rank, bounds, timedelta(seconds=opts.ps_timeout_s)))
        self.clients = clients
        if ctx.is_main:
            self._guard(lambda: clients.init(self.flat))
        self.versions = [r.version for r in self._guard(lambda: clients.pull(self.flat))]
        self.push_buf = torch.zeros(total)
        self._grad_views: list[tuple[nn.Parameter, torch.Tensor]] = []
        offset = 0
        for p in model.parameters():
            self._grad_views.append((p, self.push_buf[offset:offset + p.numel()]))
            offset += p.numel()
        return model

    def _start_shards(self) -> None:
        """No launcher manages the job (torchrun, ``prague launch``): rank 0 runs the shards itself."""
        folder = Path(tempfile.mkdtemp(prefix="prague-ps-"))
        self._spawn_dir = folder
        # A shard asks to die with its parent: here that is this worker, not a launcher.
        env = {**os.environ, LAUNCHER_PID_ENV: str(os.getpid())}
        readies = []
        for k in range(self.options.ps_shards):
            ready = folder / f"shard{k}.ready"
            argv = self._shard_argv(self.options, self.ctx.world_size, k, ready, True)
            self._spawned.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL))
            readies.append((ready, argv))
        deadline = time.monotonic() + 120
        for proc, (ready, argv) in zip(self._spawned, readies):
            while not ready.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    self._kill_spawned()
                    raise CommError(f"parameter-server shard did not start (exit code {proc.poll()}); "
                                    f"command: {' '.join(argv)}")
                time.sleep(0.05)

    def _guard(self, op: Any) -> Any:
        """Run ``op``; a communication failure marks this worker broken (close() then skips the handshake)."""
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

    def _push(self, step: int, bases: list[int], into: torch.Tensor) -> PendingReplies:
        self._fill_push()
        self.pushes += 1
        assert self.clients is not None  # set in setup()
        clients = self.clients
        return self._guard(lambda: clients.push(self.push_buf, bases, step, into))

    def _took(self, replies: list[Reply]) -> float:
        """Record the shards' versions; return the longest time a shard made this push wait, in s."""
        self.versions = [r.version for r in replies]
        return max(r.wait_us for r in replies) / 1e6

    def apply_update(self, optimizer: torch.optim.Optimizer | None, step: int) -> None:
        """Nothing: the shards own the update."""

    # -- the end

    def _drain(self) -> None:
        """Receive whatever is still in flight before saying goodbye (ps-eager's pending pull)."""

    def close(self) -> None:
        """Say goodbye to every shard and take the final server values (all workers end equal). Every
        rank calls it; it returns once all have. While an exception is propagating, or after a failed
        operation, it only releases resources."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        clients = self.clients
        failing = self._broken or clients is None or sys.exc_info()[0] is not None
        try:
            if clients is not None and not failing:
                self._drain()
                self.final_versions = [r.version for r in self._guard(lambda: clients.finish(self.flat))]
                self.shard_records = clients.shard_stats()
        finally:
            if clients is not None:
                clients.close()
            if failing:
                self._kill_spawned()
            else:
                self._reap_spawned()
            if self._spawn_dir is not None:
                shutil.rmtree(self._spawn_dir, ignore_errors=True)

    def _reap_spawned(self) -> None:
        for proc in self._spawned:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _kill_spawned(self) -> None:
        for proc in self._spawned:
            if proc.poll() is None:
                proc.kill()
            proc.wait()

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

    name = "ps"
    Options = PSOptions
    variant_field = "ps_mode"

    @classmethod
    def shard_mode(cls, options: Any) -> str:
        return str(options.ps_mode)

    def after_backward(self, step: int, times: StepTimes) -> None:
        pending = self._push(step, list(self.versions), self.flat)
        times.wait_s += self._took(self._guard(pending.wait))
