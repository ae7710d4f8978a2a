"""The update rules of the parameter server, as pure functions (the SGD step itself: :mod:`prague.optim`).

Shared by the shards (:mod:`prague.algorithms.ps.server`), which apply them, by ``ps-eager`` workers
(:mod:`prague.algorithms.ps_eager.runtime`), which apply their own update to their local copy as well
("read-my-writes"), and by the simulator models of both (:mod:`prague.algorithms.ps.sim`).
"""

from __future__ import annotations

import math

from prague.algorithms.ps.protocol import MODES, MOMENTUM_MODES, STALENESS_RULES, Layout
from prague.errors import unknown_choice
from prague.optim import SGDRule


def staleness_scale(rule: str, tau: int, nproc: int) -> float:
    """The factor applied to the learning rate of one push of staleness ``tau`` among ``nproc`` workers.

    ``inverse``: 1/max(n - 1, tau): the 1/tau rule of Zhang, Gupta, Lian, Liu, "Staleness-aware Async-SGD for
    Distributed Deep Learning", IJCAI 2016, with tau floored at n - 1: the staleness of every push when n
    workers push in turn, where n pushes at 1/(n - 1) each make about one synchronous step. A push that
    happens to be fresher (the first round; the last worker still running after the others finished)
    would otherwise take up to n times its share: measured here, the steps of the last workers alone
    undid a converged CNN (97% -> 51% MNIST accuracy). ``exp``: the same share, decaying by a factor e
    for every n versions beyond n - 1 instead of as 1/tau. ``none``: 1, plain asynchronous SGD, n times
    the step of a synchronous round.
    """
    floor = max(1, nproc - 1)
    if rule == "none":
        return 1.0
    if rule == "inverse":
        return 1.0 / max(floor, tau)
    if rule == "exp":
        return math.exp(-max(0, tau - floor) / max(1, nproc)) / floor
    raise unknown_choice("staleness rule", rule, STALENESS_RULES)


def update_scale(mode: str, rule: str, tau: int, nproc: int, accepted: bool) -> float:
    """The factor a shard applies to the learning rate of one push: 0 if it was rejected; 1 in ``sync``
    mode (the push is one of the n gradients whose mean makes one synchronous step); in ``async`` mode
    :func:`staleness_scale` of its staleness ``tau``. What the decision log records for a push."""
    if not accepted:
        return 0.0
    if mode == "sync":
        return 1.0
    if mode == "async":
        return staleness_scale(rule, tau, nproc)
    raise unknown_choice("parameter-server mode", mode, MODES)


def accepts(tau: int, max_staleness: int) -> bool:
    """Whether an update of staleness ``tau`` is applied; ``max_staleness`` <= 0 means no bound."""
    return max_staleness <= 0 or tau <= max_staleness


def sgd_rule(layout: Layout, momentum: str = "worker") -> SGDRule:
    """The workers' optimizer rule, as the layout describes it; with ``momentum="folded"``,
    :meth:`prague.optim.SGDRule.folded` (the mode of asynchronous shards under ``--ps-momentum folded``)."""
    if momentum not in MOMENTUM_MODES:
        raise unknown_choice("momentum mode", momentum, MOMENTUM_MODES)
    rule = SGDRule(layout.lr, layout.momentum, layout.dampening, layout.weight_decay, layout.nesterov)
    return rule.folded() if momentum == "folded" else rule
