"""``allreduce:balanced`` in simulated time: ``allreduce``'s overlapped buckets, each worker's compute in
proportion to its share of the step's samples.

Mirrors :mod:`prague.algorithms.allreduce.balanced` with the same decision code
(:func:`~prague.algorithms.allreduce.balanced_rules.balance`): a step's global batch is n nominal batches;
every ``--rebalance-every`` steps each worker's median simulated compute time per sample over the window
splits it, and from the next step on a worker's compute (and its backward) lasts its share over a nominal
batch times its nominal time. The buckets' all-reduce is :class:`~prague.algorithms.allreduce.sim.SimAllReduce`'s.
Not modelled: the times' all-reduce; with ``--math real`` the arithmetic keeps equal batches (the
simulated time, not the update, follows the shares).
"""

from __future__ import annotations

import statistics
from typing import Any

from prague.algorithms.allreduce.balanced_rules import balance
from prague.algorithms.allreduce.scaling import lr_factor
from prague.algorithms.allreduce.sim import SimAllReduce
from prague.sim.costs import Transfer
from prague.sim.engine import Process

#: The simulated nominal batch: shares are in units of a batch's samples over this.
NOMINAL = 1024


class SimBalancedAllReduce(SimAllReduce):
    """``allreduce:balanced`` in simulated time; see the module docstring."""

    def __init__(self, world: Any, options: Any) -> None:
        super().__init__(world, options)
        n = world.n
        self.shares = [NOMINAL] * n
        self.rebalances = 0
        self._window: dict[int, list[float]] = {w: [] for w in range(n)}

    def _rebalance(self) -> None:
        n = self.world.n
        per_sample = [statistics.median(self._window[w]) for w in range(n)]
        for w in range(n):
            self._window[w] = []
        self.shares = balance(per_sample, NOMINAL * n)
        self.rebalances += 1

    def worker(self, w: int) -> Process:
        world = self.world
        engine, math = world.engine, world.math
        everyone = tuple(range(world.n))
        every = self.options.rebalance_every
        for k in range(world.steps):
            share = self.shares[w]
            fraction = share / NOMINAL
            compute = world.compute_s(w, k) * fraction
            yield compute
            t0 = engine.now
            self._backward.setdefault(k, []).append((t0, world.backward_s(w, k) * fraction))
            self._window[w].append(compute / share)

            def update(members: tuple[int, ...], k: int = k) -> None:
                math.allreduce_step(members, k, lr_factor(self.options, len(members), k))
                if (k + 1) % every == 0 and len(members) > 1:
                    self._rebalance()

            def exchange(transfer: Transfer, k: int = k) -> float:
                return self.exchange_s(k, transfer)

            yield world.meet(("allreduce", k), everyone, setup=False, on_done=update, exchange_s=exchange)
            world.record(w, compute, engine.now - t0, 0.0)

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "rebalance_every": self.options.rebalance_every, "rebalances": self.rebalances,
                "shares": [s / NOMINAL for s in self.shares]}
