"""``allreduce`` in simulated time: every iteration, one ring all-reduce over all n workers.

Mirrors :mod:`prague.algorithms.allreduce.runtime` (PyTorch DDP, as Horovod): the all-reduce of iteration k
completes ``exposed x T_ring(n)`` after the *last* worker's compute ends, where ``T_ring`` is the
alpha-beta ring cost (:func:`prague.sim.costs.ring_allreduce_s`) and ``exposed`` the share DDP's
bucketed overlap with backward does not hide (``cluster.allreduce_exposed``). As in the runtime, the
time a fast worker spends waiting for the slowest inside DDP counts as communication.
"""

from __future__ import annotations

from prague.sim.engine import Process
from prague.sim.method import SimMethod


class SimAllReduce(SimMethod):
    """``allreduce`` in simulated time; see the module docstring."""

    def worker(self, w: int) -> Process:
        world = self.world
        engine, math = world.engine, world.math
        everyone = tuple(range(world.n))
        exposed = world.cluster.allreduce_exposed

        def charged(ring_s: float) -> float:
            return exposed * ring_s

        for k in range(world.steps):
            compute = world.compute_s(w, k)
            yield compute
            t0 = engine.now

            def update(members: tuple[int, ...], k: int = k) -> None:
                math.allreduce_step(members, k)

            yield world.meet(("allreduce", k), everyone, cost_s=charged, setup=False, on_done=update)
            world.record(w, compute, engine.now - t0, 0.0)
