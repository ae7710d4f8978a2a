"""``adpsgd``: Asynchronous Decentralized Parallel SGD on a bipartite active/passive graph.

Decisions: :mod:`.decisions` (the split and each active's neighbour choice, pure); the pair exchange:
:mod:`.exchange`; runtime: :mod:`.runtime`; simulator model: :mod:`.sim`.
"""

from __future__ import annotations

from dataclasses import dataclass

from prague.algorithms.adpsgd.decisions import bipartite_split, parse_ranks
from prague.algorithms.spec import Method, Options, option


@dataclass(frozen=True)
class ADPSGDOptions(Options):
    adpsgd_active: str = option("", "comma-separated active ranks (default: the even ranks)")
    adpsgd_seed: int = option(0, "seed of the active workers' neighbour choices (0: the run's --seed)", run_seed=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        parse_ranks(self.adpsgd_active)

    def equal_shares(self) -> bool:
        return False  # actives average with whichever passive they draw; passives serve until all actives end

    def check_job(self, nproc: int) -> None:
        bipartite_split(nproc, self.adpsgd_active)  # ranks outside the job, or no passive left


METHOD = Method(
    name="adpsgd",
    summary=("AD-PSGD (Lian et al., ICML 2018): bipartite active/passive split (even/odd ranks unless "
             "`--adpsgd-active`); an active worker computes a gradient on a snapshot, averages its parameters "
             "atomically with a random passive neighbour, then applies the gradient; passive workers serve averaging "
             "requests from a background thread, one at a time, while they compute."),
    paper="Lian, Zhang, Zhang, Liu, Asynchronous Decentralized Parallel Stochastic Gradient Descent, ICML 2018",
    options=ADPSGDOptions,
    runtime="prague.algorithms.adpsgd.runtime:ADPSGD",
    sim="prague.algorithms.adpsgd.sim:SimADPSGD",
    reports={
        "actives": "the active ranks", "passives": "the passive ranks", "role": "active, passive or alone",
        "requests_initiated": "active: averagings it started", "request_wait_s": "active: seconds waiting to be served",
        "exchange_s": "active: seconds exchanging", "peers": "active: {passive: times chosen}",
        "requests_served": "passive: averagings it answered", "serve_s": "passive: seconds serving",
        "lock_wait_s": "passive: seconds the main thread waited for the lock", "snapshots": "passive: snapshots taken",
    },
    survives_failures=True,
)
