"""P-Reduce that survives failed workers: a group averages over its members that are still alive.

Used by every method built on P-Reduce (``prague``, ``dssync``). The job's failed set comes from the
launcher through the store (:mod:`prague.runtime.liveness`). For a group of members M:

* the members declared failed are left out, and the rest average (a group left with one member is a
  local step);
* a handshake that waits for a member ends as soon as that member is declared failed
  (:class:`~prague.runtime.liveness.PeerFailed`), and a collective that breaks (a crashed peer's
  connections reset; a hung one is killed by the launcher, which resets them too) waits up to
  :data:`DECLARE_WAIT_S` for the launcher to declare someone; either way the buffer is restored from
  the values it had before, the broken communicator is thrown away, and the group is retried without
  the failed members. A failure with nobody declared raises, as before.

Members that learn of a failure at different moments still meet: one that already knew runs the
group without the failed member; one that did not waits for it in the handshake, learns of the
failure there, and retries the same smaller group. The failed set only grows, so every live member
ends up running the same group. After every attempt the members settle its outcome
(:meth:`GroupCommunicators.settle`): a collective that a freezing peer completed on one member and
broke on another is retried by both, never kept by one and retried by the other (which would leave
each waiting for the other in different groups).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from prague.comm.preduce import GroupCommunicators, preduce
from prague.errors import CommError
from prague.runtime.context import DistContext
from prague.runtime.liveness import DECLARE_WAIT_S, Membership, PeerFailed

#: One attempt at a group's average: ``(buffer, live members, communicators)``, in place, raising
#: :class:`CommError` when a member fails (:func:`~prague.comm.preduce.preduce` is the plain one).
Averaging = Callable[[torch.Tensor, tuple[int, ...], GroupCommunicators], None]


class LiveGroups:
    """Members-only communicators plus the failed set: :meth:`reduce` averages over the live members."""

    def __init__(self, ctx: DistContext, capacity: int = 16, transport: str = "auto", *,
                 namespace: str) -> None:
        """Collective (every rank of the job constructs it at the same point): see
        :meth:`GroupCommunicators.start`."""
        # Alone, nobody can fail; otherwise the failed set, read through a store connection of its own.
        self.membership = Membership(ctx.private_store(), ctx.world_size) if ctx.world_size > 1 else None
        self.comms = GroupCommunicators(ctx, capacity=capacity, membership=self.membership, transport=transport,
                                        namespace=namespace)
        self.comms.start()
        self.shrunk = 0  # groups that averaged without some of their members (they had failed)
        self._before: torch.Tensor | None = None  # the buffer's values before an attempt, to restore a broken one
        self.current: tuple[int, ...] | None = None  # the members of the latest reduction (stall warnings)

    def reduce(self, members: Sequence[int], buffer: torch.Tensor,
               average: Averaging | None = None) -> tuple[int, ...]:
        """Average ``buffer`` in place over the live ``members`` (this rank among them) with ``average``
        (default :func:`~prague.comm.preduce.preduce`; a compressed or weighted form of it); returns the
        members it averaged with (just this rank: nothing to do; ``buffer`` is then as it was)."""
        run = average if average is not None else preduce
        live = self._live(members)
        self.current = live
        if len(live) < len(members):
            self.shrunk += 1
        if len(live) > 1:
            if self._before is None or self._before.shape != buffer.shape:
                self._before = torch.empty_like(buffer)
            before = self._before.copy_(buffer)
        while len(live) > 1:
            error: CommError | None = None
            try:
                run(buffer, live, self.comms)
            except CommError as exc:
                error = exc
            if self.membership is None:
                if error is not None:
                    raise error
                return live
            if self.comms.settle(live, error is None):
                return live
            lost = self._lost(live, error)
            if not lost:
                if error is not None:
                    raise error
                raise CommError(f"P-Reduce over ranks {list(live)} failed on another member, and none of "
                                f"them was declared failed within {DECLARE_WAIT_S:g} s")
            buffer.copy_(before)
            if len(live) == len(members):
                self.shrunk += 1
            live = self.current = tuple(r for r in live if r not in lost)
        return live

    def _live(self, members: Sequence[int]) -> tuple[int, ...]:
        if self.membership is None:
            return tuple(members)
        failed = set(self.membership.failed_among(members))
        return tuple(r for r in members if r not in failed)

    def _lost(self, live: tuple[int, ...], exc: CommError | None) -> list[int]:
        """The members of ``live`` that failed, if the failure (``exc`` here, or one another member
        reported: ``exc`` None) came from one, waiting for the declaration."""
        if self.membership is None:
            return []
        if isinstance(exc, PeerFailed):
            return [r for r in exc.ranks if r in live]
        return self.membership.wait_declared(live, DECLARE_WAIT_S)

    def close(self) -> None:
        self.comms.close()
