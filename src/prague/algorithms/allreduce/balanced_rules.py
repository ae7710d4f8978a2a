"""``allreduce:balanced``'s decision, pure: how many of a step's samples each worker takes.

Speed-balanced batches, as LB-BSP (Chen, Wang, Wang, Wu, Li, "Semi-Dynamic Load Balancing: Efficient
Distributed Learning in Non-Dedicated Environments", SoCC 2020): a step's global batch of B samples is
split so that every worker finishes its share together, each share in proportion to the worker's
speed, measured as its compute time per sample. Run by every real worker (:mod:`.balanced`, on the same
gathered times, so every rank splits alike) and by the simulator (:mod:`.balanced_sim`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def balance(per_sample_s: Sequence[float], total: int) -> list[int]:
    """Shares of ``total`` samples in proportion to each worker's speed (1 / its seconds per sample),
    at least one sample each, summing to ``total`` (largest remainders get the rounding). A time that is
    not a positive finite number (nothing measured) counts as the median worker's."""
    n = len(per_sample_s)
    if n == 0 or total < n:
        raise ValueError(f"cannot give each of {n} workers at least one of {total} samples")
    measured = sorted(t for t in per_sample_s if t > 0 and math.isfinite(t))
    typical = measured[len(measured) // 2] if measured else 1.0
    speeds = [1.0 / (t if t > 0 and math.isfinite(t) else typical) for t in per_sample_s]
    spare = total - n  # one sample each first, the rest by speed
    raw = [spare * s / sum(speeds) for s in speeds]
    shares = [1 + int(r) for r in raw]
    by_remainder = sorted(range(n), key=lambda i: (-(raw[i] - int(raw[i])), i))
    for i in by_remainder[:total - sum(shares)]:
        shares[i] += 1
    return shares


def offsets(shares: Sequence[int]) -> list[int]:
    """Where each worker's share starts in the step's samples (the shares laid end to end, in rank order)."""
    out, at = [], 0
    for share in shares:
        out.append(at)
        at += share
    return out
