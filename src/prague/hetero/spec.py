"""Heterogeneity injection: declarative, seeded, and pure.

A scenario string describes how workers are made unequal; the runtime and the simulator read the very
same :class:`Scenario` object, so a simulated straggler is the runtime's straggler.

Grammar (terms joined with ``+``)::

    homogeneous             no slowdown (the empty scenario)
    paper:X                 each iteration, each worker is X times slower with probability 1/n
                            (the slowdown model of Prague, Luo et al., ASPLOS 2020)
    straggler:RANK:X        worker RANK is always X times slower
    straggler:RANK:X:A-B    worker RANK is X times slower in its steps A..B-1 only (a transient straggler)
    crash:RANK:STEP         worker RANK dies (raises) when it reaches step STEP
    hang:RANK:STEP          worker RANK freezes (stops making progress without exiting) at step STEP
    failures:P              every worker crashes with probability P in each hour of the job's clock,
                            independently: at the first step it starts once its seeded failure time has
                            passed (large clusters report about 2e-5 per accelerator-hour: Llama 3,
                            Dubey et al. 2024, 419 unexpected interruptions in 54 days on 16,384 GPUs)

Draws are a pure function of (seed, rank, step), computed with a counter-based hash, so they do not
depend on call order: a worker, a test and the simulator all see the same slow iterations.
"""

from __future__ import annotations

import functools
import math
import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from prague.errors import ConfigError

KINDS = ("homogeneous", "paper", "straggler", "crash", "hang", "failures")
#: The stream of :func:`uniform` that failure times are drawn from (slowdowns use others).
_FAILURE_STREAM = 7
#: The largest slowdown factor: a worker a million times slower is as good as a frozen one (hang:RANK:STEP),
#: and a larger factor could stretch a step past what a worker can sleep.
MAX_FACTOR = 1e6
_MASK64 = (1 << 64) - 1


def _splitmix64(x: Any) -> Any:
    """SplitMix64's finaliser of ``x``: a Python int, or an array of unsigned 64-bit ints (element-wise)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@functools.lru_cache(maxsize=1 << 17)
def _prefix(seed: int, stream: int, rank: int) -> int:
    """The hash of ``(seed, stream, rank)`` that every step's draw of that rank's stream starts from."""
    h = _splitmix64(seed & _MASK64)
    for v in (stream, rank):
        h = _splitmix64(h ^ (v & _MASK64))
    return h


def uniform(seed: int, rank: int, step: int, stream: int = 0) -> float:
    """A uniform draw in [0, 1) that depends only on its arguments."""
    h = _splitmix64(_prefix(seed, stream, rank) ^ (step & _MASK64))
    return (h >> 11) * (1.0 / (1 << 53))


def uniform_steps(seed: int, rank: int, start: int, stop: int, stream: int = 0) -> np.ndarray:
    """``uniform(seed, rank, step, stream)`` for every step in ``start..stop-1`` (>= 0), the same floats, computed
    as arrays by :func:`_splitmix64` itself: on unsigned 64-bit arrays its masks change nothing, the arithmetic
    wraps as they would."""
    h: np.ndarray = _splitmix64(np.arange(start, stop, dtype=np.uint64) ^ np.uint64(_prefix(seed, stream, rank)))
    return (h >> 11) * (1.0 / (1 << 53))


@dataclass(frozen=True)
class PaperSlowdown:
    """Each iteration, each of n workers independently runs ``factor`` times slower with probability 1/n."""

    factor: float

    def __post_init__(self) -> None:
        if not 1.0 <= self.factor <= MAX_FACTOR:
            raise ConfigError(f"paper slowdown factor must be in 1..{MAX_FACTOR:g}, got {self.factor!r}; e.g. paper:5")


@dataclass(frozen=True)
class Straggler:
    """Worker ``rank`` runs ``factor`` times slower: always, or in its steps ``start..end-1`` only."""

    rank: int
    factor: float
    start: int = 0
    end: int | None = None

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ConfigError(f"straggler rank must be >= 0, got {self.rank!r}; e.g. straggler:1:3")
        if not 1.0 <= self.factor <= MAX_FACTOR:
            raise ConfigError(f"straggler factor must be in 1..{MAX_FACTOR:g}, got {self.factor!r}; e.g. straggler:1:3")
        if self.start < 0 or (self.end is not None and self.end <= self.start):
            raise ConfigError(f"a transient straggler's steps A-B need 0 <= A < B, got {self.start}-{self.end}; "
                              "e.g. straggler:1:3:0-40")

    def covers(self, step: int) -> bool:
        """Whether the slowdown holds at ``step``."""
        return self.start <= step and (self.end is None or step < self.end)


@dataclass(frozen=True)
class Fault:
    """Worker ``rank`` fails when it reaches step ``step`` (:class:`Crash` or :class:`Hang`)."""

    rank: int
    step: int
    kind: ClassVar[str] = "fault"

    def __post_init__(self) -> None:
        if self.rank < 0 or self.step < 0:
            raise ConfigError(f"{self.kind} rank and step must be >= 0, got rank={self.rank!r} step={self.step!r}; "
                              f"e.g. {self.kind}:2:5")


@dataclass(frozen=True)
class Crash(Fault):
    """Worker ``rank`` raises :class:`InjectedCrash` when it reaches step ``step``."""

    kind: ClassVar[str] = "crash"


@dataclass(frozen=True)
class Hang(Fault):
    """Worker ``rank`` freezes when it reaches step ``step``: the whole process stops (SIGSTOP), so it
    neither exits nor beats its heartbeat, as a wedged machine would."""

    kind: ClassVar[str] = "hang"


@dataclass(frozen=True)
class FailureRate:
    """Every worker crashes with probability ``per_hour`` in each hour of the job's clock (``failures:P``)."""

    per_hour: float

    def __post_init__(self) -> None:
        if not 0.0 < self.per_hour < 1.0:
            raise ConfigError(f"failures:P needs a probability per hour in (0, 1), got {self.per_hour!r}; "
                              "e.g. failures:0.001")

    def time_s(self, seed: int, rank: int, index: int) -> float:
        """``rank``'s failure time, s on the job's clock: exponential with this rate, seeded by (seed, rank)."""
        rate = -math.log1p(-self.per_hour) / 3600.0
        return -math.log1p(-uniform(seed, rank, index, _FAILURE_STREAM)) / rate


class InjectedCrash(RuntimeError):
    """Raised by a worker that a ``crash:RANK:STEP`` scenario told to die."""


@dataclass(frozen=True)
class Scenario:
    """A parsed scenario: zero or more slowdown and crash terms, plus the seed of their draws."""

    text: str = "homogeneous"
    paper: tuple[PaperSlowdown, ...] = ()
    stragglers: tuple[Straggler, ...] = ()
    crashes: tuple[Crash, ...] = ()
    hangs: tuple[Hang, ...] = ()
    rates: tuple[FailureRate, ...] = ()
    seed: int = 0
    _paper_stream: int = field(default=1, repr=False)

    def check_world(self, world_size: int) -> None:
        """Raise ConfigError if a term names a rank that does not exist in a job of ``world_size``."""
        ranks = [s.rank for s in self.stragglers] + [c.rank for c in self.faults]
        for rank in ranks:
            if rank >= world_size:
                raise ConfigError(
                    f"scenario {self.text!r} names rank {rank}, but the job has only {world_size} "
                    f"workers (ranks 0..{world_size - 1}); use a smaller rank or a larger --nproc"
                )

    def slowdown(self, rank: int, step: int, world_size: int) -> float:
        """The factor by which worker ``rank``'s compute is slower at ``step`` (1.0 = nominal)."""
        factor = 1.0
        for term in self.paper:
            if uniform(self.seed, rank, step, self._paper_stream) < 1.0 / world_size:
                factor *= term.factor
        return self.straggler_slowdown(rank, step, factor)

    def paper_slowdowns(self, rank: int, start: int, stop: int, world_size: int) -> dict[int, float]:
        """The steps in ``start..stop-1`` that the ``paper`` terms slow for ``rank``, each with its factor from
        them (the others: 1.0); drawn as arrays, the same draws as :meth:`slowdown`."""
        slowed: dict[int, float] = {}
        if self.paper:
            factor = 1.0
            for term in self.paper:  # every term draws the same number: they slow the same steps
                factor *= term.factor
            draws = uniform_steps(self.seed, rank, start, stop, self._paper_stream)
            for offset in np.flatnonzero(draws < 1.0 / world_size).tolist():
                slowed[start + offset] = factor
        return slowed

    def straggler_slowdown(self, rank: int, step: int, factor: float = 1.0) -> float:
        """``factor`` times the slowdown the ``straggler`` terms give ``rank`` at ``step``."""
        for s in self.stragglers:
            if s.rank == rank and s.covers(step):
                factor *= s.factor
        return factor

    def mean_slowdown(self, rank: int, world_size: int) -> float:
        """The expected slowdown factor of ``rank`` per iteration (for the no-wait limit)."""
        factor = 1.0
        for term in self.paper:
            factor *= 1.0 + (term.factor - 1.0) / world_size
        for s in self.stragglers:
            if s.rank == rank and s.end is None:  # a transient one does not last: the long run's mean
                factor *= s.factor
        return factor

    def crashes_at(self, rank: int, step: int) -> bool:
        """Whether ``rank`` must die at ``step``."""
        return any(c.rank == rank and c.step == step for c in self.crashes)

    def hangs_at(self, rank: int, step: int) -> bool:
        """Whether ``rank`` must freeze at ``step``."""
        return any(h.rank == rank and h.step == step for h in self.hangs)

    @property
    def faults(self) -> tuple[Fault, ...]:
        """The crash and hang terms."""
        return self.crashes + self.hangs

    @property
    def has_faults(self) -> bool:
        """Whether some worker may crash or hang (a term, or a failure rate)."""
        return bool(self.crashes or self.hangs or self.rates)

    def without_failures(self) -> Scenario:
        """This scenario less its crash, hang and failure-rate terms (the same text, seed and slowdowns)."""
        return dataclasses.replace(self, crashes=(), hangs=(), rates=())

    def failure_time_s(self, rank: int) -> float:
        """When ``rank`` fails under the failure rates, s on the job's clock (infinity without a rate)."""
        return min((r.time_s(self.seed, rank, i) for i, r in enumerate(self.rates)), default=math.inf)

    @property
    def is_homogeneous(self) -> bool:
        return not (self.paper or self.stragglers)


FORMS = ("valid forms: homogeneous, paper:X, straggler:RANK:X, straggler:RANK:X:A-B, crash:RANK:STEP, "
         "hang:RANK:STEP, failures:P (join with '+')")


def _number(text: str, term: str, what: str, kind: type) -> float | int:
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(
            f"malformed scenario term {term!r}: {what} {text!r} is not a{'n integer' if kind is int else ' number'}; "
            f"{FORMS}"
        ) from None


def parse_scenario(text: str, seed: int = 0) -> Scenario:
    """Parse a scenario string (see the module docstring); raise ConfigError naming the bad term."""
    text = (text or "homogeneous").strip()
    paper: list[PaperSlowdown] = []
    stragglers: list[Straggler] = []
    crashes: list[Crash] = []
    forms = FORMS
    hangs: list[Hang] = []
    rates: list[FailureRate] = []
    for term in text.split("+"):
        term = term.strip()
        kind, *args = term.split(":")
        if kind == "homogeneous" and not args:
            continue
        if kind == "paper" and len(args) == 1:
            paper.append(PaperSlowdown(float(_number(args[0], term, "factor", float))))
        elif kind == "straggler" and len(args) in (2, 3):
            start, end = 0, None
            if len(args) == 3:
                a, dash, b = args[2].partition("-")
                if not dash:
                    raise ConfigError(f"malformed scenario term {term!r}: steps {args[2]!r} must be A-B; {forms}")
                start, end = int(_number(a, term, "first step", int)), int(_number(b, term, "end step", int))
            stragglers.append(Straggler(int(_number(args[0], term, "rank", int)),
                                        float(_number(args[1], term, "factor", float)), start, end))
        elif kind == "crash" and len(args) == 2:
            crashes.append(Crash(int(_number(args[0], term, "rank", int)), int(_number(args[1], term, "step", int))))
        elif kind == "hang" and len(args) == 2:
            hangs.append(Hang(int(_number(args[0], term, "rank", int)), int(_number(args[1], term, "step", int))))
        elif kind == "failures" and len(args) == 1:
            rates.append(FailureRate(float(_number(args[0], term, "probability per hour", float))))
        else:
            raise ConfigError(f"malformed scenario {text!r}: cannot read term {term!r}; {forms}")
    return Scenario(text=text, paper=tuple(paper), stragglers=tuple(stragglers), crashes=tuple(crashes),
                    hangs=tuple(hangs), rates=tuple(rates), seed=seed)
