"""Discrete-event simulation of every method at cluster scale, in simulated time (DESIGN.md section 3).

The simulator answers "what would method X gain on my cluster, with my stragglers?" without the
cluster. It drives the runtime's own decision code (the Group Generator policies of
:mod:`prague.groups`, the DS-Sync shuffle, AD-PSGD's neighbour choice, the parameter server's
staleness rules, the heterogeneity :class:`~prague.hetero.spec.Scenario`) and models only the passage of
time: compute-time distributions, alpha-beta links inside and between nodes, ring all-reduce and
P-Reduce costs, parameter-server incast, the GG's service time.

Modules:

* :mod:`~prague.sim.engine`: the heap-based event loop (and why not SimPy);
* :mod:`~prague.sim.cluster`: the cluster description (presets, TOML, validation);
* :mod:`~prague.sim.costs`: closed-form costs and link sharing;
* :mod:`~prague.sim.world`: what every simulated method shares (compute draws, logs, groups meeting);
* :mod:`~prague.sim.methods`: one module per runtime method, and their registry;
* :mod:`~prague.sim.math`: optional real arithmetic (``--math real``);
* :mod:`~prague.sim.run`: one simulated run as a ``summary.json``-shaped record, or a whole benchmark;
* :mod:`~prague.sim.calibrate`: fitting the cost model to a real ``prague bench`` run;
* :mod:`~prague.sim.cli`: ``prague simulate``.

Typical use::

    from prague.sim import SimConfig, simulate, load_cluster
    record = simulate(SimConfig(algorithm="prague:ready", scenario="paper:5", nproc=256, nodes=64,
                                model="resnet18", cluster=load_cluster("paper"), steps=300))
    print(record["throughput_samples_per_s"], record["fraction_of_limit"])
"""

from __future__ import annotations

from prague.sim.calibrate import Calibration, calibrate, calibration_table
from prague.sim.cluster import PAPER, PRESETS, Cluster, Link, load_cluster
from prague.sim.engine import Engine, Signal
from prague.sim.methods import SIM_METHODS, get_sim_method
from prague.sim.run import SimConfig, simulate, simulate_bench

__all__ = [
    "PAPER",
    "PRESETS",
    "SIM_METHODS",
    "Calibration",
    "Cluster",
    "Engine",
    "Link",
    "Signal",
    "SimConfig",
    "calibrate",
    "calibration_table",
    "get_sim_method",
    "load_cluster",
    "simulate",
    "simulate_bench",
]
