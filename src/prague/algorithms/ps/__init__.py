"""``ps``: a classic parameter server (sync or async) with K server shards of their own.

The update and staleness rules are pure code in :mod:`.rules` (applied by the shards, by ``ps-eager``
workers and by the simulator alike); the wire protocol is :mod:`.protocol`, the shard process
:mod:`.server`, the worker's side :mod:`.client`; runtime: :mod:`.runtime`; simulator model: :mod:`.sim`.
``ps-eager`` (:mod:`prague.algorithms.ps_eager`) builds on all of these.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prague.algorithms.spec import Method, Options, check_seconds, option
from prague.errors import ConfigError

MODES = ("sync", "async")
STALENESS_RULES = ("inverse", "none", "exp")
MOMENTUM_MODES = ("worker", "folded")

MOMENTUM_HELP = ("async shards: worker (a momentum buffer per worker; ps default) or folded (no buffer, step "
                 "lr/(1-momentum); ps-eager default)")


#: The most shard processes one job may start (each is a process of its own on the launching machine).
MAX_SHARDS = 1024


def check_shards(shards: int, total: int) -> None:
    """Raise ConfigError unless ``shards`` shards can split a flat state of ``total`` elements (each
    shard owns a slice of at least one element)."""
    if shards < 1:
        raise ConfigError(f"--ps-shards must be >= 1, got {shards}")
    if total < shards:
        raise ConfigError(f"--ps-shards {shards} exceeds the model's {total} state elements; use at most {total}")


@dataclass(frozen=True)
class ShardOptions(Options):
    """The options both parameter-server methods have (their shards are the same processes)."""

    ps_shards: int = option(1, "number of server shard processes")
    max_staleness: int = option(0, "reject updates staler than this many server versions (0: no bound)")
    staleness_lr: str = option("inverse", "learning rate of an update of staleness tau: inverse (lr/max(n-1,tau)), "
                                          "none, exp", choices=STALENESS_RULES)
    ps_momentum: str = option("worker", MOMENTUM_HELP, choices=MOMENTUM_MODES)
    ps_timeout_s: float = option(300.0, "how long a shard or worker waits for the other side")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ps_shards < 1:
            raise ConfigError(f"--ps-shards must be >= 1, got {self.ps_shards}")
        if self.ps_shards > MAX_SHARDS:
            raise ConfigError(f"--ps-shards {self.ps_shards} is more than {MAX_SHARDS} server processes; use at most "
                              f"{MAX_SHARDS}")
        if self.max_staleness < 0:
            raise ConfigError(f"--max-staleness must be >= 0 (0: no bound), got {self.max_staleness}")
        check_seconds("--ps-timeout-s", self.ps_timeout_s)

    def check_model(self, state_elements: Callable[[], int]) -> None:
        check_shards(self.ps_shards, state_elements())

    def equal_shares(self) -> bool:
        return False  # asynchronous shards apply each push on arrival (ps:sync overrides)


@dataclass(frozen=True)
class PSOptions(ShardOptions):
    ps_mode: str = option("sync", "sync: apply the mean of all n pushes; async: apply each on arrival", choices=MODES)

    def equal_shares(self) -> bool:
        return self.ps_mode == "sync"  # a sync version waits for every worker's push


#: What both parameter-server methods report.
PS_REPORTS = {
    "mode": "the shards' mode (sync or async)",
    "shards": "number of shards",
    "pushes": "gradients this worker pushed",
    "staleness_histogram": "{tau: count} of this worker's applied updates, as the shards recorded them",
    "mean_staleness": "mean tau of this worker's applied updates",
    "max_staleness_seen": "largest tau applied",
    "applied": "updates applied (with K shards each push counts once per shard)",
    "rejected": "updates rejected by --max-staleness",
    "max_staleness": "the bound (0: none)",
    "staleness_lr": "the staleness learning-rate rule",
    "momentum": "the shards' momentum mode",
    "server_versions": "each shard's final version",
}

#: What the simulator models of both report besides.
PS_SIM_REPORTS = {"server_receive_utilization": "share of the run the busiest shard's network card was receiving"}

METHOD = Method(
    name="ps",
    summary=("Parameter server: the flat parameter buffer is split across `--ps-shards` server processes of their "
             "own (started by the launcher, or by rank 0 under torchrun); workers push gradients and pull parameters "
             "over point-to-point communicators. `ps:sync` applies the mean of all n gradients per version "
             "(numerically the same as `allreduce`); `ps:async` applies each push on arrival, its learning rate "
             "scaled by its staleness tau (`--staleness-lr`)."),
    paper="Li et al., Scaling Distributed Machine Learning with the Parameter Server, OSDI 2014",
    options=PSOptions,
    runtime="prague.algorithms.ps.runtime:ParameterServer",
    sim="prague.algorithms.ps.sim:SimPS",
    variant_option="ps_mode",
    reports=PS_REPORTS,
    sim_reports=PS_SIM_REPORTS,
    sgd_only=True,
)
