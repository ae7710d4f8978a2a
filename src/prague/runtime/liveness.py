"""Who is still alive: heartbeats, leases, and the job's list of failed workers, all in the job's store.

* Every worker's :class:`Heartbeat` thread adds 1 to its counter (``prague/live/hb/RANK``) every
  :data:`HEARTBEAT_S` seconds from :func:`prague.runtime.context.init` on, on a store connection of its
  own. A process that is frozen (stopped, swapped out, wedged in the kernel) or gone stops beating.
* The launcher holds the leases (:class:`LeaseWatch`): a worker whose counter has not moved for
  ``lease_s`` seconds while its process still runs has hung; one whose process exited non-zero has
  crashed. Either way the launcher records a :class:`Failure` with :func:`declare_failure` (the first
  declaration of a rank wins) and bumps the **epoch**, a counter that says the failed set changed.
* Workers read the failed set through :class:`Membership`, which costs one store request per look
  (the epoch) and reads the records only when the epoch moved. Everyone who reads the same epoch sees
  the same set, which is how methods without a service agree on who is left; the group generator
  learns it from the workers (:meth:`prague.groups.client.GroupGeneratorClient.exclude`).

A worker that has finished its steps publishes ``prague/live/done/RANK`` (:func:`mark_done`); the
survivors' closing collectives are over the ranks that are done once every rank is either done or
failed (:func:`wait_settled`).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import asdict, dataclass

import torch.distributed as dist

from prague.errors import CommError
from prague.runtime.background import PeriodicWork

HEARTBEAT_S = 0.5
#: How often the launcher looks at its workers (exits, leases, stalls), seconds.
LAUNCHER_TICK_S = 0.2
#: How much longer than its lease a worker that reported an error has to exit (:class:`LeaseWatch`).
EXIT_GRACE_S = 10.0
HB_KEY = "prague/live/hb/"
#: A heartbeat counter's value once its worker has left the job (:meth:`Heartbeat.leave`); a number, so a
#: worker that joins again counts on from it.
LEFT = "-1"
FAILED_KEY = "prague/live/failed/"
DONE_KEY = "prague/live/done/"
EPOCH_KEY = "prague/live/epoch"
#: ``ORDER_KEY + N``: the rank of the N-th failure declared (N from 1), for who led the job in turn.
ORDER_KEY = "prague/live/order/"
#: After an exchange breaks with no peer declared failed, how long to wait for the launcher to declare
#: one (:meth:`Membership.wait_declared`) before the break is fatal.
DECLARE_WAIT_S = 15.0


@dataclass(frozen=True)
class Failure:
    """One worker the job lost: its rank, the steps it had completed, and how it failed."""

    rank: int
    step: int
    kind: str
    detail: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Failure:
        data = json.loads(text)
        return cls(int(data["rank"]), int(data["step"]), str(data["kind"]), str(data.get("detail", "")))

    def summary(self) -> dict[str, int | str]:
        """The record ``summary.json`` lists under ``failures``."""
        return {"rank": self.rank, "step": self.step, "kind": self.kind}


def declare_failure(store: dist.Store, failure: Failure) -> bool:
    """Record ``failure`` unless its rank was already declared; returns whether this call recorded it."""
    key = f"{FAILED_KEY}{failure.rank}"
    text = failure.to_json()
    if store.compare_set(key, "", text).decode() != text:
        return False  # someone declared this rank first
    store.set(f"{ORDER_KEY}{store.add(EPOCH_KEY, 1)}", str(failure.rank))
    return True


def leaders_in_turn(store: dist.Store, world_size: int) -> list[int]:
    """The ranks that led the job in turn (the lowest living rank, as :func:`prague.leader` says): rank 0,
    then after each failure of the leader, in the order the failures were declared, the lowest rank not
    declared failed by then."""
    declared = int(store.add(EPOCH_KEY, 0))
    order = [int(v) for _, v in sorted(read_keys(store, ORDER_KEY, range(1, declared + 1)).items())]
    leaders, failed = [0], set()
    for rank in order:
        failed.add(rank)
        if rank == leaders[-1]:
            following = next((r for r in range(world_size) if r not in failed), None)
            if following is None:
                break
            leaders.append(following)
    return leaders


def job_summary(nproc: int, error: str | None, exit_codes: list[int | None], steps: list[int],
                failures: Mapping[int, Failure], leaders: list[int]) -> dict[str, object]:
    """What ``summary.json`` says of how a script's job ended, under ``prague launch --log-dir`` and
    ``prague guard --out`` alike: whether it ended well (and the first line of the error if not), each
    rank's exit code (None: not known) and completed steps, the failures survived, the ranks that
    finished, and the ranks that led in turn."""
    return {"nproc": nproc, "ok": error is None, "error": error, "exit_codes": exit_codes, "steps": steps,
            "failures": [f.summary() for _, f in sorted(failures.items())],
            "ranks": [r for r in range(nproc) if r not in failures], "leaders": leaders}


#: What a declared failure means for the job, when the others go on without the failed worker.
GO_ON = "the other workers go on without it"


def announce_failure(store: dist.Store, failure: Failure, consequence: str = GO_ON, level: str = "warning") -> bool:
    """Declare ``failure`` (:func:`declare_failure`) and, if this call recorded it, say on stderr which rank
    failed, how, after how many steps, and ``consequence``; returns whether it was recorded."""
    if not declare_failure(store, failure):
        return False
    sys.stderr.write(f"prague: {level}: rank {failure.rank} {failure.detail} after {failure.step} steps; "
                     f"{consequence}\n")
    sys.stderr.flush()
    return True


#: A rank that left the job before its end (``allreduce:drop``): the steps it had completed.
LEFT_KEY = "prague/live/left/"


def mark_left(store: dist.Store, rank: int, steps: int) -> None:
    """This worker left the job after ``steps`` steps: it is done and does not close the run with the
    others (said before it is marked done, so whoever sees it done sees it left)."""
    store.set(f"{LEFT_KEY}{rank}", str(steps))
    mark_done(store, rank)


def mark_done(store: dist.Store, rank: int, done_key: str = DONE_KEY) -> None:
    """This worker has run all its steps (and is about to join the closing collectives); ``done_key``:
    see :func:`wait_settled`."""
    store.set(f"{done_key}{rank}", "1")


class Membership:
    """One worker's view of the failed set; thread-safe (one lock, one store connection of its own)."""

    def __init__(self, store: dist.Store, world_size: int) -> None:
        self.store = store
        self.world_size = world_size
        self._lock = threading.Lock()
        self._epoch = 0
        self._failed: dict[int, Failure] = {}

    def failed(self) -> dict[int, Failure]:
        """The workers declared failed so far (rank -> failure); one store request when nothing changed."""
        with self._lock:
            epoch = self.store.add(EPOCH_KEY, 0)
            if epoch != self._epoch:
                unknown = [r for r in range(self.world_size) if r not in self._failed]
                for rank, text in read_keys(self.store, FAILED_KEY, unknown).items():
                    self._failed[rank] = Failure.from_json(text)
                self._epoch = epoch
            return dict(self._failed)

    @property
    def epoch(self) -> int:
        """The epoch of the last :meth:`failed` (0: no failure seen)."""
        return self._epoch

    def failed_among(self, ranks: Iterable[int]) -> list[int]:
        """The ranks of ``ranks`` declared failed, sorted."""
        failed = self.failed()
        return sorted(r for r in ranks if r in failed)

    def wait_declared(self, ranks: Iterable[int], timeout_s: float) -> list[int]:
        """After an exchange with ``ranks`` broke: wait up to ``timeout_s`` for the launcher to declare one
        of them failed (it sees a crashed process within a fraction of a second; a hung one only after its
        lease, but it declares it before it kills it). Returns those declared, sorted; empty: none was, so
        the break had another cause."""
        ranks = tuple(ranks)
        deadline = time.monotonic() + timeout_s
        while True:
            lost = self.failed_among(ranks)
            if lost or time.monotonic() >= deadline:
                return lost
            time.sleep(0.1)

    def wait_keys(self, store: dist.Store, keys: list[str], members: Iterable[int], timeout_s: float, what: str,
                  slice_s: float = 1.0) -> None:
        """Wait on ``store`` (the caller's connection) up to ``timeout_s`` for ``keys``, which ``members``
        set, looking at the failed set between slices: raise :class:`PeerFailed` as soon as a member is
        declared failed, :class:`CommError` on timeout. (A slice that runs out costs the store client a
        reconnection, so slices are long.) The timeout counts inactivity: it starts again whenever a
        member reports another training step. A member declared failed after it wrote its key does not
        fail the wait: every waiter then sees the same keys, so all of them pass or none does."""
        members = tuple(members)
        idle = Inactivity(store, timeout_s, slice_s)
        while True:
            if await_keys(store, keys, idle.next_slice()):
                return
            lost = self.failed_among(members)  # a slice ran out
            if lost:
                if store.check(keys):  # written before the declaration: every waiter sees them all
                    return
                raise PeerFailed(lost, f"{what}: rank(s) {lost} failed") from None
            if idle.expired(members):
                raise CommError(f"{what}: not every member arrived within {timeout_s:g} s")

    def wait_reports(self, store: dist.Store, keys: Mapping[int, str], timeout_s: float, what: str,
                     slice_s: float = 1.0) -> dict[int, bytes]:
        """Wait on ``store`` (the caller's connection) until each member of ``keys`` (rank -> the key it
        writes once) has written its key or has been declared failed; returns the values written, by
        rank. A member's write happens before its declaration or not at all (a declared worker is dead
        or fenced), and the keys are read after the declaration is seen, so every caller gets the same
        values. :class:`CommError` after ``timeout_s`` of inactivity (as :meth:`wait_keys`)."""
        waiting = dict(keys)
        idle = Inactivity(store, timeout_s, slice_s)
        while waiting:
            if await_keys(store, list(waiting.values()), idle.next_slice()):
                break
            failed = self.failed_among(waiting)  # a slice ran out
            waiting = {r: k for r, k in waiting.items() if r not in failed}
            if waiting and idle.expired(waiting):
                silent = sorted(r for r, k in waiting.items() if not store.check([k]))
                raise CommError(f"{what}: ranks {silent} did not report within {timeout_s:g} s")
        present = {r: k for r, k in keys.items() if r in waiting or store.check([k])}
        return dict(zip(present, store.multi_get(list(present.values()))))


class PeerFailed(CommError):
    """An operation could not finish because a worker it needed was declared failed."""

    def __init__(self, ranks: Iterable[int], message: str) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)


def wait_settled(store: dist.Store, membership: Membership, timeout_s: float,
                 done_key: str = DONE_KEY) -> tuple[int, ...]:
    """After this worker's :func:`mark_done`: wait until every rank is done or failed; returns the done
    ranks, sorted (the survivors that close the run together). The timeout counts inactivity: it
    starts again whenever a rank still running reports another step (:data:`PROGRESS_KEY`), so a fast
    worker waits for a slow one as long as the slow one makes progress. ``done_key``: the prefix of the
    keys that say a rank is done (a method's own closing phases use their own)."""
    idle = Inactivity(store, timeout_s, slice_s=0.05)
    keys = {r: f"{done_key}{r}" for r in range(membership.world_size)}
    while True:
        failed = membership.failed()
        done = [r for r, key in keys.items() if r not in failed and store.check([key])]
        if len(done) + len(failed) >= membership.world_size:
            return tuple(done)
        missing = sorted(set(keys) - set(done) - set(failed))
        if idle.expired(missing):
            raise CommError(f"ranks {missing} neither finished nor failed, nor made progress, for {timeout_s:g} s")
        time.sleep(0.05)


#: Each worker's ``step,steps,loss`` after every step (written by the training loop, read by the launcher).
PROGRESS_KEY = "prague/progress/"


class Progress:
    """Whether some ranks reported a step since the last look (their :data:`PROGRESS_KEY`)."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store
        self._last: dict[int, bytes] = {}

    def moved(self, ranks: Iterable[int]) -> bool:
        moved = False
        for rank, value in read_keys(self.store, PROGRESS_KEY, ranks).items():
            if self._last.get(rank) != value:
                moved = rank in self._last or moved
                self._last[rank] = value
        return moved


#: How often :func:`await_keys` looks, at most (it starts at :data:`FIRST_LOOK_S` and doubles).
LOOK_EVERY_S = 0.005
FIRST_LOOK_S = 0.0005


def await_keys(store: dist.Store, keys: list[str], timeout_s: float) -> bool:
    """Whether every one of ``keys`` is set in ``store`` within ``timeout_s``. Looks with ``check`` at
    intervals growing from :data:`FIRST_LOOK_S` to :data:`LOOK_EVERY_S`, never with a timed ``wait``:
    each ``wait`` that runs out prints two c10d warnings ("waitForInput ... timed out") and costs the
    client a reconnection, and a healthy job waits past a slice often (a peer that evaluates)."""
    deadline = time.monotonic() + timeout_s
    pause = FIRST_LOOK_S
    while not store.check(keys):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(2 * pause, LOOK_EVERY_S)
    return True


class Inactivity:
    """The deadline of a store wait that counts inactivity: ``timeout_s`` after the last step some awaited
    member reported (:class:`Progress`), looked at between slices of at most ``slice_s``. Without a store
    (nothing to read progress from) it is ``timeout_s`` from the start."""

    def __init__(self, store: dist.Store | None, timeout_s: float, slice_s: float = 1.0) -> None:
        self.timeout_s, self.slice_s = timeout_s, slice_s
        self.deadline = time.monotonic() + timeout_s
        self._progress = Progress(store) if store is not None else None

    def next_slice(self) -> float:
        """How long the next wait may take, s: a slice, or what is left before the deadline."""
        return max(0.001, min(self.slice_s, self.deadline - time.monotonic()))

    def expired(self, members: Iterable[int]) -> bool:
        """After a slice ran out: whether the deadline passed; it moves on when ``members`` stepped."""
        if self._progress is not None and self._progress.moved(members):
            self.deadline = time.monotonic() + self.timeout_s
        return time.monotonic() >= self.deadline


class Heartbeat(PeriodicWork):
    """The work (a :class:`~prague.runtime.background.PeriodicWork`) that adds 1 to this worker's counter
    every :data:`HEARTBEAT_S` seconds and, for a loop that reports its steps through it (:attr:`steps`: a
    script's prepared optimizer), publishes them as the worker's progress when they changed, so that a
    guard names the step a worker failed at and the waits on peers see it move. The built-in loop
    publishes its own progress."""

    def __init__(self, store: dist.Store, rank: int, interval_s: float = HEARTBEAT_S) -> None:
        super().__init__("heartbeat", "prague-heartbeat", interval_s)
        self.store, self.key, self.interval_s = store, f"{HB_KEY}{rank}", interval_s
        self.progress_key = f"{PROGRESS_KEY}{rank}"
        self.steps: int | None = None  # set by the training thread; None: not reported this way
        self._published: int | None = None
        self.start()

    def tick(self) -> bool:
        try:
            self.store.add(self.key, 1)
            self._publish()
        except Exception:  # noqa: BLE001 - the store is gone: the job is ending
            return False
        return True

    def _publish(self) -> None:
        steps = self.steps
        if steps is not None and steps != self._published:
            self.store.set(self.progress_key, progress_text(steps))
            self._published = steps

    def leave(self) -> None:
        """Stop beating and say this worker left (``prague.shutdown``): its lease ends, so the seconds its
        interpreter takes to exit (gloo's and gRPC's teardown) are never taken for a hang. The steps done
        since the last beat are published first, so the job's summary has every step of a worker that
        finished (one that is killed is known as of its last beat, at most :data:`HEARTBEAT_S` earlier)."""
        self.shutdown(failed=False, timeout_s=2 * self.interval_s + 1.0)
        try:
            self._publish()
            self.store.set(self.key, LEFT)
        except Exception:  # noqa: BLE001 - the store is gone: the job is ending
            pass


class LeaseWatch:
    """The launcher's side: which workers' leases ran out. Pure bookkeeping over counter readings, so it
    is tested without processes; a worker gets a lease with its first beat (a script that never calls
    :func:`prague.init` is never declared hung).

    A worker that has reported an error (:data:`~prague.runtime.context.ERROR_KEY`, written before its
    process exits) is on its way out, not hung: its beats stop while the interpreter unwinds, which on a
    loaded machine can outlast a short lease. It gets :data:`EXIT_GRACE_S` more, so that its exit code,
    not a lease, names its failure; one that still has not exited then is reported as any other."""

    def __init__(self, lease_s: float, exit_grace_s: float = EXIT_GRACE_S) -> None:
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s!r}")
        if not exit_grace_s >= 0:
            raise ValueError(f"exit_grace_s must be >= 0, got {exit_grace_s!r}")
        self.lease_s, self.exit_grace_s = lease_s, exit_grace_s
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (counter, when it last moved)

    def observe(self, counters: Mapping[int, int], now_s: float,
                exiting: Callable[[list[int]], Collection[int]] = lambda late: ()) -> list[int]:
        """Record the counters read at ``now_s``; returns the ranks whose counter has not moved for
        ``lease_s`` (each rank once per stall: it must beat again to be reported again). ``exiting`` is asked,
        only when some lease has run out and only about those ranks, which of them reported an error: their
        lease is ``exit_grace_s`` longer (so a holder reads the reports of stalled ranks alone)."""
        late = []
        for rank, value in counters.items():
            last = self._seen.get(rank)
            if last is None or value != last[0]:
                self._seen[rank] = (value, now_s)
            elif now_s - last[1] >= self.lease_s:
                late.append(rank)
        if not late:
            return []
        graced = set(exiting(late)) if self.exit_grace_s > 0 else set()
        expired = [rank for rank in late
                   if rank not in graced or now_s - self._seen[rank][1] >= self.lease_s + self.exit_grace_s]
        for rank in expired:
            self._seen[rank] = (counters[rank], float("inf"))  # reported; silent until it moves again
        return sorted(expired)


def read_keys(store: dist.Store, prefix: str, ranks: Iterable[int]) -> dict[int, bytes]:
    """``prefix + RANK``'s value for each of ``ranks`` that has set it (the per-worker keys: heartbeats,
    progress, error reports)."""
    out: dict[int, bytes] = {}
    for rank in ranks:
        key = f"{prefix}{rank}"
        if store.check([key]):
            out[rank] = store.get(key)
    return out


def progress_text(done: int, total: int = 0, loss: float | None = None) -> str:
    """A rank's :data:`PROGRESS_KEY` value: steps done, steps it will run (0: not known), last loss."""
    return f"{done},{total},{'' if loss is None else loss}"


def progress_steps(value: bytes | str | None) -> int:
    """The steps done in a rank's :data:`PROGRESS_KEY` value (``"DONE,TOTAL,LOSS"``), 0 for none or junk."""
    text = value.decode() if isinstance(value, bytes) else value
    try:
        return int(text.split(",")[0]) if text else 0
    except ValueError:
        return 0


def read_progress(store: dist.Store, ranks: Iterable[int]) -> dict[int, int]:
    """The steps each of ``ranks`` reported done, for those that reported."""
    return {rank: progress_steps(value) for rank, value in read_keys(store, PROGRESS_KEY, ranks).items()}


def read_counters(store: dist.Store, ranks: Iterable[int]) -> dict[int, int]:
    """The heartbeat counters of ``ranks`` that have beaten at least once and not left the job."""
    return {rank: int(value) for rank, value in read_keys(store, HB_KEY, ranks).items() if value != LEFT.encode()}
