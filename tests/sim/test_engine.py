"""The event engine: time order, FIFO among equal times, processes and signals."""

from __future__ import annotations

from typing import Any

import pytest

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
