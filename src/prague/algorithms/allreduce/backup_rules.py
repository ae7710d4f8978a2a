"""``allreduce:backup``'s decisions, pure: which gradients a round takes and which arrival starts it.

Synchronous SGD with backup workers (Chen, Pan, Monga, Bengio, Jozefowicz, "Revisiting Distributed
Synchronous SGD", 2016): of n workers, each step averages the first n - b gradients to arrive and drops
the b late ones. Run by every real worker (:mod:`.backup`) and by the simulator (:mod:`.backup_sim`).

Each round (a step of the job) has one arrival counter. A worker whose gradient is ready adds
:data:`GRADIENT`; a worker that has run its last step adds :data:`FINISHED` to every round it still takes
part in, so a round at the end of the job waits only for the workers still training. Both only grow, so
the add that first meets :func:`complete` is the one that starts the round (:func:`starts`): the
(n - b)-th gradient, or the last gradient of the workers still training when fewer are left.
"""

from __future__ import annotations

#: What a gradient adds to its round's counter.
GRADIENT = 1
#: What a finished worker adds: above any count of gradients (ranks are below 2**20), so one counter holds both.
FINISHED = 1 << 21


def counts(value: int) -> tuple[int, int]:
    """A round's counter as (gradients arrived, finished workers)."""
    return value % FINISHED, value // FINISHED


def quorum(nproc: int, backup: int) -> int:
    """The gradients a round averages when every worker is still training: n - b, at least 1."""
    return max(1, nproc - backup)


def complete(value: int, nproc: int, backup: int) -> bool:
    """Whether a round whose counter reads ``value`` may start: n - b gradients are in, or every worker
    still training (not finished) has given one."""
    gradients, finished = counts(value)
    return gradients >= min(quorum(nproc, backup), nproc - finished)


def starts(value: int, added: int, nproc: int, backup: int) -> bool:
    """Whether the add of ``added`` that left the counter at ``value`` starts the round (exactly one does)."""
    return complete(value, nproc, backup) and not complete(value - added, nproc, backup)


def accepted(value: int, nproc: int, backup: int) -> bool:
    """Whether the gradient whose add left the counter at ``value`` is among the round's first n - b."""
    return counts(value)[0] <= quorum(nproc, backup)
