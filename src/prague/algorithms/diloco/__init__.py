"""``diloco``: ``localsgd``'s rounds, each ended by an outer Nesterov step on the averaged change.

Runtime: :mod:`.runtime`; simulator model: :mod:`.sim`; the outer step itself, shared by both:
:mod:`.outer`. The rounds are :mod:`prague.algorithms.localsgd`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prague.algorithms.localsgd import ROUND_REPORTS, LocalSGDOptions
from prague.algorithms.spec import Method, option
from prague.errors import ConfigError

#: The DiLoCo paper's outer optimizer: SGD with Nesterov momentum at these values.
PAPER_OUTER_LR = 0.7
PAPER_OUTER_MOMENTUM = 0.9


def check_outer(outer_lr: float, outer_momentum: float) -> None:
    """Raise ConfigError unless the outer step's learning rate and momentum are usable, naming the bad value."""
    if isinstance(outer_lr, bool) or not isinstance(outer_lr, (int, float)) or not 0 < outer_lr < math.inf:
        raise ConfigError(f"--outer-lr must be a finite number > 0, got {outer_lr!r}; the paper's is 0.7, "
                          "and 1 with --outer-momentum 0 is plain localsgd")
    if isinstance(outer_momentum, bool) or not isinstance(outer_momentum, (int, float)) \
            or not 0 <= outer_momentum < 1:
        raise ConfigError(f"--outer-momentum must be a number in [0, 1), got {outer_momentum!r}; the paper's is 0.9, "
                          "0 turns Nesterov momentum off")


@dataclass(frozen=True)
class DiLoCoOptions(LocalSGDOptions):
    outer_lr: float = option(PAPER_OUTER_LR, "diloco: learning rate of the outer SGD step on the averaged change "
                                             "(the paper's 0.7; 1 with --outer-momentum 0 is localsgd)")
    outer_momentum: float = option(PAPER_OUTER_MOMENTUM, "diloco: Nesterov momentum of the outer step, in [0, 1) "
                                                         "(the paper's 0.9; 0: none)")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_outer(self.outer_lr, self.outer_momentum)


METHOD = Method(
    name="diloco",
    summary=("DiLoCo: `localsgd`'s rounds of `--sync-every-steps` H inner steps with the worker's own optimizer "
             "(the paper's: AdamW), each ended by one all-reduce and an outer step: the averaged change of the "
             "round, start minus the mean of the replicas, is the gradient of an SGD step with Nesterov momentum "
             "(`--outer-lr` 0.7, `--outer-momentum` 0.9) from the round's start, the same on every rank, so the "
             "replicas are equal after each round."),
    paper=("Douillard, Feng, Rusu, Chhaparia, Donchev, Kuncoro, Ranzato, Szlam, Shen, DiLoCo: Distributed "
           "Low-Communication Training of Language Models, arXiv 2311.08105, 2023"),
    options=DiLoCoOptions,
    runtime="prague.algorithms.diloco.runtime:DiLoCo",
    sim="prague.algorithms.diloco.sim:SimDiLoCo",
    reports=ROUND_REPORTS,
)
