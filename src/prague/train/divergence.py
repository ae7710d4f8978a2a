"""Divergence: a run whose loss has blown up stops, instead of training on and handing over a broken model.

Each rank of the built-in loop watches its own training loss (:class:`LossWatch`). The rule:

* a loss that is not finite (NaN, inf) has diverged at once;
* a loss that has stayed above ``factor`` times the rank's starting loss for ``window`` consecutive steps
  has diverged. The starting loss is the median of the rank's first :data:`REFERENCE_STEPS` finite
  losses (a resumed run counts the steps of its checkpoint), so one noisy batch neither sets nor trips it.

The defaults (:data:`DEFAULT_FACTOR`, :data:`DEFAULT_WINDOW`) are the flags ``--divergence-factor`` and
``--divergence-window``; a factor of 0 turns the second rule off (a non-finite loss always stops the run).

The first rank that sees a divergence publishes it in the job's store (:class:`DivergenceFlag`, one
``compare_set``: the first report wins); every rank stops before its next step once it sees the report
(methods in lockstep through the loop's stop agreement, on one step), and the run closes as any other:
its averaged model is evaluated and ``summary.json`` records ``diverged`` as ``{rank, step, loss,
last_finite_loss, reason}``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any

from prague.errors import ConfigError

#: A loss this many times the starting loss, for a window of steps, has diverged (0: only non-finite losses).
DEFAULT_FACTOR = 4.0
#: Consecutive steps the loss must stay above the factor.
DEFAULT_WINDOW = 20
#: The starting loss is the median of this many first finite losses.
REFERENCE_STEPS = 10
#: The store key of the first divergence report (JSON of :class:`Divergence`).
DIVERGED_KEY = "prague/diverged"


@dataclass(frozen=True)
class Divergence:
    """Where and how a run diverged: the rank and step whose loss tripped the rule, that loss (None when it
    was not finite: JSON has no NaN), the rank's last finite loss before it, and the rule, in words."""

    rank: int
    step: int
    loss: float | None
    last_finite_loss: float | None
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Divergence:
        return cls(int(data["rank"]), int(data["step"]), data.get("loss"), data.get("last_finite_loss"),
                   str(data.get("reason", "")))


def divergence_line(method: str, diverged: dict[str, Any]) -> str:
    """The one line that reports a diverged run: method, rank, step, the rule and the last finite loss."""
    d = Divergence.from_dict(diverged)
    last = "none" if d.last_finite_loss is None else f"{d.last_finite_loss:.4g}"
    return (f"{method} diverged on rank {d.rank} at step {d.step}: {d.reason}; last finite loss {last}. The model "
            "it left is not trained: lower --lr, or change the method's settings (--divergence-factor and "
            "--divergence-window set the rule)")


def check_rule(factor: float, window: int) -> None:
    """Refuse a rule that cannot work, naming the flag."""
    if not 0 <= factor < math.inf or 0 < factor <= 1:
        raise ConfigError(f"--divergence-factor must be 0 (off) or a finite number above 1 (times the starting "
                          f"loss), got {factor}")
    if window < 1:
        raise ConfigError(f"--divergence-window must be >= 1 step, got {window}")


class LossWatch:
    """One rank's divergence rule (see the module docstring); :meth:`observe` each step's loss."""

    def __init__(self, rank: int, factor: float = DEFAULT_FACTOR, window: int = DEFAULT_WINDOW) -> None:
        check_rule(factor, window)
        self.rank, self.factor, self.window = rank, factor, window
        self._first: list[float] = []
        self.reference: float | None = None
        self.last_finite: float | None = None
        self._above = 0  # consecutive steps above the line, up to now

    def observe(self, step: int, loss: float | None) -> Divergence | None:
        """The divergence this step's ``loss`` completes, or None (also for None: emulated compute)."""
        if loss is None:
            return None
        if not math.isfinite(loss):
            return Divergence(self.rank, step, None, self.last_finite, f"the loss is {loss}")
        previous, self.last_finite = self.last_finite, loss
        if self.reference is None:
            self._first.append(loss)
            if len(self._first) == REFERENCE_STEPS:
                ordered = sorted(self._first)
                self.reference = ordered[len(ordered) // 2]
            return None
        if self.factor == 0 or loss <= self.factor * self.reference:
            self._above = 0
            return None
        self._above += 1
        if self._above < self.window:
            return None
        return Divergence(self.rank, step, loss, previous,
                          f"the loss has stayed above {self.factor:g}x its starting value {self.reference:.4g} for "
                          f"{self.window} steps (now {loss:.4g})")


class DivergenceFlag:
    """The job-wide report of the first divergence, in the store every rank shares."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._seen = False

    def report(self, divergence: Divergence) -> Divergence:
        """Publish ``divergence`` unless another rank did first; the report that stands."""
        stored = self.store.compare_set(DIVERGED_KEY, "", json.dumps(divergence.as_dict()))
        self._seen = True
        return Divergence.from_dict(json.loads(stored))

    @property
    def reported(self) -> bool:
        """Whether this rank has reported or seen a divergence (no store request)."""
        return self._seen

    def seen(self) -> bool:
        """Whether some rank has reported a divergence (one store request until one has)."""
        if not self._seen:
            self._seen = self.store.check([DIVERGED_KEY])
        return self._seen

    def read(self) -> Divergence | None:
        """The report that stands, or None."""
        if not self.store.check([DIVERGED_KEY]):
            return None
        return Divergence.from_dict(json.loads(self.store.get(DIVERGED_KEY)))
