"""``allreduce``: synchronous data parallelism with PyTorch DistributedDataParallel, the reference.

Runtime: :mod:`.runtime` (DDP with a timing communication hook); simulator model: :mod:`.sim`.
"""

from __future__ import annotations

from dataclasses import dataclass

from prague.algorithms.spec import Method, Options, option
from prague.errors import ConfigError

MAX_BUCKET_MB = 2**63 / 2**20  # DDP counts a bucket's bytes in a signed 64-bit integer
#: DDP's bucket cap when none is given, MB, and its first bucket's (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``).
DDP_BUCKET_MB = 25.0
DDP_FIRST_BUCKET_MB = 1.0


@dataclass(frozen=True)
class AllReduceOptions(Options):
    bucket_cap_mb: float | None = option(None, "DDP gradient bucket size in MB (default: DDP's own, 25 with a "
                                               "first bucket of 1, which lets the last layers' all-reduce start "
                                               "early in backward)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bucket_cap_mb is not None and not 0 < self.bucket_cap_mb < MAX_BUCKET_MB:
            raise ConfigError(f"--bucket-cap-mb must be a number > 0 and below {MAX_BUCKET_MB:.3g}, "
                              f"got {self.bucket_cap_mb!r}")


METHOD = Method(
    name="allreduce",
    summary=("PyTorch DistributedDataParallel (bucketed gradient all-reduce overlapped with backward), then the "
             "same optimizer step on every rank. The reference."),
    paper="Li et al., PyTorch Distributed, VLDB 2020; Sergeev and Del Balso, Horovod, 2018",
    options=AllReduceOptions,
    runtime="prague.algorithms.allreduce.runtime:AllReduce",
    sim="prague.algorithms.allreduce.sim:SimAllReduce",
    reports={"bucket_cap_mb": "DDP's gradient bucket size"},
    sim_reports={"buckets": "DDP's gradient buckets the model's gradients fill",
                 "exposed_fraction": "share of the buckets' all-reduce time left after the last worker's "
                                     "backward (the rest hides behind backward)"},
)
