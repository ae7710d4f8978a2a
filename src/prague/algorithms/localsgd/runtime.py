"""``localsgd``: every worker takes H local optimizer steps, then the replicas are averaged over all workers.

Local SGD (Stich, "Local SGD Converges Fast and Communicates Little", ICLR 2019; Lin, Stich, Patel and
Jaggi, "Don't Use Large Mini-Batches, Use Local SGD", ICLR 2020). Each worker's optimizer steps on its
own replica, its state (momentum, Adam's moments) staying local; after every ``--sync-every-steps`` H
steps (:func:`.decisions.ends_round`) every rank averages its parameters and floating buffers with one
all-reduce of one flat buffer (:func:`prague.comm.flat.bind_flat`) on the job's world communicator, so
the replicas are equal again. H = 1 with plain SGD is ``allreduce``'s update (the mean of the gradients
applied to equal replicas), with one all-reduce of the parameters in place of DDP's of the gradients.

Contract: a lockstep method. Every rank runs every step (``equal_shares``), :meth:`LocalSGD.setup`
and every averaging step are collectives over all ranks, and :meth:`LocalSGD.finish` averages a last,
shorter round if the job ended inside one, so every rank must run the same number of steps (as with
DDP). :meth:`LocalSGD.setup` averages the replicas once, so a job starts from one model even if the
ranks' models were built differently or a resumed run stopped inside a round. A rank that fails makes
its peers' next average fail (the job stops and names it, as ``allreduce``).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from prague.algorithms.api import Algorithm, StepTimes
from prague.algorithms.localsgd import LocalSGDOptions, round_report
from prague.algorithms.localsgd.decisions import ends_round
from prague.comm.flat import bind_flat


class LocalSGD(Algorithm):
    """H local steps, then the mean of the replicas over all ranks. :meth:`combine` is the hook a
    method built on the same rounds (``diloco``) overrides."""

    options: LocalSGDOptions

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> nn.Module:
        self.flat = bind_flat(model)
        #: the parameters' part of :attr:`flat` (:func:`bind_flat` puts them first, the floating buffers after)
        self.param_elements = sum(p.numel() for p in model.parameters())
        self.steps_done = 0
        self.in_round = 0  # local steps since the last average
        self.averages = 0
        self.step_averages = 0  # averages right after a step (the others: a last round's, in finish)
        self.averaging_s = 0.0
        self._mean()  # one model to start from, whatever each rank built or resumed
        return model

    def _mean(self) -> None:
        """Set :attr:`flat` to its mean over all ranks. Collective."""
        if self.ctx.world_size > 1:
            dist.all_reduce(self.flat)
            self.flat /= self.ctx.world_size

    def combine(self) -> None:
        """Called on every rank after :attr:`flat` became the replicas' mean: what a round ends with.
        Local SGD keeps the mean."""

    def _average(self) -> None:
        t0 = time.perf_counter()
        self._mean()
        self.combine()
        self.averaging_s += time.perf_counter() - t0
        self.averages += 1
        self.in_round = 0

    def after_step(self, step: int, times: StepTimes) -> None:
        self.steps_done += 1
        self.in_round += 1
        if ends_round(self.in_round, self.options.sync_every_steps):
            self._average()
            self.step_averages += 1

    def finish(self) -> None:
        """End a round the job stopped inside of (collective), so the replicas end equal."""
        if self.in_round:
            self._average()

    def stats(self) -> dict[str, Any]:
        return round_report(self.options, steps=self.steps_done, averages=self.averages,
                            step_averages=self.step_averages, averaging_s=self.averaging_s)
