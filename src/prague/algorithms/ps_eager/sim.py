"""``ps-eager`` in simulated time: push, post the pull, keep computing (no wait in the steady state).

Mirrors :mod:`prague.algorithms.ps_eager.runtime` on the shards of :mod:`prague.algorithms.ps.sim` (async mode):
after backward a worker installs the answer to its previous push if it has not yet (waiting for it only
if the shard has not answered within a whole iteration: ``wait_s``), then sends this push and posts
the pull of the values right after it, and starts computing at once. The answer is installed before
the next forward pass if it has arrived by then. Staleness tau is measured by the server (versions
since the values the gradient was computed on) and scales the step by ``--staleness-lr``
(:func:`prague.algorithms.ps.rules.staleness_scale`); ``--max-staleness`` rejects updates beyond it.
"""

from __future__ import annotations

from typing import Any

from prague.sim.engine import Process
from prague.sim.method import SimMethod
from prague.algorithms.ps.sim import Shards
from prague.sim.world import World


class SimPSEager(SimMethod):
    """``ps-eager`` in simulated time; see the module docstring."""

    def __init__(self, world: World, options: Any) -> None:
        super().__init__(world, options)
        self.shards = Shards(world, options.ps_shards)
        self.installs_before_forward = 0
        self.installs_after_backward = 0

    def worker(self, w: int) -> Process:
        world = self.world
        engine, math = world.engine, world.math
        o = self.options
        base = 0
        pending: tuple[float, int, Any] | None = None  # (reply time, version, values) of the posted pull
        for k in range(world.steps):
            if pending is not None and pending[0] <= engine.now:
                _, base, values = pending
                math.install(w, values)
                pending = None
                self.installs_before_forward += 1
            compute = world.compute_s(w, k)
            yield compute
            grad = math.gradient(w, k)
            bases = base  # the values this gradient was computed on
            wait = 0.0
            if pending is not None:
                wait = max(0.0, pending[0] - engine.now)
                if wait > 0.0:
                    yield wait
                _, base, values = pending
                math.install(w, values)
                self.installs_after_backward += 1
            pending = self.shards.push_async(world, grad, bases, o.staleness_lr, o.max_staleness, engine.now)
            world.record(w, compute, 0.0, wait)

    def stats(self) -> dict[str, Any]:
        return {"mode": "async", "staleness_lr": self.options.staleness_lr, **self.shards.stats(self.world),
                "installs_before_forward": self.installs_before_forward,
                "installs_after_backward": self.installs_after_backward}
