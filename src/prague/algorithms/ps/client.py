"""Worker side of the parameter-server protocol: one link per shard, requests and pending replies.

See :mod:`prague.algorithms.ps.protocol` for the messages. Every operation that fails (the shard's process
died and closed the connection, or nothing came back within the job's timeout) raises
:class:`CommError` naming the shard, so a worker never hangs on a dead server.

A gloo receive is only marked complete by ``wait()``: ``is_completed()`` stays false however long ago
its data arrived. So a round whose replies must be noticed without blocking (``ps-eager``'s pull,
checked before the forward pass) is completed by a :class:`ReplyCompleter`, a background thread that
waits for it while the worker computes; :meth:`PendingReplies.done` then turns true as soon as the data
is in.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from prague.algorithms.ps.protocol import (
    HEADER_LEN, OP_BYE, OP_CLOSED, OP_INIT, OP_PULL, OP_PUSH, SHARD_SIDE, TAG_PAYLOAD, TAG_REPLY, TAG_REQUEST,
    TAG_STATE, WORKER_SIDE, Reply, pair_group, request_header, stats_key,
)
from prague.comm.owned import HoldsGroup
from prague.runtime.background import COMMUNICATING, QueuedWork
from prague.errors import CommError

T = TypeVar("T")


class ShardLink(HoldsGroup):
    """This worker's connection to one shard, owning the slice ``[lo, hi)`` of the flat state."""

    def __init__(self, store: dist.Store, shard: int, rank: int, lo: int, hi: int, timeout: timedelta) -> None:
        self.shard, self.rank, self.lo, self.hi = shard, rank, lo, hi
        self.timeout = timeout
        try:
            self._pg = pair_group(store, shard, rank, WORKER_SIDE, timeout)
        except RuntimeError as exc:
            raise CommError(f"worker rank {rank} could not connect to parameter-server shard {shard} within "
                            f"{timeout.total_seconds():g} s: {exc}") from exc
        self._reply_header = torch.zeros(HEADER_LEN, dtype=torch.int64)

    def request(self, op: int, base_version: int = 0, step: int = 0,
                payload: torch.Tensor | None = None) -> list[dist.Work]:
        def send() -> list[dist.Work]:
            works = [self.pg.send([request_header(op, base_version, step, self.rank)], SHARD_SIDE, TAG_REQUEST)]
            if payload is not None:
                works.append(self.pg.send([payload], SHARD_SIDE, TAG_PAYLOAD))
            return works

        return self._checked(send, "sending a request")

    def post_reply(self, into: torch.Tensor) -> list[dist.Work]:
        return self._checked(lambda: [self.pg.recv([self._reply_header], SHARD_SIDE, TAG_REPLY),
                                      self.pg.recv([into], SHARD_SIDE, TAG_STATE)], "waiting for an answer")

    def reply(self) -> Reply:
        return Reply.decode(self._reply_header)

    def wait(self, works: Sequence[dist.Work], what: str) -> None:
        def wait_all() -> None:
            for w in works:
                w.wait()

        self._checked(wait_all, what)

    def _checked(self, op: Callable[[], T], what: str) -> T:
        """Run a gloo call; its failure (at the call, or when waited for) becomes a CommError naming the shard."""
        try:
            return op()
        except RuntimeError as exc:
            raise CommError(
                f"{what} with parameter-server shard {self.shard} failed on worker rank {self.rank}: {exc}\n"
                f"The shard process has most likely died; its output is in the run's logs/ps-shard-{self.shard}.log "
                f"(prague run) or in rank 0's output (torchrun)."
            ) from exc

    def close(self) -> None:
        self.release_group()


class PendingReplies:
    """The replies of one round of requests to every shard, received in the background.

    Completed either by the caller's :meth:`wait` (on the calling thread), or, when handed to a
    :class:`ReplyCompleter`, on its thread: :meth:`done` then tells without blocking whether the whole
    round has arrived, and :meth:`wait` only collects the result (or raises the failure, as a
    :class:`CommError` naming the shard)."""

    def __init__(self, links: Sequence[ShardLink], sends: list[list[dist.Work]], recvs: list[list[dist.Work]],
                 what: str, completer: ReplyCompleter | None = None, step: int = 0) -> None:
        self.links, self.sends, self.recvs, self.what, self.step = links, sends, recvs, what, step
        self._completed = threading.Event()
        self._error: BaseException | None = None
        self._background = completer is not None
        if completer is not None:
            completer.submit(self)

    def done(self) -> bool:
        """Whether every reply has arrived (never blocks; a failed one counts as arrived). Without a
        completer, only what an earlier ``wait()`` completed counts (see the module docstring)."""
        if self._background:
            return self._completed.is_set()
        return all(w.is_completed() for ws in self.recvs for w in ws)

    def _wait_works(self) -> None:
        for link, sends, recvs in zip(self.links, self.sends, self.recvs):
            link.wait(sends, self.what)
            link.wait(recvs, self.what)

    def complete(self) -> None:
        """Wait for every send and receive of the round, keeping a failure for :meth:`wait`. Called by the
        completer's thread; never raises."""
        try:
            self._wait_works()
        except BaseException as exc:  # noqa: BLE001 - handed to the worker's thread by wait()
            self._error = exc
        finally:
            self._completed.set()

    def wait(self) -> list[Reply]:
        if self._background:
            # The gloo operations time out by themselves (the links' timeout); the margin only guards
            # against a completer that never ran.
            limit_s = max(link.timeout.total_seconds() for link in self.links) * 2 + 10
            if not self._completed.wait(limit_s):
                raise CommError(f"{self.what}: no answer from the parameter-server shards on worker rank "
                                f"{self.links[0].rank} within {limit_s:g} s")
            if isinstance(self._error, CommError):
                raise self._error
            if self._error is not None:
                raise CommError(f"{self.what} failed on worker rank {self.links[0].rank}: {self._error}") \
                    from self._error
        else:
            self._wait_works()
        return [link.reply() for link in self.links]


class ReplyCompleter(QueuedWork["PendingReplies"]):
    """A daemon thread that completes :class:`PendingReplies` rounds, one at a time, in submission order;
    each round is one ``communicating`` operation of the thread
    (:class:`~prague.runtime.background.BackgroundWork`), on behalf of the step that pushed it.

    It only waits on gloo ``Work`` objects of rounds already posted (the waits release the GIL), so the
    worker's thread may compute meanwhile. The owner must not post the next round on the same links
    before the previous one is :meth:`PendingReplies.done` or waited for (``ps-eager`` installs each
    pull before pushing again), so the two threads never use a communicator at once. :meth:`close`
    stops the thread once it has finished what was submitted and waits for it, so that no round's gloo
    work is released on this thread while the owner shuts the communicators down; a thread stuck in a
    receive from a dead shard ends with that receive's timeout (a daemon: it never keeps the process
    alive). A round's failure is the round's (:meth:`PendingReplies.wait` raises it); the thread goes on.
    """

    def __init__(self, name: str) -> None:
        super().__init__("parameter-server replies", name)
        self.start()

    def submit(self, pending: PendingReplies) -> None:
        self.raise_if_failed()
        self.put(pending)

    def handle(self, pending: PendingReplies) -> None:
        with self.operation(pending.step, COMMUNICATING):
            pending.complete()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread after what was submitted; wait for it at most ``timeout_s`` (a round stuck on
        a dead shard is left to its own timeout). Call before closing the links."""
        self.shutdown(False, timeout_s)


class ShardClients:
    """Links to all shards of a job; every operation covers the whole flat state."""

    def __init__(self, store: dist.Store, rank: int, bounds: Sequence[tuple[int, int]], timeout: timedelta) -> None:
        self.store, self.rank = store, rank
        self.links = [ShardLink(store, k, rank, lo, hi, timeout) for k, (lo, hi) in enumerate(bounds)]
        self._completer: ReplyCompleter | None = None

    def init(self, state: torch.Tensor) -> None:
        """Send the initial values (worker rank 0 only)."""
        for link in self.links:
            link.wait(link.request(OP_INIT, payload=state[link.lo:link.hi]), "sending the initial values")

    def _round(self, op: int, what: str, into: torch.Tensor, payload: torch.Tensor | None = None,
               bases: Sequence[int] | None = None, step: int = 0, background: bool = False) -> PendingReplies:
        sends, recvs = [], []
        for k, link in enumerate(self.links):
            recvs.append(link.post_reply(into[link.lo:link.hi]))
            part = None if payload is None else payload[link.lo:link.hi]
            sends.append(link.request(op, bases[k] if bases is not None else 0, step, part))
        return PendingReplies(self.links, sends, recvs, what, self.completer() if background else None, step)

    def completer(self) -> ReplyCompleter:
        """The thread that completes rounds in the background (started on first use)."""
        if self._completer is None:
            self._completer = ReplyCompleter(f"ps-replies-w{self.rank}")
        return self._completer

    def pull(self, into: torch.Tensor) -> list[Reply]:
        return self._round(OP_PULL, "pulling the parameters", into).wait()

    def push(self, payload: torch.Tensor, bases: Sequence[int], step: int, into: torch.Tensor,
             background: bool = False) -> PendingReplies:
        """Push ``payload`` (gradient and buffer values) computed on shard versions ``bases``; the
        shards' answers (the values after the push) land in ``into``. Complete when waited for, or, with
        ``background``, as soon as they arrive (on this client's :class:`ReplyCompleter` thread), so that
        :meth:`PendingReplies.done` can tell. Either way ``payload`` and ``into`` must stay untouched
        until the round is done."""
        return self._round(OP_PUSH, f"pushing step {step}", into, payload, bases, step, background)

    def finish(self, into: torch.Tensor) -> list[Reply]:
        """Say goodbye; returns when every worker has, with the final values in ``into``."""
        replies = self._round(OP_BYE, "finishing", into).wait()
        for link in self.links:  # the shard may exit once every worker has confirmed
            link.wait(link.request(OP_CLOSED), "confirming the final values")
        return replies

    def shard_stats(self) -> list[dict[str, object]]:
        """Each shard's record of this worker's updates (available after :meth:`finish`)."""
        return [json.loads(self.store.get(stats_key(link.shard, self.rank))) for link in self.links]

    def close(self) -> None:
        if self._completer is not None:
            self._completer.close()
        for link in self.links:
            link.close()
