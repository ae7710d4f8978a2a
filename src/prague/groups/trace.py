"""A record of a Group Generator policy's calls, and their replay (pure).

The service (:mod:`prague.groups.service`) writes one :class:`PolicyCall` per call of its policy when
asked to trace (``prague gg serve --trace FILE``, or the ``Trace`` RPC that workers of a run with
``--log-decisions`` send before their first request); the simulator records its calls in the same
shape. A policy's answers depend only on its configuration (seed included) and on the order and times
of the calls, so :func:`replay` through a fresh policy of the same configuration gives the same
answers: that is how a real run's groups are checked against the simulator's policy objects.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prague.errors import ConfigError
from prague.groups.api import Answer, Group, GroupPolicy

CALLS = ("request", "finish", "exclude", "poll")


@dataclass(frozen=True)
class PolicyCall:
    """One call of a policy: ``call`` (``request``, ``finish`` or ``poll``), the worker that made it
    (None for ``poll``; a sharded generator's poll of one shard: that shard), the time it was given (``now_s``) and every answer it returned, in order."""

    call: str
    worker: int | None
    now_s: float
    answers: tuple[Answer, ...]
    iteration: int | None = None  # a request's step, when the worker said it

    def __post_init__(self) -> None:
        if self.call not in CALLS:
            raise ConfigError(f"policy call must be one of {', '.join(CALLS)}, got {self.call!r}")
        object.__setattr__(self, "answers", tuple(self.answers))

    def to_dict(self) -> dict[str, Any]:
        out = {"call": self.call, "worker": self.worker, "now_s": self.now_s,
               "answers": [[w, g.seq, list(g.members)] for w, g in self.answers]}
        if self.iteration is not None:
            out["iteration"] = self.iteration
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PolicyCall:
        answers = tuple((int(w), Group.parse(seq, members)) for w, seq, members in data["answers"])
        iteration = data.get("iteration")
        return cls(data["call"], data["worker"], float(data["now_s"]), answers,
                   None if iteration is None else int(iteration))


def call_policy(policy: GroupPolicy, call: str, worker: int | None, now_s: float,
                iteration: int | None = None) -> list[Answer]:
    """Make one call of ``policy`` by name (``request``/``finish`` need a worker; ``iteration``: the step a
    request comes after, when known)."""
    if call == "poll":  # a sharded generator's poll of one shard names it as the worker
        poll_shard = getattr(policy, "poll_shard", None)
        return policy.poll(now_s) if worker is None or poll_shard is None else poll_shard(worker, now_s)
    if worker is None:
        raise ConfigError(f"a {call!r} call needs the worker that made it")
    if call == "request":
        return policy.request(worker, now_s, iteration)
    if call == "finish":
        return policy.finish(worker, now_s)
    if call == "exclude":
        return policy.exclude(worker, now_s)
    raise ConfigError(f"policy call must be one of {', '.join(CALLS)}, got {call!r}")


def replay(policy: GroupPolicy, calls: Iterable[PolicyCall]) -> list[PolicyCall]:
    """Make the recorded ``calls`` on ``policy``, in order and at their times; return what ``policy``
    answered, call by call (equal to ``calls`` when it decides as the recorded policy did)."""
    return [PolicyCall(c.call, c.worker, c.now_s, tuple(call_policy(policy, c.call, c.worker, c.now_s, c.iteration)),
                       c.iteration) for c in calls]
