"""Partial All-Reduce (P-Reduce): average one flat buffer over an arbitrary set of ranks.

From Prague (Luo et al., "Prague: High-Performance Heterogeneity-Aware Asynchronous Decentralized
Training", ASPLOS 2020): instead of an all-reduce over all n workers, a small group G averages its
members' parameters, x_i <- mean_{j in G} x_j for i in G, and non-members are untouched.

A group needs a communicator that contains only its members, and creating one must involve only them:
``torch.distributed.new_group`` needs every rank of the job (or, with ``use_local_synchronization``,
names groups from a process-wide counter that disagrees when members create their groups in different
orders, which dynamic groups do). So the members build a backend process group themselves, on a
``PrefixStore`` of the job's store named after the member set (and a generation, below). Communicators
are cached by member set in a bounded LRU; an evicted one is shut down (a gloo group holds several file
descriptors). A communicator whose operation failed or timed out is thrown away for good, and its
replacement gets the next generation's name so it never meets the broken pairs again.

Ordering: every member must run its groups in one global order (the Group Generator's sequence
numbers). That total order is what rules out deadlock; this module does not reorder anything.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from prague.errors import CommError, ConfigError
from prague.runtime.context import DistContext

GROUP_STORE_PREFIX = "prague/preduce"


@dataclass
class CommStats:
    """Counters a method reports in its summary."""

    reduces: int = 0
    created: int = 0
    create_s: float = 0.0
    evicted: int = 0
    failed: int = 0


def _backend_group(ctx: DistContext, store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
    if ctx.backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size, timeout=timeout)


class GroupCommunicators:
    """Members-only communicators, cached by member set (LRU of ``capacity`` entries).

    Only the members of a group call :meth:`get` for it, all at the same point of their global order;
    the call blocks until every member has arrived (the backend's rendezvous through the store).
    """

    def __init__(self, ctx: DistContext, capacity: int = 16, timeout_s: float | None = None) -> None:
        if capacity < 1:
            raise ConfigError(f"communicator cache capacity must be >= 1, got {capacity}")
        self.ctx = ctx
        self.capacity = capacity
        self.timeout = timedelta(seconds=timeout_s if timeout_s is not None else ctx.timeout_s)
        self._cache: OrderedDict[tuple[int, ...], dist.ProcessGroup] = OrderedDict()
        self._generation: dict[tuple[int, ...], int] = {}
        self.stats = CommStats()

    def _check(self, members: tuple[int, ...]) -> None:
        if self.ctx.rank not in members:
            raise ConfigError(f"rank {self.ctx.rank} asked for the communicator of {members}, which it is not in")
        if list(members) != sorted(set(members)) or members[0] < 0 or members[-1] >= self.ctx.world_size:
            raise ConfigError(f"group members must be sorted distinct ranks in 0..{self.ctx.world_size - 1}, got {members}")

    def get(self, members: tuple[int, ...]) -> dist.ProcessGroup:
        """The communicator of ``members`` (this rank must be one), creating it if needed."""
        pg = self._cache.get(members)
        if pg is not None:
            self._cache.move_to_end(members)
            return pg
        self._check(members)
        t0 = time.perf_counter()
        gen = self._generation.get(members, 0)
        name = f"{GROUP_STORE_PREFIX}/{'-'.join(map(str, members))}/g{gen}"
        pg = _backend_group(self.ctx, dist.PrefixStore(name, self.ctx.store), members.index(self.ctx.rank),
                            len(members), self.timeout)
        self.stats.created += 1
        self.stats.create_s += time.perf_counter() - t0
        self._cache[members] = pg
        while len(self._cache) > self.capacity:
            _, old = self._cache.popitem(last=False)
            self._shutdown(old)
            self.stats.evicted += 1
        return pg

    def discard(self, members: tuple[int, ...]) -> None:
        """Throw away the communicator of ``members`` after a failure; the next one gets a new name."""
        pg = self._cache.pop(members, None)
        self._generation[members] = self._generation.get(members, 0) + 1
        self.stats.failed += 1
        if pg is not None:
            self._shutdown(pg)

    @staticmethod
    def _shutdown(pg: dist.ProcessGroup) -> None:
        try:
            if hasattr(pg, "shutdown"):
                pg.shutdown()
        except Exception:  # noqa: BLE001 - a broken group may fail to shut down cleanly; drop it anyway
            pass

    def close(self) -> None:
        while self._cache:
            _, pg = self._cache.popitem()
            self._shutdown(pg)


def preduce(buffer: torch.Tensor, members: tuple[int, ...], comms: GroupCommunicators) -> None:
    """Average ``buffer`` in place over ``members`` (sorted ranks, this rank among them).

    Called by every member, at the same point of the global group order. A group of one returns at once.
    If the operation fails or times out, the communicator is discarded and :class:`CommError` raised;
    ``buffer`` may then hold a partial result.
    """
    if len(members) == 1:
        return
    pg = comms.get(members)
    try:
        pg.allreduce([buffer]).wait()
    except RuntimeError as exc:
        comms.discard(members)
        raise CommError(f"P-Reduce over ranks {list(members)} failed on rank {comms.ctx.rank}: {exc}") from exc
    buffer.div_(len(members))
    comms.stats.reduces += 1
