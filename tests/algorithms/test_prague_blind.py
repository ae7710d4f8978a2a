"""``prague:static-blind`` and ``prague:smart-blind``: the topology-aware generators given one node holding
every rank, while the job's ``--nodes`` (the physical layout) stays. No processes: the options, the
service's command line, the static schedule and the simulator."""

from __future__ import annotations

from pathlib import Path

import pytest

from prague.algorithms.prague import METHOD, PragueOptions
from prague.algorithms.prague.runtime import Prague
from prague.algorithms.prague.source import gg_argv
from prague.algorithms.registry import parse_method
from prague.errors import ConfigError
from prague.groups import GeneratorConfig, Topology, make_generator, static_group, static_schedule
from prague.metrics.report import method_label
from prague.simulate.run import SimConfig, build, simulate
from prague.train.config import follow_hosts


def _options(variant: str, **values: object) -> PragueOptions:
    options: PragueOptions = METHOD.make_options({"nodes": 4, **values}, variant)
    return options


def _argv_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_blind_variants_round_trip_and_name_their_base() -> None:
    for base in ("static", "smart"):
        variant = f"{base}-blind"
        assert parse_method(f"prague:{variant}") == (METHOD, variant)
        options = _options(variant)
        assert METHOD.variant_of(options) == variant
        assert (options.base_generator, options.blind) == (base, True)
        assert METHOD.make_options({"generator": variant}) == METHOD.make_options({}, variant)  # --generator too
    assert (_options("smart").base_generator, _options("smart").blind) == ("smart", False)
    with pytest.raises(ConfigError, match="static-blind"):
        parse_method("prague:ready-blind")  # ready and random ignore the topology: no blind versions


def test_blind_topology_is_one_node_and_still_checks_nodes() -> None:
    assert _options("static-blind").topology(8) == Topology(1, 8)
    assert _options("smart-blind").topology(8) == Topology(1, 8)
    assert _options("static").topology(8) == Topology(4, 2)
    with pytest.raises(ConfigError, match="--nproc 6 is not a multiple of --nodes 4"):
        _options("smart-blind").check_job(6)
    # With emulated hosts --nodes follows --hosts; the blind generator still sees one node.
    hosted: PragueOptions = METHOD.make_options(follow_hosts(METHOD, {}, 4), "smart-blind")
    assert hosted.nodes == 4 and hosted.topology(8) == Topology(1, 8)


def test_static_blind_groups_are_the_one_node_schedule() -> None:
    blind, aware = _options("static-blind").topology(8), _options("static").topology(8)
    one_node = Topology(1, 8)
    for k in range(8):
        assert static_schedule(k, blind) == static_schedule(k, one_node)
        assert [static_group(k, r, blind) for r in range(8)] == [static_group(k, r, one_node) for r in range(8)]
    # Aware static alternates inter-node (one representative per node) and intra-node groups; blind does not.
    assert static_schedule(0, aware)[0].members == (0, 2, 4, 6)
    assert [g.members for g in static_schedule(1, aware)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [g.members for g in static_schedule(1, blind)] == [tuple(range(8))]
    assert any(static_schedule(k, blind) != static_schedule(k, aware) for k in range(4))


def test_static_blind_needs_no_service_and_always_waits(tmp_path: Path) -> None:
    for variant in ("static", "static-blind"):
        options = _options(variant, when_busy="local")
        assert not options.uses_service and options.busy_policy == "wait"
        assert Prague.job_resources(options, 8, tmp_path).services == ()
    smart_blind = _options("smart-blind", when_busy="local")
    assert smart_blind.uses_service and smart_blind.busy_policy == "local"


def test_smart_blind_service_is_started_with_one_node(tmp_path: Path) -> None:
    (spec,) = Prague.job_resources(_options("smart-blind"), 8, tmp_path).services
    argv = list(spec.argv)
    assert (_argv_value(argv, "--generator"), _argv_value(argv, "--nodes")) == ("smart", "1")
    aware = gg_argv(_options("smart"), 8, 0, tmp_path / "address")
    assert (_argv_value(aware, "--generator"), _argv_value(aware, "--nodes")) == ("smart", "4")


def test_the_threshold_rule_travels_to_the_service_and_is_checked(tmp_path: Path) -> None:
    from prague.groups.api import GeneratorConfig

    # the default rule is the same in the method and in the Group Generator's settings (the service's default)
    assert _options("smart").threshold == GeneratorConfig(nproc=2).threshold == "time"
    assert "--threshold" not in gg_argv(_options("smart"), 8, 0, tmp_path / "address")
    paper = gg_argv(_options("smart", threshold="steps"), 8, 0, tmp_path / "address")
    assert _argv_value(paper, "--threshold") == "steps"
    with pytest.raises(ConfigError, match="--threshold steps needs the smart generator"):
        _options("ready", threshold="steps")
    with pytest.raises(ConfigError, match="threshold"):
        _options("smart", threshold="seconds")


def test_simulated_smart_blind_keeps_the_cluster_and_blinds_the_generator() -> None:
    config = SimConfig.of(algorithm="prague:smart-blind", scenario="paper:5", nproc=8, nodes=4, steps=20, model="mlp",
                       seed=3, trace=True, options={"when_busy": "wait"})
    world, method = build(config)
    assert world.topology == Topology(4, 2)  # the costs keep the physical nodes
    assert method.config.topology == Topology(1, 8) and method.remote
    record = simulate(config).to_dict()
    assert method_label(record) == "prague:smart-blind" and record["sim"]["nodes"] == 4
    stats = record["algorithm_stats"][0]
    assert stats["generator"] == "smart-blind" and stats["generator_stats"]["divisions"] >= 1
    # Replayed in the same order, the groups are those of the runtime's smart policy on one node.
    policy = make_generator("smart", GeneratorConfig(nproc=8, topology=Topology(1, 8), seed=3))
    for what, worker, t, answers in record["sim"]["trace"]:
        got = policy.request(worker, t) if what == "request" else policy.finish(worker, t)
        assert [(w, g.seq, g.members) for w, g in got] == list(answers), (what, worker, t)
