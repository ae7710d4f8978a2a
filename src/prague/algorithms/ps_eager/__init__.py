"""``ps-eager``: an asynchronous parameter server whose pull is posted at once and overlaps compute.

Built on the shards, protocol and rules of :mod:`prague.algorithms.ps`; runtime: :mod:`.runtime`;
simulator model: :mod:`.sim`.
"""

from __future__ import annotations

from dataclasses import dataclass

from prague.algorithms.ps import MOMENTUM_HELP, MOMENTUM_MODES, PS_REPORTS, PS_SIM_REPORTS, ShardOptions
from prague.algorithms.spec import Method, option


@dataclass(frozen=True)
class PSEagerOptions(ShardOptions):
    """The shards' options; momentum is folded by default (heavy-ball momentum oscillates on gradients two
    rounds old: see :meth:`prague.optim.SGDRule.folded`)."""

    ps_momentum: str = option("folded", MOMENTUM_HELP, choices=MOMENTUM_MODES)


METHOD = Method(
    name="ps-eager",
    summary=("Eager-pull parameter server: the pull of fresh parameters is posted as soon as the push is sent and "
             "overlaps the next iteration's compute; each update's learning rate is scaled by its staleness tau "
             "(`--staleness-lr inverse` = lr/max(n-1, tau), default; `none`; `exp`), and `--max-staleness` rejects "
             "(and counts) updates beyond the bound."),
    paper="Li et al., OSDI 2014 (shards); Zhang, Gupta, Lian, Liu, Staleness-aware Async-SGD, IJCAI 2016 (rule)",
    options=PSEagerOptions,
    runtime="prague.algorithms.ps_eager.runtime:EagerParameterServer",
    sim="prague.algorithms.ps_eager.sim:SimPSEager",
    variant_option="staleness_lr",
    reports={
        **PS_REPORTS,
        "installs_before_forward": "fresh values installed before the next forward pass (the overlap worked)",
        "installs_after_backward": "fresh values installed only after the next backward (waited if not there)",
        "rejections_seen": "rejections this worker was told of",
    },
    sim_reports=PS_SIM_REPORTS,
    sgd_only=True,
)
