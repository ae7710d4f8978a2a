"""The job-wide budget: how much work the job as a whole does, and which batch each worker takes next.

``--budget epochs:E | samples:N | seconds:T`` measures the job, not a worker: E passes over the training
set across all workers together (every sample once per epoch), N samples, or T seconds of training on
the common clock (:mod:`prague.train.evaluation`). Methods whose workers may run different numbers of steps
(:meth:`prague.algorithms.spec.Options.equal_shares` is False: ``prague`` with a service generator,
``adpsgd``, ``ps:async``, ``ps-eager``) take their batches from a counter in the job's store
(:class:`SharedBatches`), a chunk at a time, so a fast worker takes more batches than a slow one and
nobody waits for the slowest worker's quota. The others need every rank in every step (``allreduce``,
``ps:sync``, ``eager-sgd``, ``dssync``, ``lossy``, ``prague:static``): they take equal shares by
construction (:class:`EqualShares`), and stop together (:class:`StopAgreement`) when the time is up or
the target is reached.

Batches are addressed globally (:class:`prague.workload.data.GlobalBatches`): batch ``g`` of the job is
batch ``g mod B`` of epoch ``g div B`` (B full batches per epoch), so whichever worker takes it, every
sample is used once per epoch. The chunk size follows guided self-scheduling (Polychronopoulos and Kuck,
"Guided Self-Scheduling: A Practical Scheduling Scheme for Parallel Supercomputers", IEEE Trans. Computers
1987): large while much is left, one batch at the end, so the last claims leave no worker with a long
tail of batches while the others are done, and the counter is touched a few times per worker per chunk
rather than every step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from prague.errors import ConfigError

BUDGET_KINDS = ("epochs", "samples", "seconds")
#: The largest chunk a worker claims at once (batches).
MAX_CHUNK = 16
CLAIM_KEY = "prague/budget/claimed"
STOP_STEP_KEY = "prague/budget/stop-step"


@dataclass(frozen=True)
class Budget:
    """One ``--budget``: ``kind`` (epochs, samples or seconds) and its ``amount``."""

    kind: str
    amount: float

    @property
    def text(self) -> str:
        return f"{self.kind}:{self.amount:g}"

    @property
    def seconds(self) -> float | None:
        """The training time of a ``seconds`` budget, else None."""
        return self.amount if self.kind == "seconds" else None

    def total_batches(self, train_samples: int, batch_size: int) -> int | None:
        """The batches the whole job processes (None for a time budget): E epochs of ``train_samples //
        batch_size`` full batches (a partial batch counts as one, float error does not), or N samples in
        batches of ``batch_size`` (rounded up)."""
        if self.kind == "seconds":
            return None
        if self.kind == "epochs":
            per_epoch = train_samples // batch_size
            if per_epoch < 1:
                raise ConfigError(f"--batch-size {batch_size} is larger than the {train_samples} training samples; "
                                  "lower it")
            return max(1, math.ceil(round(self.amount * per_epoch, 6)))
        return max(1, math.ceil(self.amount / batch_size))


def parse_budget(text: str, flag: str = "--budget") -> Budget:
    """``epochs:3`` -> Budget("epochs", 3.0); ConfigError naming ``flag`` and the form on anything else."""
    kind, sep, value = str(text).strip().partition(":")
    form = f"give {flag} epochs:E, samples:N or seconds:T (e.g. epochs:3)"
    if not sep or kind not in BUDGET_KINDS:
        raise ConfigError(f"{flag} {text!r} is not a budget; {form}")
    try:
        amount = float(value)
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: {value!r} is not a number; {form}") from None
    if not 0 < amount < math.inf or (kind == "samples" and amount != int(amount)):
        what = "a whole number of samples > 0" if kind == "samples" else "a finite number > 0"
        raise ConfigError(f"{flag} {text!r}: the amount must be {what}; {form}")
    if kind == "seconds" and amount > 1e9:
        raise ConfigError(f"{flag} {text!r}: at most 1e9 seconds; {form}")
    return Budget(kind, amount)


def claim_size(remaining: int | None, nproc: int, max_chunk: int = MAX_CHUNK) -> int:
    """Batches a worker claims at once with ``remaining`` batches left in the job (None: no limit):
    guided self-scheduling, ``remaining / (2 nproc)`` capped at ``max_chunk``, at least 1."""
    if remaining is None:
        return max_chunk
    return max(1, min(max_chunk, remaining // (2 * max(1, nproc))))


class KeyValue(Protocol):
    """The part of ``torch.distributed.Store`` the budget uses."""

    def add(self, key: str, value: int) -> int: ...

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...

    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes: ...


class SharedBatches:
    """Global batch indices from a counter in the store, for methods whose workers may take unequal
    shares. Every index in ``0..total-1`` goes to exactly one worker; ``next()`` is None once the budget
    is spent. Each call touches the store only when this worker's claimed chunk is used up."""

    def __init__(self, store: KeyValue, total: int | None, nproc: int, *, key: str = CLAIM_KEY) -> None:
        self.store, self.total, self.nproc, self.key = store, total, nproc, key
        self._next = 0
        self._end = 0
        self.claims = 0

    def next(self) -> int | None:
        if self._next >= self._end:
            if not self._claim():
                return None
        index = self._next
        self._next += 1
        return index

    def _claim(self) -> bool:
        remaining = None
        if self.total is not None:
            remaining = self.total - self.store.add(self.key, 0)
            if remaining <= 0:
                return False
        size = claim_size(remaining, self.nproc)
        end = self.store.add(self.key, size)
        self.claims += 1
        start = end - size
        if self.total is not None:
            end = min(end, self.total)
        if start >= end:
            return False
        self._next, self._end = start, end
        return True


class EqualShares:
    """Global batch indices for methods that need every rank in every step: rank r takes batches
    ``r, r + n, r + 2n, ...``, ``total // n`` of them (the remainder, fewer than n batches, is left out),
    or without end under a time budget."""

    def __init__(self, rank: int, nproc: int, total: int | None) -> None:
        self.rank, self.nproc, self.total = rank, nproc, total
        self.steps = None if total is None else total // nproc
        if self.steps == 0:
            raise ConfigError(f"the budget is {total} batch(es), fewer than the {nproc} workers this method runs "
                              "in lockstep; raise --budget or lower --nproc")
        self._k = 0
        self._base, self._done = 0, 0  # since the last regroup: first batch index, steps before it
        self._index, self._size = rank, nproc  # this rank's place among the ranks stepping, and their number

    def next(self) -> int | None:
        if self.steps is not None and self._k >= self.steps:
            return None
        index = self._base + self._index + (self._k - self._done) * self._size
        self._k += 1
        return index

    def window_start(self, index: int) -> int:
        """The first batch index of the step that handed out ``index`` to this rank: the step's batches,
        every rank's, are ``window_start .. window_start + ranks stepping - 1``."""
        return index - self._index

    def regroup(self, completed: int, ranks: Sequence[int]) -> None:
        """From step ``completed`` on (every rank has completed that many), only ``ranks`` take steps: the
        batches not taken yet, the leavers' included, are shared among them in the same way. A rank not
        among them takes none."""
        if not ranks:
            raise ConfigError("regroup needs at least one rank still stepping")
        self._base += (completed - self._done) * self._size
        self._done = self._k = completed
        self._size = len(ranks)
        if self.rank not in ranks:
            self.steps = completed
            return
        self._index = list(ranks).index(self.rank)
        if self.total is not None:
            self.steps = completed + (self.total - self._base) // self._size


class StopAgreement:
    """The step at which every rank of a lockstep method stops, once one of them must stop (time is up,
    or the target was reached).

    Every rank publishes the steps it has completed (the loop's progress record) before it asks
    :meth:`stop_before` ahead of each step; ``published()`` reads every rank's count. The first rank that
    must stop proposes the largest count plus one, and the store keeps the first proposal
    (``compare_set``); every rank then stops when it has completed that many steps. A rank running step k
    published k before it checked, so the agreed stop is past every step already started: no rank is left
    waiting in a step its peers skip."""

    def __init__(self, store: KeyValue, published: Callable[[], Iterable[int]]) -> None:
        self.store, self.published = store, published
        self._stop: int | None = None

    def stop_before(self, completed: int, must_stop: bool) -> bool:
        """Whether this rank, having completed ``completed`` steps, stops now; ``must_stop``: it would
        stop on its own (its clock passed the budget, or the target was reached)."""
        if self._stop is None and self.store.check([STOP_STEP_KEY]):
            self._stop = int(self.store.get(STOP_STEP_KEY))
        if self._stop is None and must_stop:
            proposal = max([completed, *self.published()]) + 1
            self._stop = int(self.store.compare_set(STOP_STEP_KEY, "", str(proposal)))
        return self._stop is not None and completed >= self._stop

