"""Partial All-Reduce (P-Reduce): average one flat buffer over an arbitrary set of ranks.

From Prague (Luo et al., "Prague: High-Performance Heterogeneity-Aware Asynchronous Decentralized
Training", ASPLOS 2020): instead of an all-reduce over all n workers, a small group G averages its
members' parameters, x_i <- mean_{j in G} x_j for i in G, and non-members are untouched.

A group needs a communicator that contains only its members, and creating one must involve only them:
``torch.distributed.new_group`` needs every rank of the job (or, with ``use_local_synchronization``,
names groups from a process-wide counter that disagrees when members create their groups in different
orders, which dynamic groups do). So the members build a backend process group themselves, on a
``PrefixStore`` of the job's store. Communicators are cached by member set in a bounded LRU
(:class:`prague.comm.cache.CommunicatorCache`, the policy the simulator charges set-up by); an evicted
one is shut down (a gloo group holds several file descriptors).

Each rank's cache follows its own history, so members disagree about what is cached: rank 0 may have
evicted {0, 1} while rank 1 still holds it, or one member may have thrown a communicator away after a
failure that its peer did not see. Using a communicator that a peer no longer has hangs until the
timeout, so every :meth:`GroupCommunicators.get` starts with a handshake through the store: each
member publishes the name of the communicator it holds for the set (or none), and all of them rebuild
unless all hold the same one. The k-th use of a member set is the same on every member (global order,
below), so it names both the handshake's keys and a rebuilt communicator: a replacement never meets the
store keys or broken pairs of an earlier one. The handshake costs three or four store round trips
(about 0.15 ms on loopback) plus waiting for the last member, which the collective would wait for
anyway; ``benchmarks/preduce.py`` measures it.

Ordering: every member must run its groups in one global order (the Group Generator's sequence
numbers). That total order is what rules out deadlock; this module does not reorder anything.

Two transports (``transport``, :func:`pick_transport`):

* ``groups`` (gloo's default): the members-only communicators above. Building one costs a store
  rendezvous and a few sockets (tens of ms with gloo), and a failed member breaks only its group's
  communicator, which the survivors throw away.
* ``world`` (NCCL's default): no communicator per member set. After the same handshake, the members
  exchange their buffers point to point on the job's world communicator (``batch_isend_irecv``, which
  NCCL runs on the world communicator itself, where single sends would build a two-rank communicator
  per pair) and each adds the k buffers in member order, so every member gets the same bits. An NCCL
  communicator costs 0.15-2 s and hundreds of MB of GPU memory to create: built lazily per member set
  on the hot path it would stall the averages, and a cache large enough for a dynamic generator's sets
  (56 sets of 3 among 8 workers, 560 among 16) would not fit in GPU memory. The price is traffic: each
  member sends its buffer to k - 1 peers, (k - 1) N bytes against 2 (k - 1) / k N for a ring all-reduce:
  the same for pairs, 1.5x for groups of 3. The world communicator is created eagerly (one collective
  when the transport starts), since NCCL requires every rank in the first operation of a communicator.
  What it costs in fault tolerance: a member that dies after the handshake, inside the exchange, breaks
  the world communicator on NCCL (its errors are sticky), which ends the job; a member that fails
  before is caught by the handshake as with ``groups``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from prague.comm.cache import CommunicatorCache
from prague.comm.compress import ErrorFeedback, decode
from prague.comm.owned import shutdown_group
from prague.comm.transports import pick_transport
from prague.errors import CommError, ConfigError
from prague.runtime.background import COMMUNICATING, BackgroundWork
from prague.runtime.context import DistContext
from prague.runtime.liveness import Membership, PeerFailed

GROUP_STORE_PREFIX = "prague/preduce"
WORLD = "world"  # the handshake value of every member under the world transport
NONE_HELD = "-"  # handshake value of a member that holds no communicator for the set


@dataclass
class CommStats:
    """Counters a method reports in its summary."""

    reduces: int = 0
    created: int = 0
    create_s: float = 0.0
    evicted: int = 0
    failed: int = 0

    def report(self) -> dict[str, float | int]:
        """The fields a method built on P-Reduce reports (see ``COMM_REPORTS`` in :mod:`prague.algorithms.spec`)."""
        return {"preduces": self.reduces, "communicators_created": self.created,
                "communicator_create_s": self.create_s, "communicators_evicted": self.evicted}


def backend_group(ctx: DistContext, store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
    """A communicator of `size` ranks on the job's backend, rendezvousing through `store`; this rank is `rank`."""
    # torch's stubs declare these backends as ``Backend``, which (in the stubs) has no collectives.
    if ctx.backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)  # type: ignore[return-value]
    return dist.ProcessGroupGloo(store, rank, size, timeout=timeout)  # type: ignore[return-value]



class Rendezvous(BackgroundWork):
    """One communicator's rendezvous (``create``) on a thread of its own, the background work
    :meth:`GroupCommunicators._create` watches the failed set beside; :attr:`group` once it is made, or
    :attr:`~prague.runtime.background.BackgroundWork.error`. An abandoned one ends at its timeout."""

    def __init__(self, members: tuple[int, ...], create: Callable[[], dist.ProcessGroup]) -> None:
        super().__init__(f"rendezvous of ranks {list(members)}", "prague-rendezvous")
        self._make = create
        self.group: dist.ProcessGroup | None = None
        self.start()

    def run(self, index: int) -> None:
        with self.operation(-1, COMMUNICATING):
            group = self._make()
        with self.cond:
            self.group = group
            self.cond.notify_all()

class GroupCommunicators:
    """Members-only communicators, cached by member set (LRU of ``capacity`` entries).

    An instance's store keys are under ``namespace``, the store-key namespace its owner was given (a
    method's :attr:`~prague.algorithms.api.Algorithm.namespace` and a child name: ``prague/0/groups``);
    two instances of one job need two namespaces. Only the members of a group call :meth:`get` for it, all at the same
    point of their global order, and each member calls it once for every occurrence of the group (the
    handshake counts uses). The call blocks until every member has arrived; a member missing for
    ``timeout_s`` (default: the job's timeout) or a failed rendezvous raises :class:`CommError` and
    counts as a failure. With a ``membership`` (:mod:`prague.runtime.liveness`), a member declared
    failed while the others wait for it raises :class:`~prague.runtime.liveness.PeerFailed` within a
    second instead.
    """

    def __init__(self, ctx: DistContext, capacity: int = 16, timeout_s: float | None = None,
                 membership: Membership | None = None, transport: str = "auto", *, namespace: str) -> None:
        if timeout_s is not None and not timeout_s > 0:
            raise ConfigError(f"communicator timeout_s must be > 0, got {timeout_s!r}")
        self.ctx = ctx
        self.transport = pick_transport(transport, ctx.backend)
        self._scratch: list[torch.Tensor] = []  # the world transport's receive buffers and sum, reused
        self.store = ctx.private_store()  # handshakes wait for slow members: never on the shared client
        self.timeout = timedelta(seconds=timeout_s if timeout_s is not None else ctx.timeout_s)
        self._cache: CommunicatorCache[tuple[str, dist.ProcessGroup]] = CommunicatorCache(capacity)
        self._uses: dict[tuple[int, ...], int] = {}
        if not namespace:
            raise ConfigError("a communicator cache needs the store-key namespace of its owner (namespace=...)")
        self._prefix = f"{GROUP_STORE_PREFIX}/{namespace}"
        # Connections for the rendezvous thread of :meth:`_create`, reused: opening a store connection
        # while the job runs can stall the store for every client for seconds (seen as 5 s pauses of
        # all workers when each new communicator opened its own), so one is opened per concurrent
        # rendezvous and kept; only one abandoned after a failure is replaced.
        self._rendezvous_stores: list[dist.Store] = []
        self.stats = CommStats()
        self.membership = membership  # when set, a member declared failed ends a handshake at once
        self._agreed: tuple[tuple[int, ...], int] | None = None  # the latest handshake that passed here

    def _check(self, members: tuple[int, ...]) -> None:
        if self.ctx.rank not in members:
            raise ConfigError(f"rank {self.ctx.rank} asked for the communicator of {members}, which it is not in")
        if list(members) != sorted(set(members)) or members[0] < 0 or members[-1] >= self.ctx.world_size:
            raise ConfigError(f"group members must be sorted distinct ranks in 0..{self.ctx.world_size - 1}, got {members}")

    def _fail(self, members: tuple[int, ...], what: str, exc: BaseException) -> CommError:
        self.discard(members)
        return CommError(f"{what} for ranks {list(members)} failed on rank {self.ctx.rank} "
                         f"(timeout {self.timeout.total_seconds():g} s): {exc}")

    def _agree(self, members: tuple[int, ...], use: int, held: str | None) -> bool:
        """Handshake of the ``use``-th occurrence of ``members``: True if every member holds ``held``."""
        store, rank = self.store, self.ctx.rank
        base = f"{self._prefix}/{_set_name(members)}/use"
        keys = [f"{base}{use}/{r}" for r in members]
        store.set(keys[members.index(rank)], held or NONE_HELD)
        if self.membership is None:
            store.wait(keys, self.timeout)
        else:
            self.membership.wait_keys(store, keys, members, self.timeout.total_seconds(),
                                      f"communicator handshake for ranks {list(members)}")
        self._agreed = (members, use)
        if use >= 2:  # every member read use-2's keys before writing use-1's, which we have seen
            store.delete_key(f"{base}{use - 2}/{rank}")
        return held is not None and all(v.decode() == held for v in store.multi_get(keys))

    def settle(self, members: tuple[int, ...], ok: bool) -> bool:
        """After the latest use of ``members`` (:meth:`get` or :meth:`meet`, then the collective): tell
        the other members whether it succeeded here, and learn the same of them. Returns True only if no
        member reported a failure; members declared failed without a report are left out (needs a
        membership).

        A collective can succeed on some members and fail on others: a peer that froze after sending
        its last piece to one member, but not to another, completes the first and breaks the second.
        The first would go on to its next group while the second retries without the frozen peer and
        waits for it there: both wait forever, each for the other. Settling makes every member see the
        same outcome, so either all keep the result or all retry.

        A use whose handshake did not pass here passed on no member (:meth:`Membership.wait_keys`):
        there is nothing to settle, and this returns False at once."""
        if self.membership is None:
            raise ConfigError("settling a group's outcome needs a membership (the failed set)")
        store, rank = self.store, self.ctx.rank
        use = self._uses[members] - 1
        if self._agreed != (members, use):
            return False
        base = f"{self._prefix}/{_set_name(members)}/end"
        store.set(f"{base}{use}/{rank}", "1" if ok else "0")
        reports = self.membership.wait_reports(store, {r: f"{base}{use}/{r}" for r in members},
                                               self.timeout.total_seconds(),
                                               f"outcome of the group of ranks {list(members)}")
        if use >= 2:  # every member read use-2's reports before it took part in use-1
            store.delete_key(f"{base}{use - 2}/{rank}")
        return all(v == b"1" for v in reports.values())

    def start(self) -> None:
        """Collective over every rank of the job, once, before the first group: creates the world
        communicator under the world transport on NCCL (whose first operation needs every rank); nothing
        otherwise."""
        if self.transport == WORLD and self.ctx.backend == "nccl" and self.ctx.world_size > 1:
            dist.all_reduce(torch.zeros(1, device=self.ctx.device))

    def meet(self, members: tuple[int, ...]) -> None:
        """World transport: the handshake of this use of ``members`` (every member is here), no communicator."""
        self._check(members)
        use = self._uses.get(members, 0)
        self._uses[members] = use + 1
        try:
            self._agree(members, use, WORLD)
        except PeerFailed:
            raise
        except RuntimeError as exc:
            raise CommError(f"P-Reduce handshake for ranks {list(members)} failed on rank {self.ctx.rank} "
                            f"(timeout {self.timeout.total_seconds():g} s): {exc}") from exc

    def scratch(self, like: torch.Tensor, count: int) -> list[torch.Tensor]:
        """``count`` buffers shaped as ``like`` (kept for the next call)."""
        if self._scratch and (self._scratch[0].shape != like.shape or self._scratch[0].dtype != like.dtype
                              or self._scratch[0].device != like.device):
            self._scratch = []
        while len(self._scratch) < count:
            self._scratch.append(torch.empty_like(like))
        return self._scratch[:count]

    def get(self, members: tuple[int, ...]) -> dist.ProcessGroup:
        """The communicator of ``members`` (this rank must be one), creating it unless every member holds it."""
        self._check(members)
        use = self._uses.get(members, 0)
        self._uses[members] = use + 1
        cached = self._cache.get(members)
        try:
            agreed = self._agree(members, use, cached[0] if cached else None)
        except PeerFailed:
            self.discard(members)
            raise
        except RuntimeError as exc:
            raise self._fail(members, "communicator handshake", exc) from exc
        if cached is not None and agreed:
            return cached[1]
        if cached is not None:  # a peer no longer holds it: never use it again
            self._cache.pop(members)
            shutdown_group(cached[1])
        t0 = time.perf_counter()
        name = f"{self._prefix}/{_set_name(members)}/pg{use}"
        try:
            pg = self._create(name, members)
        except PeerFailed:
            self.discard(members)
            raise
        except RuntimeError as exc:
            raise self._fail(members, "communicator creation", exc) from exc
        self.stats.created += 1
        self.stats.create_s += time.perf_counter() - t0
        for _, old in self._cache.put(members, (name, pg)):
            shutdown_group(old)
            self.stats.evicted += 1
        return pg

    def _create(self, name: str, members: tuple[int, ...]) -> dist.ProcessGroup:
        """The backend's rendezvous for ``members`` under store prefix ``name``. With a membership it runs
        in a thread of its own, on a store connection of its own, while this thread watches the failed
        set: a member that passed the handshake and then froze or died would otherwise hold every other
        member in the rendezvous for the whole timeout (it waits in the store for that member's address).
        A member declared failed raises :class:`PeerFailed` at once; the abandoned rendezvous ends on
        its own (at its timeout) and is dropped."""
        index, size = members.index(self.ctx.rank), len(members)
        if self.membership is None:
            return backend_group(self.ctx, dist.PrefixStore(name, self.store), index, size, self.timeout)
        store = self._rendezvous_stores.pop() if self._rendezvous_stores else self.ctx.private_store()
        work = Rendezvous(members, lambda: backend_group(self.ctx, dist.PrefixStore(name, store), index, size,
                                                         self.timeout))
        while True:
            with work.cond:
                work.cond.wait_for(lambda: work.group is not None or work.error is not None, 0.2)
                # taken out of the work: only the cache may hold a communicator, since only dropping its
                # last reference closes a gloo group's connections (what a peer of a failed collective
                # waits for), and the finished work lingers until the garbage collector runs
                group, error, work.group, work.error = work.group, work.error, None, None
            if group is not None or error is not None:
                break
            lost = self.membership.failed_among(members)
            if lost:
                raise PeerFailed(lost, f"communicator creation for ranks {list(members)}: rank(s) {lost} failed")
        self._rendezvous_stores.append(store)  # the rendezvous ended: its connection is free again
        if error is not None:
            raise error
        assert group is not None
        return group

    def discard(self, members: tuple[int, ...]) -> None:
        """Throw away the communicator of ``members`` after a failure; the next use rebuilds it on every member."""
        entry = self._cache.pop(members)
        self.stats.failed += 1
        if entry is not None:
            shutdown_group(entry[1])

    def close(self) -> None:
        for _, pg in self._cache.clear():
            shutdown_group(pg)


def _set_name(members: tuple[int, ...]) -> str:
    return "-".join(map(str, members))


def preduce(buffer: torch.Tensor, members: tuple[int, ...], comms: GroupCommunicators, divide: bool = True) -> None:
    """Average ``buffer`` in place over ``members`` (sorted ranks, this rank among them); ``divide`` False:
    leave the members' sum (what :func:`preduce_weighted` divides by the weights' sum itself).

    Called by every member, at the same point of the global group order. A group of one returns at once.
    If a member does not arrive within the communicators' timeout, or the operation fails or times out,
    the communicator is discarded and :class:`CommError` raised; ``buffer`` may then hold a partial
    result. The members can form the same group again later: its next use rebuilds the communicator.
    """
    if len(members) == 1:
        return
    if comms.transport == WORLD:
        comms.meet(members)
        try:
            exchange_average(buffer, members, comms.ctx.rank, comms.scratch(buffer, len(members)), divide)
        except RuntimeError as exc:
            comms.stats.failed += 1
            raise _broken(members, comms.ctx.rank, exc) from exc
        comms.stats.reduces += 1
        return
    pg = comms.get(members)
    try:
        pg.allreduce([buffer]).wait()
    except RuntimeError as exc:
        # Only dropping the last reference closes a gloo group's connections (shutdown() and abort() do
        # not): a member still inside this collective, waiting for data this rank will never relay,
        # then fails at once instead of at the timeout. The exception's frames must not keep it.
        del pg
        comms.discard(members)
        raise _broken(members, comms.ctx.rank, exc) from exc
    if divide:
        buffer.div_(len(members))
    comms.stats.reduces += 1


def _broken(members: tuple[int, ...], rank: int, exc: BaseException) -> CommError:
    """The error of a group's collective that failed on ``rank`` (every P-Reduce form raises it)."""
    return CommError(f"P-Reduce over ranks {list(members)} failed on rank {rank}: {exc}")


def preduce_weighted(buffer: torch.Tensor, members: tuple[int, ...], comms: GroupCommunicators, weight: float,
                     work: torch.Tensor) -> None:
    """The group's mean of ``buffer`` weighted by each member's ``weight`` (> 0): ``sum_j w_j x_j / sum_j w_j``,
    in place, in one collective: each member reduces ``[w x, w]`` (in ``work``, one value longer than
    ``buffer``, the caller's to keep) and divides the values by the weights' sum. Called as :func:`preduce`,
    with its failure behaviour (``buffer`` unchanged on failure)."""
    if len(members) == 1:
        return
    n = buffer.numel()
    work[:n].copy_(buffer.reshape(-1)).mul_(weight)
    work[n] = weight
    preduce(work, members, comms, divide=False)
    buffer.reshape(-1).copy_(work[:n].div_(work[n]))


def exchange(buffer: torch.Tensor, members: tuple[int, ...], rank: int,
             scratch: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Every member's ``buffer``, by member, exchanged point to point on the world communicator: send it
    to every other member and receive theirs in one batch (so NCCL neither orders nor deadlocks the
    pairs). ``scratch``: at least ``len(members) - 1`` buffers shaped as ``buffer``, which receive."""
    peers = [m for m in members if m != rank]
    incoming = dict(zip(peers, scratch))
    ops = [dist.P2POp(dist.isend, buffer, peer) for peer in peers]
    ops += [dist.P2POp(dist.irecv, incoming[peer], peer) for peer in peers]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    incoming[rank] = buffer
    return incoming


def exchange_average(buffer: torch.Tensor, members: tuple[int, ...], rank: int, scratch: list[torch.Tensor],
                     divide: bool = True) -> None:
    """Average ``buffer`` over ``members`` point to point (:func:`exchange`), adding the buffers in member
    order, so that every member computes the same sum in the same order and gets the same bits (``divide``
    False: the sum). ``scratch``: ``len(members)`` buffers shaped as ``buffer`` (received ones and the sum)."""
    received = exchange(buffer, members, rank, scratch)
    total = scratch[len(members) - 1].zero_()
    for member in members:
        total.add_(received[member])
    buffer.copy_(total)
    if divide:
        buffer.div_(len(members))


def preduce_compressed(buffer: torch.Tensor, members: tuple[int, ...], comms: GroupCommunicators,
                       feedback: ErrorFeedback) -> None:
    """P-Reduce in 8 bits with error feedback (:mod:`prague.comm.compress`): every member sends the code of
    its values plus its residual, decodes every member's in member order (the same bits everywhere),
    and adds to ``buffer`` the group's mean of what was sent minus what it sent itself. The group's mean
    of ``buffer`` is unchanged (up to float rounding). The new residual is kept aside in ``feedback``:
    the caller commits it once the group's outcome is settled. Called as :func:`preduce`, with the same
    failure behaviour (``buffer`` unchanged on failure)."""
    if len(members) == 1:
        return
    rank = comms.ctx.rank
    payload = feedback.encode(buffer)
    # the transport's steps and failure handling are preduce's: a member declared failed in the handshake
    # raises PeerFailed as it is (the survivors then know whom to leave out without waiting)
    if comms.transport == WORLD:
        comms.meet(members)
        try:
            received = exchange(payload, members, rank, comms.scratch(payload, len(members) - 1))
        except RuntimeError as exc:
            comms.stats.failed += 1
            raise _broken(members, rank, exc) from exc
    else:
        pg = comms.get(members)
        gathered = comms.scratch(payload, len(members))
        try:
            pg.allgather([gathered], [payload]).wait()
        except RuntimeError as exc:
            del pg  # as in preduce: only dropping the last reference closes the group's connections
            comms.discard(members)
            raise _broken(members, rank, exc) from exc
        received = dict(zip(members, gathered))
    numel = buffer.numel()
    mean, one = feedback.sums()
    mean.zero_()
    for member in members:
        mean.add_(decode(received[member], numel, one, feedback.block))
    mean.div_(len(members))
    assert feedback.sent is not None
    buffer.add_(mean.sub_(feedback.sent.float()).to(buffer.dtype))
    comms.stats.reduces += 1
