"""One primitive for a method's background communication: :class:`BackgroundWork`.

Every method that communicates beside the training thread (``prague``'s overlapped averages, ``eager-sgd``'s
rounds, ``lossy``'s chunk streams, ``ps-eager``'s reply completer, ``adpsgd``'s passive server) runs it
on a :class:`BackgroundWork`: one or more daemon threads with

* **operations with a stage**: the thread runs each unit of work (one average, one round, one request)
  inside :meth:`BackgroundWork.operation`, which yields an :class:`Operation` handle whose stage moves
  from ``waiting`` (for a group, a round's start, a request: no peer is blocked on it yet) to
  ``communicating`` (inside a collective or an exchange with peers) to ``done``. The stage of each
  thread's current operation is what stall warnings watch (:mod:`prague.runtime.stall`: a long
  ``communicating`` stage names the peers holding it up), and every finished stage is kept as a
  :class:`Span` for the run's timeline (:mod:`prague.metrics.timeline`);
* **one error path**: an exception that ends a thread is kept (:meth:`BackgroundWork.fail`) and raised
  on the training thread by the next call that waits on or hands work to the thread
  (:meth:`BackgroundWork.raise_if_failed`, :meth:`BackgroundWork.wait_until`): the project's own errors
  as they are (a wrong setting stays a :class:`~prague.errors.ConfigError`, exit 2), any other as a
  :class:`~prague.errors.CommError` naming the work;
* **one stop/join protocol**: :meth:`BackgroundWork.stop` asks every thread to end after what it was
  given; :meth:`BackgroundWork.shutdown` stops and joins, and after a failure waits at most
  :data:`FAILED_JOIN_S`: a thread blocked in a collective with a dead peer ends only at that
  collective's timeout, and as a daemon it never keeps the process alive.

The worker's own watches run on it too, in its periodic form (:class:`PeriodicWork`: the heartbeat, the
stall watch, the Group Generator watch), and so does a new communicator's rendezvous (a
:class:`QueuedWork`). The services' threads and the launcher's are :class:`FunctionWork`: the Group
Generator's timer and the process's gRPC event loop, a parameter-server shard's thread per worker, the
cross-traffic streams, and the launcher's reader of each child's output. :func:`live_works` lists every
work whose threads still run in this process, so that a thread of the package is always one work's (a
test lists a live worker's threads by owner).

The same handle-with-stages shape as hivemind's ``StepControl`` (Ryabinin et al., "Moshpit SGD",
NeurIPS 2021), reduced to what a method here needs.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

from prague.errors import CommError, PragueError

WAITING = "waiting"
COMMUNICATING = "communicating"
DONE = "done"
STAGES = (WAITING, COMMUNICATING, DONE)
#: After a failure, how long :meth:`BackgroundWork.shutdown` waits for the threads.
FAILED_JOIN_S = 1.0
#: Finished stages kept per work for the timeline (the oldest go first).
MAX_SPANS = 200_000
J = TypeVar("J")
_works: weakref.WeakSet[BackgroundWork] = weakref.WeakSet()  # every work this process started
_works_lock = threading.Lock()
#: Every work's finished stages, as (the work's name, span), for the timeline: kept here, not only on the
#: work, so that a work that has ended and been dropped (a communicator's rendezvous) still shows.
_spans: deque[tuple[str, Span]] = deque(maxlen=MAX_SPANS)


def spans_since(start_s: float) -> list[tuple[str, Span]]:
    """The finished stages of every work of this process that ended after ``start_s``
    (``time.perf_counter``), oldest first: what a run's timeline shows of its background threads."""
    return [(what, span) for what, span in list(_spans) if span.end_s >= start_s]


def live_works() -> list[BackgroundWork]:
    """Every work of this process whose threads still run."""
    with _works_lock:
        works = list(_works)
    return [w for w in works if w.alive]


def owner_of(thread: threading.Thread) -> BackgroundWork | None:
    """The work ``thread`` was made for, if any (a thread of the package knows its work from the start,
    so a thread ending while it is asked still names it)."""
    return thread.work if isinstance(thread, _WorkThread) else None


class _WorkThread(threading.Thread):
    """A daemon thread of one :class:`BackgroundWork`, which it names as :attr:`work`."""

    def __init__(self, work: BackgroundWork, index: int, name: str) -> None:
        super().__init__(target=work._main, args=(index,), name=name, daemon=True)
        self.work = work


@dataclass(frozen=True)
class Span:
    """One stage of one operation: ``stage`` from ``start_s`` to ``end_s`` (``time.perf_counter``, the
    clock the training loop times its steps with), on behalf of the worker's step ``step``, on thread
    ``thread`` of the work."""

    stage: str
    step: int
    start_s: float
    end_s: float
    thread: int = 0


class Operation:
    """One unit of background work (an average, a round, a request), handed out by
    :meth:`BackgroundWork.operation`; the thread moves it through its stages with :meth:`to`. Read from
    other threads as one tuple (:attr:`state`), replaced whole."""

    def __init__(self, work: BackgroundWork, thread: int, step: int, stage: str) -> None:
        self._work, self.thread, self.step = work, thread, step
        self.state: tuple[str, float, float] = (stage, time.monotonic(), time.perf_counter())  # stage, since, start

    @property
    def stage(self) -> str:
        return self.state[0]

    def to(self, stage: str, step: int | None = None) -> None:
        """Enter ``stage`` (``step``: the operation turned out to be on behalf of another step)."""
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; one of {STAGES}")
        self._work._record(self)
        if step is not None:
            self.step = step
        self.state = (stage, time.monotonic(), time.perf_counter())


class BackgroundWork:
    """The threads of one method's background communication; see the module docstring.

    ``what`` names the work in warnings and errors ("background average", "eager-sgd round thread");
    ``name`` is the threads' name; ``threads`` how many run :meth:`run` (each with its index).
    Subclasses implement :meth:`run` and call :meth:`start` at the end of their constructor; they guard
    their own state with :attr:`cond`, which :meth:`wait_until` and :meth:`fail` use too.
    """

    def __init__(self, what: str, name: str, threads: int = 1) -> None:
        self.what = what
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.stopping = False
        self.spans: deque[Span] = deque(maxlen=MAX_SPANS)
        self._current: list[Operation | None] = [None] * threads
        self._ended = 0  # threads whose body returned or raised (guarded by cond)
        self._threads = [_WorkThread(self, i, name if threads == 1 else f"{name}-{i}") for i in range(threads)]

    def start(self) -> None:
        with _works_lock:
            _works.add(self)
        for thread in self._threads:
            thread.start()

    def run(self, index: int) -> None:
        """Thread ``index``'s body: return when :attr:`stopping` (or the work is over); raise to fail."""
        raise NotImplementedError

    def wake(self) -> None:
        """Make a thread blocked outside :attr:`cond` (on a queue) notice :attr:`stopping`."""

    # -- stages ------------------------------------------------------------------------------------
    @contextmanager
    def operation(self, step: int, stage: str = WAITING, thread: int = 0) -> Iterator[Operation]:
        """Run one operation on behalf of the worker's step ``step`` (this thread's current one until the
        block ends, then ``done``)."""
        op = self.begin_operation(step, stage, thread)
        try:
            yield op
        finally:
            self.end_operation(op)

    def begin_operation(self, step: int, stage: str = WAITING, thread: int = 0) -> Operation:
        """:meth:`operation` for work whose operations do not nest in one block: end it with
        :meth:`end_operation`."""
        op = Operation(self, thread, step, stage)
        self._current[thread] = op
        return op

    def end_operation(self, op: Operation) -> None:
        self._record(op)
        op.state = (DONE, time.monotonic(), time.perf_counter())

    def _record(self, op: Operation) -> None:
        stage, _, start = op.state
        if stage != DONE:
            span = Span(stage, op.step, start, time.perf_counter(), op.thread)
            self.spans.append(span)
            _spans.append((self.what, span))

    def stages(self) -> list[tuple[int, str, float]]:
        """Each thread's current operation as (step, stage, since ``time.monotonic``); ``done`` for a
        thread between operations. Safe from any thread."""
        out = []
        for op in self._current:
            if op is None:
                out.append((-1, DONE, 0.0))
            else:
                stage, since, _ = op.state
                out.append((op.step, stage, since))
        return out

    # -- errors ------------------------------------------------------------------------------------
    def _main(self, index: int) -> None:
        try:
            self.run(index)
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread, which raises it
            self.fail(exc)
        finally:
            op = self._current[index]
            if op is not None and op.stage != DONE:  # an operation left open by a failure
                self.end_operation(op)
            with self.cond:
                self._ended += 1
                self.cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        """Keep ``exc`` (the first failure stands) and wake every waiter."""
        with self.cond:
            if self.error is None:
                self.error = exc
            self.cond.notify_all()

    def raise_if_failed(self) -> None:
        """Raise the threads' failure, if any, on the calling thread: one of the project's errors as it is
        (a :class:`~prague.errors.ConfigError` from a service, a :class:`CommError`), any other exception
        wrapped in a :class:`CommError` that names the work."""
        exc = self.error
        if exc is None:
            return
        if isinstance(exc, PragueError):
            raise exc
        raise CommError(f"the {self.what} failed: {exc!r}") from exc

    def wait_until(self, ready: Callable[[], bool], timeout_s: float | None = None) -> bool:
        """Block until ``ready()`` (evaluated holding :attr:`cond`; notify it when it may have changed) or
        ``timeout_s`` passes; returns whether it became true. Raises the threads' failure first."""
        with self.cond:
            ok = self.cond.wait_for(lambda: self.error is not None or ready(), timeout_s)
            self.raise_if_failed()
            return ok

    def wait_ended(self, timeout_s: float | None = None) -> bool:
        """Block until every thread's body has returned (or ``timeout_s`` passes); whether they all did.
        Raises the first thread's failure as soon as it happens, without waiting for the others."""
        return self.wait_until(lambda: self._ended == len(self._threads), timeout_s)

    # -- stop and join -----------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask every thread to end once it has finished what it was given."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.wake()

    def join(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every thread to end; whether they all did."""
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def shutdown(self, failed: bool, timeout_s: float) -> bool:
        """:meth:`stop`, then :meth:`join` for ``timeout_s`` (after a failure at most :data:`FAILED_JOIN_S`);
        whether every thread ended."""
        self.stop()
        return self.join(min(timeout_s, FAILED_JOIN_S) if failed else timeout_s)

    @property
    def alive(self) -> bool:
        return any(t.is_alive() for t in self._threads)


class QueuedWork(BackgroundWork, Generic[J]):
    """A work with one thread that handles the jobs :meth:`put` to it, one at a time, in order
    (:meth:`handle`); :meth:`stop` ends it after every job put before."""

    def __init__(self, what: str, name: str) -> None:
        super().__init__(what, name)
        self._jobs: queue.SimpleQueue[J | None] = queue.SimpleQueue()
        self._closed = False

    def put(self, job: J) -> None:
        self._jobs.put(job)

    def handle(self, job: J) -> None:
        """The thread's work for one job; raise to fail."""
        raise NotImplementedError

    def wake(self) -> None:
        if not self._closed:  # the thread ends at this mark, after every job before it
            self._closed = True
            self._jobs.put(None)

    def run(self, index: int) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self.handle(job)
            del job  # dropped now (a round's gloo works, a snapshot), not when the next job arrives


class PeriodicWork(BackgroundWork):
    """A work with one thread that calls :meth:`tick` every ``period_s`` seconds until :meth:`stop`
    (the first call at once); :meth:`tick` returns False to end the work quietly (its store is gone: the
    job is ending), or raises to fail it."""

    def __init__(self, what: str, name: str, period_s: float) -> None:
        if not period_s > 0:
            raise ValueError(f"period_s must be > 0, got {period_s!r}")
        super().__init__(what, name)
        self.period_s = period_s

    def tick(self) -> bool:
        """One period's work; False ends the work."""
        raise NotImplementedError

    def run(self, index: int) -> None:
        while not self.stopping:
            if self.tick() is False:
                return
            with self.cond:
                self.cond.wait_for(lambda: self.stopping, self.period_s)


class FunctionWork(BackgroundWork):
    """A work whose ``threads`` threads each run ``body(index)`` once: a service's serving loop, an event
    loop, the reader of a pipe. ``wake`` (if given) makes a body blocked outside :attr:`cond` notice
    :meth:`stop` (a body that runs until its input ends needs none). Started at once unless ``start`` is
    False."""

    def __init__(self, what: str, name: str, body: Callable[[int], None], threads: int = 1,
                 wake: Callable[[], None] | None = None, start: bool = True) -> None:
        super().__init__(what, name, threads)
        self._body, self._wake = body, wake
        if start:
            self.start()

    def run(self, index: int) -> None:
        self._body(index)

    def wake(self) -> None:
        if self._wake is not None:
            self._wake()
