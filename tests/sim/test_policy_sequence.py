"""The simulator drives the runtime's own decision code: same seed and arrival order, same groups.

Each simulated run records every Group Generator call (what, worker, simulated time, answers). Replaying
those calls in the same order and at the same times through the runtime's service core
(:class:`prague.groups.service.GroupGeneratorCore`, with its clock injected) for the buffered and
static policies, and through a fresh policy from :func:`prague.groups.make_generator` for ``ready``
(whose answers can wait on partners), must give the same groups. The configuration is built here the
way the service builds it from ``prague run``'s flags, not taken from the simulator.
"""

from __future__ import annotations

from typing import Any

import pytest

from prague.algorithms.adpsgd.decisions import NeighbourChooser, bipartite_split
from prague.algorithms.dssync.decisions import dssync_groups
from prague.groups import GeneratorConfig, Topology, make_generator
from prague.groups.service import GroupGeneratorCore
from prague.sim.cluster import PAPER
from prague.simulate.run import SimConfig, build, simulate


def _run(generator: str, seed: int, scenario: str = "paper:5", nproc: int = 16, nodes: int = 4) -> list[Any]:
    record = simulate(SimConfig.of(algorithm=f"prague:{generator}", scenario=scenario, nproc=nproc, nodes=nodes,
                                steps=40, model="mlp", cluster=PAPER, seed=seed, trace=True,
                                options={"gg_seed": 0, "group_size": 3, "delta_c": 4, "window_ms": 20.0,
                                         "when_busy": "wait"})).to_dict()  # a request every step
    return record["sim"]["trace"]


def _runtime_config(seed: int, nproc: int = 16, nodes: int = 4) -> GeneratorConfig:
    return GeneratorConfig(nproc=nproc, topology=Topology(nodes, nproc // nodes), group_size=3, delta_c=4,
                           seed=seed, window_s=0.020)


@pytest.mark.parametrize("generator", ["smart", "random", "static"])
def test_buffered_and_static_groups_equal_the_runtime_service(generator: str) -> None:
    trace = _run(generator, seed=5)
    now = [0.0]
    core = GroupGeneratorCore(make_generator(generator, _runtime_config(seed=5)), clock=lambda: now[0])
    iteration: dict[int, int] = {}
    try:
        assert len(trace) > 600
        for what, worker, t, answers in trace:
            now[0] = t
            if what == "request":
                k = iteration.get(worker, 0)
                iteration[worker] = k + 1
                group = core.get_group(worker, k)
                assert [(worker, group.seq, group.members)] == list(answers), (what, worker, t)
            else:
                assert what == "finish"
                groups = core.finish(worker)
                assert [(worker, g.seq, g.members) for g in groups] == list(answers)
    finally:
        core.stop()


def test_ready_groups_equal_a_fresh_runtime_policy() -> None:
    trace = _run("ready", seed=3)
    policy = make_generator("ready", _runtime_config(seed=3))
    kinds = set()
    for what, worker, t, answers in trace:
        kinds.add(what)
        if what == "request":
            got = policy.request(worker, t)
        elif what == "finish":
            got = policy.finish(worker, t)
        else:
            got = policy.poll(t)
        assert [(w, g.seq, g.members) for w, g in got] == list(answers), (what, worker, t)
    assert kinds == {"request", "poll", "finish"}  # the window fired: poll was driven too


def test_static_policy_is_asked_without_a_round_trip() -> None:
    world, method = build(SimConfig.of(algorithm="prague:static", nproc=8, nodes=2, steps=4, model="mlp"))
    method.start()
    world.engine.run()
    assert method.stats()["gg_utilization"] == 0.0
    assert all(w == 0.0 for log in world.wait_log for w in log)


def test_dssync_and_adpsgd_use_the_runtime_choices() -> None:
    world, method = build(SimConfig.of(algorithm="dssync", nproc=12, steps=3, model="mlp",
                                    options={"group_size": 4, "shuffle_seed": 9}))
    for k in range(3):
        expected = {r: g for g in dssync_groups(k, 12, 4, 9) for r in g}
        assert all(method._group(k, r) == expected[r] for r in range(12))
    record_steps = 7
    world, method = build(SimConfig.of(algorithm="adpsgd", scenario="paper:5", nproc=6, steps=record_steps, model="mlp",
                                    options={"adpsgd_seed": 4}))
    method.start()
    world.engine.run()
    actives, passives = bipartite_split(6)
    assert (method.actives, method.passives) == (actives, passives)
    for w in actives:
        runtime = NeighbourChooser(passives, w, 4)
        assert method.chosen[w] == [runtime.next() for _ in range(record_steps)]
