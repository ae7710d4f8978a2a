"""``allreduce:balanced``: DDP with speed-balanced batches, so that every worker finishes its step together.

LB-BSP (Chen, Wang, Wang, Wu, Li, "Semi-Dynamic Load Balancing: Efficient Distributed Learning in
Non-Dedicated Environments", SoCC 2020): a synchronous job with unequal workers wastes the fast ones'
time at every step; giving each worker a share of the step's samples in proportion to its speed makes
them finish together. Here:

* Every ``--rebalance-every`` steps the ranks share their median compute time per sample over the window
  and their batch of the moment (one small all-reduce; at the first, the batches together are the step's
  global batch, B samples, from then on) and every rank splits B alike (:func:`~.balanced_rules.balance`): a 4x slower rank takes about a quarter of the
  samples of the others, and a rank that slows down or recovers is followed at the next window.
* The loop asks for this rank's share of the next step (:meth:`BalancedAllReduce.batch_share`: an offset
  and a count within the step's B samples, so the shares of a step never overlap and a job-wide budget
  still uses every sample once an epoch). Under paced compute a step's pace is in proportion to its
  samples.
* The update is the mean over all samples of the step: DDP's comm hook weights this rank's gradient (the
  mean over its own samples) by n times its samples over B before DDP's mean over ranks, so each sample
  counts alike (before the first split: equal weights, as DDP). The weight comes from the samples the
  forward pass was given (the first dimension of its first tensor argument).

Through ``prague.prepare`` the user's loop reads its share from ``model.batch_share()`` and feeds that many
samples; a loop that keeps its own batch size trains as ``allreduce`` does (equal weights). A step is one
forward pass: micro-batches under ``model.no_sync()`` are weighted by the last one's size.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
from torch import nn

from prague.algorithms.allreduce.balanced_rules import balance, offsets
from prague.algorithms.allreduce.runtime import TimedAllReduce
from prague.algorithms.api import StepTimes


def _leading_size(args: tuple[Any, ...]) -> int | None:
    """The first dimension of the first tensor among a forward pass's arguments (its samples), if any."""
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.dim() > 0:
            return int(arg.shape[0])
    return None


class BalancedAllReduce(TimedAllReduce):
    """See the module docstring."""

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> nn.Module:
        module = super().setup(model, optimizer)
        self.total: int | None = None  # B: the samples of a step, all ranks together
        self.shares: list[int] | None = None
        self._offsets: list[int] = []
        self._count = 0  # the samples of this rank's step under way
        self._per_sample: list[float] = []
        self.rebalances = 0

        def on_forward(module: nn.Module, args: tuple[Any, ...]) -> None:
            size = _leading_size(args)
            if size is None:
                return
            self._count = size
            if self._hook is not None and self.total is not None:  # equal weights before the first split
                self._hook.weight = self.ctx.world_size * size / self.total

        self._handles.append(model.register_forward_pre_hook(on_forward))
        return module

    def batch_share(self) -> tuple[int, int] | None:
        if self.shares is None:
            return None
        rank = self.ctx.rank
        return self._offsets[rank], self.shares[rank]

    def after_backward(self, step: int, times: StepTimes) -> None:
        super().after_backward(step, times)
        if self._count:
            self._per_sample.append(self.compute_s / self._count)

    def after_step(self, step: int, times: StepTimes) -> None:
        n = self.ctx.world_size
        if (step + 1) % self.options.rebalance_every or n < 2 or not self._count:
            return
        # every rank's time per sample and its samples
        shared = self.share([statistics.median(self._per_sample) if self._per_sample else 0.0, self._count], range(n))
        self._per_sample = []
        if self.total is None:  # the first split: B is the ranks' batches of the moment, together
            self.total = int(round(sum(shared[1::2])))
        self.shares = balance(shared[0::2], self.total)
        self._offsets = offsets(self.shares)
        self.rebalances += 1

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "rebalance_every": self.options.rebalance_every, "rebalances": self.rebalances,
                "shares": list(self.shares) if self.shares is not None else None}
