"""State every policy shares: request counts, finished workers, the global sequence, stats, observer.

Also the group buffer (per-worker FIFOs of committed groups) that the smart and random policies share:
a policy that fixes groups ahead of time appends each new group to the FIFO of every member, and each
request pops the head of the requester's FIFO. Appending whole groups in one global ``seq`` order to
every member's FIFO is what makes any schedule built this way deadlock-free.
"""

from __future__ import annotations

import random
from array import array
from collections import deque

from prague.errors import ConfigError
from prague.groups.api import (
    Answer,
    Formation,
    GeneratorConfig,
    Group,
    Observer,
    PolicyCounters,
    check_worker_id,
)


def _tallies(counts: list[int], progress: list[int]) -> tuple[memoryview, memoryview]:
    """Each worker's requests and steps (``counts``, ``progress``) as two views of one array of raw integers where
    a worker's two sit side by side: a request reads and writes both, one cache line, and makes no int object. A
    shard holds them for every worker of the job, which at 16,384 workers in 64 shards no cache holds."""
    view = memoryview(array("q", bytes(16 * len(counts))))
    counts_view, progress_view = view[0::2], view[1::2]
    counts_view[:] = array("q", counts)  # copied in C: a shard of a 65,536-worker job makes these for every worker
    progress_view[:] = array("q", progress)
    return counts_view, progress_view


class PolicyBase:
    """Bookkeeping common to all policies; subclasses implement ``request`` (and maybe ``poll``)."""

    def __init__(self, config: GeneratorConfig, *, observer: Observer | None = None) -> None:
        if not isinstance(config, GeneratorConfig):
            raise ConfigError(f"config must be a GeneratorConfig, got {config!r}")
        self.config = config
        self.nproc = config.nproc  # checked at every call
        self.rng = random.Random(config.seed)
        self.counts, self.progress = _tallies([0] * config.nproc, [0] * config.nproc)
        self.finished = [False] * config.nproc
        self._active: tuple[int, ...] | None = None  # built when asked for, after a change
        self.active_count = config.nproc  # workers that have not finished
        self.counters = PolicyCounters()
        self._observer = observer
        self._next_seq = 0
        self._batch = 0

    # -- checks -------------------------------------------------------------------------------------
    def _check_worker(self, worker: int) -> None:
        check_worker_id(worker, self.nproc)
        if self.finished[worker]:
            raise ConfigError(f"worker {worker} already called finish; it cannot request groups any more")

    def active(self) -> tuple[int, ...]:
        """Workers that have not finished, in rank order (built once per change: a finish costs O(1), so
        that the workers of a large job finishing one by one cost O(n), not O(n^2))."""
        if self._active is None:
            self._active = tuple(w for w, done in enumerate(self.finished) if not done)
        return self._active

    def _mark_finished(self, worker: int) -> None:
        self.finished[worker] = True
        self.active_count -= 1
        self._active = None

    def _note_request(self, worker: int, iteration: int | None) -> None:
        """Count ``worker``'s request, and its progress: ``iteration + 1`` steps when it says after which
        step it asks (a worker that averages in the background asks only when it submits an average, so
        its requests lag its steps), else one step more than before."""
        self.counts[worker] += 1
        self.counters.requests += 1
        self.progress[worker] = self._progress_after(worker, iteration)

    def _progress_after(self, worker: int, iteration: int | None) -> int:
        """The steps ``worker`` has done once its request after step ``iteration`` is counted (see
        :meth:`_note_request`)."""
        before = self.progress[worker]
        return before + 1 if iteration is None else max(before, iteration + 1)

    # -- forming groups -----------------------------------------------------------------------------
    def _new_batch(self) -> int:
        self._batch += 1
        return self._batch

    def _record(self, group: Group, requester: int | None, kind: str, conflict: bool = False) -> None:
        self.counters.formed(group)
        if self._observer is not None:
            self._observer(Formation(group, requester, tuple(self.progress), self._batch, kind, conflict))

    def _form(self, members: list[int] | tuple[int, ...], requester: int | None, kind: str,
              conflict: bool = False) -> Group:
        """Give ``members`` the next global sequence number and report the new group."""
        group = Group.formed(self._next_seq, tuple(sorted(members)))
        self._next_seq += 1
        self._record(group, requester, kind, conflict)
        return group

    # -- the protocol (see prague.groups.api) ------------------------------------------------------
    def request(self, worker: int, now_s: float, iteration: int | None = None) -> list[Answer]:
        raise NotImplementedError

    def finish(self, worker: int, now_s: float) -> list[Answer]:
        raise NotImplementedError

    def exclude(self, worker: int, now_s: float) -> list[Answer]:
        """``worker`` failed (see :class:`~prague.groups.api.GroupPolicy`); idempotent."""
        check_worker_id(worker, self.nproc)
        if self.finished[worker]:
            return []
        self._withdraw(worker)
        return [(w, g) for w, g in self.finish(worker, now_s) if w != worker]

    def _withdraw(self, worker: int) -> None:
        """Forget a request of ``worker``'s that still waits for its answer (none by default: answers are
        immediate)."""

    def continue_after(self, seq: int, counts: list[int]) -> None:
        """A restarted generator (:meth:`prague.groups.service.GroupGeneratorCore.restore`): number new
        groups after ``seq``, the last one an earlier instance handed out, and take the workers' request
        counts (and progress) from where they were."""
        self._next_seq = max(self._next_seq, seq + 1)
        self.counts, self.progress = _tallies([max(a, b) for a, b in zip(self.counts, counts)],
                                              [max(a, b) for a, b in zip(self.progress, counts)])

    # -- defaults for policies without timers ------------------------------------------------------
    def poll(self, now_s: float) -> list[Answer]:
        return []

    def next_deadline(self) -> float | None:
        return None

    def stats(self) -> dict[str, float | int]:
        return self.counters.as_dict()


class BufferedPolicy(PolicyBase):
    """A policy that fixes groups ahead of time in per-worker FIFOs (the paper's group buffer).

    On a request from a worker whose FIFO is empty, :meth:`_fill` commits one or more new groups (at
    least one containing the requester); the answer is always the head of the requester's FIFO, so
    answers are immediate and ``poll`` never has anything to do.
    """

    def __init__(self, config: GeneratorConfig, *, observer: Observer | None = None) -> None:
        super().__init__(config, observer=observer)
        self._fifos: list[deque[Group]] = [deque() for _ in range(config.nproc)]
        self.counters.extra.update(conflicts=0, max_fifo=0)

    def _fill(self, requester: int) -> None:
        """Commit new groups with :meth:`_commit`; at least one must contain ``requester``."""
        raise NotImplementedError

    def _commit(self, members: list[int] | tuple[int, ...], requester: int, kind: str) -> Group:
        """Append a new group to every member's FIFO.

        A conflict is a group some member of which is still committed to an earlier group it has not
        been handed yet: that member's FIFO is non-empty, so the group waits for it.
        """
        conflict = any(self._fifos[m] for m in members)
        group = self._form(members, requester, kind, conflict)
        extra = self.counters.extra
        extra["conflicts"] += conflict
        for m in group.members:
            self._fifos[m].append(group)
            extra["max_fifo"] = max(extra["max_fifo"], len(self._fifos[m]))
        return group

    def pending(self, worker: int) -> int:
        """How many committed groups ``worker`` has not been handed yet."""
        return len(self._fifos[worker])

    def request(self, worker: int, now_s: float, iteration: int | None = None) -> list[Answer]:
        self._check_worker(worker)
        self._note_request(worker, iteration)
        fifo = self._fifos[worker]
        if not fifo:
            self._new_batch()
            self._fill(worker)
            if not fifo:
                raise RuntimeError(f"{type(self).__name__}._fill left worker {worker} without a group")
        return [(worker, fifo.popleft())]

    def finish(self, worker: int, now_s: float) -> list[Answer]:
        self._check_worker(worker)
        self._mark_finished(worker)
        fifo = self._fifos[worker]
        answers = [(worker, group) for group in fifo]
        fifo.clear()
        return answers

    def stats(self) -> dict[str, float | int]:
        out = super().stats()
        out["pending_groups"] = sum(len(f) for f in self._fifos)
        return out
