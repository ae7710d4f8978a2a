"""``ps-eager`` in simulated time: push, post the pull, keep computing (no wait in the steady state).

Mirrors :mod:`prague.algorithms.ps_eager.runtime` on the shards of :mod:`prague.algorithms.ps.sim` (async mode):
after backward a worker installs the answer to its previous push if it has not yet (waiting for it only
if the shard has not answered within a whole iteration: ``wait_s``), then sends this push and posts
the pull of the values right after it, and starts computing at once. The answer is installed before
the next forward pass if it has arrived by then. Staleness tau is measured by the server (versions
since the values the gradient was computed on) and scales the step by ``--staleness-lr``
(:func:`prague.algorithms.ps.rules.staleness_scale`); ``--max-staleness`` rejects updates beyond it.
Read-my-writes as in the runtime: right after pushing, the worker takes the shard's step on its own
copy too (the shard's rule, scaled by the tau of the last answer it installed).

With a decision log, a worker logs each push as the runtime does (the shard's answer; logged here when
the shard decides, by the runtime when the answer arrives: the same lines in the same order).
"""

from __future__ import annotations

from typing import Any

from prague.algorithms.ps.rules import staleness_scale
from prague.algorithms.ps.sim import Answer, Shards, log_push
from prague.sim.engine import Process
from prague.sim.method import SimMethod
from prague.sim.world import World


class SimPSEager(SimMethod):
    """``ps-eager`` in simulated time; see the module docstring."""

    def __init__(self, world: World, options: Any) -> None:
        super().__init__(world, options)
        self.shards = Shards(world, options, "async")
        self.installs_before_forward = 0
        self.installs_after_backward = 0
        self.rejections_seen = 0

    def worker(self, w: int) -> Process:
        world = self.world
        engine, math = world.engine, world.math
        base, last_tau = 0, 0
        log = None if world.decisions is None else world.decisions[w]
        pending: Answer | None = None  # the answer to the posted pull

        def install(answer: Answer) -> None:
            nonlocal base, last_tau
            base, last_tau = answer.version, answer.tau
            self.rejections_seen += not answer.accepted
            math.install(w, answer.values)

        for k in world.steps_of(w):
            if pending is not None and pending.at_s <= engine.now:
                install(pending)
                pending = None
                self.installs_before_forward += 1
            compute = world.compute_s(w, k)
            yield compute
            grad = math.gradient(w, k)
            bases = base  # the values this gradient was computed on
            wait = 0.0
            if pending is not None:
                wait = max(0.0, pending.at_s - engine.now)
                if wait > 0.0:
                    yield wait
                install(pending)
                self.installs_after_backward += 1
            pending = self.shards.push_async(world, w, grad, bases, engine.now, k)
            if log is not None:
                log_push(log, k, self.shards.count, pending.tau, pending.scale, pending.accepted)
            scale = staleness_scale(self.shards.book.staleness_lr, last_tau, world.n)
            math.own_step(w, grad, self.shards.async_rule, scale)
            world.record(w, compute, 0.0, wait)

    def stats(self) -> dict[str, Any]:
        return {"mode": "async", **self.shards.stats(self.world),
                "installs_before_forward": self.installs_before_forward,
                "installs_after_backward": self.installs_after_backward, "rejections_seen": self.rejections_seen}
