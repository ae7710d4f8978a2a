"""``lossy``: deadline-bounded chunked gradient all-reduce with bounded loss and error feedback (DLCP).

A method of its own rather than an option of ``allreduce``: ``allreduce`` is PyTorch DDP itself, the
reference every figure is measured against, while ``lossy`` replaces DDP's collective with its own
(chunks over several communicators, a per-step deadline, an agreed drop mask, a carried residual).

Decisions: :mod:`.decisions` (chunking, priority, the stop rule, the deadline; pure); runtime:
:mod:`.runtime`; simulator model: :mod:`.sim`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from prague.algorithms.spec import Method, Options, option
from prague.errors import ConfigError

HIERARCHIES = ("hosts", "flat")
MAX_LOSS = 0.5  # above it, a chunk dropped in one step could be dropped again in the next
MAX_STREAMS = 64


@dataclass(frozen=True)
class LossyOptions(Options):
    max_loss: float = option(0.1, "lossy: the largest share of the gradient's elements one step may drop; a "
                             "dropped chunk is carried into the next step (error feedback), in 0..0.5")
    streams: int = option(4, "lossy: communicators the chunks are spread over (parallel connections)")
    chunk_mb: float = option(4.0, "lossy: largest chunk in MB (each stream gets at least 4 chunks)")
    min_chunk_kb: float = option(256.0, "lossy: smallest chunk in KB: a gradient under 4 x --streams x this is cut "
                                 "into fewer chunks (a small exchange is bound by round trips, not bytes)")
    deadline_slack: float = option(1.0, "lossy: a step stops starting chunks after this multiple of the time its "
                                   "chunks take at the median rate of the last 16 steps")
    hierarchy: str = option("hosts", "lossy: hosts: each chunk is reduced inside its host, all-reduced over a ring of "
                            "one rank per host (stream s: each host's local rank s mod the host's ranks), then "
                            "broadcast inside the host; flat: one ring over every rank", choices=HIERARCHIES)
    deadline_quantile: float = option(0.5, "lossy: which of the last 16 steps' rates the deadline is measured at, "
                                      "as a quantile (0.5: the median; 0.75: a faster step's, so more steps drop)")
    priority_tiers: int = option(4, "lossy: layer tiers of the send order (the first layers of the next forward "
                                 "pass first; by magnitude within a tier)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.max_loss <= MAX_LOSS:
            raise ConfigError(f"--max-loss must be a share in 0..{MAX_LOSS} (0: never drop), got {self.max_loss!r}")
        if not 1 <= self.streams <= MAX_STREAMS:
            raise ConfigError(f"--streams must be in 1..{MAX_STREAMS}, got {self.streams!r}")
        if not (math.isfinite(self.chunk_mb) and 0 < self.chunk_mb <= 2**20):
            raise ConfigError(f"--chunk-mb must be a size in MB > 0 and at most {2**20}, got {self.chunk_mb!r}")
        if not (math.isfinite(self.min_chunk_kb) and 0 < self.min_chunk_kb <= 1024 * self.chunk_mb):
            raise ConfigError(f"--min-chunk-kb must be a size in KB > 0 and at most --chunk-mb x 1024 "
                              f"({1024 * self.chunk_mb:g}), got {self.min_chunk_kb!r}")
        if not (math.isfinite(self.deadline_slack) and 0 < self.deadline_slack <= 1e6):
            raise ConfigError(f"--deadline-slack must be a number > 0 and at most 1e6, got {self.deadline_slack!r}")
        if not (math.isfinite(self.deadline_quantile) and 0 <= self.deadline_quantile <= 1):
            raise ConfigError(f"--deadline-quantile must be in 0..1 (0.5: the median rate), got {self.deadline_quantile!r}")
        if not 1 <= self.priority_tiers <= 1024:
            raise ConfigError(f"--priority-tiers must be in 1..1024, got {self.priority_tiers!r}")

    def chunk_elements(self, element_bytes: int = 4) -> int:
        return max(1, int(self.chunk_mb * 2**20) // element_bytes)

    def min_chunk_elements(self, element_bytes: int = 4) -> int:
        return max(1, int(self.min_chunk_kb * 2**10) // element_bytes)


def drops_report(options: LossyOptions, *, chunks: int, shares: list[float], deadlines_s: list[float],
                 control_s: float, hierarchy: str | None = None) -> dict[str, Any]:
    """``lossy``'s stats (the fields :data:`METHOD` reports) from what the runtime keeps per worker and the
    simulator for the job: each step's dropped share (the same on every rank), the deadline of every
    step that had one, the seconds spent agreeing on the masks, and the path the chunks took
    (``hierarchy``: default ``--hierarchy`` itself)."""
    steps = len(shares)
    return {
        "max_loss": options.max_loss,
        "streams": options.streams,
        "hierarchy": hierarchy or options.hierarchy,
        "chunks": chunks,
        "dropped_share": [round(s, 6) for s in shares],
        "mean_dropped_share": sum(shares) / steps if steps else 0.0,
        "max_dropped_share": max(shares, default=0.0),
        "steps_with_drops": sum(1 for s in shares if s > 0),
        "mean_deadline_ms": 1e3 * sum(deadlines_s) / len(deadlines_s) if deadlines_s else 0.0,
        "control_s": control_s,
        "carried_share_end": shares[-1] if shares else 0.0,
    }


METHOD = Method(
    name="lossy",
    summary=("DLCP-style bounded-loss gradient all-reduce: the flat gradient, plus what earlier steps dropped, goes "
             "in chunks over `--streams` streams, in priority order (chunks dropped last step, then the first "
             "layers of the next forward pass, then large magnitudes); on several hosts a chunk is reduced inside its "
             "host, all-reduced over a ring of one rank per host and broadcast back (`--hierarchy hosts`); at a "
             "deadline derived from the measured rate of recent steps every rank stops starting chunks and all agree "
             "on one mask, dropping at most "
             "`--max-loss` of the elements; dropped chunks are carried into the next step (error feedback), and "
             "every rank applies the same averaged gradient."),
    paper=("Wang, Chen, Wan, Tian, Xia, Zeng, Wang, Chen, Bai, Jiang, Domain-specific Communication Optimization for "
           "Distributed DNN Training (DLCP), arXiv 2008.08445; error feedback: Seide et al., 1-Bit SGD, Interspeech 2014"),
    options=LossyOptions,
    runtime="prague.algorithms.lossy.runtime:Lossy",
    sim="prague.algorithms.lossy.sim:SimLossy",
    reports={
        "max_loss": "the largest share of elements a step may drop",
        "streams": "communicators the chunks went over",
        "hierarchy": "the path of a chunk: `hosts (H hosts)` (reduce inside a host, a ring of one rank per host, "
                     "broadcast) or `flat` (one ring over every rank; also `hosts` on one host or one rank per host)",
        "chunks": "chunks the gradient is cut into",
        "dropped_share": "per step, the share of the gradient's elements dropped (carried to the next step); the "
                         "same on every rank",
        "mean_dropped_share": "mean of dropped_share",
        "max_dropped_share": "largest of dropped_share",
        "steps_with_drops": "steps that dropped anything",
        "mean_deadline_ms": "mean deadline of the steps that had one (after the first chunk)",
        "control_s": "seconds spent agreeing on the masks (one small all-reduce per step)",
        "carried_share_end": "share of the elements still carried after the last step (dropped by it, never applied)",
    },
)
