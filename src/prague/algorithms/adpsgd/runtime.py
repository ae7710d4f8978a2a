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
:mod:`prague.algorithms.adpsgd.exchange`.

A passive worker's parameters may change at any time during its iteration, so it keeps its values in a
lock-guarded master copy: the forward pass runs on a snapshot taken under the lock (autograd must not
see its inputs change), and the optimizer step applies g to the current master values (after whatever
averaging happened meanwhile), again under the lock. BatchNorm running statistics updated by the
forward pass are carried over as the change they made to the snapshot. An active worker averages in
its own main thread between backward and the step, so it needs no copy.

Failed workers (Lian et al.'s graph without them): the launcher declares a crashed or hung worker
failed (:mod:`prague.runtime.liveness`). An active stops drawing failed passives
(:meth:`~.decisions.NeighbourChooser.next_live`); an exchange that breaks restores the active's values
from before it, waits for the partner to be declared failed and draws another (none left: a local
step). A passive's server counts an active that broke off or failed as gone and serves the others.
The closing barrier is through the store over the ranks still alive, and the final model is the
survivors' mean.

Time accounting: an active's wait for the passive to take its request is ``wait_s``; the exchange is
communication. A passive's waits for the lock are ``wait_s``, its snapshot copies communication.
Stats: requests initiated (active) or served (passive), total waiting and serving time, and peers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from prague.algorithms.adpsgd import ADPSGDOptions
from prague.algorithms.adpsgd.decisions import NeighbourChooser, bipartite_split
from prague.algorithms.adpsgd.exchange import EXCHANGE_BACKEND, ActiveLink, PassiveServer, exchange_group
from prague.algorithms.api import Algorithm, BeforeForward, StepTimes
from prague.comm.flat import bind_flat, staging_device
from prague.errors import CommError
from prague.runtime.liveness import DECLARE_WAIT_S, Membership, mark_done, wait_settled
from prague.metrics.decisions import Decision


#: Each rank's "done with the exchange" key (a barrier through the store over the ranks still alive).
FINISHED_KEY = "prague/adpsgd/finished/"


class PassiveReplica:
    """A passive worker's values: a lock-guarded master copy that its server thread averages into at any
    time, and the snapshot the main thread computes on (see the module docstring).

    Main thread: :meth:`take_snapshot` before forward, :meth:`step` for the optimizer step. Both report
    the time they spent waiting for the lock and copying through :meth:`take_times`.
    """

    def __init__(self, flat: torch.Tensor, n_params: int, server_for: Any) -> None:
        self.flat, self.n_params = flat, n_params
        self.lock = threading.Lock()
        self.master = flat.clone()
        self._snap_buffers = flat[n_params:].clone()
        self.server: PassiveServer = server_for(self.master, self.lock)
        self._synced = 0  # server.version whose values self.flat holds
        self._lock_wait_s = 0.0  # since the last take_times()
        self._snapshot_s = 0.0
        self.lock_wait_total_s = 0.0
        self.snapshots = 0

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the lock on ``master``, counting the time spent waiting for it."""
        t0 = time.perf_counter()
        with self.lock:
            waited = time.perf_counter() - t0
            self._lock_wait_s += waited
            self.lock_wait_total_s += waited
            yield

    def take_snapshot(self) -> None:
        """Before forward: compute on the latest values (copied only if an averaging changed them)."""
        self.server.check()
        if self.server.version == self._synced:
            return
        t0 = time.perf_counter()
        with self._locked():
            self.flat.copy_(self.master)
            self._snap_buffers.copy_(self.flat[self.n_params:])
            self._synced = self.server.version
        self.snapshots += 1
        self._snapshot_s += time.perf_counter() - t0

    def step(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Apply the gradient (computed on the snapshot) to the current master values."""
        self.server.check()
        p = self.n_params
        with self._locked():
            if self.server.version != self._synced:  # averaged since the snapshot: step from the new values
                buffers_delta = self.flat[p:] - self._snap_buffers
                self.flat[:p].copy_(self.master[:p])
                torch.add(self.master[p:], buffers_delta, out=self.flat[p:])
                self._synced = self.server.version
            if optimizer is not None:
                optimizer.step()
            self.master.copy_(self.flat)
            self._snap_buffers.copy_(self.flat[p:])

    def take_times(self) -> tuple[float, float]:
        """(seconds copying the snapshot, seconds waiting for the lock) since the last call."""
        out = (self._snapshot_s, self._lock_wait_s)
        self._snapshot_s = self._lock_wait_s = 0.0
        return out

    def settle(self, timeout_s: float, store: dist.Store) -> None:
        """After this worker's last step: serve until every active is done (or failed), then keep the
        final values. ``timeout_s`` counts inactivity of the actives (their progress in ``store``)."""
        self.server.wait_for_actives(timeout_s, store)
        with self.lock:
            self.flat.copy_(self.master)


class ADPSGD(Algorithm):
    """See the module docstring."""

    options: ADPSGDOptions

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> nn.Module:
        ctx = self.ctx
        self.actives, self.passives = bipartite_split(ctx.world_size, self.options.adpsgd_active)
        self.flat = bind_flat(model)
        self.link: ActiveLink | None = None
        self._peer: int | None = None  # an active's partner of the moment
        self.replica: PassiveReplica | None = None
        self._pg: Any = None
        if ctx.world_size == 1:
            return model
        # Not registered for release: after a failure a passive's server thread may still block in a
        # receive on it, and the process is about to exit anyway. finish() shuts it down.
        pg = self._pg = exchange_group(ctx, ctx.timeout)
        self.membership = Membership(ctx.private_store(), ctx.world_size)
        stage_on = staging_device(EXCHANGE_BACKEND, self.flat.device)  # host copies for a model on CUDA
        if ctx.rank in self.actives:
            self.link = ActiveLink(pg, ctx.rank, stage_on)
            self.chooser = NeighbourChooser(self.passives, ctx.rank, self.options.adpsgd_seed)
            self._before = torch.empty_like(self.flat)  # the values before an exchange, to restore a broken one
            return model
        n_params = sum(p.numel() for p in model.parameters())
        self.replica = PassiveReplica(self.flat, n_params,
                                      lambda master, lock: PassiveServer(pg, ctx.rank, master, lock, self.actives,
                                                                         stage_on, self.membership))
        self.in_background(self.replica.server)
        return BeforeForward(model, self.replica.take_snapshot)

    # -- hooks

    def after_backward(self, step: int, times: StepTimes) -> None:
        if self.link is not None:
            times.wait_s += self._average(step, self.link)
        elif self.replica is not None:  # the snapshot (in forward) was communication, not compute
            self.replica.server.step = step + 1  # requests served from now on come during the next step
            snapshot_s, lock_wait_s = self.replica.take_times()
            times.inner_comm_s += snapshot_s
            times.wait_s += lock_wait_s

    def _average(self, step: int, link: ActiveLink) -> float:
        """Average with a live passive (another one if the exchange breaks because the partner failed;
        none left: no averaging this step). Returns the seconds spent waiting for the partner."""
        while (peer := self.chooser.next_live(self.membership.failed())) is not None:
            self._peer = peer
            if self.decisions is not None:
                self.decisions.write(Decision.of_partner(step, peer))
            self._before.copy_(self.flat)
            try:
                return link.average(self.flat, peer)[0]
            except CommError:
                if not self.membership.wait_declared((peer,), DECLARE_WAIT_S):
                    raise
                self.flat.copy_(self._before)  # a receive that broke may have left part of the mean
        self._peer = None
        return 0.0

    def apply_update(self, optimizer: torch.optim.Optimizer | None, step: int) -> None:
        if self.replica is None:
            super().apply_update(optimizer, step)
        else:
            self.replica.step(optimizer)

    def after_step(self, step: int, times: StepTimes) -> None:
        if self.replica is not None:  # lock waits inside apply_update: waiting, not compute
            _, lock_wait_s = self.replica.take_times()
            times.inner_comm_s += lock_wait_s
            times.wait_s += lock_wait_s

    def peers(self) -> Sequence[int] | None:
        return None if self._peer is None else (self._peer,)

    def finish(self) -> None:
        """Actives tell every live passive they are done; passives serve until every active is done or
        failed, then keep the final values; then all meet through the store (a barrier over the ranks
        still alive). Collective: every rank calls it."""
        if self._pg is None:
            return  # alone
        ctx = self.ctx
        if self.link is not None:
            failed = self.membership.failed()
            unreachable = self.link.done([p for p in self.passives if p not in failed])
            if unreachable and not self.membership.wait_declared(unreachable, DECLARE_WAIT_S):
                raise CommError(f"rank {ctx.rank} could not tell ranks {unreachable} that it is done, and they "
                                "were not declared failed")
        elif self.replica is not None:
            self.replica.settle(ctx.timeout_s, ctx.store)
        # Nobody tears the communicator down while a passive may still serve; the store, unlike a
        # barrier on the communicator, leaves failed ranks out.
        mark_done(ctx.store, ctx.rank, FINISHED_KEY)
        wait_settled(ctx.store, self.membership, ctx.timeout_s, FINISHED_KEY)
        # Drop every reference to the communicator: its gloo threads end with the last one.
        self._pg = None
        if self.link is not None:
            self.link.release_group()
        if self.replica is not None:
            self.replica.server.release_group()

    def stats(self) -> dict[str, Any]:
        base: dict[str, Any] = {"actives": list(self.actives), "passives": list(self.passives)}
        if self.link is not None:
            return {**base, "role": "active", "requests_initiated": self.link.initiated,
                    "request_wait_s": self.link.wait_s, "exchange_s": self.link.exchange_s,
                    "peers": {str(k): v for k, v in sorted(self.link.peers.items())}}
        if self.replica is not None:
            return {**base, "role": "passive", "requests_served": self.replica.server.served,
                    "serve_s": self.replica.server.serve_s, "lock_wait_s": self.replica.lock_wait_total_s,
                    "snapshots": self.replica.snapshots}
        return {**base, "role": "alone"}
