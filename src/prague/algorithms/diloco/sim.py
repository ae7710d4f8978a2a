"""``diloco`` in simulated time: ``localsgd``'s rounds (:class:`~prague.algorithms.localsgd.sim.SimLocalSGD`),
with the outer step applied where the average is.

The outer step is arithmetic every rank does alike after the all-reduce, so it costs no simulated time.
With ``--math real`` the members' mean (:meth:`prague.sim.math.RealMath.average`) becomes the outer step
from the round's start (:func:`prague.algorithms.diloco.outer.outer_step`, the runtime's), which every
worker then takes; one start and one momentum buffer stand for every rank's, equal in the runtime.
"""

from __future__ import annotations

from typing import Any

from prague.algorithms.diloco.outer import outer_rule, outer_step
from prague.algorithms.localsgd.sim import SimLocalSGD


class SimDiLoCo(SimLocalSGD):
    """``diloco`` in simulated time; see the module docstring."""

    key = "diloco"

    def __init__(self, world: Any, options: Any) -> None:
        super().__init__(world, options)
        self.rule = outer_rule(options.outer_lr, options.outer_momentum)
        self.round_start: Any = world.math.values(0) if world.math.enabled else None  # every row starts equal
        self.momentum: Any = None

    def combine(self, members: tuple[int, ...]) -> None:
        math = self.world.math
        self.momentum = outer_step(self.round_start, math.values(members[0]), self.momentum, self.rule)
        for w in members:
            math.install(w, self.round_start)
