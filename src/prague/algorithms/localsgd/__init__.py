"""``localsgd``: H local optimizer steps, then one average of the replicas over all workers.

Decisions: :mod:`.decisions` (which steps end a round, pure); runtime: :mod:`.runtime`; simulator model:
:mod:`.sim`. ``diloco`` (:mod:`prague.algorithms.diloco`) is the same rounds with an outer step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prague.algorithms.spec import Method, Options, option
from prague.errors import ConfigError

#: ``--sync-every-steps`` when not given: the fastest to 98.5% of H = 2, 4, 8, 16 on the MNIST CNN with 8
#: paced workers on one machine (docs/bench/localsgd-h*.json, docs/methods.md); a slower network favours more.
DEFAULT_SYNC_EVERY_STEPS = 8


@dataclass(frozen=True)
class LocalSGDOptions(Options):
    sync_every_steps: int = option(
        DEFAULT_SYNC_EVERY_STEPS,
        "H: local optimizer steps of every worker between two averages over all workers (1: every step). "
        "The default was the fastest of 2, 4, 8 and 16 to a target on one machine; a slower network may "
        "want more (larger H sends less and mixes less)")

    def __post_init__(self) -> None:
        super().__post_init__()
        h = self.sync_every_steps
        if isinstance(h, bool) or not isinstance(h, int) or h < 1:
            raise ConfigError(f"--sync-every-steps must be a whole number of steps >= 1, got {h!r}; "
                              "1 averages after every step")


#: What ``localsgd`` and ``diloco`` report, per worker (the simulator: summed over workers).
ROUND_REPORTS: dict[str, str] = {
    "sync_every_steps": "H: local steps between two averages over all workers",
    "averages": "averages over all workers after a round of H steps, plus one after a last, shorter round",
    "local_step_share": "share of steps not followed by an average",
    "averaging_s": "seconds spent in the averages (the all-reduce, waiting for the slowest worker included)",
}


def round_report(options: LocalSGDOptions, *, steps: int, averages: int, step_averages: int,
                 averaging_s: float) -> dict[str, Any]:
    """The fields of :data:`ROUND_REPORTS`, from counts the runtime keeps per worker and the simulator sums
    over workers: ``steps`` run, ``averages`` run (``step_averages`` of them right after a step, the rest
    after the last step), their seconds."""
    return {"sync_every_steps": options.sync_every_steps, "averages": averages,
            "local_step_share": (steps - step_averages) / max(1, steps), "averaging_s": averaging_s}


METHOD = Method(
    name="localsgd",
    summary=("Local SGD: every worker takes `--sync-every-steps` H local steps with its own optimizer (whose state "
             "stays local), then every replica's parameters and floating buffers are averaged over all workers by "
             "one all-reduce of one flat buffer; a last, shorter round ends the job. One all-reduce per H steps "
             "instead of one per step: against slow networks."),
    paper=("Stich, Local SGD Converges Fast and Communicates Little, ICLR 2019; Lin, Stich, Patel, Jaggi, Don't Use "
           "Large Mini-Batches, Use Local SGD, ICLR 2020"),
    options=LocalSGDOptions,
    runtime="prague.algorithms.localsgd.runtime:LocalSGD",
    sim="prague.algorithms.localsgd.sim:SimLocalSGD",
    reports=ROUND_REPORTS,
)
