"""DS-Sync's one decision, pure: the partition of the ranks at an iteration.

Run by every real worker (:mod:`.runtime`) and by the simulator (:mod:`.sim`), so both form the same
groups from the same seed.
"""

from __future__ import annotations

import random

from prague.groups.smart import chunk


def dssync_groups(iteration: int, nproc: int, group_size: int, seed: int) -> list[tuple[int, ...]]:
    """The partition of ranks ``0..nproc-1`` used at ``iteration`` (the same on every rank): a shuffle
    seeded by (seed, iteration), cut into groups of ``group_size`` (remainders as :func:`chunk` places them)."""
    ranks = list(range(nproc))
    random.Random(f"dssync/{seed}/{iteration}").shuffle(ranks)
    return [tuple(sorted(g)) for g in chunk(ranks, min(group_size, nproc))]
