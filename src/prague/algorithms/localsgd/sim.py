"""``localsgd`` in simulated time: H steps of compute, then an all-reduce of the model over all workers.

Mirrors :mod:`prague.algorithms.localsgd.runtime`: a worker computes and takes a local step; after every
``--sync-every-steps`` H steps (:func:`prague.algorithms.localsgd.decisions.ends_round`, the runtime's
rule) it joins the all-reduce of the model's bytes over all n workers, which starts when the slowest has
joined and takes ``cluster.allreduce_ring_factor`` times the alpha-beta ring time (as ``eager-sgd``'s
flat all-reduce: nothing to overlap, it follows the optimizer step). The time from joining to the end is
the step's communication, the wait for the slowest included, as the runtime counts it. A job whose
steps are not a multiple of H ends with one more all-reduce after the last step (the runtime's
``finish``). With ``--math real`` the average is :meth:`prague.sim.math.RealMath.average` over everyone,
and :meth:`SimLocalSGD.combine` what follows it (``diloco``: the outer step).
"""

from __future__ import annotations

from typing import Any

from prague.algorithms.localsgd import round_report
from prague.algorithms.localsgd.decisions import ends_round
from prague.sim.engine import Process
from prague.sim.method import SimMethod


class SimLocalSGD(SimMethod):
    """``localsgd`` in simulated time; see the module docstring."""

    key = "localsgd"

    def __init__(self, world: Any, options: Any) -> None:
        super().__init__(world, options)
        self.steps = 0  # summed over workers, as the other counts
        self.averages = 0
        self.step_averages = 0
        self.averaging_s = 0.0

    def combine(self, members: tuple[int, ...]) -> None:
        """Once per average, right after the members' rows became their mean (real arithmetic only)."""

    def _on_average(self, members: tuple[int, ...]) -> None:
        self.world.math.average(members)
        if self.world.math.enabled:
            self.combine(members)

    def _average(self, w: int, round_id: int) -> Process:
        world = self.world
        factor = world.cluster.allreduce_ring_factor
        t0 = world.engine.now
        yield world.meet((self.key, round_id), tuple(range(world.n)), cost_s=lambda ring_s: factor * ring_s,
                         setup=False, on_done=self._on_average)
        self.averages += 1
        self.averaging_s += world.engine.now - t0

    def worker(self, w: int) -> Process:
        world = self.world
        engine, math = world.engine, world.math
        every = self.options.sync_every_steps
        in_round = rounds = 0
        for k in range(world.steps):
            compute = world.compute_s(w, k)
            yield compute
            math.local_step(w, k)
            t0 = engine.now
            in_round += 1
            self.steps += 1
            if ends_round(in_round, every):
                yield from self._average(w, rounds)
                self.step_averages += 1
                in_round, rounds = 0, rounds + 1
            world.record(w, compute, engine.now - t0, 0.0)
        if in_round:  # the runtime's finish: a last, shorter round
            yield from self._average(w, rounds)

    def stats(self) -> dict[str, Any]:
        return round_report(self.options, steps=self.steps, averages=self.averages,
                            step_averages=self.step_averages, averaging_s=self.averaging_s)
