"""The optimizer's update as a pure rule on flat tensors: ``torch.optim.SGD``, element-wise.

Shared by everything that applies an SGD step outside ``torch.optim``: the parameter-server shards
(:mod:`prague.algorithms.ps.server`), ``ps-eager`` workers' read-my-writes step, and the simulator's
real arithmetic (:mod:`prague.sim.math`), so that all of them take the step a worker's optimizer takes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


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


@contextlib.contextmanager
def scaled_lr(optimizer: torch.optim.Optimizer, factor: float) -> Iterator[None]:
    """Every param group's learning rate times ``factor`` inside the block, restored after it: on top of
    whatever rate the user's schedule set for this step."""
    if factor == 1.0:
        yield
        return
    saved = [group["lr"] for group in optimizer.param_groups]
    for group, lr in zip(optimizer.param_groups, saved):
        group["lr"] = lr * factor
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved):
            group["lr"] = lr
