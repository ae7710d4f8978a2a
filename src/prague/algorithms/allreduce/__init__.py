"""``allreduce``: synchronous data parallelism, the reference, and the synchronous variants practitioners
run against stragglers.

* ``allreduce`` (``allreduce:ddp``): PyTorch DistributedDataParallel. Runtime :mod:`.runtime` (DDP with a
  timing communication hook); simulator model :mod:`.sim`.
* ``allreduce:backup``: synchronous SGD with backup workers (Chen et al. 2016): each step applies the mean
  of the first n - b gradients to arrive. Decisions :mod:`.backup_rules` (pure); runtime :mod:`.backup`;
  simulator model :mod:`.backup_sim`.
* ``allreduce:balanced``: DDP with speed-balanced batches (LB-BSP, SoCC 2020). Decisions
  :mod:`.balanced_rules` (pure); runtime :mod:`.balanced`; simulator model :mod:`.balanced_sim`.
* ``allreduce:drop``: DDP that lets a persistently slow rank leave. Decisions :mod:`.drop_rules` (pure);
  runtime :mod:`.drop`; simulator model :mod:`.drop_sim`.
"""

from __future__ import annotations

from dataclasses import dataclass

from prague.algorithms.spec import Method, Options, option
from prague.errors import ConfigError

MAX_BUCKET_MB = 2**63 / 2**20  # DDP counts a bucket's bytes in a signed 64-bit integer
#: DDP's bucket cap when none is given, MB, and its first bucket's (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``).
DDP_BUCKET_MB = 25.0
DDP_FIRST_BUCKET_MB = 1.0
SYNCS = ("ddp", "backup", "balanced", "drop")
#: ``--backup`` when not given: one backup worker, the setting Chen et al. found most of the gain with.
DEFAULT_BACKUP = 1
MAX_DROP_FACTOR = 1e6


@dataclass(frozen=True)
class AllReduceOptions(Options):
    sync: str = option("ddp", "allreduce: ddp (DistributedDataParallel: every step waits for every worker), "
                       "backup (each step applies the mean of the first n - b gradients to arrive; late ones "
                       "are dropped), balanced (DDP with each worker's share of a step's samples set from its "
                       "speed) or drop (DDP that lets a persistently slow rank go and goes on without it)",
                       choices=SYNCS)
    bucket_cap_mb: float | None = option(None, "DDP gradient bucket size in MB (default: DDP's own, 25 with a "
                                               "first bucket of 1, which lets the last layers' all-reduce start "
                                               "early in backward)")
    backup: int = option(DEFAULT_BACKUP, "allreduce:backup: b, the backup workers: a step goes on once n - b "
                                         "workers' gradients are in, and the b latest are dropped (0: wait for "
                                         "all, as DDP, but without overlap)")
    drop_factor: float = option(2.0, "allreduce:drop: a rank whose median compute time over a window is above "
                                     "this times the median rank's is slow; slow in two windows in a row, it "
                                     "leaves the job")
    lr_scaling: str = option("none", "allreduce: none, or linear: the linear scaling rule (Goyal et al. 2017): the "
                                     "learning rate times the workers (a step's batch is n workers' batches), "
                                     "reached over --scaling-warmup-steps", choices=("none", "linear"))
    scaling_warmup_steps: int = option(100, "allreduce --lr-scaling linear: steps of gradual warm-up from the "
                                            "one-worker learning rate (0: none)")
    rebalance_every: int = option(20, "allreduce:balanced: steps between two splits of the step's samples from the "
                                      "ranks' measured compute time per sample")
    drop_window: int = option(20, "allreduce:drop: steps per window over which the ranks' compute times are "
                                  "compared (the first window is the probe)")
    find_unused_parameters: bool = option(False, "allreduce (DDP's option): find the parameters a forward pass did "
                                                 "not use, so that a model with an unused branch trains")
    static_graph: bool = option(False, "allreduce (DDP's option): the model's graph and its used parameters are "
                                       "the same in every step, which lets DDP plan once")
    broadcast_buffers: bool = option(True, "allreduce (DDP's option): rank 0's buffers (BatchNorm statistics) "
                                           "are broadcast at the start of every forward pass")
    gradient_as_bucket_view: bool = option(True, "allreduce (DDP's option): gradients are views into DDP's "
                                                 "buckets, one copy less (DDP's own default is off)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bucket_cap_mb is not None and not 0 < self.bucket_cap_mb < MAX_BUCKET_MB:
            raise ConfigError(f"--bucket-cap-mb must be a number > 0 and below {MAX_BUCKET_MB:.3g}, "
                              f"got {self.bucket_cap_mb!r}")
        b = self.backup
        if isinstance(b, bool) or not isinstance(b, int) or b < 0:
            raise ConfigError(f"--backup must be a whole number of workers >= 0, got {b!r}")
        f = self.drop_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 1.0 < f <= MAX_DROP_FACTOR:
            raise ConfigError(f"--drop-factor must be a number above 1 and at most {MAX_DROP_FACTOR:g}, got {f!r}; "
                              "2 drops a rank twice as slow as the median")
        s = self.scaling_warmup_steps
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ConfigError(f"--scaling-warmup-steps must be a whole number of steps >= 0, got {s!r}")
        for flag, w in (("--drop-window", self.drop_window), ("--rebalance-every", self.rebalance_every)):
            if isinstance(w, bool) or not isinstance(w, int) or w < 1:
                raise ConfigError(f"{flag} must be a whole number of steps >= 1, got {w!r}")

    def check_job(self, nproc: int) -> None:
        if self.sync == "backup" and nproc > 1 and self.backup >= nproc:
            raise ConfigError(f"--backup {self.backup} leaves no worker to wait for in a job of --nproc {nproc}; "
                              f"use at most {nproc - 1}")

    def equal_shares(self) -> bool:
        return self.sync != "backup"  # a late worker's step is dropped: it takes fewer batches, not the same


METHOD = Method(
    name="allreduce",
    summary=("PyTorch DistributedDataParallel (bucketed gradient all-reduce overlapped with backward), then the "
             "same optimizer step on every rank. The reference. `allreduce:backup`: synchronous SGD with `--backup` "
             "b backup workers: each step applies the mean of the first n - b gradients to arrive, the late ones "
             "are dropped, and every replica stays identical. `allreduce:drop`: DDP that compares the ranks' "
             "compute times every `--drop-window` steps and lets a rank slower than `--drop-factor` times the "
             "median, two windows in a row, leave; the others go on as a smaller DDP job and take its batches. "
             "`allreduce:balanced`: DDP whose workers each take a share of the step's samples in proportion to "
             "their measured speed (every `--rebalance-every` steps), so all finish together; the update is the "
             "mean over all the step's samples."),
    paper=("Li et al., PyTorch Distributed, VLDB 2020; Sergeev and Del Balso, Horovod, 2018; linear scaling: Goyal et al., "
           "Accurate, Large Minibatch SGD, 2017; backup: Chen, Pan, "
           "Monga, Bengio, Jozefowicz, Revisiting Distributed Synchronous SGD, 2016; balanced: Chen et al., "
           "Semi-Dynamic Load Balancing (LB-BSP), SoCC 2020"),
    options=AllReduceOptions,
    runtime="prague.algorithms.allreduce.runtime:AllReduce",
    sim="prague.algorithms.allreduce.sim:SimAllReduce",
    variant_option="sync",
    plain_default=True,
    # DistributedDataParallel's constructor imports torch._dynamo: 1.7 s of CPU in each worker otherwise
    worker_imports=("torch._dynamo",),
    variant_runtimes={"backup": "prague.algorithms.allreduce.backup:BackupAllReduce",
                      "balanced": "prague.algorithms.allreduce.balanced:BalancedAllReduce",
                      "drop": "prague.algorithms.allreduce.drop:DropAllReduce"},
    variant_sims={"backup": "prague.algorithms.allreduce.backup_sim:SimBackupAllReduce",
                  "balanced": "prague.algorithms.allreduce.balanced_sim:SimBalancedAllReduce",
                  "drop": "prague.algorithms.allreduce.drop_sim:SimDropAllReduce"},
    reports={"bucket_cap_mb": "DDP's gradient bucket size",
             "lr_scaling": "none, or linear (the learning rate times the workers after the warm-up)",
             "backup": "allreduce:backup: b, the backup workers",
             "rounds": "allreduce:backup: steps of the job (rounds) this worker took part in",
             "mean_gradients_per_round": "allreduce:backup: gradients averaged in a round, mean over rounds",
             "accepted": "allreduce:backup: this worker's gradients among the first n - b of their round",
             "dropped": "allreduce:backup: this worker's gradients that arrived after their round's n - b",
             "waits": "allreduce:backup: steps in which this worker waited for its round",
             "drop_factor": "allreduce:drop: the factor over the median compute time that makes a rank slow",
             "left": "allreduce:drop: the ranks that left the job, each with the step after which it left",
             "rebalance_every": "allreduce:balanced: steps between two splits of the step's samples",
             "rebalances": "allreduce:balanced: splits made from the measured times",
             "shares": "allreduce:balanced: each rank's samples per step after the last split (null before the "
                       "first)"},
    sim_reports={"buckets": "DDP's gradient buckets the model's gradients fill",
                 "exposed_fraction": "share of the buckets' all-reduce time left after the last worker's "
                                     "backward (the rest hides behind backward)"},
)
