"""``dssync`` in simulated time: local step, then average with this iteration's shuffled group.

The groups are :func:`prague.algorithms.dssync.decisions.dssync_groups` itself (the runtime's partition, from the
shared ``shuffle_seed``), so a simulated worker meets exactly the partners a real one would. No Group
Generator and no round trip; a group waits for its slowest member (blocking P-Reduce).

Failures (``crash``, ``hang``, ``failures:P``): as the runtime's surviving P-Reduce
(:class:`~prague.comm.surviving.LiveGroups`) does, a failed member's group waits for it until it is declared
failed, then averages over its live members (:meth:`~prague.sim.world.World.meet`); the partitions stay
the runtime's, failed ranks and all.
"""

from __future__ import annotations

from typing import Any

from prague.algorithms.dssync.decisions import dssync_groups
from prague.metrics.decisions import Decision
from prague.sim.engine import Process
from prague.sim.method import SimMethod


class SimDSSync(SimMethod):
    """``dssync`` in simulated time; see the module docstring."""

    models_failures = True

    def __init__(self, world: Any, options: Any) -> None:
        super().__init__(world, options)
        world.use_comm_cache(options.comm_cache)
        self._by_rank: dict[int, list[tuple[int, ...]]] = {}  # step -> each rank's group
        self._users: dict[int, int] = {}  # step -> workers that looked it up so far

    def _group(self, step: int, rank: int) -> tuple[int, ...]:
        """``rank``'s group at ``step``; each partition is computed once and dropped when all used it."""
        by_rank = self._by_rank.get(step)
        if by_rank is None:
            n = self.world.n
            by_rank = self._by_rank[step] = [()] * n
            for g in dssync_groups(step, n, self.options.group_size, self.options.shuffle_seed):
                for r in g:
                    by_rank[r] = g
            self._users[step] = 0
        self._users[step] += 1
        if self._users[step] == self.world.n - len(self.world.stopped):  # every worker still running
            del self._by_rank[step], self._users[step]
        return by_rank[rank]

    def worker(self, w: int) -> Process:
        world = self.world
        engine, math = world.engine, world.math
        log = None if world.decisions is None else world.decisions[w]
        for k in range(world.steps):
            fault = world.fault_at(w, k)
            if fault is not None:  # crash or hang: this worker stops here
                world.stop_here(w, k, fault)
                return
            compute = world.compute_s(w, k)
            yield compute
            math.local_step(w, k)
            t0 = engine.now
            members = self._group(k, w)
            if log is not None:
                log.write(Decision.of_group(k, members))
            if len(members) > 1:
                yield world.meet(("dssync", k, members[0]), members, on_done=math.average)
            world.record(w, compute, engine.now - t0, 0.0)

    def stats(self) -> dict[str, Any]:
        return {"group_size": self.options.group_size, **self.world.comm_stats()}
