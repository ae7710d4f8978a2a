"""``allreduce:drop`` in simulated time: ``allreduce``'s overlapped buckets over the ranks still in the job.

Mirrors :mod:`prague.algorithms.allreduce.drop` with the same decision code
(:class:`~prague.algorithms.allreduce.drop_rules.DropWatch`): every ``--drop-window`` steps the median
simulated compute time of each rank still in the job over the window goes to the watch, and the ranks it
names leave after that step. The others go on with the buckets' all-reduce over themselves only
(:class:`~prague.algorithms.allreduce.sim.SimAllReduce`'s model with that many members) and take the
leavers' batches: each worker's steps come from the runtime's
:class:`~prague.workload.budget.EqualShares`, regrouped as the runtime's loop does. Compute-time draws
beyond the world's ``steps`` (a kept worker runs more steps than its first share) reuse the earlier
draws' jitter. Not modelled: the medians' all-reduce and the set-up of the smaller communicator.
"""

from __future__ import annotations

import statistics
from typing import Any

from prague.algorithms.allreduce.drop_rules import DropWatch
from prague.algorithms.allreduce.scaling import lr_factor
from prague.algorithms.allreduce.sim import SimAllReduce
from prague.sim.costs import Transfer
from prague.sim.engine import Process
from prague.workload.budget import EqualShares


class SimDropAllReduce(SimAllReduce):
    """``allreduce:drop`` in simulated time; see the module docstring."""

    def __init__(self, world: Any, options: Any) -> None:
        super().__init__(world, options)
        n = world.n
        total = n * world.steps
        self.plans = [EqualShares(w, n, total) for w in range(n)]
        self.indices: list[list[int]] = [[] for _ in range(n)]  # each worker's job-wide batch per step
        self.live: tuple[int, ...] = tuple(range(n))
        self.watch = DropWatch(options.drop_factor)
        self.dropped: dict[int, int] = {}
        self._window: dict[int, list[float]] = {w: [] for w in range(n)}
        if world.math.enabled:
            world.math.use_global_batches(lambda w, k: self.indices[w][k])

    def _end_window(self, completed: int) -> None:
        """The last live worker has ended step ``completed - 1``, a window's last: who leaves."""
        medians = {w: statistics.median(self._window[w]) for w in self.live}
        for w in self.live:
            self._window[w] = []
        leaving = self.watch.observe(medians)
        if not leaving:
            return
        for w in leaving:
            self.dropped[w] = completed
        self.live = tuple(w for w in self.live if w not in leaving)
        for w in range(self.world.n):
            self.plans[w].regroup(completed, self.live)

    def worker(self, w: int) -> Process:
        world = self.world
        engine, math = world.engine, world.math
        window = self.options.drop_window
        k = 0
        while (index := self.plans[w].next()) is not None:
            self.indices[w].append(index)
            compute = world.compute_s(w, k % world.steps)
            yield compute
            t0 = engine.now
            self._backward.setdefault(k, []).append((t0, world.backward_s(w, k % world.steps)))
            self._window[w].append(compute)
            members = self.live

            def update(group: tuple[int, ...], k: int = k) -> None:
                math.allreduce_step(group, k, lr_factor(self.options, len(group), k))
                if (k + 1) % window == 0 and len(self.live) > 1:
                    self._end_window(k + 1)

            def exchange(transfer: Transfer, k: int = k, n: int = len(members)) -> float:
                return self.exchange_s(k, transfer, n)

            yield world.meet(("allreduce", k), members, setup=False, on_done=update, exchange_s=exchange)
            world.record(w, compute, engine.now - t0, 0.0)
            k += 1

    def check_done(self) -> None:
        world = self.world
        short = [w for w in self.live if self.plans[w].next() is not None]
        if short or world.open_meetings:
            raise RuntimeError(f"simulated allreduce:drop stopped early: workers {short[:8]} have steps left, "
                               f"{world.open_meetings} all-reduces still wait for members")

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "drop_factor": self.options.drop_factor,
                "left": {str(w): step for w, step in sorted(self.dropped.items())}}
