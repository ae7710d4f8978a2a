"""What a simulator model reports is declared by its method, with the runtime's meaning and shape."""

from __future__ import annotations

from typing import Any

import pytest

from prague.algorithms.registry import METHODS, parse_method
from prague.sim.cluster import PAPER
from prague.simulate.run import SimConfig, simulate

EVERY_VARIANT = [f"{m.name}:{v}" for m in METHODS.values() for v in m.variants] + \
    [m.name for m in METHODS.values() if not m.variants]


def _stats(algorithm: str, **options: Any) -> dict[str, Any]:
    record = simulate(SimConfig.of(algorithm=algorithm, scenario="paper:5", nproc=8, nodes=2, steps=30, model="mlp",
                                data="digits", cluster=PAPER.replace_fields(preduce_setup_s=0.002),
                                options=options))
    assert record.algorithm_stats is not None and len(record.algorithm_stats) == 1
    return record.algorithm_stats[0]


@pytest.mark.parametrize("algorithm", EVERY_VARIANT)
def test_simulator_reports_only_declared_fields(algorithm: str) -> None:
    method, _ = parse_method(algorithm)
    stats = _stats(algorithm)
    assert not set(method.reports) & set(method.sim_reports), "a field is either shared or simulator-only"
    undeclared = set(stats) - set(method.reports) - set(method.sim_reports)
    assert not undeclared, f"{algorithm} simulator reports undeclared fields {sorted(undeclared)}"


def test_prague_counts_are_summed_over_workers() -> None:
    stats = _stats("prague:smart", comm_cache=2)
    gg = stats["generator_stats"]
    # One request per worker and step, except the steps a worker took locally because its average was
    # still out; every group the generator formed was run once by each of its members (groups of one
    # included), so the workers' runs add up to the generator's memberships.
    assert gg["requests"] == 8 * 30 - stats["busy_local_steps"]
    assert stats["groups_run"] == pytest.approx(gg["groups"] * gg["mean_group_size"])
    # ... and each worker's last average over everyone (--final-average on) is a P-Reduce of its own
    assert stats["final_average"] == "on" and stats["final_average_ranks"] == 8
    assert stats["preduces"] + stats["local_steps"] == stats["groups_run"] + 8
    # Eight workers cycling through many member sets with room for two: builds and evictions on every member.
    assert stats["communicators_created"] > stats["communicators_evicted"] > 0
    assert stats["communicator_create_s"] == pytest.approx(stats["communicators_created"] * 0.002)
    # The workers' view of the groups agrees with the generator's own count.
    assert stats["mean_group_size"] == pytest.approx(stats["generator_stats"]["mean_group_size"])


def test_a_larger_cache_rebuilds_less() -> None:
    small, large = _stats("prague:random", comm_cache=1), _stats("prague:random", comm_cache=64)
    assert large["communicators_evicted"] == 0
    assert small["communicators_created"] > large["communicators_created"]


def test_adpsgd_reports_ranks_and_partners_like_the_runtime() -> None:
    stats = _stats("adpsgd")
    assert sorted(stats["actives"] + stats["passives"]) == list(range(8))
    assert sum(stats["peers"].values()) == stats["requests_initiated"] == len(stats["actives"]) * 30
    assert {int(p) for p in stats["peers"]} <= set(stats["passives"])


@pytest.mark.parametrize("algorithm", ["ps:sync", "ps:async", "ps-eager"])
def test_parameter_server_counts(algorithm: str) -> None:
    stats = _stats(algorithm, ps_shards=2)
    assert stats["pushes"] == 8 * 30 == stats["applied"] + stats["rejected"]
    assert stats["server_versions"] == [stats["applied"] if algorithm != "ps:sync" else 30] * 2
    assert sum(stats["staleness_histogram"].values()) == stats["applied"]
