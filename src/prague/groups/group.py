"""A Group Generator's answer, a :class:`Group`, and what every policy counts of the groups it forms.

Its own module so that it is compiled with the policies (:mod:`prague.native`): the simulator forms and reads
millions of groups. Policies and callers import it through :mod:`prague.groups.api`, the interface.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeGuard

from prague.errors import ConfigError


def is_int(value: object) -> TypeGuard[int]:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


Answer = tuple[int, "Group"]
"""``(worker, group)``: the group ``worker`` must run next."""


def check_worker_id(worker: object, nproc: int) -> None:
    """Raise ConfigError unless ``worker`` is a rank in ``0..nproc - 1``."""
    if type(worker) is int and 0 <= worker < nproc:  # the common case, first: a policy checks every call
        return
    if not is_int(worker) or not 0 <= worker < nproc:  # type: ignore[operator]
        raise ConfigError(
            f"unknown worker id {worker!r}; this group generator serves workers 0..{nproc - 1}"
        )


def _checked(seq: object, members: tuple[object, ...], given: object) -> tuple[int, tuple[int, ...]]:
    """``(seq, members)`` of a group, checked whatever their types: ConfigError naming what is wrong (``given``: the
    members as they came, for the message)."""
    if not is_int(seq) or seq < 0:
        raise ConfigError(f"group seq must be an integer >= 0, got {seq!r}")
    ranks = tuple(m for m in members if is_int(m) and m >= 0)
    if not members or len(ranks) != len(members):
        raise ConfigError(f"group members must be a non-empty list of ranks >= 0, got {given!r}")
    if list(ranks) != sorted(set(ranks)):
        raise ConfigError(f"group members must be sorted and distinct, got {given!r}")
    return seq, ranks


@dataclass(frozen=True)
class Group:
    """One P-Reduce group: every member receives this same object.

    ``seq`` is the global sequence number (members execute their groups in increasing ``seq``);
    ``members`` are the sorted, distinct ranks. A group of one member is a purely local step.
    """

    seq: int
    members: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", _checked(self.seq, tuple(self.members), self.members)[1])

    @staticmethod
    def formed(seq: int, members: tuple[int, ...]) -> Group:
        """A group a policy formed itself: ``members`` already a sorted tuple of distinct ranks, ``seq`` >= 0,
        so the checks of a group that arrives from outside (a message, a file) are skipped: a policy forms
        one per decision, and the simulator makes millions."""
        group = Group.__new__(Group)
        object.__setattr__(group, "seq", seq)
        object.__setattr__(group, "members", members)
        return group

    @staticmethod
    def parse(seq: object, members: object) -> Group:
        """A group read from outside (a message, a file): ConfigError naming what is wrong, whatever the values'
        types (the compiled build's constructor would raise TypeError for a field of another type)."""
        return Group.formed(*_checked(seq, tuple(members) if isinstance(members, (list, tuple)) else (), members))

    def __reduce__(self) -> tuple[type[Group], tuple[int, tuple[int, ...]]]:
        # pickle and copy rebuild it through the constructor: the compiled build's frozen class refuses their
        # default, which sets the fields one by one
        return (Group, (self.seq, self.members))

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def is_local(self) -> bool:
        """True for a group of one: the worker takes a local step and communicates with no one."""
        return len(self.members) == 1


@dataclass
class PolicyCounters:
    """Counters every policy keeps; :meth:`as_dict` is the common part of ``stats()``."""

    requests: int = 0
    groups: int = 0
    members: int = 0
    local_steps: int = 0
    extra: dict[str, float | int] = field(default_factory=dict)

    def formed(self, group: Group) -> None:
        self.groups += 1
        self.members += group.size
        self.local_steps += group.is_local

    def as_dict(self) -> dict[str, float | int]:
        out: dict[str, float | int] = {
            "requests": self.requests,
            "groups": self.groups,
            "mean_group_size": self.members / self.groups if self.groups else 0.0,
            "local_steps": self.local_steps,
        }
        out.update(self.extra)
        return out
