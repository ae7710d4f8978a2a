"""Worker side of the parameter-server protocol: one link per shard, requests and pending replies.

See :mod:`prague.algorithms.ps.protocol` for the messages. Every operation that fails (the shard's process
died and closed the connection, or nothing came back within the job's timeout) raises
:class:`CommError` naming the shard, so a worker never hangs on a dead server.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from prague.algorithms.ps.protocol import (
    HEADER_LEN, OP_BYE, OP_CLOSED, OP_INIT, OP_PULL, OP_PUSH, SHARD_SIDE, TAG_PAYLOAD, TAG_REPLY, TAG_REQUEST,
    TAG_STATE, WORKER_SIDE, Reply, pair_group, request_header, stats_key,
)
from prague.errors import CommError

T = TypeVar("T")


class ShardLink:
    """This worker's connection to one shard, owning the slice ``[lo, hi)`` of the flat state."""

    def __init__(self, store: dist.Store, shard: int, rank: int, lo: int, hi: int, timeout: timedelta) -> None:
        self.shard, self.rank, self.lo, self.hi = shard, rank, lo, hi
        try:
            self.pg = pair_group(store, shard, rank, WORKER_SIDE, timeout)
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
        if hasattr(self.pg, "shutdown"):
            try:
                self.pg.shutdown()
            except Exception:  # noqa: BLE001 - the shard may be gone already
                pass


class PendingReplies:
    """The replies of one round of requests to every shard, received in the background."""

    def __init__(self, links: Sequence[ShardLink], sends: list[list[dist.Work]], recvs: list[list[dist.Work]],
                 what: str) -> None:
        self.links, self.sends, self.recvs, self.what = links, sends, recvs, what

    def done(self) -> bool:
        """Whether every reply has arrived (never blocks; a failed one counts as arrived)."""
        return all(w.is_completed() for ws in self.recvs for w in ws)

    def wait(self) -> list[Reply]:
        for link, sends, recvs in zip(self.links, self.sends, self.recvs):
            link.wait(sends, self.what)
            link.wait(recvs, self.what)
        return [link.reply() for link in self.links]


class ShardClients:
    """Links to all shards of a job; every operation covers the whole flat state."""

    def __init__(self, store: dist.Store, rank: int, bounds: Sequence[tuple[int, int]], timeout: timedelta) -> None:
        self.store, self.rank = store, rank
        self.links = [ShardLink(store, k, rank, lo, hi, timeout) for k, (lo, hi) in enumerate(bounds)]

    def init(self, state: torch.Tensor) -> None:
        """Send the initial values (worker rank 0 only)."""
        for link in self.links:
            link.wait(link.request(OP_INIT, payload=state[link.lo:link.hi]), "sending the initial values")

    def _round(self, op: int, what: str, into: torch.Tensor, payload: torch.Tensor | None = None,
               bases: Sequence[int] | None = None, step: int = 0) -> PendingReplies:
        sends, recvs = [], []
        for k, link in enumerate(self.links):
            recvs.append(link.post_reply(into[link.lo:link.hi]))
            part = None if payload is None else payload[link.lo:link.hi]
            sends.append(link.request(op, bases[k] if bases is not None else 0, step, part))
        return PendingReplies(self.links, sends, recvs, what)

    def pull(self, into: torch.Tensor) -> list[Reply]:
        return self._round(OP_PULL, "pulling the parameters", into).wait()

    def push(self, payload: torch.Tensor, bases: Sequence[int], step: int, into: torch.Tensor) -> PendingReplies:
        """Push ``payload`` (gradient and buffer values) computed on shard versions ``bases``; the
        shards' answers (the values after the push) land in ``into`` when the result is waited for."""
        return self._round(OP_PUSH, f"pushing step {step}", into, payload, bases, step)

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
        for link in self.links:
            link.close()
