"""``prague``: local SGD steps, then Partial All-Reduce with a group chosen by the Group Generator.

Prague (Luo, Lin, Zhuo, Qian, "Prague: High-Performance Heterogeneity-Aware Asynchronous Decentralized
Training", ASPLOS 2020; arXiv 1909.08029, also "Ripples"). Each iteration a worker takes a local optimizer
step (its optimizer state stays local), asks the Group Generator which group it belongs to next, and
averages its parameters with that group's members only (:func:`prague.comm.preduce.preduce`). Slow
workers hold back only the few workers they meet, not the whole job.

Generators (``--generator``): ``static`` (a conflict-free schedule computed locally, no round trip),
``smart`` (the paper's: random divisions under a threshold rule, through a group buffer), ``random``
(one random group per request: the naive baseline) and ``ready`` (groups formed only from workers
already waiting at the service). Where the groups come from (and where the service runs) is
:mod:`.source`; the policies themselves are :mod:`prague.groups`.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from prague.algorithms.api import Algorithm, JobResources, StepTimes
from prague.algorithms.prague import PragueOptions
from prague.algorithms.prague.source import (
    MANAGED_ENV, TOKEN_ENV, GroupSource, ServiceSource, StaticSource, gg_service,
)
from prague.comm.flat import bind_flat
from prague.comm.preduce import GroupCommunicators, preduce
from prague.errors import CommError
from prague.groups import Group
from prague.metrics.decisions import Decision, gg_trace_path


class GroupTally:
    """What a worker's groups were: counts for the summary."""

    def __init__(self) -> None:
        self.groups_run = 0
        self.local_steps = 0
        self.member_total = 0

    def add(self, group: Group) -> None:
        self.groups_run += 1
        self.member_total += group.size
        self.local_steps += group.is_local

    @property
    def mean_group_size(self) -> float:
        return self.member_total / self.groups_run if self.groups_run else 0.0


class Prague(Algorithm):
    """Local step, then P-Reduce over the group the generator names; see the module docstring."""

    options: PragueOptions

    @classmethod
    def job_resources(cls, options: PragueOptions, nproc: int, out_dir: Path) -> JobResources:
        options.topology(nproc)
        if not options.uses_service:
            return JobResources()
        spec = gg_service(options, nproc, out_dir / "gg.address")
        return JobResources(services=(spec,), env={TOKEN_ENV: secrets.token_hex(16), MANAGED_ENV: "1"})

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> nn.Module:
        topology = self.options.topology(self.ctx.world_size)
        self.flat = bind_flat(model)
        self.comms = GroupCommunicators(self.ctx, capacity=self.options.comm_cache)
        self.resources.callback(self.comms.close)
        self.tally = GroupTally()
        self.steps_done = 0
        self.source: GroupSource
        if self.options.generator == "static":
            self.source = StaticSource(topology)
        else:
            trace = None if self.decisions is None else gg_trace_path(self.decisions.folder)
            self.source = ServiceSource(self.ctx, self.options, self.resources, trace=trace)
        return model

    def _run(self, group: Group, step: int) -> None:
        if self.ctx.rank not in group.members:
            raise CommError(f"group generator sent rank {self.ctx.rank} a group it is not in: {group}")
        self.tally.add(group)
        if self.decisions is not None:
            self.decisions.write(Decision.of_group(step, group.members, group.seq))
        if not group.is_local:
            preduce(self.flat, group.members, self.comms)

    def after_step(self, step: int, times: StepTimes) -> None:
        t0 = time.perf_counter()
        group = self.source.next_group(self.ctx.rank, step)
        times.wait_s += time.perf_counter() - t0  # the generator's answer: RPC plus waiting for partners
        self.steps_done = step + 1
        self._run(group, step)

    def finish(self) -> None:
        """Run the groups this worker is still committed to, then leave (see :class:`.source.ServiceSource`).
        Logged with ``step`` = the number of steps run."""
        for group in self.source.finish(self.ctx.rank):
            self._run(group, self.steps_done)
        self.source.leave()

    def stats(self) -> dict[str, Any]:
        return {
            "generator": self.options.generator,
            "group_size": self.options.group_size,
            "groups_run": self.tally.groups_run,
            "local_steps": self.tally.local_steps,
            "mean_group_size": self.tally.mean_group_size,
            **self.comms.stats.report(),
            "generator_stats": self.source.stats(),
        }
