"""Delayed averaging: P-Reduce of a parameter snapshot on a background thread while the worker computes.

After its local step a worker hands a snapshot s of its flat parameters to :class:`BackgroundAverager`.
The averager's thread asks the group source for the next group and averages the snapshot with that
group's members (:func:`prague.comm.preduce.preduce`), while the worker goes on with the next
iteration. When the average a arrives, the worker applies the correction ``x += a - s``: the change
the group's average made to the values it was computed on. Over one group the corrections sum to zero
(``sum_i (a - s_i) = |G| a - sum_i s_i = 0``), so the mean over all workers moves only by their local
updates, as with a blocking P-Reduce; what differs is that each worker's local steps since the snapshot
are kept on top of the average. This is the delayed averaging of CoCoD-SGD (Shen, Xu, Liu, Wang,
"Faster Distributed Deep Net Training: Computation and Communication Decoupled Stochastic Gradient
Descent", IJCAI 2019) and Overlap-SGP (Assran, Loizou, Ballas, Rabbat, "Stochastic Gradient Push for
Distributed Deep Learning", ICML 2019), applied to Prague's partial groups.

Buffers are reused: a fresh 45 MB tensor (ResNet-18) costs 20-35 ms of page faults on this project's
machines, a copy into an existing one 4-5 ms. The averager keeps a pool of (snapshot, work) pairs;
:meth:`BackgroundAverager.submit` copies the values into a free pair, the thread copies the snapshot into
the work buffer and averages that, and the correction is the work buffer; the worker returns the pair
with :meth:`BackgroundAverager.recycle` once it has added the correction.

The thread runs the requests in the order they were submitted, one at a time, so every member still
meets its groups in the Group Generator's global order (what rules out deadlock). A failure on the
thread (a dead peer, a timeout) is raised on the worker's thread at its next call.

Several in flight (``--max-in-flight`` >= 2): a snapshot taken while earlier averages were out lacks
their corrections. Averaged as it is, it would pull the worker back to where it stood before them and
the corrections would pile up: two workers at 0 and 4, grouped together with two averages out, would
end at 4 and 0 (three out: 6 and -2) instead of 2 and 2. Since requests run in order, every earlier
correction is known when request k starts, so the thread first adds to its snapshot those the worker
had not yet added when it took it (:class:`Backlog`): ``s' = s + sum of the lacked corrections``, and
the correction is ``avg(s') - s'``. The worker's values are then, request by request, what blocking
P-Reduce in the same order would give plus the local updates since; the corrections of a group still
sum to zero.

On a GPU the thread's copies and collectives run on a stream of their own, ordered against the worker's
compute stream by events (:mod:`prague.comm.streams`): the side stream starts on a snapshot only after
the compute stream has copied it, and a correction is handed over only once the side stream is done
with it. On the CPU those orderings hold by themselves.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from prague.algorithms.prague.flow import ASK, CATCH_UP, DONE, REDUCE, averaging
from prague.comm.streams import HOST, Streams
from prague.runtime.background import COMMUNICATING, QueuedWork
from prague.groups import Group

#: Runs one group on a buffer: averages ``buffer`` in place over ``group`` (nothing for a group of one);
#: returns False when the group could not average (a member failed), which makes the correction zero.
RunGroup = Callable[[Group, torch.Tensor], "bool | None"]
#: Asks for the next group of this worker: ``(the step it comes after) -> Group``.
NextGroup = Callable[[int], Group]


@dataclass
class Averaged:
    """One finished request: the correction to add, and what the thread spent on it. ``correction`` is
    the averager's buffer: valid until the request is handed back with :meth:`BackgroundAverager.recycle`."""

    index: int
    group: Group
    correction: torch.Tensor
    ask_s: float  # waiting for the group generator's answer
    reduce_s: float  # P-Reduce, waiting for the members included
    snapshot: torch.Tensor  # the pair's other buffer, reused with it


class Backlog:
    """The corrections of a worker's earlier requests that a snapshot lacks (see the module docstring):
    the rule both :class:`BackgroundAverager`'s thread and the simulator's averaging chain
    (:mod:`.sim`) follow, for one worker.

    Whoever runs the worker's requests, one at a time in submission order, calls :meth:`catch_up` when
    request k starts (every earlier request has finished) and :meth:`finished` when k's correction is
    known. ``taken``, recorded when the snapshot was taken, is how many corrections the worker had
    added to its values by then: corrections are added oldest first, so the snapshot holds those of
    requests ``0 .. taken - 1`` and lacks those of ``taken .. k - 1``."""

    def __init__(self) -> None:
        # (request index, correction) of finished requests that a later snapshot may still lack.
        self._kept: deque[tuple[int, torch.Tensor]] = deque()

    def catch_up(self, snapshot: torch.Tensor, taken: int) -> torch.Tensor:
        """Add to ``snapshot`` (in place; returned) the corrections of the requests finished since the
        first ``taken``; forget the older ones (no later snapshot lacks them: ``taken`` never decreases)."""
        kept = self._kept
        while kept and kept[0][0] < taken:
            kept.popleft()
        for _, correction in kept:
            snapshot.add_(correction)
        return snapshot

    def finished(self, index: int, correction: torch.Tensor | None) -> None:
        """Request ``index`` (the next in order) is done; ``correction`` None stands for zero (a group of
        one, a failed group). The tensor is read by later :meth:`catch_up` calls until the worker has
        added it and submitted again, so it must not change until then."""
        if correction is not None:
            self._kept.append((index, correction))


_Request = tuple[int, int, torch.Tensor, torch.Tensor, int, Any]  # index, corrections taken, snapshot, work, step, copy event


class BackgroundAverager(QueuedWork[_Request]):
    """One background thread that averages snapshots in submission order; see the module docstring.
    Each request is one operation of the thread (:class:`~prague.runtime.background.BackgroundWork`):
    ``waiting`` while it asks for its group, ``communicating`` while the group averages."""

    def __init__(self, next_group: NextGroup, run_group: RunGroup, *, name: str = "prague-averager",
                 streams: Streams = HOST) -> None:
        super().__init__("background average", name)
        self._next_group = next_group
        self._run_group = run_group
        self._streams = streams  # the values' device: a side stream and events on CUDA, nothing on the CPU
        self._pool: list[tuple[torch.Tensor, torch.Tensor]] = []  # free (snapshot, work) pairs
        self._done: deque[Averaged] = deque()
        self._submitted = 0
        self._finished = 0
        self._taken = 0  # corrections handed to the worker (which adds each before its next submit)
        self._backlog = Backlog()  # the thread's
        self.busy_s = 0.0  # seconds the thread spent on requests (asking plus reducing)
        self.start()

    # -- the worker's side -------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        """Requests submitted whose correction has not been taken yet."""
        with self.cond:
            return self._submitted - self._finished + len(self._done)

    def submit(self, values: torch.Tensor, step: int | None = None) -> int:
        """Average a snapshot of ``values`` (copied now; ``values`` stays the caller's) with the next
        group, asked for after the worker's step ``step`` (default: the request's index); returns the
        request's index. ``values`` must hold every correction taken so far (from
        :meth:`take_ready`, :meth:`take_oldest`, :meth:`drain`): the thread adds the later ones itself."""
        self.raise_if_failed()
        with self.cond:
            index = self._submitted
            self._submitted += 1
            taken = self._taken
            pair = self._pool.pop() if self._pool else None
        if pair is None or pair[0].shape != values.shape or pair[0].dtype != values.dtype \
                or pair[0].device != values.device:
            pair = (torch.empty_like(values), torch.empty_like(values))
        snapshot, work = pair
        snapshot.copy_(values)  # on the caller's (compute) stream, after the step that made the values
        copied = self._streams.mark()
        self.put((index, taken, snapshot, work, index if step is None else step, copied))
        return index

    def recycle(self, done: Averaged) -> None:
        """Hand back a finished request's buffers (after adding its correction) for later snapshots."""
        with self.cond:
            self._pool.append((done.snapshot, done.correction))

    def take_ready(self) -> list[Averaged]:
        """The requests finished so far, oldest first, without waiting."""
        with self.cond:
            self.raise_if_failed()
            out = list(self._done)
            self._done.clear()
            self._taken += len(out)
            return out

    def take_oldest(self, timeout_s: float | None = None) -> Averaged:
        """Wait for the oldest request still pending and return it (raise if the thread failed)."""
        if not self.wait_until(lambda: bool(self._done), timeout_s):
            raise TimeoutError(f"no average came back within {timeout_s} s")
        with self.cond:
            self._taken += 1
            return self._done.popleft()

    def drain(self) -> list[Averaged]:
        """Wait for every submitted request; return them oldest first."""
        out: list[Averaged] = []
        while self.in_flight:
            out.append(self.take_oldest())
        return out

    def close(self) -> None:
        """Stop the thread after the requests already submitted (:meth:`stop`)."""
        self.stop()

    # -- the thread --------------------------------------------------------------------------------
    def handle(self, job: _Request) -> None:
        """One request, as :func:`.flow.averaging` orders it."""
        index, taken, snapshot, work, step, copied = job
        with self.operation(step) as op:
            t0 = time.perf_counter()
            t1 = t0
            group: Group | None = None
            correction = work
            flow = averaging()
            effect, argument = next(flow)
            with self._streams.side():
                while effect != DONE:
                    reply: Any = None
                    if effect == ASK:
                        group = reply = self._next_group(step)
                        t1 = time.perf_counter()
                        self._streams.wait(copied)  # the snapshot's copy on the compute stream is done
                    elif effect == CATCH_UP:
                        # The earlier corrections read here may sit in pairs the worker has recycled: a
                        # pair is reused only by a request submitted after its correction was taken,
                        # which this thread runs later and which forgets that correction before writing
                        # the pair.
                        work.copy_(self._backlog.catch_up(snapshot, taken))
                        op.to(COMMUNICATING)
                    elif effect == REDUCE:
                        reply = self._run_group(argument, work)
                    else:  # SETTLE: the correction, zero where nothing was averaged
                        correction = work.sub_(snapshot) if argument else work.zero_()
                        self._streams.finish(self._streams.mark())  # the correction is complete on the device
                        self._backlog.finished(index, correction if argument else None)
                    effect, argument = flow.send(reply)
            t2 = time.perf_counter()
        assert group is not None
        with self.cond:
            self.busy_s += t2 - t0
            self._finished += 1
            self._done.append(Averaged(index, group, correction, t1 - t0, t2 - t1, snapshot))
            self.cond.notify_all()
