"""What failures cost a method that cannot go on without a failed worker: a restart from its last checkpoint.

A lockstep method (``allreduce`` and its variants, ``localsgd``, ``diloco``, the synchronous parameter
server) stops when a worker fails; under torchrun (``--max-restarts``) every worker starts again from the
last complete checkpoint (``--checkpoint-every K`` steps; none: from the start). The simulator runs such a
method without its failures and then charges them (:func:`charge`), on the run's own timeline: the
progress made by time t is the run's steps completed by t, so a failure at progress p costs the launcher's
detection (a crash at its next look; a hang once the lease runs out), the restart itself
(``Cluster.restart_s``: every process started again, the rendezvous, the checkpoint read) and the steps
since the checkpoint, done again. A step's failure (``crash:R:S``, ``hang:R:S``) fires when the run first
reaches step S (once per job, as the runtime's harness fires it); a failure rate's (``failures:P``) at the
rank's failure time on the job's clock, which the restarts stretch; one that falls while the job is down
fires once it is up again. Pure.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from prague.hetero.spec import Scenario
from prague.runtime.liveness import LAUNCHER_TICK_S, Failure


@dataclass
class Charge:
    """The failures of a run and what they cost: ``extra_s`` on top of the run without them."""

    extra_s: float = 0.0
    restarts: int = 0
    failures: list[Failure] = field(default_factory=list)


def charge(step_ends: Sequence[float], scenario: Scenario, n: int, restart_s: float, lease_s: float,
           checkpoint_every: int | None) -> Charge:
    """The cost of ``scenario``'s failures for a run whose k-th step ended at ``step_ends[k]`` (the slowest
    rank's, rising) with ``n`` workers (see the module docstring)."""
    out = Charge()
    if not step_ends:
        return out
    end = step_ends[-1]
    checkpoints = [0.0]
    if checkpoint_every:
        checkpoints += [step_ends[k - 1] for k in range(checkpoint_every, len(step_ends) + 1, checkpoint_every)]
    # pending: a step's failure fires at a progress, a rate's at a wall time; each once
    pending: dict[int, tuple[str, float, int, str]] = {}
    for f in scenario.faults:
        if f.step < len(step_ends):  # a fault at a step the run never starts never fires
            pending[len(pending)] = ("progress", 0.0 if f.step == 0 else step_ends[f.step - 1], f.rank, f.kind)
    if scenario.rates:
        for rank in range(n):
            t = scenario.failure_time_s(rank)
            if math.isfinite(t):
                pending[len(pending)] = ("wall", t, rank, "crash")
    wall, progress = 0.0, 0.0  # the job's clock at the start of the current attempt, and its progress then
    while True:
        soonest: tuple[float, float, int] | None = None  # (wall it fires, progress then, key)
        for key, (on, value, _, _) in pending.items():
            if on == "progress":
                if value < progress:  # already passed before this attempt: it fired then
                    continue
                at, reached = wall + value - progress, value
            else:
                at = max(value, wall)  # one that fell while the job was down fires once it is up
                reached = progress + at - wall
            if reached < end and (soonest is None or (at, reached, key) < soonest):
                soonest = (at, reached, key)
        if soonest is None:
            break
        at, reached, key = soonest
        _, _, rank, kind = pending.pop(key)
        steps_done = bisect.bisect_right(step_ends, reached + 1e-12)
        out.failures.append(Failure(rank, steps_done, kind, "simulated: the job restarted from its last checkpoint"))
        detected = (math.floor(at / LAUNCHER_TICK_S) + 1) * LAUNCHER_TICK_S + (lease_s if kind == "hang" else 0.0)
        wall = detected + restart_s
        progress = checkpoints[bisect.bisect_right(checkpoints, reached + 1e-12) - 1]
        out.restarts += 1
    out.extra_s = wall + (end - progress) - end
    return out
