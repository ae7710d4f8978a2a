"""``adpsgd``: Asynchronous Decentralized Parallel SGD on a bipartite active/passive graph.

Lian, Zhang, Zhang, Liu, "Asynchronous Decentralized Parallel Stochastic Gradient Descent", ICML 2018.
Every worker i repeats, without any global synchronisation:

1. compute a stochastic gradient g on a snapshot of its parameters x_i;
2. average with one neighbour j: x_i, x_j <- (x_i + x_j) / 2, atomically for the pair;
3. apply g (computed before the averaging) with the local optimizer (momentum stays local).

Deadlock freedom comes from the paper's bipartite split: workers are **active** (they initiate
averaging, step 2, with a passive worker drawn uniformly at random) or **passive** (they never initiate;
a background thread answers requests one at a time while the main thread computes). By default even
ranks are active and odd ranks passive (``--adpsgd-active 0,3,5`` chooses the active set; both sides must
be non-empty), so 2 workers and odd counts work. The exchange itself is in
:mod:`prague.comm.pair_average`.

A passive worker's parameters may change at any time during its iteration, so it keeps its values in a
lock-guarded master copy: the forward pass runs on a snapshot taken under the lock (autograd must not
see its inputs change), and the optimizer step applies g to the current master values (after whatever
averaging happened meanwhile), again under the lock. BatchNorm running statistics updated by the
forward pass are carried over as the change they made to the snapshot. An active worker averages in
its own main thread between backward and the step, so it needs no copy.

Time accounting: an active's wait for the passive to take its request is ``wait_s``; the exchange is
communication. A passive's waits for the lock are ``wait_s``, its snapshot copies communication.
Stats: requests initiated (active) or served (passive), total waiting and serving time, and peers.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from prague.algorithms.api import Algorithm, StepTimes
from prague.comm.flat import bind_flat
from prague.comm.pair_average import ActiveLink, PassiveServer, exchange_group
from prague.errors import CommError, ConfigError


@dataclass(frozen=True)
class ADPSGDOptions:
    adpsgd_active: str = field(default="", metadata={"help": "comma-separated active ranks (default: the even ranks)"})
    adpsgd_seed: int = field(default=0, metadata={"help": "seed of the active workers' neighbour choices"})

    def __post_init__(self) -> None:
        parse_ranks(self.adpsgd_active)


def parse_ranks(text: str) -> tuple[int, ...]:
    """``"0, 2,4"`` -> ``(0, 2, 4)``; empty text -> ``()``. Raises ConfigError on anything else."""
    ranks: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            ranks.append(int(part))
        except ValueError:
            raise ConfigError(f"--adpsgd-active must be comma-separated ranks like '0,2,4', got {text!r}") from None
    if len(set(ranks)) != len(ranks):
        raise ConfigError(f"--adpsgd-active lists a rank twice: {text!r}")
    return tuple(sorted(ranks))


def bipartite_split(nproc: int, active: str = "") -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(active ranks, passive ranks): even/odd ranks unless ``active`` lists the active ones. Pure."""
    if nproc < 1:
        raise ConfigError(f"nproc must be >= 1, got {nproc}")
    chosen = parse_ranks(active)
    actives = chosen if chosen else tuple(r for r in range(nproc) if r % 2 == 0)
    bad = [r for r in actives if not 0 <= r < nproc]
    if bad:
        raise ConfigError(f"--adpsgd-active names ranks {bad} outside 0..{nproc - 1}")
    passives = tuple(r for r in range(nproc) if r not in actives)
    if nproc > 1 and not passives:
        raise ConfigError(f"--adpsgd-active {active!r} leaves no passive worker among {nproc}; leave at least one out")
    return actives, passives


class NeighbourChooser:
    """An active worker's random choice of passive neighbour: uniform, seeded by (seed, rank). Pure."""

    def __init__(self, passives: tuple[int, ...], rank: int, seed: int) -> None:
        if not passives:
            raise ConfigError("an active worker needs at least one passive neighbour")
        self.passives = passives
        self._rng = random.Random(f"adpsgd/{seed}/{rank}")

    def next(self) -> int:
        return self._rng.choice(self.passives)


class _BeforeForward(nn.Module):
    def __init__(self, module: nn.Module, hook: Callable[[], None]) -> None:
        super().__init__()
        self.module = module
        self._hook = hook

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._hook()
        return self.module(*args, **kwargs)


class ADPSGD(Algorithm):
    """See the module docstring."""

    name = "adpsgd"
    Options = ADPSGDOptions

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> nn.Module:
        ctx = self.ctx
        self.actives, self.passives = bipartite_split(ctx.world_size, self.options.adpsgd_active)
        self.flat = bind_flat(model)
        self.n_params = sum(p.numel() for p in model.parameters())
        self.active = ctx.rank in self.actives and bool(self.passives)
        self.link: ActiveLink | None = None
        self.server: PassiveServer | None = None
        self._closed = False
        self._pg = None
        self._lock_wait_s = 0.0  # passive: main thread waiting for the lock, since the last report
        self._snapshot_s = 0.0
        self.lock_wait_total_s = 0.0
        self.snapshots = 0
        if ctx.world_size == 1:
            return model
        self._pg = exchange_group(ctx, ctx.timeout)
        if self.active:
            self.link = ActiveLink(self._pg, ctx.rank)
            self.chooser = NeighbourChooser(self.passives, ctx.rank, self.options.adpsgd_seed)
            return model
        self.lock = threading.Lock()
        self.master = self.flat.clone()
        self._snap_buffers = self.flat[self.n_params:].clone()
        self.server = PassiveServer(self._pg, ctx.rank, self.master, self.lock, self.actives)
        self._synced = 0  # server.version whose values self.flat holds
        return _BeforeForward(model, self._take_snapshot)

    # -- passive worker: main thread

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the lock on ``master``, counting the time spent waiting for it."""
        t0 = time.perf_counter()
        with self.lock:
            waited = time.perf_counter() - t0
            self._lock_wait_s += waited
            self.lock_wait_total_s += waited
            yield

    def _take_snapshot(self) -> None:
        """Before forward: compute on the latest values (copied only if an averaging changed them)."""
        server = self.server
        assert server is not None
        server.check()
        if server.version == self._synced:
            return
        t0 = time.perf_counter()
        with self._locked():
            self.flat.copy_(self.master)
            self._snap_buffers.copy_(self.flat[self.n_params:])
            self._synced = server.version
        self.snapshots += 1
        self._snapshot_s += time.perf_counter() - t0

    def _passive_step(self, optimizer: torch.optim.Optimizer | None) -> None:
        server = self.server
        assert server is not None
        server.check()
        p = self.n_params
        with self._locked():
            if server.version != self._synced:  # averaged since the snapshot: step from the new values
                buffers_delta = self.flat[p:] - self._snap_buffers
                self.flat[:p].copy_(self.master[:p])
                torch.add(self.master[p:], buffers_delta, out=self.flat[p:])
                self._synced = server.version
            if optimizer is not None:
                optimizer.step()
            self.master.copy_(self.flat)
            self._snap_buffers.copy_(self.flat[p:])

    # -- hooks

    def after_backward(self, step: int, times: StepTimes) -> None:
        if self.link is not None:
            waited, _ = self.link.average(self.flat, self.chooser.next())
            times.wait_s += waited
        elif self.server is not None:  # the snapshot (in forward) was communication, not compute
            times.inner_comm_s += self._snapshot_s
            times.wait_s += self._lock_wait_s
            self._snapshot_s = self._lock_wait_s = 0.0

    def apply_update(self, optimizer: torch.optim.Optimizer | None, step: int) -> None:
        if self.server is None:
            super().apply_update(optimizer, step)
        else:
            self._passive_step(optimizer)

    def after_step(self, step: int, times: StepTimes) -> None:
        if self.server is not None:  # lock waits inside apply_update: waiting, not compute
            times.inner_comm_s += self._lock_wait_s
            times.wait_s += self._lock_wait_s
            self._lock_wait_s = 0.0

    def close(self) -> None:
        """Actives tell every passive they are done; passives serve until all actives are, then keep the
        final values; then all meet at a barrier. Every rank calls it. While an exception propagates it
        returns at once."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        if self._pg is None or sys.exc_info()[0] is not None:
            return  # alone, or failing: peers are stopped by the launcher; do not wait for them
        if self.link is not None:
            self.link.done(self.passives)
        elif self.server is not None:
            self.server.join(self.ctx.timeout_s)
            with self.lock:
                self.flat.copy_(self.master)
        # Nobody tears the communicator down while a passive may still serve: a closed connection
        # would fail the passive's receive-from-any.
        try:
            self._pg.barrier().wait()
        except RuntimeError as exc:
            raise CommError(f"rank {self.ctx.rank}: AD-PSGD's closing barrier failed: {exc}") from exc
        if hasattr(self._pg, "shutdown"):
            self._pg.shutdown()

    def stats(self) -> dict[str, Any]:
        base: dict[str, Any] = {"actives": list(self.actives), "passives": list(self.passives)}
        if self.link is not None:
            return {**base, "role": "active", "requests_initiated": self.link.initiated,
                    "request_wait_s": self.link.wait_s, "exchange_s": self.link.exchange_s,
                    "peers": {str(k): v for k, v in sorted(self.link.peers.items())}}
        if self.server is not None:
            return {**base, "role": "passive", "requests_served": self.server.served,
                    "serve_s": self.server.serve_s, "lock_wait_s": self.lock_wait_total_s,
                    "snapshots": self.snapshots}
        return {**base, "role": "alone"}
