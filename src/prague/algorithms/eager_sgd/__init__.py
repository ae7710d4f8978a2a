"""``eager-sgd``: gradient all-reduce in rounds that start without waiting for every worker.

Decisions: :mod:`.decisions` (who starts a round, which rounds are synchronous, what a worker
contributes; pure); runtime: :mod:`.runtime`; simulator model: :mod:`.sim`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prague.algorithms.spec import Method, Options, option
from prague.errors import ConfigError

QUORUMS = ("solo", "majority")


@dataclass(frozen=True)
class EagerSGDOptions(Options):
    quorum: str = option("majority", "eager-sgd: who starts a round: solo (the first worker to finish its gradient) or "
                         "majority (a rank drawn per round from --eager-seed, so about half have arrived)",
                         choices=QUORUMS)
    renormalize: str = option("off", "eager-sgd: divide a round's gradient sum by the number of workers (off, the "
                              "paper's choice) or by the number of gradients in it (on)", choices=("off", "on"))
    sync_every: int = option(10, "eager-sgd: every L-th round is a synchronous all-reduce of every worker's fresh "
                             "gradient, which bounds staleness (0: never)")
    stale_weight: str = option("inverse", "eager-sgd: weight of a gradient that arrives s rounds late in its round's "
                               "sum: inverse (1 / (1 + s), a staleness-aware learning rate) or none (1, the paper's)",
                               choices=("inverse", "none"))
    lookahead: str = option("on", "eager-sgd: on: compute each gradient at the parameters shifted by the momentum "
                            "step still to come (x - lr m v, as DANA), so a gradient applied a round late was "
                            "taken near where it lands; off: at the current parameters", choices=("on", "off"))
    eager_seed: int = option(0, "eager-sgd: seed of majority's per-round initiators (0: the run's --seed)", run_seed=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sync_every < 0:
            raise ConfigError(f"--sync-every must be >= 0 (0: no synchronous rounds), got {self.sync_every}")


def rounds_report(*, quorum: str, rounds: int, sync_rounds: int, gradients: int, fresh: int,
                  staleness: Mapping[int, int], waits: int, recoveries: int = 0, lost_gradients: int = 0,
                  recovered_rounds: int = 0) -> dict[str, Any]:
    """``eager-sgd``'s stats (the fields :data:`METHOD` reports) from the counts the runtime keeps per worker
    and the simulator for the whole job: ``gradients`` and ``fresh`` summed over the rounds,
    ``staleness`` as {rounds late: gradients}; the last three only a run with failed workers has."""
    contributed = sum(staleness.values())
    return {
        "quorum": quorum,
        "rounds": rounds,
        "sync_rounds": sync_rounds,
        "mean_gradients_per_round": gradients / rounds if rounds else 0.0,
        "mean_fresh_per_round": fresh / rounds if rounds else 0.0,
        "contributed": contributed,
        "staleness": {str(k): v for k, v in sorted(staleness.items())},
        "mean_staleness": sum(k * v for k, v in staleness.items()) / contributed if contributed else 0.0,
        "waits": waits,
        "recoveries": recoveries,
        "lost_gradients": lost_gradients,
        "recovered_rounds": recovered_rounds,
    }


METHOD = Method(
    name="eager-sgd",
    summary=("eager-SGD: one gradient all-reduce per round over all workers, run by a background thread on each; "
             "a round starts when its first worker (`solo`) or a seeded initiator (`majority`) has a gradient, and "
             "late workers' gradients go into the next round, so every replica applies the same sums without "
             "waiting for the slowest. Every `--sync-every`-th round is synchronous."),
    paper=("Li, Ben-Nun, Di Girolamo, Alistarh, Hoefler, Taming Unbalanced Training Workloads in Deep Learning with "
           "Partial Collective Operations, PPoPP 2020"),
    options=EagerSGDOptions,
    runtime="prague.algorithms.eager_sgd.runtime:EagerSGD",
    sim="prague.algorithms.eager_sgd.sim:SimEagerSGD",
    variant_option="quorum",
    reports={
        "quorum": "solo or majority",
        "rounds": "rounds this worker took part in (synchronous and final ones included)",
        "sync_rounds": "synchronous rounds among them",
        "mean_gradients_per_round": "gradients summed in a round, mean over rounds (all workers' contributions)",
        "mean_fresh_per_round": "of those, gradients computed on the latest values (staleness 0), mean over rounds",
        "contributed": "gradients this worker contributed",
        "staleness": "this worker's contributed gradients by staleness (rounds between the values a gradient was "
                     "computed on and the round that carried it), as {staleness: count}",
        "mean_staleness": "mean of that histogram",
        "waits": "iterations in which this worker waited for its round",
        "recoveries": "times the rounds went on over the survivors after workers failed",
        "lost_gradients": "this worker's gradients in rounds that broke when a worker failed (not applied)",
        "recovered_rounds": "rounds whose all-reduce broke here when a worker failed but completed on another "
                            "survivor, which sent their result over",
    },
    survives_failures=True,
)
