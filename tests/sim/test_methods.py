"""Every registered method runs in simulated time, deterministically, and behaves as its design says."""

from __future__ import annotations

import gc
from typing import Any

import pytest

import prague

from prague.algorithms.registry import METHODS
from prague.errors import ConfigError
from prague.sim.cluster import PAPER, Cluster, Link
from prague.sim.method import SimMethod
from prague.simulate.run import SimConfig, simulate

EVERY_METHOD = ["allreduce", "ps:sync", "ps:async", "ps-eager", "adpsgd", "prague:static", "prague:smart",
                "prague:random", "prague:ready", "dssync", "eager-sgd:solo", "eager-sgd:majority", "lossy",
                "localsgd", "diloco"]


def _sim(algorithm: str, scenario: str = "paper:5", **kw: Any) -> dict[str, Any]:
    args: dict[str, Any] = dict(algorithm=algorithm, scenario=scenario, nproc=16, nodes=4, steps=40,
                                batch_size=128, model="resnet18", data="synthetic", cluster=PAPER)
    args.update(kw)
    return simulate(SimConfig.of(**args)).to_dict()


def test_every_method_has_a_simulator_model() -> None:
    for method in METHODS.values():
        assert issubclass(method.sim_class(), SimMethod), method.name
    assert {a.partition(":")[0] for a in EVERY_METHOD} == set(METHODS)


@pytest.mark.parametrize("algorithm", EVERY_METHOD)
def test_every_method_completes_with_consistent_records(algorithm: str) -> None:
    record = _sim(algorithm)
    assert record["simulated"] is True and record["backend"] == "sim"
    assert record["steps"] == 40 and record["nproc"] == 16
    assert 0 < record["fraction_of_limit"] <= 1.0 + 1e-9
    assert len(record["mean_compute_s"]) == 16 and all(c > 0 for c in record["mean_compute_s"])
    assert all(c >= 0 for c in record["mean_comm_s"]) and all(w >= 0 for w in record["mean_wait_s"])
    name, _, variant = algorithm.partition(":")
    assert record["algorithm"] == name and record["variant"] == (variant or None if name != "ps-eager" else "inverse")


@pytest.mark.parametrize("algorithm", ["prague:smart", "prague:ready", "ps:async", "adpsgd"])
def test_same_seed_same_events_other_seed_other_events(algorithm: str) -> None:
    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return (r["wall_s"], r["throughput_samples_per_s"], r["mean_comm_s"], r["mean_wait_s"], r["sim"]["events"],
                r["sim"].get("trace"))

    a, b = (_sim(algorithm, trace=True, steps=25) for _ in range(2))
    assert key(a) == key(b)
    c = _sim(algorithm, trace=True, steps=25, seed=1)
    assert key(c) != key(a)


def test_slowdowns_are_the_runtime_scenarios_draws() -> None:
    from prague.hetero.spec import parse_scenario

    cluster = Cluster(compute_s=0.1, intra=Link(0.0, 1e12), inter=Link(0.0, 1e12))
    record = _sim("adpsgd", nproc=8, nodes=1, cluster=cluster, warmup_steps=0, seed=3)
    scenario = parse_scenario("paper:5", seed=3)
    expected = [sum(0.1 * scenario.slowdown(r, k, 8) for k in range(40)) / 40 for r in range(8)]
    assert record["mean_compute_s"] == pytest.approx(expected, rel=1e-12)


def test_stragglers_hurt_allreduce_and_not_ready() -> None:
    rel = {}
    for algorithm in ("allreduce", "prague:ready", "prague:smart"):
        hom = _sim(algorithm, scenario="homogeneous", steps=60)["throughput_samples_per_s"]
        het = _sim(algorithm, scenario="paper:5", steps=60)["throughput_samples_per_s"]
        rel[algorithm] = het / hom
    assert rel["allreduce"] < 0.4 < rel["prague:ready"]
    assert rel["allreduce"] < rel["prague:smart"]


def test_parameter_server_incast_grows_with_workers() -> None:
    small = _sim("ps:sync", scenario="homogeneous", nproc=4, nodes=1)
    large = _sim("ps:sync", scenario="homogeneous", nproc=16, nodes=1)
    assert large["fraction_of_limit"] < small["fraction_of_limit"]
    assert large["algorithm_stats"][0]["server_receive_utilization"] > 0.5


def test_ps_eager_never_waits_when_the_server_keeps_up() -> None:
    fast = Cluster(compute_s=0.1, intra=Link(1e-6, 1e12), inter=Link(1e-6, 1e12))
    record = _sim("ps-eager", scenario="homogeneous", nproc=4, nodes=1, cluster=fast)
    assert max(record["mean_wait_s"]) < 1e-3
    assert record["algorithm_stats"][0]["mean_staleness"] > 0  # the price: stale gradients


def test_large_runs_finish_for_every_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each generator's run of 256 workers finishes, with the cycle collector off while its engine runs
    (its cost grew with the job's live objects) and on again after."""
    from prague.sim.engine import Engine

    states: list[bool] = []
    pure = prague.BUILD == "pure"  # a compiled Engine's methods cannot be patched: the runs are checked alone
    if pure:
        run = Engine.run
        monkeypatch.setattr(Engine, "run", lambda self, *a: (states.append(gc.isenabled()), run(self, *a))[1])
    assert gc.isenabled()
    for generator in ("static", "smart", "random", "ready"):
        record = _sim(f"prague:{generator}", nproc=256, nodes=64, steps=6)
        assert record["nproc"] == 256 and len(record["mean_compute_s"]) == 256
    assert states == ([False] * 4 if pure else []) and gc.isenabled()


@pytest.mark.parametrize("kw,match", [
    ({"algorithm": "nope"}, "valid choices"),
    ({"nproc": 10, "nodes": 4}, "not a multiple of --nodes"),
    ({"scenario": "straggler:99:2"}, "names rank 99"),
    ({"math": "imaginary"}, "valid choices: mixing, none, real"),
])
def test_bad_configs_are_config_errors(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        SimConfig.of(**{"nproc": 8, **kw})


def test_compressed_groups_charge_the_gathered_codes_not_the_ring() -> None:
    """``prague --compress int8`` in the simulator: each group gathers one message per member, of the
    runtime's byte count, so averaging that a slow link makes the bottleneck takes less time, blocking
    or on the averaging thread."""
    slow = Cluster(compute_s=0.05, intra=Link(1e-4, 2e8), inter=Link(1e-4, 2e8))  # 1.6 Gbit/s
    for overlap in ("off", "on"):
        _compare_codecs(slow, overlap)


def test_adapt_size_forms_pairs_while_the_averages_come_back_late() -> None:
    """``prague --adapt-size on`` in the simulator: the generator's own rule (:mod:`prague.groups.ready`). On
    links too slow for a group of 3 to average within a step, it comes down to pairs, and fewer steps go
    without an average; on links that keep up, it stays at ``--group-size``."""
    def run(inter_bytes_per_s: float, adapt: str) -> dict[str, Any]:
        cluster = Cluster(compute_s=0.1, intra=Link(1e-4, 1e10), inter=Link(1e-4, inter_bytes_per_s))
        record = _sim("prague:ready", scenario="homogeneous", nproc=8, nodes=4, steps=120, cluster=cluster,
                      options={"compress": "int8", "adapt_size": adapt})
        return record["algorithm_stats"][0]

    fixed, adapted = run(1e8, "off"), run(1e8, "on")
    assert "size_changes" not in fixed["generator_stats"]
    assert adapted["generator_stats"]["group_size"] == 2 and adapted["generator_stats"]["size_changes"] >= 1
    assert adapted["generator_stats"]["mean_group_size"] < fixed["generator_stats"]["mean_group_size"] - 0.3
    assert adapted["local_step_share"] < fixed["local_step_share"] - 0.05
    fast = run(1e10, "on")["generator_stats"]
    assert fast["group_size"] == 3 and fast["size_changes"] == 0


def test_two_levels_average_inside_a_node_every_other_time() -> None:
    """``prague --levels 2`` in the simulator: on 4 nodes of 2, a worker's every other request waits in its node's
    pool, so a large share of the groups form inside a node, over its fast links; on slow links between the nodes
    the averages that cross them are half as many, and fewer steps go without an average than with one level."""
    def run(inter_bytes_per_s: float, levels: int) -> dict[str, Any]:
        cluster = Cluster(compute_s=0.1, intra=Link(1e-4, 1e10), inter=Link(1e-4, inter_bytes_per_s))
        record = _sim("prague:ready", scenario="homogeneous", nproc=8, nodes=4, steps=120, cluster=cluster,
                      options={"compress": "int8", "levels": levels, "nodes": 4})
        return record["algorithm_stats"][0]

    one, two = run(1e8, 1), run(1e8, 2)
    assert "node_groups" not in one["generator_stats"]
    generator = two["generator_stats"]
    assert generator["node_groups"] >= 0.3 * generator["groups"]
    assert two["local_step_share"] < one["local_step_share"] - 0.05
    fast = run(1e10, 2)["generator_stats"]
    assert fast["node_groups"] >= 0.4 * fast["groups"]


def test_smart_threshold_in_time_keeps_a_persistent_straggler_out_of_the_fast_workers_groups() -> None:
    """``prague:smart --threshold time`` in the simulator, blocking (``--overlap off``), one worker 4x slower: the
    step rule puts it into the fast workers' divisions while it is fewer than ``delta_c`` steps behind, and they
    wait for it; weighed by its measured step time it joins only its own divisions and those it is level with, so
    the fast workers spend far less time averaging and train faster. Without a straggler the two rules give the same run."""
    def run(scenario: str, threshold: str) -> dict[str, Any]:
        return _sim("prague:smart", scenario=scenario, nproc=8, nodes=4, steps=120,
                    options={"overlap": "off", "threshold": threshold, "nodes": 4})

    steps, timed = run("straggler:3:4", "steps"), run("straggler:3:4", "time")
    assert timed["algorithm_stats"][0]["averaging_s"] < 0.5 * steps["algorithm_stats"][0]["averaging_s"]
    assert timed["throughput_samples_per_s"] > 1.5 * steps["throughput_samples_per_s"]
    excluded = [r["algorithm_stats"][0]["generator_stats"]["excluded_by_threshold"] for r in (steps, timed)]
    assert excluded[1] > excluded[0]
    same = [run("homogeneous", rule) for rule in ("steps", "time")]
    assert same[0]["sim"]["groups"] == same[1]["sim"]["groups"] and same[0]["job_s"] == same[1]["job_s"]
    with pytest.raises(ConfigError, match="--threshold steps needs the smart generator"):
        _sim("prague:ready", options={"threshold": "steps"})  # time, the default, is refused by none


def _compare_codecs(slow: Cluster, overlap: str) -> None:
    from prague.comm.codecs import member_send_bytes
    from prague.simulate.run import model_size

    runs = {codec: _sim("prague:ready", scenario="homogeneous", nproc=8, nodes=4, steps=40, cluster=slow,
                        options={"compress": codec, "overlap": overlap})
            for codec in ("none", "int8")}
    stats = {codec: r["algorithm_stats"][0] for codec, r in runs.items()}
    assert stats["int8"]["compress"] == "int8"
    if overlap == "off":  # blocking: the shorter averages are the step's
        assert stats["int8"]["averaging_s"] < 0.6 * stats["none"]["averaging_s"]
        assert runs["int8"]["throughput_samples_per_s"] > runs["none"]["throughput_samples_per_s"]
    else:  # on the averaging thread, whose time also holds the wait for partners
        assert stats["int8"]["averaging_s"] < 0.9 * stats["none"]["averaging_s"]
    per_group = {codec: s["averaging_sent_bytes"] / s["preduces"] for codec, s in stats.items()}
    assert per_group["int8"] < 0.6 * per_group["none"]  # groups of 2-3: 0.26-0.52 of the ring's bytes
    numel = model_size("resnet18", "synthetic")[1] // 4
    assert per_group["int8"] >= member_send_bytes(numel, 2, "int8") / 2  # each member sends a message


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_weighted_groups_in_the_simulator_weigh_each_member_by_its_steps(overlap: str) -> None:
    """``prague --average-by samples`` in the simulator: each member of a group weighs its steps since its
    last average (the runtime's rule), so with a straggler the replicas mix differently than under the
    equal mean; without a straggler every group's members weigh about alike."""
    runs = {by: _sim("prague:ready", scenario="straggler:1:4", nproc=8, nodes=2, steps=60, math="mixing",
                     options={"average_by": by, "overlap": overlap, "final_average": "off"})
            for by in ("equal", "samples")}
    assert runs["samples"]["algorithm_stats"][0]["average_by"] == "samples"
    assert runs["samples"]["consensus_distance"] != runs["equal"]["consensus_distance"]
    assert runs["samples"]["consensus_distance"] < 3 * runs["equal"]["consensus_distance"]
