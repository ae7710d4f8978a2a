"""A member set that hashes once: the key of one group looked up in many communicator caches.

A tuple does not keep its hash; a dict lookup hashes it again, element by element. A group over every
worker of the job (the last average of ``--final-average on``) is looked up in each member's cache
(:func:`prague.comm.cache.group_needs_setup`), which made that one group cost ``n^2`` element hashes: at
65,536 simulated workers, minutes. This module stays pure Python (it is not among the compiled modules of
:mod:`prague.native`): a compiled class cannot derive from ``tuple``.
"""

from __future__ import annotations

from typing import Any


class HashedMembers(tuple):  # type: ignore[type-arg]
    """A tuple of ranks, equal to (and hashing as) the plain tuple of the same ranks, that computes its hash
    once."""

    _hash: int

    def __hash__(self) -> int:
        try:
            return self._hash
        except AttributeError:
            self._hash = tuple.__hash__(self)
            return self._hash

    def __reduce__(self) -> tuple[Any, ...]:  # pickles and copies as the plain tuple it stands for
        return tuple, (tuple(self),)
