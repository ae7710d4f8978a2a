"""``prague``'s control flow around the background averages, written once and driven twice.

With overlap on, after each local step a worker does, in this order (:func:`overlapped_step`): take the
averages that came back and apply their corrections (:data:`TAKE_READY`); if ``max_in_flight``
averages are still out, either step on without averaging this time (``--when-busy local``, counted in
``busy_local_steps``) or wait for the oldest and apply it (``--when-busy wait``: :data:`TAKE_OLDEST`,
counted in ``average_waits``); then hand a snapshot of its parameters to the background averager
(:data:`SUBMIT`). After its last step it takes every average still out, then runs the groups it is still
committed to (:func:`finishing`: :data:`DRAIN`, :data:`COMMITTED`).

Each function is a generator of effects: its driver performs each effect its own way and then asks for
the next. The runtime (:meth:`prague.algorithms.prague.runtime.Prague.after_step`) performs them on real
threads and tensors; the simulator (:class:`prague.algorithms.prague.sim.SimPrague`) in simulated time,
inside its own event-engine process. So the order and the policy cannot drift apart between the two.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

#: Apply every average that has come back.
TAKE_READY = "take_ready"
#: Wait for the oldest average still out, and apply it.
TAKE_OLDEST = "take_oldest"
#: Hand a snapshot of the parameters to the background averager.
SUBMIT = "submit"
#: Apply every average still out, waiting for each.
DRAIN = "drain"
#: Run the groups the worker is still committed to, and leave.
COMMITTED = "committed"


@dataclass
class OverlapCounts:
    """How often the busy policy acted: steps taken without averaging (``local``), waits for the oldest
    average (``wait``)."""

    busy_local_steps: int = 0
    average_waits: int = 0


def overlapped_step(in_flight: Callable[[], int], max_in_flight: int, busy_policy: str,
                    counts: OverlapCounts) -> Iterator[str]:
    """The effects of one step's end, with overlap on (see the module docstring). ``in_flight()``: the
    averages still out, read after the ready ones were taken."""
    yield TAKE_READY
    if in_flight() >= max_in_flight:
        if busy_policy == "local":
            counts.busy_local_steps += 1
            return
        yield TAKE_OLDEST
        counts.average_waits += 1
    yield SUBMIT


def finishing() -> Iterator[str]:
    """The effects after the last step: every average still out, then the committed groups."""
    yield DRAIN
    yield COMMITTED
