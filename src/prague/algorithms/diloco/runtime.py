"""``diloco``: ``localsgd``'s rounds of H inner steps, each ended by an outer Nesterov step.

DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models", arXiv
2311.08105, 2023). The inner optimizer is the worker's own (whatever the loop gives; the paper's is
AdamW), its state local. Each round starts from x_start, the same on every rank; after H inner steps
one all-reduce gives the mean of the replicas (parameters and floating buffers, as
:class:`~prague.algorithms.localsgd.runtime.LocalSGD`), and every rank applies the same outer step
(:func:`.outer.outer_step`): the averaged change Delta = x_start - mean is the gradient of SGD with
Nesterov momentum (``--outer-lr``, ``--outer-momentum``) at x_start. The result is the next round's start
and every replica's parameters; the floating buffers (BatchNorm statistics) keep their mean.

Contract: as ``localsgd`` (a lockstep method; setup, every round's end and a last, shorter round in
``finish`` are collectives over all ranks). The outer momentum buffer is kept by every rank, the same
on all of them; like every method's communication state it is not part of a checkpoint, so a resumed
run starts it again at zero.
"""

from __future__ import annotations

import torch
from torch import nn

from prague.algorithms.diloco import DiLoCoOptions
from prague.algorithms.diloco.outer import outer_rule, outer_step
from prague.algorithms.localsgd.runtime import LocalSGD


class DiLoCo(LocalSGD):
    """Local SGD's rounds with the outer step in :meth:`combine`."""

    options: DiLoCoOptions

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> nn.Module:
        module = super().setup(model, optimizer)
        self.rule = outer_rule(self.options.outer_lr, self.options.outer_momentum)
        self.round_start = self.flat[: self.param_elements].clone()  # the first round's start: the replicas' mean
        self.momentum: torch.Tensor | None = None
        return module

    def combine(self) -> None:
        params = self.flat[: self.param_elements]
        self.momentum = outer_step(self.round_start, params, self.momentum, self.rule)
        params.copy_(self.round_start)
