"""Atomic pairwise averaging between an active and a passive worker (the exchange of AD-PSGD).

Used by :mod:`prague.algorithms.adpsgd.runtime` (Lian, Zhang, Zhang, Liu, "Asynchronous Decentralized Parallel
Stochastic Gradient Descent", ICML 2018). Two roles:

* :class:`ActiveLink` (an active worker's main thread): :meth:`ActiveLink.average` sets its flat buffer
  and the chosen passive's to their mean, and blocks until done.
* :class:`PassiveServer` (a passive worker's background thread): answers such requests one at a time,
  while the worker's main thread computes. The passive's values live in ``master``, guarded by ``lock``;
  the main thread takes the lock only for short copies and its optimizer step, never while
  communicating, so neither side can wait on the other in a cycle: actives wait only for passives'
  server threads, which wait for nothing but that lock. No deadlock, for any number of workers.

Wire protocol, on one gloo communicator over all ranks built only for this purpose (so it never mixes
with the job's own collectives), p2p only::

    active -> passive   [op, sender]   tag REQUEST  (op AVERAGE or DONE; received with recv_anysource)
    passive -> active   [1]            tag ACK      (the passive took the request: waiting ends here)
    active -> passive   x_active       tag VALUES
    passive: under the lock, m = (x_active + x_passive) / 2; x_passive = m
    passive -> active   m              tag MEAN     (the active sets x_active = m: both hold the same bits)

The communicator is gloo (:data:`EXCHANGE_BACKEND`) whatever the job's backend, so parameters on CUDA
travel through host buffers (``stage_on``: :func:`prague.comm.flat.staging_device`; on the CPU the
values are sent and received in place, with no copies).

Each active sends DONE to every passive when it finishes; a passive's server stops after the DONE of
every active. A failed operation raises :class:`CommError` (in the active), or is kept by the server and
raised by :meth:`PassiveServer.check` in the passive's main thread.

Failed workers (:mod:`prague.runtime.liveness`): a gloo send or receive to a process that died fails at
once, and only the operations with that peer fail (measured: the other pairs of the communicator, and a
pending receive-from-any, keep working), so the communicator is kept. When an exchange with an active
breaks, the server waits for the launcher to declare that active failed (a hung one is killed when it
is declared, so its exchange breaks too), counts it as gone and serves the others; a break with nobody
declared is fatal as before. An active that failed between exchanges sends no DONE:
:meth:`PassiveServer.wait_for_actives` stops waiting for it once it is declared failed. (A gloo receive cannot be
waited for with a timeout: a timed-out wait closes the pairs it waits on, which breaks the peers'
operations too; so the server never polls.)
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist

from prague.comm.flat import StagingBuffer
from prague.comm.owned import HoldsGroup
from prague.errors import CommError
from prague.runtime.background import COMMUNICATING, BackgroundWork
from prague.runtime.context import DistContext
from prague.runtime.liveness import DECLARE_WAIT_S, Inactivity, Membership

STORE_PREFIX = "prague/adpsgd/pg"
#: The backend of :func:`exchange_group`, whatever the job's backend.
EXCHANGE_BACKEND = "gloo"
OP_AVERAGE, OP_DONE = 1, 2
TAG_REQUEST, TAG_ACK, TAG_VALUES, TAG_MEAN = 20, 21, 22, 23


def exchange_group(ctx: DistContext, timeout: timedelta) -> dist.ProcessGroup:
    """The all-ranks communicator the exchange runs on. Collective: every rank calls it once."""
    pg = dist.ProcessGroupGloo(dist.PrefixStore(STORE_PREFIX, ctx.store), ctx.rank, ctx.world_size, timeout)
    # A gloo backend has send/recv at run time; torch's type stubs declare them on ProcessGroup only.
    return cast(dist.ProcessGroup, pg)


def _run(ops: Callable[[], Sequence[dist.Work]], what: str) -> None:
    """Start the gloo operations ``ops()`` returns and wait for them; a failure at either point (a peer
    that died is reported at once) becomes a CommError."""
    try:
        for w in ops():
            w.wait()
    except RuntimeError as exc:
        raise CommError(f"AD-PSGD {what} failed: {exc}") from exc


class ActiveLink(HoldsGroup):
    """An active worker's side: averages with any passive on request. Main thread only.

    ``stage_on``: where the values travel through (see the module docstring); None: in place."""

    def __init__(self, pg: dist.ProcessGroup, rank: int, stage_on: torch.device | None = None) -> None:
        self._pg, self.rank, self.stage_on = pg, rank, stage_on
        self._wire: StagingBuffer | None = None
        self._ack = torch.zeros(1, dtype=torch.int64)
        self.initiated = 0
        self.wait_s = 0.0
        self.exchange_s = 0.0
        self.peers: Counter[int] = Counter()

    def average(self, values: torch.Tensor, peer: int) -> tuple[float, float]:
        """Set ``values`` and ``peer``'s values to their mean. Returns (seconds waiting for the peer to
        take the request, seconds exchanging)."""
        t0 = time.perf_counter()
        what = f"averaging of rank {self.rank} with rank {peer}"
        _run(lambda: [self.pg.send([torch.tensor([OP_AVERAGE, self.rank])], peer, TAG_REQUEST),
               self.pg.recv([self._ack], peer, TAG_ACK)], what)
        t1 = time.perf_counter()
        if self._wire is None or self._wire.tensor is not values:
            self._wire = StagingBuffer(values, self.stage_on)
        wire = self._wire
        outgoing = wire.outgoing()
        _run(lambda: [self.pg.send([outgoing], peer, TAG_VALUES)], what)
        # Only after the send: the buffer is never read and written at once.
        _run(lambda: [self.pg.recv([wire.wire], peer, TAG_MEAN)], what)
        wire.land()
        t2 = time.perf_counter()
        self.initiated += 1
        self.peers[peer] += 1
        self.wait_s += t1 - t0
        self.exchange_s += t2 - t1
        return t1 - t0, t2 - t1

    def done(self, passives: Sequence[int]) -> list[int]:
        """Tell each of ``passives`` that this active will send no more requests; returns those it could
        not tell (their connection is gone: they failed)."""
        unreachable = []
        for p in passives:
            try:
                _run(lambda: [self.pg.send([torch.tensor([OP_DONE, self.rank])], p, TAG_REQUEST)],
                     f"goodbye of rank {self.rank} to rank {p}")
            except CommError:
                unreachable.append(p)
        return unreachable


class PassiveServer(HoldsGroup, BackgroundWork):
    """A passive worker's background thread that serves averaging requests one at a time; each request
    is one operation (:class:`~prague.runtime.background.BackgroundWork`): ``waiting`` for it,
    ``communicating`` while it is served, on behalf of the worker's step :attr:`step` (set by the worker).

    ``master`` holds this worker's values; every access to it, by any thread, holds ``lock``.
    :attr:`version` counts the averagings applied, so the main thread can tell whether ``master``
    changed since it last looked. ``stage_on``: where the values travel through (see the module
    docstring); None: in place.
    """

    def __init__(self, pg: dist.ProcessGroup, rank: int, master: torch.Tensor, lock: threading.Lock,
                 actives: Sequence[int], stage_on: torch.device | None = None,
                 membership: Membership | None = None) -> None:
        BackgroundWork.__init__(self, "AD-PSGD server", f"adpsgd-passive-{rank}")
        self._pg, self.rank, self.master, self.lock = pg, rank, master, lock
        self.actives = tuple(actives)
        self.membership = membership  # None: any broken exchange is fatal
        self.finished: set[int] = set()  # actives whose DONE arrived
        self.gone: set[int] = set()  # actives whose exchange broke and that were declared failed
        self.version = 0
        self.served = 0
        self.serve_s = 0.0
        self.step = 0  # the worker's step, for stall warnings and the timeline
        self._incoming = StagingBuffer(torch.empty_like(master), stage_on)
        self.start()

    def run(self, index: int) -> None:
        request = torch.zeros(2, dtype=torch.int64)
        while len(self.finished) + len(self.gone) < len(self.actives):
            with self.operation(self.step) as operation:
                _run(lambda: [self.pg.recv_anysource([request], TAG_REQUEST)], f"request wait on rank {self.rank}")
                op, src = (int(x) for x in request.tolist())
                if src not in self.actives:
                    raise CommError(f"rank {self.rank} (passive) got a request from rank {src}, which is not active")
                if op == OP_DONE:
                    self.finished.add(src)
                    continue
                operation.to(COMMUNICATING, self.step)
                try:
                    self._average_with(src)
                except CommError:
                    if self.membership is None or not self.membership.wait_declared((src,), DECLARE_WAIT_S):
                        raise
                    self.gone.add(src)  # the active died mid-exchange; ``master`` is whole either way

    def _average_with(self, src: int) -> None:
        """Serve one averaging request of active ``src``. ``master`` changes only after all of ``src``'s
        values arrived, in one step under the lock, so a break leaves it whole."""
        t0 = time.perf_counter()
        what = f"averaging of rank {src} with rank {self.rank} (passive)"
        incoming = self._incoming
        _run(lambda: [self.pg.send([torch.ones(1, dtype=torch.int64)], src, TAG_ACK),
                      self.pg.recv([incoming.wire], src, TAG_VALUES)], what)
        incoming.land()
        with self.lock:
            incoming.tensor.add_(self.master).mul_(0.5)
            self.master.copy_(incoming.tensor)
            self.version += 1
        mean = incoming.outgoing()
        _run(lambda: [self.pg.send([mean], src, TAG_MEAN)], what)
        self.served += 1
        self.serve_s += time.perf_counter() - t0

    def check(self) -> None:
        """Raise the server thread's failure, if any, in the calling (main) thread."""
        self.raise_if_failed()

    def shutdown(self, failed: bool, timeout_s: float) -> bool:
        """The thread ends by the protocol (every active's goodbye, or its failure: :meth:`join`), never
        by a stop: one left in a receive after failures is abandoned (a daemon). Whether it ended."""
        self.stop()
        return self.join(0.0)

    def wait_for_actives(self, timeout_s: float, store: dist.Store | None = None) -> None:
        """Wait until every active has said it is done or has failed; raise if none of those still
        running reports a step for ``timeout_s`` (their progress through ``store``; without one, if it
        takes longer than ``timeout_s`` in all). An active that failed between exchanges never says
        it is done: once every other one has, the thread is left blocked in its receive (it holds no
        lock and touches nothing; the process ends soon after)."""
        idle = Inactivity(store, timeout_s)
        while True:
            ended = self.join(0.1)
            self.check()
            if ended:
                return
            waiting = [a for a in self.actives if a not in self.finished and a not in self.gone]
            failed = set(self.membership.failed()) if self.membership is not None else set()
            waiting = [a for a in waiting if a not in failed]
            if not waiting:
                return
            if idle.expired(waiting):
                raise CommError(f"rank {self.rank} (passive) waited {timeout_s:g} s for the active workers "
                                f"{waiting} to finish, and they made no progress")
