"""``dssync``: divide and shuffle. Every iteration all workers split into disjoint groups of size k by a
random permutation drawn from a seed every rank shares, and each group averages its parameters.

DS-Sync (Wang et al., "Divide-and-Shuffle Synchronization for Distributed Machine Learning", arXiv
2007.03298). No Group Generator and no round trip: each rank computes the same partition locally from
(seed, iteration) (:func:`.decisions.dssync_groups`), so the groups of one iteration are disjoint and
every rank executes them in the same order, which rules out deadlock. A new shuffle each iteration
mixes the replicas.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from prague.algorithms.api import Algorithm, StepTimes
from prague.algorithms.dssync import DSSyncOptions
from prague.algorithms.dssync.decisions import dssync_groups
from prague.comm.flat import bind_flat
from prague.comm.surviving import LiveGroups
from prague.metrics.decisions import Decision


class DSSync(Algorithm):
    """Local step, then average with this iteration's shuffled group."""

    options: DSSyncOptions

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> nn.Module:
        self.flat = bind_flat(model)
        self.groups = LiveGroups(self.ctx, capacity=self.options.comm_cache, namespace=f"{self.namespace}/groups")  # survivors leave failed members out
        self.resources.callback(self.groups.close)
        return model

    def after_step(self, step: int, times: StepTimes) -> None:
        groups = dssync_groups(step, self.ctx.world_size, self.options.group_size, self.options.shuffle_seed)
        mine = next(g for g in groups if self.ctx.rank in g)
        if self.decisions is not None:
            self.decisions.write(Decision.of_group(step, mine))
        self.groups.reduce(mine, self.flat)

    def peers(self) -> Sequence[int] | None:
        return self.groups.current

    def stats(self) -> dict[str, Any]:
        return {"group_size": self.options.group_size, "shrunk_groups": self.groups.shrunk,
                **self.groups.comms.stats.report()}
