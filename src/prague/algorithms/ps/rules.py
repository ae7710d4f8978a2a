"""The update rules of the parameter server, as pure functions and a frozen dataclass.

Shared by the shards (:mod:`prague.algorithms.ps.server`), which apply them, and by ``ps-eager`` workers
(:mod:`prague.algorithms.ps_eager.runtime`), which apply their own update to their local copy as well
("read-my-writes").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from prague.algorithms.ps.protocol import MOMENTUM_MODES, STALENESS_RULES, Layout
from prague.errors import unknown_choice


def staleness_scale(rule: str, tau: int, nproc: int) -> float:
    """The factor applied to the learning rate of one push of staleness ``tau`` among ``nproc`` workers.

    ``inverse``: 1/max(1, tau), the rule of Zhang, Gupta, Lian, Liu, "Staleness-aware Async-SGD for
    Distributed Deep Learning", IJCAI 2016, with tau floored at n - 1: the staleness of every push when n
    workers push in turn, where n pushes at 1/(n - 1) each make about one synchronous step. A push that
    happens to be fresher (the first round; the last worker still running after the others finished)
    would otherwise take up to n times its share: measured here, the steps of the last workers alone
    undid a converged CNN (97% -> 51% MNIST accuracy). ``exp``: the same share, decaying by a factor e
    for every n versions beyond n - 1 instead of as 1/tau. ``none``: 1, plain asynchronous SGD, n times
    the step of a synchronous round.
    """
    floor = max(1, nproc - 1)
    if rule == "none":
        return 1.0
    if rule == "inverse":
        return 1.0 / max(floor, tau)
    if rule == "exp":
        return math.exp(-max(0, tau - floor) / max(1, nproc)) / floor
    raise unknown_choice("staleness rule", rule, STALENESS_RULES)


def accepts(tau: int, max_staleness: int) -> bool:
    """Whether an update of staleness ``tau`` is applied; ``max_staleness`` <= 0 means no bound."""
    return max_staleness <= 0 or tau <= max_staleness


@dataclass(frozen=True)
class SGDRule:
    """``torch.optim.SGD``'s update, for one flat slice (element-wise, so slicing changes nothing)."""

    lr: float
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def step(self, param: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor | None,
             scale: float = 1.0) -> torch.Tensor | None:
        """Update ``param`` in place with ``grad`` whose learning rate is scaled by ``scale``; returns the
        new momentum buffer. With ``scale`` 1 this is ``torch.optim.sgd._single_tensor_sgd`` operation
        for operation (bit for bit); otherwise the scaled gradient enters the momentum buffer, i.e. the
        scale is this gradient's own learning-rate factor, folded into the existing passes."""
        if self.weight_decay != 0:
            grad = grad.add(param, alpha=self.weight_decay)
        if self.momentum == 0:
            param.add_(grad, alpha=-self.lr * scale)
            return None
        if buf is None:
            buf = grad.detach().clone() if scale == 1.0 else grad.mul(scale)
        else:
            buf.mul_(self.momentum).add_(grad, alpha=(1 - self.dampening) * scale)
        if self.nesterov:
            scaled = grad if scale == 1.0 else grad.mul(scale)
            direction = scaled.add(buf, alpha=self.momentum)
        else:
            direction = buf
        param.add_(direction, alpha=-self.lr)
        return buf

    @classmethod
    def from_layout(cls, layout: Layout, momentum: str = "worker") -> "SGDRule":
        """The optimizer's rule; with ``momentum="folded"``, :meth:`folded`."""
        if momentum not in MOMENTUM_MODES:
            raise unknown_choice("momentum mode", momentum, MOMENTUM_MODES)
        rule = cls(layout.lr, layout.momentum, layout.dampening, layout.weight_decay, layout.nesterov)
        return rule.folded() if momentum == "folded" else rule

    def folded(self) -> "SGDRule":
        """Plain SGD whose step is this rule's steady-state step: for a constant gradient g, momentum m
        and dampening d settle at lr (1 - d) / (1 - m) g per step (Nesterov: lr (1 + m (1 - d) / (1 - m)) g).

        For heavily delayed gradients: asynchrony itself acts like momentum (Mitliagkas, Zhang, Hadjis,
        Re, "Asynchrony begets Momentum, with an Application to Deep Learning", 2016), so explicit
        momentum on top of it overshoots; this keeps the step size and drops the memory."""
        if self.momentum == 0:
            return self
        gain = (1 - self.dampening) / (1 - self.momentum)
        if self.nesterov:
            gain = 1 + self.momentum * gain
        return SGDRule(self.lr * gain, 0.0, 0.0, self.weight_decay, False)
