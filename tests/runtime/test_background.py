"""``BackgroundWork``: the one primitive of a method's background communication: operations with stages,
one error path to the training thread, one stop/join protocol, spans for the timeline, and stall
warnings for an operation stuck communicating."""

from __future__ import annotations

import io
import queue
import threading
import time

import pytest
import torch.distributed as dist

from prague.errors import CommError, ConfigError
from prague.runtime.background import (
    COMMUNICATING,
    DONE,
    WAITING,
    BackgroundWork,
    FunctionWork,
    PeriodicWork,
    live_works,
    owner_of,
)
from prague.runtime.stall import Phase, StallWatch

pytestmark = pytest.mark.timeout(30)


class Echo(BackgroundWork):
    """Takes numbers from a queue; each is one operation: ``waiting`` until ``go`` is set, then
    ``communicating`` until ``release`` is set. A number below 0 raises ``errors[n]``."""

    def __init__(self, errors: dict[int, BaseException] | None = None) -> None:
        super().__init__("echo work", "echo")
        self.jobs: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self.go, self.release = threading.Event(), threading.Event()
        self.errors = errors or {}
        self.done: list[int] = []
        self.start()

    def wake(self) -> None:
        self.jobs.put(None)

    def run(self, index: int) -> None:
        while (job := self.jobs.get()) is not None:
            with self.operation(job) as op:
                self.go.wait()
                op.to(COMMUNICATING)
                self.release.wait()
                if job < 0:
                    raise self.errors[job]
            with self.cond:
                self.done.append(job)
                self.cond.notify_all()


def _until(predicate: object, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_an_operation_moves_through_its_stages_and_leaves_spans() -> None:
    work = Echo()
    assert work.stages()[0][1] == DONE  # between operations
    work.jobs.put(7)
    _until(lambda: work.stages()[0][1] == WAITING)
    assert work.stages()[0][0] == 7
    work.go.set()
    _until(lambda: work.stages()[0][1] == COMMUNICATING)
    work.release.set()
    assert work.wait_until(lambda: work.done == [7], timeout_s=10)
    assert work.stages()[0][1] == DONE
    assert [(s.stage, s.step) for s in work.spans] == [(WAITING, 7), (COMMUNICATING, 7)]
    assert all(s.start_s <= s.end_s for s in work.spans)
    assert work.spans[0].end_s <= work.spans[1].start_s
    assert work.shutdown(failed=False, timeout_s=10) and not work.alive


@pytest.mark.parametrize("error,raised,match", [
    (ValueError("bad bytes"), CommError, "echo work failed: ValueError"),  # any other error: named by the work
    (ConfigError("wrong token"), ConfigError, "wrong token"),  # the project's own: as it is (exit 2 stays 2)
])
def test_a_failure_reaches_the_training_thread_and_wakes_its_waits(error: BaseException, raised: type,
                                                                   match: str) -> None:
    work = Echo({-1: error})
    work.go.set()
    work.release.set()
    work.jobs.put(-1)
    with pytest.raises(raised, match=match):
        work.wait_until(lambda: False, timeout_s=10)  # would wait forever without the failure
    with pytest.raises(raised):
        work.raise_if_failed()  # and it stays raised
    assert work.join(10)  # the failure ended the thread (it may still be leaving its last frame just now)


def test_stop_lets_the_given_work_finish_and_a_failed_shutdown_leaves_a_stuck_thread() -> None:
    work = Echo()
    work.go.set()
    work.release.set()
    for job in (1, 2, 3):
        work.jobs.put(job)
    assert work.shutdown(failed=False, timeout_s=10)
    assert work.done == [1, 2, 3]
    stuck = Echo()
    stuck.jobs.put(4)  # waits for go forever: a collective with a dead peer
    _until(lambda: stuck.stages()[0][1] == WAITING)
    assert not stuck.shutdown(failed=True, timeout_s=60)  # does not wait for it
    assert stuck.alive
    stuck.go.set()
    stuck.release.set()
    assert stuck.join(10) and stuck.done == [4]  # it ends after its operation, as stopped


def test_a_stall_warning_names_the_background_work_stuck_communicating() -> None:
    store = dist.HashStore()
    out = io.StringIO()
    work = Echo()
    work.go.set()
    work.jobs.put(12)
    _until(lambda: work.stages()[0][1] == COMMUNICATING)
    phase = Phase()
    phase.compute(13)  # the training thread computes on: only the background operation waits
    watch = StallWatch(store, 0, 2, phase, lambda: [1], warn_s=0.3, out=out, background=[work])
    try:
        _until(lambda: watch.warnings)
    finally:
        watch.stop()
        work.release.set()
        work.shutdown(failed=False, timeout_s=10)
    report = watch.warnings[0]
    assert report["what"] == "echo work " and report["step"] == 12 and report["ranks"] == [1]
    assert "rank 0's echo work has waited" in out.getvalue()


class Ticker(PeriodicWork):
    """Counts its ticks; ends itself after ``last`` ticks, or raises at tick ``fail_at``."""

    def __init__(self, last: int | None = None, fail_at: int | None = None) -> None:
        super().__init__("ticker", "prague-ticker", 0.01)
        self.ticks, self.last, self.fail_at = 0, last, fail_at
        self.start()

    def tick(self) -> bool:
        self.ticks += 1
        if self.ticks == self.fail_at:
            raise OSError("the store went away")
        return self.last is None or self.ticks < self.last


def test_a_periodic_work_ticks_until_stopped_and_is_listed_while_it_runs() -> None:
    work = Ticker()
    try:
        assert work.wait_until(lambda: work.ticks >= 5, timeout_s=5.0)
        assert work in live_works() and owner_of(work._threads[0]) is work
        assert work._threads[0].name == "prague-ticker"
    finally:
        assert work.shutdown(failed=False, timeout_s=5.0)
    count = work.ticks
    time.sleep(0.05)
    assert work.ticks == count and work not in live_works() and work.error is None


def test_a_periodic_work_ends_quietly_on_false_and_hands_an_exception_to_the_training_thread() -> None:
    quiet = Ticker(last=3)
    assert quiet.join(5.0) and quiet.ticks == 3 and quiet.error is None
    failing = Ticker(fail_at=2)
    assert failing.join(5.0)
    with pytest.raises(CommError, match="the ticker failed: OSError"):
        failing.raise_if_failed()
    with pytest.raises(ValueError, match="period_s must be > 0"):
        PeriodicWork("bad", "bad", 0.0)


def test_a_function_work_runs_its_body_on_each_thread_and_wait_ended_raises_the_first_failure_at_once() -> None:
    seen: list[int] = []
    lock = threading.Lock()

    def body(index: int) -> None:
        with lock:
            seen.append(index)

    work = FunctionWork("three bodies", "bodies", body, threads=3)
    assert work.wait_ended(5.0) and sorted(seen) == [0, 1, 2] and work.join(5.0)
    assert [t.name for t in work._threads] == ["bodies-0", "bodies-1", "bodies-2"]

    hold = threading.Event()

    def one_fails(index: int) -> None:
        if index == 0:
            raise OSError("stream broke")
        hold.wait(10.0)  # the others still run when the failure is raised

    failing = FunctionWork("streams", "streams", one_fails, threads=2, wake=hold.set)
    try:
        with pytest.raises(CommError, match="the streams failed: OSError"):
            failing.wait_ended(5.0)
        assert failing.alive and owner_of(failing._threads[1]) is failing
    finally:
        assert failing.shutdown(failed=True, timeout_s=5.0)  # wake() released the waiting body
    assert not FunctionWork("late", "late", body, start=False).alive
