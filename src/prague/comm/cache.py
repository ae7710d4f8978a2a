"""The communicator cache's policy: least recently used member sets, a fixed capacity per worker.

Pure (no torch, no I/O), so the runtime (:class:`prague.comm.preduce.GroupCommunicators`, whose values
are process groups) and the simulator (:class:`prague.sim.world.World`, which only needs to know when a
member set is new to a worker and so pays communicator set-up) make the same decisions: which sets are
cached, which is evicted, when a group has to build a new communicator.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, TypeVar

from prague.comm.keys import HashedMembers
from prague.errors import ConfigError

V = TypeVar("V")
Members = tuple[int, ...]
#: Member sets longer than this are hashed once for all the caches a group is looked up in (a tuple hashes its
#: ranks again at every lookup); shorter ones cost less than the wrapper.
HASH_ONCE_OVER = 32


class CommunicatorCache(Generic[V]):
    """One worker's communicators by member set, least recently used evicted first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ConfigError(f"communicator cache capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        # A dict keeps its keys in insertion order: re-inserting a key makes it the most recently used, and the
        # first key is the least recently used (plain dict operations, cheaper than an OrderedDict's).
        self._entries: dict[Members, V] = {}

    def get(self, members: Members) -> V | None:
        """The entry of ``members`` (now the most recently used), or None."""
        entries = self._entries
        value = entries.get(members)
        if value is not None:  # to the end: the most recently used
            del entries[members]
            entries[members] = value
        return value

    def put(self, members: Members, value: V) -> list[V]:
        """Cache ``value`` for ``members`` as the most recently used; returns the entries evicted to make room."""
        entries = self._entries
        entries.pop(members, None)
        entries[members] = value
        evicted = []
        while len(entries) > self.capacity:
            evicted.append(entries.pop(next(iter(entries))))
        return evicted

    def use(self, members: Members, value: V) -> int | None:
        """``members``' entry as the most recently used: None if it was cached, else ``value`` (not None) is cached
        (as :meth:`put`) and the count of entries evicted is returned (the simulator's whole use of a cache)."""
        entries = self._entries
        known = entries.pop(members, None)
        if known is not None:  # back in, now the most recently used
            entries[members] = known
            return None
        entries[members] = value  # as put: one entry more, so at most one out
        if len(entries) > self.capacity:
            del entries[next(iter(entries))]
            return 1
        return 0

    def pop(self, members: Members) -> V | None:
        """Forget ``members``; returns its entry, if any."""
        return self._entries.pop(members, None)

    def clear(self) -> list[V]:
        """Forget everything; returns the entries."""
        values = list(self._entries.values())
        self._entries.clear()
        return values

    def __contains__(self, members: object) -> bool:
        return members in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[Members]:
        """Member sets, least recently used first."""
        return list(self._entries)


def group_needs_setup(caches: Iterable[CommunicatorCache[bool]], members: Members) -> tuple[bool, int]:
    """Run one group over ``caches`` (one per member): whether any member lacked the set, so all build it,
    and how many entries were evicted. Every member's cache then holds the set as most recently used: the
    runtime's handshake (:meth:`prague.comm.preduce.GroupCommunicators.get`) has the same outcome."""
    missing, evicted = False, 0
    key = HashedMembers(members) if len(members) > HASH_ONCE_OVER else members
    for cache in caches:
        dropped = cache.use(key, True)  # now its most recently used
        if dropped is not None:
            missing = True
            evicted += dropped
    return missing, evicted
