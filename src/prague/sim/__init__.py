"""The simulator's engine layer: a cluster in simulated time, knowing nothing about any one method.

* :mod:`~prague.sim.engine`: the heap-based event loop (and why not SimPy);
* :mod:`~prague.sim.cluster`: the cluster description (presets, TOML, validation);
* :mod:`~prague.sim.costs`: closed-form costs and link sharing;
* :mod:`~prague.sim.traffic`: cross traffic, the seeded bursts on the nodes' links (``--cross-traffic``);
* :mod:`~prague.sim.world`: what every simulated method shares (compute draws, logs, groups meeting);
* :mod:`~prague.sim.math`: optional real arithmetic (``--math real``);
* :mod:`~prague.sim.method`: the interface of a method's simulator model.

Each method's model lives with the method (``prague/algorithms/<name>/sim.py``); the driver that runs
methods on a cluster (``prague simulate``, calibration) is :mod:`prague.simulate`.
"""
