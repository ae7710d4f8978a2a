"""The event engine: time order, FIFO among equal times, processes and signals."""

from __future__ import annotations

import heapq
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prague.errors import ConfigError
from prague.sim.engine import Engine, Process, Signal


def test_events_run_in_time_order_and_fifo_at_equal_times() -> None:
    engine = Engine()
    seen: list[tuple[float, str]] = []
    for t, name in [(2.0, "c"), (1.0, "a"), (2.0, "d"), (1.0, "b"), (0.0, "z")]:
        engine.at(t, lambda n, t=t: seen.append((t, n)), name)
    assert engine.run() == 2.0
    assert seen == [(0.0, "z"), (1.0, "a"), (1.0, "b"), (2.0, "c"), (2.0, "d")]
    assert engine.events == 5


def test_events_scheduled_for_now_run_after_the_earlier_scheduled_ones_at_the_same_time() -> None:
    """An event scheduled during a run for the current time: still ordered by (time, the order scheduled)."""
    engine = Engine()
    seen: list[tuple[float, str]] = []

    def note(name: str) -> None:
        seen.append((engine.now, name))
        if name == "a":  # at t=1, behind b (scheduled earlier for t=1): c now, d a little later, e now
            engine.after(0.0, note, "c")
            engine.after(0.5, note, "d")
            engine.at(1.0, note, "e")
        if name == "c":
            engine.at(engine.now, note, "f")

    engine.at(1.0, note, "a")
    engine.at(1.0, note, "b")
    engine.at(1.5, note, "g")  # scheduled before d for the same time: first
    assert engine.pending == 3
    assert engine.run() == 1.5
    assert seen == [(1.0, "a"), (1.0, "b"), (1.0, "c"), (1.0, "e"), (1.0, "f"), (1.5, "g"), (1.5, "d")]
    assert engine.events == 7 and engine.pending == 0


def test_run_until_runs_what_is_due_by_then_and_leaves_later_events_for_the_next_run() -> None:
    engine = Engine()
    seen: list[str] = []

    def a(_: Any) -> None:
        seen.append("a")
        engine.after(0.0, seen.append, "b")

    engine.at(1.0, a)
    engine.at(3.0, seen.append, "c")
    assert engine.run(until_s=2.0) == 1.0 and seen == ["a", "b"]
    assert engine.run(until_s=0.5) == 1.0 and engine.pending == 1  # before now: nothing runs
    assert engine.run() == 3.0 and seen == ["a", "b", "c"]


def test_cannot_schedule_in_the_past() -> None:
    engine = Engine()
    engine.at(1.0, lambda _: engine.at(0.5, print))
    with pytest.raises(ConfigError, match="before the current time"):
        engine.run()


def test_processes_sleep_and_wait_for_signals() -> None:
    engine = Engine()
    log: list[tuple[str, float, Any]] = []
    sig = Signal(engine)

    def sleeper() -> Process:
        yield 1.5
        log.append(("slept", engine.now, None))
        sig.fire("hello")
        yield 0.5
        log.append(("done", engine.now, None))

    def waiter() -> Process:
        value = yield sig
        log.append(("woke", engine.now, value))

    engine.process(waiter())
    engine.process(sleeper())
    engine.run()
    assert log == [("slept", 1.5, None), ("woke", 1.5, "hello"), ("done", 2.0, None)]


def test_signal_fired_before_the_wait_resumes_at_once_and_fires_once() -> None:
    engine = Engine()
    sig = Signal(engine)
    sig.fire(7)
    got: list[Any] = []

    def waiter() -> Process:
        got.append((yield sig))

    engine.process(waiter())
    engine.run()
    assert got == [7]
    with pytest.raises(RuntimeError, match="fires once"):
        sig.fire(8)


def test_fire_after_and_run_until() -> None:
    engine = Engine()
    sig = Signal(engine)
    got: list[float] = []

    def waiter() -> Process:
        yield sig
        got.append(engine.now)

    engine.process(waiter())
    sig.fire_after(3.0)
    assert engine.run(until_s=2.0) == 0.0 and not got
    engine.run()
    assert got == [3.0]


def test_a_process_yielding_something_else_fails_loudly() -> None:
    engine = Engine()

    def bad() -> Process:
        yield "soon"  # type: ignore[misc]

    engine.process(bad())
    with pytest.raises(TypeError, match="yield a delay in seconds or a Signal"):
        engine.run()


def test_an_event_that_raises_leaves_the_later_ones_queued_in_order() -> None:
    """An exception out of an event stops the run there; the events after it, at its time and later, stay queued in
    their order and run on the next call."""
    engine = Engine()
    seen: list[str] = []

    def boom(_: Any) -> None:
        seen.append("boom")
        raise ValueError("stop here")

    engine.at(1.0, seen.append, "a")
    engine.at(1.0, boom)
    engine.at(1.0, seen.append, "b")
    engine.at(2.0, seen.append, "c")
    with pytest.raises(ValueError, match="stop here"):
        engine.run()
    assert seen == ["a", "boom"] and engine.pending == 2 and engine.now == 1.0
    engine.at(1.0, seen.append, "d")  # scheduled later for the same time: after b
    assert engine.run() == 2.0
    assert seen == ["a", "boom", "b", "d", "c"] and engine.pending == 0 and engine.events == 5


def test_pending_counts_what_is_left_while_events_run() -> None:
    engine = Engine()
    counts: list[int] = []
    for t in (1.0, 1.0, 2.0):
        engine.at(t, lambda _: counts.append(engine.pending))
    engine.at(1.0, lambda _: engine.after(0.5, lambda _: counts.append(engine.pending)))
    engine.run()
    assert counts == [3, 2, 1, 0]


def test_an_event_scheduled_before_a_bucket_begun_by_a_stopped_run_goes_first() -> None:
    """``run(until_s)`` may stop with a later bucket of the calendar begun; an event scheduled then for a time
    before it still runs first, and the begun bucket's events keep their order."""
    engine = Engine()
    seen: list[str] = []
    engine.at(10.0, seen.append, "late-1")
    engine.at(10.0, seen.append, "late-2")
    assert engine.run(until_s=1.0) == 0.0 and not seen
    engine.at(2.0, seen.append, "early")
    engine.at(10.0, seen.append, "late-3")
    assert engine.pending == 4
    assert engine.run() == 10.0
    assert seen == ["early", "late-1", "late-2", "late-3"]


_DELAYS = [0.0, 1e-6, 2.0**-13, 3e-4, 0.05]  # now, inside a bucket, at its edge, a few buckets on, far


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 0.01), st.lists(st.sampled_from(_DELAYS), max_size=3)), min_size=1,
                max_size=60))
def test_the_calendar_runs_events_in_the_order_of_one_heap(plan: list[tuple[float, list[float]]]) -> None:
    """Against a reference queue (one heap of (time, order scheduled)): the same events in the same order, with
    events scheduled from inside events at delays inside the bucket being run, at its edge and beyond."""
    engine = Engine()
    got: list[tuple[float, int]] = []

    def event(name: int) -> None:
        got.append((engine.now, name))
        for j, delay in enumerate(plan[name][1] if name < len(plan) else []):
            engine.after(delay, event, 1000 * (name + 1) + j)

    for i, (t, _) in enumerate(plan):
        engine.at(t, event, i)
    engine.run()

    heap: list[tuple[float, int, int]] = []
    want: list[tuple[float, int]] = []
    for i, (t, _) in enumerate(plan):
        heapq.heappush(heap, (t, i, i))
    order = len(plan)
    while heap:
        now, _, name = heapq.heappop(heap)
        want.append((now, name))
        for j, delay in enumerate(plan[name][1] if name < len(plan) else []):
            order += 1
            heapq.heappush(heap, (now + delay, order, 1000 * (name + 1) + j))
    assert got == want and engine.pending == 0 and engine.events == len(want)
