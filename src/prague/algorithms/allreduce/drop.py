"""``allreduce:drop``: DDP that lets a persistently slow rank leave, as an operator would by hand.

An engineer with one slow machine in a synchronous job watches the step times, then restarts the job
without it. Here that happens inside the job: DDP runs as ``allreduce`` does; every ``--drop-window``
steps the ranks still in the job share their median compute time over the window (one small all-reduce),
and every rank applies the same rule to the same numbers (:mod:`.drop_rules`): a rank above
``--drop-factor`` times the median rank's in two windows in a row leaves. The others build a group of
their own (``torch.distributed.new_group``, created by its members only) and go on as a smaller DDP job over it; under a
job-wide ``--budget`` they share the batches the leavers would have taken
(:meth:`~prague.workload.budget.EqualShares.regroup`). The leavers stop stepping: they take no further
part in the run, their replicas are not the job's model (the closing, :mod:`prague.train.closing`, is the
others'), and the summary's ``algorithm_stats`` name them with the step after which they left.

A rank's compute time is :class:`~prague.algorithms.allreduce.runtime.TimedAllReduce`'s: from the start
of its step to the launch of DDP's last bucket, less its wait in DDP's buffer broadcast.

Through ``prague.prepare`` a leaver's further steps are local and change nothing (its loop may run on or
stop: :attr:`Algorithm.left`), and ``model.averaged_model()`` averages the ranks still in the job.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from prague.algorithms.allreduce.drop_rules import DropWatch
from prague.algorithms.allreduce.runtime import TimedAllReduce
from prague.algorithms.api import StepTimes


class Front(nn.Module):
    """The module the loop runs forward through: the current DDP, or the plain model once this rank has left."""

    target: nn.Module

    def __init__(self, target: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "target", target)  # not a submodule: the state stays the user's model's

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.target(*args, **kwargs)


class DropAllReduce(TimedAllReduce):
    """See the module docstring."""

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> nn.Module:
        self._model = model
        self._watch = DropWatch(self.options.drop_factor)
        self._times: list[float] = []
        self.live: tuple[int, ...] = tuple(range(self.ctx.world_size))
        self.dropped: dict[int, int] = {}  # rank -> the steps it had completed when it left
        self._group: dist.ProcessGroup | None = None  # the communicator of the ranks still in (None: the world's)
        self.front = Front(super().setup(model, optimizer))
        self.resources.callback(self._release_group)
        return self.front

    def _release_group(self) -> None:
        # the front lets go of DDP, which holds its process group: only dropping a group's last reference
        # frees it (and its gloo threads) when prague.shutdown() destroys the world's
        object.__setattr__(self.front, "target", self._model)
        group, self._group = self._group, None
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group)

    def after_backward(self, step: int, times: StepTimes) -> None:
        if self.left:
            return
        super().after_backward(step, times)
        self._times.append(self.compute_s)

    def apply_update(self, optimizer: torch.optim.Optimizer | None, step: int) -> None:
        if not self.left:  # a leaver's replica is no longer the job's: it stays as it was
            super().apply_update(optimizer, step)

    def after_step(self, step: int, times: StepTimes) -> None:
        if self.left or (step + 1) % self.options.drop_window or len(self.live) < 2:
            return
        shared = self.share([statistics.median(self._times) if self._times else 0.0], self.live, self._group)
        medians = dict(zip(self.live, shared))
        self._times = []
        leaving = self._watch.observe(medians)
        if leaving:
            self._leave(leaving, step + 1)

    def _leave(self, leaving: tuple[int, ...], completed: int) -> None:
        """``leaving`` leave after ``completed`` steps; the others go on over a communicator of their own."""
        for rank in leaving:
            self.dropped[rank] = completed
        kept = tuple(r for r in self.live if r not in leaving)
        self.live = kept
        self.stepping = kept
        old = self._group
        if self.ctx.rank in leaving:
            self.left = True
            self._unwrap()
            object.__setattr__(self.front, "target", self._model)
        else:  # only the members build it (DDP needs a group of torch.distributed's own)
            self._group = dist.new_group(list(kept), timeout=self.ctx.timeout, use_local_synchronization=True)
            object.__setattr__(self.front, "target", self.wrap(self._model, self._group))
        if old is not None:
            dist.destroy_process_group(old)

    def replica_group(self) -> tuple[tuple[int, ...], dist.ProcessGroup | None]:
        return self.live, self._group

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "drop_factor": self.options.drop_factor,
                "left": {str(rank): step for rank, step in sorted(self.dropped.items())}}
