"""eager-SGD's decisions, pure: which rounds are synchronous, who starts a round, and what a worker contributes.

Run by every real worker (:mod:`.runtime`) and by the simulator (:mod:`.sim`), so both start the same
rounds for the same reasons. Rounds are numbered 0, 1, ...; round ``t`` carries the gradients of
iteration ``t`` that are ready when it starts (Li et al., "Taming Unbalanced Training Workloads in Deep
Learning with Partial Collective Operations", PPoPP 2020):

* ``solo``: the first worker to finish its gradient of iteration ``t`` starts round ``t``;
* ``majority``: round ``t``'s initiator, a rank drawn from a seed every worker shares
  (:func:`initiator`), starts it when it finishes that gradient, so on average half the workers have;
* every ``sync_every``-th round (:func:`is_sync_round`) waits for every worker's gradient of its
  iteration, as a plain all-reduce would; so does the final round after the last iteration, which
  carries whatever is left.

What a worker's finished gradient means for its round (:func:`activation`) and what every round adds to
the job's counts (:class:`RoundTally`) are the rounds' control flow, written here once: the runtime's
round thread and the simulator's driver both follow it.

A worker contributes everything it has accumulated since its last contribution (:class:`Ledger`); a
gradient that misses its round is carried by the next one the worker takes part in, so none is lost or
counted twice. Under ``--stale-weight inverse`` (the default) a gradient that will arrive s rounds late
enters the sum weighted 1 / (1 + s) (:func:`stale_weight`), the staleness-aware learning rate of Zhang,
Gupta, Lian, Liu, "Staleness-aware Async-SGD for Distributed Deep Learning" (IJCAI 2016), applied per
gradient: heavy-ball momentum on gradients a round old oscillates, and the late share is what it damps.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from prague.errors import ConfigError


def is_sync_round(round_id: int, sync_every: int) -> bool:
    """Whether round ``round_id`` is synchronous (every ``sync_every``-th: rounds L-1, 2L-1, ...)."""
    return sync_every > 0 and (round_id + 1) % sync_every == 0


#: Results a worker may hold unapplied when there are no synchronous rounds.
MAX_PENDING = 16


def result_capacity(sync_every: int) -> int:
    """How many finished rounds a worker may hold before applying them: its round thread waits for room
    before taking another round, which bounds how far the others get ahead of it (``sync_every`` rounds,
    which synchronous rounds bound anyway, else :data:`MAX_PENDING`)."""
    return sync_every if sync_every > 0 else MAX_PENDING


STALE_WEIGHTS = ("inverse", "none")


def stale_weight(rule: str, staleness: int) -> float:
    """The weight of a gradient deposited when the round that will carry it is ``staleness`` rounds past
    the values it was computed on: ``1 / (1 + staleness)`` under ``inverse``, 1 under ``none``."""
    if rule == "none":
        return 1.0
    if rule == "inverse":
        return 1.0 / (1 + max(0, staleness))
    raise ConfigError(f"unknown eager-sgd stale weight {rule!r}; valid: {', '.join(STALE_WEIGHTS)}")


def initiator(round_id: int, nproc: int, seed: int) -> int:
    """``majority``: the rank whose arrival starts round ``round_id``; the same on every worker."""
    if nproc < 1:
        raise ConfigError(f"nproc must be >= 1, got {nproc}")
    return random.Random(f"eager-sgd/{seed}/{round_id}").randrange(nproc)


def starts_round(quorum: str, rank: int, round_id: int, nproc: int, seed: int,
                 live: Sequence[int] | None = None) -> bool:
    """Whether ``rank``, having just finished its gradient of iteration ``round_id``, starts that round
    (when no one has yet); never for a synchronous round, which starts on every worker by itself.
    ``live``: the ranks still taking part after failures (default: all ``nproc``); ``majority`` draws
    the initiator among them, the same draw as without failures when none has failed."""
    if quorum == "solo":
        return True
    if quorum == "majority":
        if live is None:
            return rank == initiator(round_id, nproc, seed)
        return bool(live) and rank == live[initiator(round_id, len(live), seed)]
    raise ConfigError(f"unknown eager-sgd quorum {quorum!r}; valid: solo, majority")


#: :func:`activation`: the round is synchronous (it starts once every worker has deposited its gradient).
SYNC = "sync"
#: :func:`activation`: this worker starts the round (if nobody has yet).
START = "start"


def activation(quorum: str, sync_every: int, rank: int, round_id: int, nproc: int, seed: int,
               live: Sequence[int] | None = None) -> str | None:
    """What ``rank``'s finished gradient of iteration ``round_id`` means for round ``round_id``:
    :data:`SYNC` (a synchronous round, which waits for every worker's gradient), :data:`START` (this
    worker starts it, :func:`starts_round`) or None (another worker will)."""
    if is_sync_round(round_id, sync_every):
        return SYNC
    return START if starts_round(quorum, rank, round_id, nproc, seed, live) else None


@dataclass
class RoundTally:
    """What the rounds carried, as every round adds it (:meth:`add`): how many were synchronous, the
    gradients and the fresh ones in them, and how late each contributed gradient was."""

    sync_rounds: int = 0
    gradients: int = 0
    fresh: int = 0
    staleness: Counter[int] = field(default_factory=Counter)

    def add(self, sync: bool, gradients: int, fresh: int, staleness: Iterable[int]) -> None:
        """One round: whether it was synchronous, its gradients and fresh ones, and how many rounds late
        each gradient this tally counts came (the runtime counts its own worker's, the simulator all)."""
        self.sync_rounds += bool(sync)
        self.gradients += gradients
        self.fresh += fresh
        self.staleness.update(staleness)


@dataclass(frozen=True)
class Contribution:
    """What one worker put into one round: how many gradients, how stale each was, and the sum of the
    weights they entered the sum with (:func:`stale_weight`)."""

    count: int
    staleness: tuple[int, ...]
    weight: float = 0.0

    @property
    def fresh(self) -> int:
        return sum(1 for s in self.staleness if s == 0)


@dataclass
class Ledger:
    """The gradients one worker has computed and not yet contributed (their count and the model version,
    rounds applied, each was computed on). The gradient sum itself lives beside it (a tensor in the
    runtime, nothing in the simulator); whoever holds the ledger keeps the two in step under one lock."""

    versions: list[int] = field(default_factory=list)
    deposited: int = 0
    taken: int = 0
    weight: float = 0.0

    def deposit(self, version: int, weight: float = 1.0) -> None:
        """A gradient computed on the values after ``version`` applied rounds joins the next contribution,
        weighted ``weight`` in the sum."""
        self.versions.append(version)
        self.deposited += 1
        self.weight += weight

    def take(self, round_id: int) -> Contribution:
        """Everything deposited since the last take, as round ``round_id``'s contribution; empties the ledger.
        A gradient computed after applying rounds 0..v-1 (version v) and carried by round r is r - v stale."""
        staleness = tuple(max(0, round_id - v) for v in self.versions)
        self.taken += len(self.versions)
        self.versions = []
        weight, self.weight = self.weight, 0.0
        return Contribution(len(staleness), staleness, weight)

    @property
    def pending(self) -> int:
        return len(self.versions)
