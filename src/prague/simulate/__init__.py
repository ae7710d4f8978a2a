"""Discrete-event simulation of every method at cluster scale, in simulated time: the driver.

The simulator answers "what would method X gain on my cluster, with my stragglers?" without the
cluster. Each method's simulator model (``prague/algorithms/<name>/sim.py``) drives the method's own
decision code, shared with its runtime, on the engine of :mod:`prague.sim`, which models only the
passage of time. This package runs them:

* :mod:`~prague.simulate.run`: one simulated run as a :class:`~prague.metrics.record.RunRecord`, or a
  whole benchmark;
* :mod:`~prague.simulate.calibrate`: fitting the cost model to a real ``prague bench`` run;
* :mod:`~prague.simulate.cli`: ``prague simulate``.

Typical use::

    from prague.simulate.run import SimConfig, simulate
    from prague.sim.cluster import load_cluster
    record = simulate(SimConfig.of(algorithm="prague:ready", scenario="paper:5", nproc=256, nodes=64,
                                model="resnet18", cluster=load_cluster("paper"), steps=300))
    print(record.throughput_samples_per_s, record.fraction_of_limit)
"""
