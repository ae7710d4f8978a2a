"""Simulated methods, one module per runtime method, and their registry.

Every method of :data:`prague.algorithms.registry.ALGORITHMS` must have an entry here (a test checks
it), so ``prague simulate`` runs everything ``prague bench`` runs.
"""

from __future__ import annotations

from prague.errors import unknown_choice
from prague.sim.methods.adpsgd import SimADPSGD
from prague.sim.methods.allreduce import SimAllReduce
from prague.sim.methods.api import SimMethod
from prague.sim.methods.dssync import SimDSSync
from prague.sim.methods.prague import SimPrague
from prague.sim.methods.ps import SimPS
from prague.sim.methods.ps_eager import SimPSEager

SIM_METHODS: dict[str, type[SimMethod]] = {
    SimAllReduce.name: SimAllReduce,
    SimPrague.name: SimPrague,
    SimDSSync.name: SimDSSync,
    SimPS.name: SimPS,
    SimPSEager.name: SimPSEager,
    SimADPSGD.name: SimADPSGD,
}


def get_sim_method(name: str) -> type[SimMethod]:
    """The simulated method registered as ``name``; an unknown name raises ConfigError listing the valid ones."""
    try:
        return SIM_METHODS[name]
    except KeyError:
        raise unknown_choice("simulated method", name, SIM_METHODS) from None


__all__ = ["SIM_METHODS", "SimMethod", "get_sim_method"]
