"""A small discrete-event engine: a calendar of timed callbacks, plus generator processes on top.

Why not SimPy: the simulator's inner loop is "a worker computes, asks, waits for its partners,
communicates" for up to a million worker-iterations per run, and every SimPy event is an object with
callbacks and a trip through its environment. Measured by ``benchmarks/simulator.py --engine`` on this
project's 2-core machine (1,024 workers x 300 iterations of compute, a pairwise rendezvous and a
transfer; the same workload, the same simulated end time): SimPy 4.1.2 needed 2.4 s and 4.1 s of CPU in
two runs, this loop 1.1 s and 1.7 s (2.1-2.5x less). A whole Prague-smart run spends about a third of
its time in the engine, and the 1,024-worker target (1,000 iterations in under 20 s; about 27 s of CPU
here) leaves no room for that factor, nor for a dependency, so the engine is this file.

Contract:

* :meth:`Engine.at` / :meth:`Engine.after` schedule ``fn(arg)``; events at equal times run in the
  order they were scheduled (a stable sort by time keeps it), so a run is a deterministic function of
  its inputs: the same seed gives the same event order, bit for bit.
* A *process* is a generator driven by :meth:`Engine.process`. It yields either a ``float`` (sleep that
  many simulated seconds; ``0.0`` yields the turn to events already due) or a :class:`Signal` (sleep
  until someone calls :meth:`Signal.fire`; the process resumes with the fired value, inside the
  ``fire`` call). A generator that returns ends the process.
* Nothing here knows about workers, links or methods (see :mod:`prague.sim.method`).
"""

from __future__ import annotations

import heapq
from bisect import insort
from collections.abc import Callable, Generator
from typing import Any, cast

from prague.errors import ConfigError

#: The width of the engine's buckets in simulated seconds (a power of two: see :class:`Engine`). A 100 ms step
#: of 16,384 workers puts some 60 events in one; a small job leaves most empty, which costs nothing.
BUCKET_S = 2.0**-13
_PER_S = 1.0 / BUCKET_S  # exact: the inverse of a power of two

Process = Generator["float | Signal", Any, None]
#: A bucket of scheduled calls ``fn(arg)`` at ``time``, as three lists side by side (times, fns, args), in the order
#: scheduled: no object per event (a tuple per event was made, tracked by the cycle collector, and unlinked from its
#: list again when its bucket was done, a likely cache miss each at 16,384 workers). A bucket is run in the order
#: of its times, sorted stably, so that equal times keep the order scheduled (no sequence number to make, box and
#: compare per event).
Bucket = tuple[list[float], list[Callable[[Any], None]], list[Any]]


class Signal:
    """A one-shot wake-up for the processes (or callbacks) waiting on it, carrying a value.

    ``fire(value)`` resumes the waiters *inside the caller*, in the order they started waiting, at the
    current simulated time: each runs until its next yield before ``fire`` returns. That saves an event
    per wake-up (the simulator wakes every worker several times per iteration), and is safe because a
    simulated worker always yields a delay or a new signal before it could wake anyone else. Firing
    before anyone waits is fine: a waiter resumes at once (as a new event) when it yields the signal.
    """

    __slots__ = ("_engine", "_first", "_more", "_fired", "_value")

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        # The waiters in the order they came: the first in a field of its own, any others in a list made for them.
        # Most signals have one waiter (an answer, a wake-up) and a group's a few: a list for every signal was two
        # allocations per wake-up (the list and the one swapped in at ``fire``).
        self._first: Callable[[Any], None] | None = None
        self._more: list[Callable[[Any], None]] | None = None
        self._fired = False
        self._value: Any = None

    @property
    def fired(self) -> bool:
        return self._fired

    def fire(self, value: Any = None) -> None:
        if self._fired:
            raise RuntimeError("a Signal fires once; make a new one for the next wake-up")
        self._fired = True
        self._value = value
        first, more = self._first, self._more
        self._first = self._more = None
        if first is not None:
            first(value)
            if more is not None:
                for resume in more:
                    resume(value)

    def fire_after(self, delay_s: float, value: Any = None) -> None:
        """``fire(value)`` ``delay_s`` seconds from now (one event)."""
        self._engine.after(delay_s, self.fire, value)

    def _wait(self, resume: Callable[[Any], None]) -> None:
        if self._fired:
            self._engine.after(0.0, resume, self._value)
        elif self._first is None:
            self._first = resume
        elif self._more is None:
            self._more = [resume]
        else:
            self._more.append(resume)


class Signals:
    """One :class:`Signal` per key (a round's start, its end), made on first use: whoever comes first,
    the waiter or the firer, finds the same one."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._table: dict[Any, Signal] = {}

    def __getitem__(self, key: Any) -> Signal:
        sig = self._table.get(key)
        if sig is None:
            sig = self._table[key] = Signal(self._engine)
        return sig


class Engine:
    """The event loop; ``now`` is the simulated time in seconds.

    The queue is a calendar (Brown, "Calendar queues: a fast O(1) priority queue implementation for the
    simulation event set problem", CACM 1988), in its simplest form: events fall into buckets of
    :data:`BUCKET_S` simulated seconds, a heap holds the keys of the buckets not yet reached (a few
    hundred ints at any job size: the events of the next step or two), and a bucket (:data:`Bucket`), which holds
    its events in the order scheduled, is put in time order once, stably, when the run reaches it (its indices
    sorted by its list of float times, which the sort compares directly); an event scheduled into the bucket being
    run goes after those of its time in what is left of it. A heap of every event had grown to a few per worker,
    and each pop walked it: at 16,384 workers a tenth of a run's time, its entries spread over memory.
    The order is exactly the heap's (time, then the order scheduled), so a run is the same event for
    event.
    """

    __slots__ = ("now", "events", "_times", "_fns", "_args", "_order", "_cur_i", "_cur_key", "_buckets", "_keys",
                 "_count")

    def __init__(self) -> None:
        self.now = 0.0
        self.events = 0  # events executed so far (for the scale report)
        # The bucket being run (its times, fns and args, as scheduled), its events' indices in time order and the
        # next of them, and its key (-1: none).
        self._times: list[float] = []
        self._fns: list[Callable[[Any], None]] = []
        self._args: list[Any] = []
        self._order: list[int] = []
        self._cur_i = 0
        self._cur_key = -1
        self._buckets: dict[int, Bucket] = {}  # the others, in the order scheduled
        self._keys: list[int] = []  # a heap of ``_buckets``' keys
        self._count = 0  # events queued

    def _push(self, t: float, fn: Callable[[Any], None], arg: Any) -> None:
        self._count += 1
        key = int(t * _PER_S)  # exact scaling (a power of two), so monotone in t
        if key == self._cur_key:  # after the events of its time already there: scheduled before it
            times = self._times
            times.append(t)
            self._fns.append(fn)
            self._args.append(arg)
            insort(self._order, len(times) - 1, self._cur_i, key=times.__getitem__)
            return
        if key < self._cur_key:  # only after ``run(until_s)`` stopped with a later bucket begun: put it back
            self._shelve()
        bucket = self._buckets.get(key)
        if bucket is None:
            self._buckets[key] = ([t], [fn], [arg])
            heapq.heappush(self._keys, key)
        else:
            bucket[0].append(t)
            bucket[1].append(fn)
            bucket[2].append(arg)

    def _shelve(self) -> None:
        rest = self._order[self._cur_i:]
        if rest:  # in time order: they stay ahead of any later event of their times when sorted again
            times, fns, args = self._times, self._fns, self._args
            self._buckets[self._cur_key] = ([times[i] for i in rest], [fns[i] for i in rest], [args[i] for i in rest])
            heapq.heappush(self._keys, self._cur_key)
        self._times, self._fns, self._args, self._order = [], [], [], []
        self._cur_i = 0
        self._cur_key = -1

    def _next(self) -> bool:
        """Make sure ``_order[_cur_i]`` is the next event; False when none is queued."""
        if self._cur_i < len(self._order):
            return True
        if not self._keys:
            return False
        key = heapq.heappop(self._keys)
        times, self._fns, self._args = self._buckets.pop(key)
        self._times = times
        # by time; stable, so in the order scheduled among equal times
        self._order = sorted(range(len(times)), key=times.__getitem__)
        self._cur_i = 0
        self._cur_key = key
        return True

    def at(self, t: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        """Run ``fn(arg)`` at simulated time ``t`` (not before ``now``)."""
        if not t >= self.now:  # also rejects NaN
            raise ConfigError(f"cannot schedule an event at t={t!r}, before the current time {self.now!r}")
        self._push(t, fn, arg)

    def after(self, delay_s: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        """Run ``fn(arg)`` ``delay_s`` seconds from now."""
        self._push(self.now + delay_s, fn, arg)

    def signal(self) -> Signal:
        return Signal(self)

    def process(self, gen: Process) -> None:
        """Start driving ``gen`` now (its first step runs as an event at the current time)."""

        driven: Any = gen  # what it yields is checked below, with the fix (not by a compiled build's annotation)

        def step(value: Any) -> None:
            try:
                what: Any = driven.send(value)
            except StopIteration:
                return
            # Each kind checked exactly, then cast: the compiled build reads a Signal's fields in place and adds a
            # float unboxed (an attribute of an object of unknown type is looked up by name).
            if what.__class__ is Signal:  # Signal._wait, inlined: one call less per wake-up
                sig = cast(Signal, what)
                if sig._fired:
                    self._push(self.now, step, sig._value)
                elif sig._first is None:
                    sig._first = step
                else:
                    sig._wait(step)
            elif what.__class__ is float:
                self._push(self.now + cast(float, what), step, None)
            elif what.__class__ is int:
                self._push(self.now + what, step, None)
            elif isinstance(what, Signal):
                what._wait(step)
            else:
                raise TypeError(f"a simulated process yielded {what!r}; yield a delay in seconds or a Signal")

        self.after(0.0, step, None)

    def run(self, until_s: float | None = None) -> float:
        """Execute events in time order until none is left (or the next is after ``until_s``)."""
        count = 0
        try:
            while self._next():
                i = self._order[self._cur_i]
                t = self._times[i]
                if until_s is not None and t > until_s:
                    break
                self._cur_i += 1
                self._count -= 1
                self.now = t
                count += 1
                self._fns[i](self._args[i])
        finally:  # an event that raises counts as run; the later ones stay queued
            self.events += count
        return self.now

    @property
    def pending(self) -> int:
        return self._count
