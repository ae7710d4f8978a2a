"""``dssync``: divide and shuffle. Every iteration all workers split into disjoint groups of size k by a
random permutation drawn from a seed every rank shares, and each group averages its parameters.

DS-Sync (Wang et al., "Divide-and-Shuffle Synchronization for Distributed Machine Learning", arXiv
2007.03298). No Group Generator and no round trip: each rank computes the same partition locally from
(seed, iteration), so the groups of one iteration are disjoint and every rank executes them in the same
order, which rules out deadlock. A new shuffle each iteration mixes the replicas.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from prague.algorithms.api import Algorithm, StepTimes
from prague.comm.flat import bind_flat
from prague.comm.preduce import GroupCommunicators, preduce
from prague.errors import ConfigError
from prague.groups.smart import chunk


@dataclass(frozen=True)
class DSSyncOptions:
    group_size: int = 3
    shuffle_seed: int = field(default=0, metadata={"help": "seed of the shared per-iteration shuffles"})
    comm_cache: int = 64

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ConfigError(f"--group-size must be >= 2, got {self.group_size}")
        if self.comm_cache < 1:
            raise ConfigError(f"--comm-cache must be >= 1, got {self.comm_cache}")


def dssync_groups(iteration: int, nproc: int, group_size: int, seed: int) -> list[tuple[int, ...]]:
    """The partition of ranks ``0..nproc-1`` used at ``iteration`` (the same on every rank)."""
    ranks = list(range(nproc))
    random.Random(f"dssync/{seed}/{iteration}").shuffle(ranks)
    return [tuple(sorted(g)) for g in chunk(ranks, min(group_size, nproc))]


class DSSync(Algorithm):
    """Local step, then average with this iteration's shuffled group."""

    name = "dssync"
    Options = DSSyncOptions

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> nn.Module:
        self.flat = bind_flat(model)
        self.comms = GroupCommunicators(self.ctx, capacity=self.options.comm_cache)
        return model

    def after_step(self, step: int, times: StepTimes) -> None:
        groups = dssync_groups(step, self.ctx.world_size, self.options.group_size, self.options.shuffle_seed)
        mine = next(g for g in groups if self.ctx.rank in g)
        preduce(self.flat, mine, self.comms)

    def close(self) -> None:
        self.comms.close()

    def stats(self) -> dict[str, Any]:
        s = self.comms.stats
        return {"group_size": self.options.group_size, "preduces": s.reduces, "communicators_created": s.created,
                "communicator_create_s": s.create_s, "communicators_evicted": s.evicted}
