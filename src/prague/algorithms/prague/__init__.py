"""``prague``: local steps, then Partial All-Reduce with a group chosen by the Group Generator.

The group policies are pure code in :mod:`prague.groups` (shared with the simulator); runtime:
:mod:`.runtime` (group source, P-Reduce); simulator model: :mod:`.sim`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from prague.algorithms.spec import (
    COMM_REPORTS, Method, Options, check_address, check_group_size, check_seconds, option,
)
from prague.algorithms.prague.weights import AVERAGE_BY
from prague.comm.codecs import CODECS
from prague.comm.transports import TRANSPORTS
from prague.errors import ConfigError
from prague.groups import GENERATORS, Topology
from prague.groups.api import DEFAULT_THRESHOLD, THRESHOLDS, check_levels


OVERLAP_MODES = ("on", "off")
#: The ready window of a blocking worker (``--overlap off``) when ``--window-ms`` is left at 0.
BLOCKING_WINDOW_S = 0.05
WHEN_BUSY = ("wait", "local")
#: The generators that follow the topology (``--nodes``: alternating intra- and inter-node groups). Each
#: also runs blind, as ``NAME-blind``: the same generator given one node holding every rank, while the
#: job's ``--nodes`` (its physical layout: the simulator's costs, ``--hosts``) stays, so one bench can
#: measure what the alternation buys.
TOPOLOGY_AWARE = ("static", "smart")
BLIND = "-blind"
#: ``--generator``'s choices (the ``prague:VARIANT`` names): every registered policy, each topology-aware
#: one followed by its blind version.
GENERATOR_CHOICES = tuple(name for g in GENERATORS for name in ((g, g + BLIND) if g in TOPOLOGY_AWARE else (g,)))


@dataclass(frozen=True)
class PragueOptions(Options):
    generator: str = option("ready", "group generator (NAME-blind: NAME given one node holding every rank, "
                            "whatever --nodes)", choices=GENERATOR_CHOICES)
    group_size: int = option(3, "workers per group (prague: smart, random, ready; dssync: k)")
    delta_c: int = option(4, "smart's threshold: join only if c_w > c_i - delta_c, c counting "
                          "iterations (each request says after which step it comes)")
    threshold: str = option(DEFAULT_THRESHOLD, "smart: the threshold rule: steps (the paper's: join only if c_w > "
                            "c_i - delta_c), or time (join only if w catches up within delta_c of the requester's "
                            "steps at its own measured time per step: a persistently slow worker joins a fast "
                            "one's division only when close; default: measured level, and 2.49x sooner to the "
                            "MNIST target under a 4x straggler with --overlap off on 4 hosts, 5 seeds)",
                            choices=THRESHOLDS)
    nodes: int = option(1, "topology: nodes (nproc must be a multiple)")
    window_ms: float = option(0.0, "ready: how long a request waits for partners, ms; 0: adaptive with --overlap on "
                              "(half the median time between a worker's requests), 50 with --overlap off")
    gg_address: str = option("", "host:port of a running `prague gg serve` (token from $PRAGUE_GG_TOKEN)")
    gg_timeout_s: float = option(300.0, "timeout of one group generator call")
    comm_cache: int = option(64, "members-only communicators kept per worker (LRU; --transport groups)")
    transport: str = option("auto", "P-Reduce: groups (members-only communicators, cached), world (point to point on "
                            "the job's world communicator: no communicator per group), auto (world on NCCL, "
                            "groups on gloo)", choices=TRANSPORTS)
    gg_seed: int = option(0, "seed of the group generator (0: the run's --seed)", run_seed=True)
    overlap: str = option("on", "on: average a snapshot on a background thread while the next iteration computes, "
                          "then correct (delayed averaging); off: block on every P-Reduce", choices=OVERLAP_MODES)
    max_in_flight: int = option(1, "overlap: averages a worker may have in flight at once")
    share_momentum: str = option("off", "on: the SGD momentum buffers travel with the parameters and are averaged in "
                                 "every group (twice the bytes; needs torch.optim.SGD with momentum); off: each "
                                 "worker keeps its own (default: on did not move the accuracy curve, MNIST, 8 "
                                 "workers, straggler:3:4, 3 seeds)", choices=("on", "off"))
    gg_shards: int = option(0, "Group Generator shards (ready only), one service each: each serves the workers of "
                            "a block of whole nodes, the blocks drawn again every --gg-epoch-steps steps so that "
                            "the parts mix; 0: one per 256 workers, at most one per node")
    gg_epoch_steps: int = option(10, "with several --gg-shards: the parts are drawn again every this many steps")
    compress: str = option("none", "what a group exchanges: none (its members' values in full precision, a ring "
                           "all-reduce), int8 (8-bit codes per block of 256 values, gathered by every member, with "
                           "error feedback: the part a message does not carry is sent with the next one; "
                           "DeepSqueeze's rule, about a quarter of the bytes)", choices=CODECS)
    average_by: str = option("equal", "the group's mean: equal (P-Reduce's), or samples (each member weighted by the "
                             "samples it processed since its own last average, so that a fast worker is not pulled "
                             "back toward a slow one's older values)", choices=AVERAGE_BY)
    adapt_size: str = option("off", "ready: on: the group size follows how late the averages come back, between 2 "
                             "and --group-size (one smaller while a third of the steps or more go without an "
                             "average because the last one is still out, one larger again once nearly none do); "
                             "off: always --group-size", choices=("on", "off"))
    levels: int = option(1, "ready: 1: groups of whoever waits; 2: two levels: a group across nodes forms once "
                         "its members are of two nodes or more (partners of other nodes first), and a worker's "
                         "second, fourth... request forms a group of its node at once (its fast links) when its "
                         "node-mates wait too (needs --nodes or --hosts of several workers each; default 1, "
                         "measured: no gain on the congested transformer)")
    final_average: str = option("on", "on: after its last groups each worker waits until every living worker is done "
                                "and averages its full-precision values with all of them once, so that every replica "
                                "ends as the average model (Local SGD's last round); off: each keeps its own replica "
                                "(default on, measured on MNIST with full budgets: the worst replica then is the "
                                "average model, inside DDP's interval where off left it under, for one average of "
                                "under 0.1 s per worker)", choices=("on", "off"))
    when_busy: str = option("local", "overlap: when max-in-flight averages are out, wait for the oldest, or take a "
                            "local step without averaging (static always waits: its fixed schedule needs every "
                            "worker's every request)", choices=WHEN_BUSY)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.group_size < 2:
            raise ConfigError(f"--group-size must be >= 2, got {self.group_size}")
        if self.delta_c < 1:
            raise ConfigError(f"--delta-c must be >= 1, got {self.delta_c}")
        if self.nodes < 1:
            raise ConfigError(f"--nodes must be >= 1, got {self.nodes}")
        if not 0 <= self.window_ms / 1000 <= threading.TIMEOUT_MAX:
            raise ConfigError(f"--window-ms must be a number of ms in 0..{threading.TIMEOUT_MAX * 1000:.3g} "
                              f"(0: adaptive), got {self.window_ms}")
        check_seconds("--gg-timeout-s", self.gg_timeout_s)
        if self.gg_address:
            check_address("--gg-address", self.gg_address)
        if self.comm_cache < 1:
            raise ConfigError(f"--comm-cache must be >= 1, got {self.comm_cache}")
        if self.max_in_flight < 1:
            raise ConfigError(f"--max-in-flight must be >= 1, got {self.max_in_flight}")
        if self.gg_shards < 0:
            raise ConfigError(f"--gg-shards must be >= 0 (0: one per 256 workers), got {self.gg_shards}")
        if self.gg_shards > 1 and self.base_generator != "ready":
            raise ConfigError(f"--gg-shards {self.gg_shards} needs the ready generator (--generator ready): "
                              f"{self.generator} fixes groups ahead of time, which a worker moving between "
                              "shards would leave behind")
        if self.average_by != "equal" and self.compress != "none":
            raise ConfigError(f"--average-by {self.average_by} weighs full-precision values; with --compress "
                              f"{self.compress} the members' codes are averaged equally: drop one of the two")
        if self.adapt_size == "on" and self.base_generator != "ready":
            raise ConfigError(f"--adapt-size on needs the ready generator (--generator ready): {self.generator} "
                              "fixes its groups ahead of time at --group-size")
        if self.threshold != DEFAULT_THRESHOLD and self.base_generator != "smart":
            raise ConfigError(f"--threshold {self.threshold} needs the smart generator (--generator smart): "
                              f"{self.generator} has no threshold")
        if self.levels not in (1, 2):
            raise ConfigError(f"--levels must be 1 or 2, got {self.levels}")
        if self.levels == 2 and self.base_generator != "ready":
            raise ConfigError(f"--levels 2 needs the ready generator (--generator ready): {self.generator} has "
                              "its own schedule")
        if self.gg_epoch_steps < 1:
            raise ConfigError(f"--gg-epoch-steps must be >= 1, got {self.gg_epoch_steps}")

    def check_job(self, nproc: int) -> None:
        check_levels(self.levels, self.topology(nproc), "--levels")
        check_group_size(self, nproc)

    def shard_count(self, topology: Topology) -> int:
        """The Group Generator's shards for a job laid out as ``topology``: ``--gg-shards``, or for 0 one per
        :data:`~prague.groups.shards.WORKERS_PER_SHARD` workers (at most one per node); 1 for every generator
        but ``ready`` and for the static schedule. ConfigError for more shards than nodes."""
        from prague.groups.shards import ShardPlan, auto_shards

        if self.base_generator != "ready":
            return 1
        count = self.gg_shards or auto_shards(topology.size, topology.nodes)
        ShardPlan(topology, count, self.gg_epoch_steps)  # checks it
        return count

    @property
    def base_generator(self) -> str:
        """The policy's name in :data:`prague.groups.GENERATORS`: ``generator`` without ``-blind``."""
        return self.generator.removesuffix(BLIND)

    @property
    def blind(self) -> bool:
        """Whether the generator is given one node holding every rank instead of the job's ``--nodes``."""
        return self.generator.endswith(BLIND)

    @property
    def is_static(self) -> bool:
        """The static schedule (blind or not): each worker computes its groups itself, no service."""
        return self.base_generator == "static"

    def topology(self, nproc: int) -> Topology:
        """The topology the generator gets for a job of ``nproc`` workers (ConfigError unless ``--nodes``
        divides ``nproc``, blind or not): ``--nodes`` nodes, or one node when blind."""
        if nproc % self.nodes:
            raise ConfigError(f"--nproc {nproc} is not a multiple of --nodes {self.nodes}; use a divisor of {nproc}")
        return self.generator_topology(Topology(self.nodes, nproc // self.nodes))

    def generator_topology(self, physical: Topology) -> Topology:
        """The topology the generator gets on a cluster laid out as ``physical``: it, or one node holding
        every rank when blind (the simulator keeps ``physical`` for its costs)."""
        return Topology.flat(physical.size) if self.blind else physical

    def equal_shares(self) -> bool:
        """Only the static schedule needs every worker's every request; the service's generators group
        whoever asks and let a finished worker leave."""
        return self.is_static

    @property
    def busy_policy(self) -> str:
        """What a worker does with ``max_in_flight`` averages out: ``when_busy``, except that the static
        schedule pairs every worker's k-th request with its partners' k-th, so skipping one would leave
        a partner waiting for ever; static (blind too) always waits."""
        return "wait" if self.is_static else self.when_busy

    @property
    def window_s(self) -> float:
        """The ready window the generator gets: the one given, else 0 (adaptive) for overlapped workers,
        whose waiting requests do not stall compute, and :data:`BLOCKING_WINDOW_S` for blocking ones."""
        if self.window_ms > 0:
            return self.window_ms / 1000.0
        return 0.0 if self.overlap == "on" else BLOCKING_WINDOW_S

    @property
    def uses_service(self) -> bool:
        """Whether this job needs a Group Generator service of its own (``static`` and ``static-blind``
        need none; with ``--gg-address`` the user runs it)."""
        return not self.is_static and not self.gg_address


def overlap_report(options: PragueOptions, *, steps: int, local_steps: int, busy_local_steps: int,
                   average_waits: int, averaging_s: float, exposed_s: float) -> dict[str, Any]:
    """The overlap fields of ``prague``'s stats, from counts the runtime keeps per worker and the
    simulator sums over workers: ``steps`` run, groups of one, steps taken locally while busy, waits for
    an earlier average, seconds of averaging (asking plus P-Reduce) and of it the worker waited on."""
    return {
        "overlap": options.overlap,
        "max_in_flight": options.max_in_flight,
        "when_busy": options.busy_policy,
        "busy_local_steps": busy_local_steps,
        "average_waits": average_waits,
        "local_step_share": (local_steps + busy_local_steps) / max(1, steps),
        "averaging_s": averaging_s,
        "exposed_averaging_s": exposed_s,
        "hidden_comm_share": max(0.0, 1.0 - exposed_s / averaging_s) if averaging_s > 0 else 0.0,
    }


def final_report(options: PragueOptions, ranks: int, seconds: float, distance: float | None) -> dict[str, Any]:
    """The stats of the last average over every living worker (``--final-average``): the workers in it (0:
    none ran), its seconds (the runtime's per worker; the simulator's summed over workers) and the replicas'
    distance from their average just before it (the runtime's: this worker's; the simulator's: the mean
    over workers, None without arithmetic)."""
    return {"final_average": options.final_average, "final_average_ranks": ranks, "final_average_s": seconds,
            "final_average_distance": distance}


METHOD = Method(
    name="prague",
    summary=("Prague (ASPLOS 2020): a local optimizer step, then one call to the Group Generator service for this "
             "iteration's group, then P-Reduce (average of one flat buffer of all parameters and buffers) with that "
             "group only. Variants pick the generator: `static` (a conflict-free schedule each worker computes "
             "itself, no round trip), `smart` (the paper's: random divisions into groups of `--group-size`, "
             "alternating intra-/inter-node, through per-worker FIFOs in one global order, with the threshold rule "
             "`--delta-c`, weighed by each worker's measured time per step (`--threshold time`, the default) or "
             "counted in steps as the paper does (`--threshold steps`)), "
             "`random` (one random group per request: the naive generator), `ready` (ours: groups "
             "formed only from workers already waiting, within a window (adaptive by default), preferring partners not met "
             "recently); `static-blind` and `smart-blind` (the same generators given one node holding every rank, "
             "while `--nodes` still lays out the job: what their intra-/inter-node alternation buys). By default "
             "(`--overlap on`) the Group Generator call and P-Reduce run on a background thread on a "
             "snapshot of the parameters while the next iteration computes, and the worker adds the group's correction "
             "(average minus snapshot) when it arrives: delayed averaging (CoCoD-SGD, IJCAI 2019; Overlap-SGP, ICML "
             "2019); with `--max-in-flight` averages already out a worker takes a local step (`--when-busy local`, default; "
             "static always waits) or waits for the oldest (`wait`). After the last step every worker averages once with "
             "all the living others (`--final-average on`), so that the replicas end as the average model."),
    paper="Luo, Lin, Zhuo, Qian, Prague: High-Performance Heterogeneity-Aware Asynchronous Decentralized Training, "
          "ASPLOS 2020 (arXiv 1909.08029)",
    options=PragueOptions,
    runtime="prague.algorithms.prague.runtime:Prague",
    sim="prague.algorithms.prague.sim:SimPrague",
    variant_option="generator",
    reports={
        "generator": "the group generator",
        "group_size": "the requested group size",
        "groups_run": "groups this worker executed (including groups of one)",
        "local_steps": "groups of one: iterations without communication",
        "mean_group_size": "mean size of the groups executed",
        "shrunk_groups": "groups that averaged without members that had failed (crashed or hung; see `failures`)",
        "compress": "what the groups exchanged: none (full precision) or int8 (8-bit codes, error feedback)",
        "average_by": "the group's mean: equal, or weighted by each member's samples since its last average",
        "averaging_sent_bytes": "bytes this worker sent in its group averages (a ring all-reduce's 2 (p - 1) / p of "
                                "the values; compressed, p - 1 messages)",
        "overlap": "whether averaging ran in the background (on) or blocked the worker (off)",
        "max_in_flight": "overlap: averages a worker could have out at once",
        "when_busy": "overlap: what a worker did with max-in-flight averages out (wait, local)",
        "busy_local_steps": "overlap: steps that took no average because max-in-flight averages were out "
                            "(--when-busy local)",
        "average_waits": "overlap: steps that waited for an earlier average before submitting (--when-busy wait)",
        "local_step_share": "share of steps without averaging: groups of one plus busy local steps",
        "averaging_s": "seconds the averaging spent asking the generator and in P-Reduce",
        "exposed_averaging_s": "seconds the worker waited on averaging (all of it when overlap is off)",
        "hidden_comm_share": "share of the averaging time hidden behind compute (0 when overlap is off)",
        "final_average": "whether the replicas ended with one average over every living worker (--final-average)",
        "final_average_ranks": "the workers of that last average (0: none ran)",
        "final_average_s": "seconds of that last average, after the wait for the last worker to finish",
        "final_average_distance": "||x_i - mean|| of the replicas just before that last average (this worker's; the "
                                  "simulator's: the mean over workers): the consensus distance it removed",
        **COMM_REPORTS,
        "generator_stats": "the service's own counters (rank 0 only)",
    },
    sim_reports={
        "gg_shards": "Group Generator shards (--gg-shards; 1 without sharding)",
        "gg_utilization": "share of the run the Group Generator's thread was busy (the busiest shard's)",
        "gg_utilization_per_shard": "each shard's share of the run busy",
        "gg_mean_queue_s": "mean seconds a request queued in front of the Group Generator (its shard)",
        "gg_latency_p50_s": "median seconds from a request to its answer (its group formed), sampled",
        "gg_latency_p99_s": "99th percentile of the same",
        "policy_us_per_call": "CPU microseconds of one decision of the real policy code, timed while simulating",
        "policy_core_share": "share of one core the policy would need at the simulated request rate",
    },
    survives_failures=True,
)
