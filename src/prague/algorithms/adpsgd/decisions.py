"""AD-PSGD's decisions, pure: which workers are active, and whom an active worker averages with next.

Run by every real worker (:mod:`.runtime`) and by the simulator (:mod:`.sim`): a simulated active picks
the same passives in the same order as a real one, from the same seed.
"""

from __future__ import annotations

import random
from collections.abc import Collection

from prague.errors import ConfigError


def parse_ranks(text: str) -> tuple[int, ...]:
    """``"0, 2,4"`` -> ``(0, 2, 4)``; empty text -> ``()``. Raises ConfigError on anything else."""
    ranks: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            ranks.append(int(part))
        except ValueError:
            raise ConfigError(f"--adpsgd-active must be comma-separated ranks like '0,2,4', got {text!r}") from None
    if len(set(ranks)) != len(ranks):
        raise ConfigError(f"--adpsgd-active lists a rank twice: {text!r}")
    return tuple(sorted(ranks))


def bipartite_split(nproc: int, active: str = "") -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(active ranks, passive ranks): even/odd ranks unless ``active`` lists the active ones. Pure."""
    if nproc < 1:
        raise ConfigError(f"nproc must be >= 1, got {nproc}")
    chosen = parse_ranks(active)
    actives = chosen if chosen else tuple(r for r in range(nproc) if r % 2 == 0)
    bad = [r for r in actives if not 0 <= r < nproc]
    if bad:
        raise ConfigError(f"--adpsgd-active names ranks {bad} outside 0..{nproc - 1}")
    active_set = set(actives)  # so that the split stays linear in nproc
    passives = tuple(r for r in range(nproc) if r not in active_set)
    if nproc > 1 and not passives:
        raise ConfigError(f"--adpsgd-active {active!r} leaves no passive worker among {nproc}; leave at least one out")
    return actives, passives


class NeighbourChooser:
    """An active worker's random choice of passive neighbour: uniform, seeded by (seed, rank). Pure."""

    def __init__(self, passives: tuple[int, ...], rank: int, seed: int) -> None:
        if not passives:
            raise ConfigError("an active worker needs at least one passive neighbour")
        self.passives = passives
        self._rng = random.Random(f"adpsgd/{seed}/{rank}")

    def next(self) -> int:
        return self._rng.choice(self.passives)

    def next_live(self, failed: Collection[int]) -> int | None:
        """The next partner among the passives not in ``failed``: the same draw as :meth:`next` while
        none of them failed; None when every passive has failed."""
        if not any(p in failed for p in self.passives):
            return self.next()
        live = [p for p in self.passives if p not in failed]
        return self._rng.choice(live) if live else None
