"""``dssync``: divide and shuffle, every iteration a new partition into groups from a shared seed.

Decisions: :mod:`.decisions` (the partition, pure); runtime: :mod:`.runtime`; simulator model: :mod:`.sim`.
"""

from __future__ import annotations

from dataclasses import dataclass

from prague.algorithms.spec import COMM_REPORTS, Method, Options, check_group_size, option
from prague.errors import ConfigError


@dataclass(frozen=True)
class DSSyncOptions(Options):
    group_size: int = option(3, "workers per group (prague: smart, random, ready; dssync: k)")
    shuffle_seed: int = option(0, "seed of dssync's shared per-iteration shuffles (0: the run's --seed)", run_seed=True)
    comm_cache: int = option(64, "members-only communicators kept per worker (LRU)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.group_size < 2:
            raise ConfigError(f"--group-size must be >= 2, got {self.group_size}")
        if self.comm_cache < 1:
            raise ConfigError(f"--comm-cache must be >= 1, got {self.comm_cache}")

    def check_job(self, nproc: int) -> None:
        check_group_size(self, nproc)


METHOD = Method(
    name="dssync",
    summary=("DS-Sync (divide and shuffle): every iteration all workers split into disjoint groups of "
             "`--group-size` by a permutation from a seed every rank shares (no service, no round trip), then "
             "each group averages."),
    paper="Wang et al., Divide-and-Shuffle Synchronization for Distributed Machine Learning, arXiv 2007.03298",
    options=DSSyncOptions,
    runtime="prague.algorithms.dssync.runtime:DSSync",
    sim="prague.algorithms.dssync.sim:SimDSSync",
    reports={"group_size": "workers per group",
             "shrunk_groups": "groups that averaged without members that had failed (crashed or hung; see `failures`)",
             **COMM_REPORTS},
    survives_failures=True,
)
