"""DiLoCo's outer step on flat tensors, shared by the runtime (:mod:`.runtime`) and the simulator's real
arithmetic (:mod:`.sim`), so both take the same step.

The outer gradient of a round is the averaged change Delta = x_start - mean_i(x_i); the outer optimizer
is ``torch.optim.SGD`` with Nesterov momentum (Douillard et al., 2023, Algorithm 1), taken here as
:class:`prague.optim.SGDRule`, the project's element-wise copy of that step.
"""

from __future__ import annotations

import torch

from prague.optim import SGDRule


def outer_rule(outer_lr: float, outer_momentum: float) -> SGDRule:
    """The outer optimizer: SGD at ``outer_lr`` with Nesterov momentum ``outer_momentum`` (none at 0)."""
    return SGDRule(outer_lr, outer_momentum, nesterov=outer_momentum > 0)


def outer_step(start: torch.Tensor, mean: torch.Tensor, momentum: torch.Tensor | None,
               rule: SGDRule) -> torch.Tensor | None:
    """Move ``start`` (the round's start, the same on every rank) in place by one step of ``rule`` whose
    gradient is ``start - mean``; returns the new momentum buffer (None without momentum). With learning
    rate 1 and no momentum ``start`` becomes ``mean``: Local SGD's average."""
    return rule.step(start, start - mean, momentum)
