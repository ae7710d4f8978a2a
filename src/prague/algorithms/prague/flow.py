"""``prague``'s control flow around the background averages, written once and driven twice.

With overlap on, after each local step a worker does, in this order (:func:`overlapped_step`): take the
averages that came back and apply their corrections (:data:`TAKE_READY`); if ``max_in_flight``
averages are still out, either step on without averaging this time (``--when-busy local``, counted in
``busy_local_steps``) or wait for the oldest and apply it (``--when-busy wait``: :data:`TAKE_OLDEST`,
counted in ``average_waits``); then hand a snapshot of its parameters to the background averager
(:data:`SUBMIT`). After its last step it takes every average still out, then runs the groups it is still
committed to and leaves the Group Generator (:func:`finishing`: :data:`DRAIN`, :data:`COMMITTED`); with
``--final-average on`` it then averages its values with every living worker once, when all are done
(:data:`FINAL`), so that the replicas end equal. Overlap off, only the finish's effects apply.

On the averaging thread, each request the worker submitted goes through :func:`averaging`: ask for its
group (:data:`ASK`); unless the group is the worker alone, add to the snapshot the earlier corrections
it lacks (:data:`CATCH_UP`, :class:`~prague.algorithms.prague.overlap.Backlog`) and average it with the
group (:data:`REDUCE`); then settle the request (:data:`SETTLE`): its correction, zero when nothing was
averaged, goes to the backlog and to the worker; :data:`DONE` then ends the request.

Each function is a generator of effects: its driver performs each effect its own way and then asks for
the next. The runtime (:meth:`prague.algorithms.prague.runtime.Prague.after_step`, the thread of
:class:`~prague.algorithms.prague.overlap.BackgroundAverager`) performs them on real threads and tensors;
the simulator (:class:`prague.algorithms.prague.sim.SimPrague`) in simulated time, inside its own
event-engine processes. So the order and the policy cannot drift apart between the two.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any, Final

#: Apply every average that has come back.
TAKE_READY: Final = "take_ready"
#: Wait for the oldest average still out, and apply it.
TAKE_OLDEST: Final = "take_oldest"
#: Hand a snapshot of the parameters to the background averager.
SUBMIT: Final = "submit"
#: Apply every average still out, waiting for each.
DRAIN: Final = "drain"
#: Run the groups the worker is still committed to, and leave.
COMMITTED: Final = "committed"
#: Once every living worker is done: average the values over all of them (``--final-average on``).
FINAL: Final = "final"

#: The averaging thread: ask for the request's group; the driver sends the :class:`~prague.groups.Group` back.
ASK: Final = "ask"
#: Add to the request's snapshot the corrections of earlier requests it lacks.
CATCH_UP: Final = "catch_up"
#: Average the snapshot with the group (the effect's argument); the driver sends back False when nothing
#: was averaged (every other member had failed), anything else when it was.
REDUCE: Final = "reduce"
#: The request is done: its correction (zero where the argument, whether it averaged, is False) goes to
#: the backlog, then to the worker.
SETTLE: Final = "settle"
#: The request is over: the driver stops (the generator ends without raising StopIteration, which a driver
#: would otherwise catch at every request).
DONE: Final = "done"


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


def finishing(final_average: bool) -> Iterator[str]:
    """The effects after the last step: every average still out, the committed groups, then (``final_average``)
    the last average over every living worker."""
    yield DRAIN
    yield COMMITTED
    if final_average:
        yield FINAL


def averaging() -> Generator[tuple[str, Any], Any, None]:
    """The effects of one request on the averaging thread (see the module docstring), each as
    ``(effect, argument)``: ``(ASK, None)``, then for a group of more than one ``(CATCH_UP, group)`` and
    ``(REDUCE, group)``, then ``(SETTLE, averaged)``, then ``(DONE, None)``, where the driver stops."""
    group = yield ASK, None
    averaged = False
    if not group.is_local:
        yield CATCH_UP, group
        averaged = (yield REDUCE, group) is not False
    yield SETTLE, averaged
    yield DONE, None
