"""Emulated compute: a model whose forward is a timed wait instead of arithmetic.

With ``--compute emulated --compute-ms T`` each iteration's forward/backward is replaced by a T ms sleep,
while the parameters and gradients every method communicates keep the real model's sizes. This lets a
2-core machine measure synchronisation at 8+ workers without the workers fighting over cores.
"""

from __future__ import annotations

import time

import torch
from torch import nn


class EmulatedCompute(nn.Module):
    """Wraps a real model; ``forward()`` sleeps ``compute_ms`` and returns a zero-valued loss that touches
    every parameter, so ``backward()`` produces (zero) gradients of the true sizes and methods that hook
    into backward (DDP) communicate them as usual.
    """

    def __init__(self, model: nn.Module, compute_ms: float) -> None:
        super().__init__()
        self.model = model
        self.nominal_compute_s = compute_ms / 1000.0

    def forward(self, *_: object) -> torch.Tensor:
        time.sleep(self.nominal_compute_s)
        # p.sum() has a gradient of ones expanded over p: cheap, and of the parameter's full size.
        return torch.stack([p.sum() for p in self.model.parameters()]).sum() * 0.0
