"""The ranks that close a run together: every rank, or the survivors after failures.

After its last step each worker evaluates, averages and reports with the others. A worker first says
it is done (:func:`prague.runtime.liveness.mark_done`) and waits until every rank is done or failed.
Normally that is every rank, and the closing collectives use the job's world group; if some failed (a
method that survives failures, ``Method.survives_failures``, went on without them) or left the job
(``allreduce:drop`` let them go: :func:`prague.runtime.liveness.mark_left`), the others build a
communicator of their own (on the job's backend, through the store, like a P-Reduce group), and the
closing collectives and the summary are theirs. Every
survivor computes the same survivor set: a rank that is done is not declared failed afterwards, and a
failed one never becomes done.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from prague.comm.owned import shutdown_group
from prague.comm.preduce import backend_group
from prague.runtime.context import DistContext
from prague.runtime.liveness import LEFT_KEY, Failure, Membership, mark_done, read_keys, wait_settled

CLOSE_PREFIX = "prague/close"


@dataclass
class Closing:
    """Collectives over :attr:`ranks` (``group`` None: the world group)."""

    ctx: DistContext
    ranks: tuple[int, ...]
    group: dist.ProcessGroup | None = None
    failures: dict[int, Failure] = field(default_factory=dict)
    left: dict[int, int] = field(default_factory=dict)  # rank -> steps completed, for ranks that left the job
    _gathers: int = 0  # numbers the store keys of each all_gather_object

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def is_main(self) -> bool:
        """The rank that writes the summary: the lowest survivor."""
        return self.ctx.rank == self.ranks[0]

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` in place over the closing ranks."""
        if self.group is None:
            dist.all_reduce(tensor)
        else:
            self.group.allreduce([tensor]).wait()

    def all_gather_floats(self, value: float) -> list[float]:
        """Every closing rank's ``value``, in rank order."""
        out = torch.zeros(self.size, dtype=torch.float64, device=self.ctx.device)
        out[self.ranks.index(self.ctx.rank)] = value
        self.all_reduce(out)
        return out.tolist()

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every closing rank's JSON-serialisable ``obj``, in rank order."""
        if self.group is None:
            gathered: list[Any] = [None] * self.size
            dist.all_gather_object(gathered, obj)
            return gathered
        store = self.ctx.store
        self._gathers += 1
        prefix = f"{CLOSE_PREFIX}/{_name(self.ranks)}/gather{self._gathers}"
        store.set(f"{prefix}/{self.ctx.rank}", json.dumps(obj))
        keys = [f"{prefix}/{r}" for r in self.ranks]
        store.wait(keys, self.ctx.timeout)
        return [json.loads(v) for v in store.multi_get(keys)]

    def close(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            shutdown_group(group)


def closing_ranks(ctx: DistContext) -> Closing:
    """Who closes this run with this worker (see the module docstring); after its last step. Every
    worker first waits until all are done (or failed), through the store and with a timeout that counts
    inactivity only, so a worker that finishes long before the slowest never times out in the closing
    collectives."""
    if ctx.world_size == 1:
        return Closing(ctx, (0,))
    membership = Membership(ctx.private_store(), ctx.world_size)
    mark_done(ctx.store, ctx.rank)
    done = wait_settled(ctx.store, membership, ctx.timeout_s)
    failures = membership.failed()
    left = {rank: int(steps) for rank, steps in read_keys(ctx.store, LEFT_KEY, done).items()}
    survivors = tuple(r for r in done if r not in left)
    if len(survivors) == ctx.world_size:
        return Closing(ctx, survivors)
    store = dist.PrefixStore(f"{CLOSE_PREFIX}/{_name(survivors)}/pg", ctx.store)
    group = backend_group(ctx, store, survivors.index(ctx.rank), len(survivors), ctx.timeout)
    return Closing(ctx, survivors, group, failures, left)


def _name(ranks: Sequence[int]) -> str:
    return "-".join(map(str, ranks))
