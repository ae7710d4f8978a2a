"""The update rules of the parameter server, as pure functions (the SGD step itself: :mod:`prague.optim`),
and a shard's version and staleness bookkeeping (:class:`ShardBook`), written once for the shard process
and the simulator.

Shared by the shards (:mod:`prague.algorithms.ps.server`), which apply them, by ``ps-eager`` workers
(:mod:`prague.algorithms.ps_eager.runtime`), which apply their own update to their local copy as well
("read-my-writes"), and by the simulator models of both (:mod:`prague.algorithms.ps.sim`).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from prague.algorithms.ps.protocol import MODES, MOMENTUM_MODES, STALENESS_RULES, Layout
from prague.errors import ConfigError, unknown_choice
from prague.metrics.decisions import ShardPush
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


@dataclass(frozen=True)
class Admission:
    """What a shard does with one asynchronous push: its staleness ``tau``, whether it is applied, the
    factor of the learning rate (0 when rejected) and the version after it; :attr:`record` for the trace."""

    tau: int
    accepted: bool
    scale: float
    version: int
    record: ShardPush


class ShardBook:
    """A parameter-server shard's control flow over versions, written once: the shard process
    (:mod:`.server`, under its lock) and the simulator (:mod:`.sim`, one book for every shard: they see
    the pushes in one order) drive it; each applies the arithmetic its own way.

    Asynchronous: :meth:`admit` a push computed on ``base_version`` (staleness, acceptance, scale; an
    accepted push moves the version on). Synchronous: :meth:`contribute` each worker's push to the round
    of version + 1, then :meth:`close_round` once all ``nproc`` have. Per worker it counts the applied
    updates by staleness and the rejected ones."""

    def __init__(self, mode: str, nproc: int, staleness_lr: str, max_staleness: int) -> None:
        if mode not in MODES:
            raise unknown_choice("parameter-server mode", mode, MODES)
        self.mode, self.nproc, self.staleness_lr, self.max_staleness = mode, nproc, staleness_lr, max_staleness
        self.version = 0
        self.histogram: list[Counter[int]] = [Counter() for _ in range(nproc)]
        self.rejected = [0] * nproc

    def admit(self, worker: int, base_version: int, step: int) -> Admission:
        """An asynchronous push of ``worker``'s ``step``; ConfigError for one computed on a version ahead of
        this shard's (a protocol error: the shard fails)."""
        tau = self.version - base_version
        if tau < 0:
            raise ConfigError(f"worker {worker} pushed a gradient computed on version {base_version}, ahead of "
                              f"this shard's version {self.version}")
        ok = accepts(tau, self.max_staleness)
        scale = update_scale("async", self.staleness_lr, tau, self.nproc, ok)
        if ok:
            self.version += 1
            self.histogram[worker][tau] += 1
        else:
            self.rejected[worker] += 1
        record = ShardPush(worker, step, base_version, tau, scale, ok, self.version)
        return Admission(tau, ok, scale, self.version, record)

    def contribute(self, worker: int, base_version: int, step: int) -> ShardPush:
        """A synchronous push of ``worker``'s ``step``, computed on ``base_version``, to the round of this
        shard's version + 1: the trace's record."""
        return ShardPush(worker, step, base_version, 0, update_scale("sync", self.staleness_lr, 0, self.nproc, True),
                         True, self.version + 1)

    def close_round(self) -> int:
        """Every worker has pushed: the round's mean is applied, the version moves on; the new version."""
        self.version += 1
        for hist in self.histogram:
            hist[0] += 1
        return self.version

    def totals(self) -> tuple[Counter[int], int]:
        """The applied updates by staleness and the rejected ones, over every worker."""
        return sum(self.histogram, Counter()), sum(self.rejected)
