"""``allreduce``'s ``--lr-scaling linear``, pure: the learning-rate factor at each step (no torch).

The linear scaling rule with gradual warm-up (Goyal et al., "Accurate, Large Minibatch SGD: Training
ImageNet in 1 Hour", 2017): a step's batch is n workers' batches, so the learning rate is n times the
one-worker rate, reached linearly over the first ``--scaling-warmup-steps`` steps. Applied by the runtime
on top of the optimizer's own rate (:func:`prague.optim.scaled_lr`) and by the simulator's arithmetic.
"""

from __future__ import annotations

from typing import Any


def linear_scaling(workers: int, step: int, warmup_steps: int) -> float:
    """The factor at ``step`` (0-based) for ``workers`` workers: ``workers``, reached linearly from 1 over
    the first ``warmup_steps`` steps (0: at once)."""
    if warmup_steps <= 0:
        return float(workers)
    return 1.0 + (workers - 1) * min(1.0, (step + 1) / warmup_steps)


def lr_factor(options: Any, workers: int, step: int) -> float:
    """The factor ``options.lr_scaling`` sets at ``step`` for ``workers`` workers (1 without it)."""
    if options.lr_scaling != "linear":
        return 1.0
    return linear_scaling(workers, step, options.scaling_warmup_steps)
