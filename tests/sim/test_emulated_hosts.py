"""The simulator's emulated hosts: ``--hosts`` makes the nodes, ``--link-rate`` the inter-node bandwidth,
``--cross-traffic`` the runtime's seeded bursts on every node's link; and ``lossy``'s two hierarchies."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from prague_testing import bench_records

from prague.cli import build_parser
from prague.errors import ConfigError
from prague.net.traffic import PERIOD_S, CrossTraffic, burst_plan
from prague.sim.cluster import Cluster, Link
from prague.sim.traffic import Bursts, node_crossings
from prague.simulate.cli import cmd_simulate
from prague.sim.costs import MIB, ddp_buckets
from prague.simulate.run import SimConfig, gradient_sizes, simulate

# Constant compute, no jitter, no backward to hide the all-reduce behind: every difference below is the network's.
CLUSTER = Cluster(compute_s=0.05, intra=Link.of(10, 64), inter=Link.of(25, 45), backward_share=0.0)
INTER_METHODS = ["allreduce", "lossy", "prague:static", "dssync", "adpsgd", "ps:sync"]


def _parse(argv: list[str]) -> argparse.Namespace:
    return build_parser(only="simulate").parse_args(["simulate", *argv])


def _sim(algorithm: str, **kw: Any) -> dict[str, Any]:
    args: dict[str, Any] = dict(algorithm=algorithm, scenario="homogeneous", nproc=8, nodes=4, steps=20,
                                batch_size=32, model="resnet18", data="synthetic", cluster=CLUSTER, warmup_steps=0,
                                link_rate="1gbit")
    args.update(kw)
    args["hosts"] = args["nodes"] if args.get("link_rate") or args.get("cross_traffic") else None
    return simulate(SimConfig.of(**args)).to_dict()


def test_a_burst_halves_a_lone_transfer_while_it_lasts() -> None:
    # P = 1: a burst every period on every link; 5 MB at 1e8 B/s take half a period.
    bursts = Bursts(CrossTraffic(1.0, 5.0), seed=0, link=Link(0.0, 1e8))
    assert bursts.burst_s == pytest.approx(PERIOD_S / 2)
    assert bursts.busy(0, "out", 0.01) and not bursts.busy(0, "out", 0.07) and bursts.busy(3, "in", 0.12)
    # 0.1 s of work from t=0: 0.025 done in the burst, 0.05 after it, the last 0.025 in the next burst.
    assert bursts.delay_s([(0, "out")], 0.0, 0.1) == pytest.approx(0.05)
    # Four flows against the burst's one get 4/5 of the link; a half share (two transfers) 2/3 of its half.
    assert bursts.delay_s([(0, "out")], 0.0, 0.04, flows=4) == pytest.approx(0.01)
    assert bursts.delay_s([(0, "out")], 0.0, 0.03, share=0.5) == pytest.approx(0.015)
    assert bursts.delay_s([], 0.0, 0.1) == 0.0 and bursts.delay_s([(0, "out")], 0.06, 0.03) == 0.0


def test_bursts_are_the_runtime_plan_and_queue_behind_each_other() -> None:
    # 30 MB at 1e8 B/s: 0.3 s per burst, three periods: a link drawn often stays busy (one connection each way).
    bursts = Bursts(CrossTraffic(0.3, 30.0), seed=7, link=Link(0.0, 1e8))
    plan = burst_plan(7, 2, "in", 400, 0.3)
    free_at, busy = 0.0, []
    for k, drawn in enumerate(plan):
        if drawn:
            start = max(k * PERIOD_S, free_at)
            free_at = start + 0.3
            busy.append((start, free_at))
    probes = [i * 0.0137 for i in range(2900)]  # about 40 s, beyond the first lazily drawn periods
    expected = [any(a <= t < b for a, b in busy) for t in probes]
    assert [bursts.busy(2, "in", t) for t in probes] == expected
    assert any(expected) and not all(expected)


def test_hosts_and_link_rate_make_the_topology_and_the_inter_node_link(tmp_path: Path) -> None:
    out = tmp_path / "sim"
    args = _parse(["--algorithms", "allreduce,prague:static", "--scenarios", "homogeneous", "--nproc", "8",
                   "--hosts", "4", "--link-rate", "200mbit", "--model", "mlp", "--steps", "5", "--out", str(out),
                   "--quiet"])
    assert cmd_simulate(args) == 0
    records = bench_records(out)
    for record in records:
        assert record["sim"]["nodes"] == 4 and record["sim"]["workers_per_node"] == 2
        assert record["sim"]["cluster"]["inter"]["bandwidth_gbps"] == pytest.approx(0.2)
        assert record["sim"]["cluster"]["intra"]["bandwidth_gbps"] == pytest.approx(64)  # paper's, a host's loopback
        assert record["sim"]["link_rate"] == "200mbit" and record["sim"]["cross_traffic"] is None
    default = _parse(["--algorithms", "allreduce", "--scenarios", "homogeneous", "--nproc", "4", "--hosts", "2",
                      "--cross-traffic", "bursts:1:2", "--model", "mlp", "--steps", "3", "--out",
                      str(tmp_path / "default"), "--quiet"])
    assert cmd_simulate(default) == 0
    record = bench_records(tmp_path / "default")[0]
    assert record["sim"]["nodes"] == 2 and record["sim"]["cluster"]["inter"]["bandwidth_gbps"] == pytest.approx(1)
    assert record["sim"]["link_rate"] == "1gbit" and record["sim"]["cross_traffic"]["traffic"] == "bursts:1:2"


def test_allreduce_step_grows_as_bytes_over_the_link_rate() -> None:
    fast, slow = _sim("allreduce", link_rate="1gbit"), _sim("allreduce", link_rate="250mbit")
    gradients = gradient_sizes("resnet18", "synthetic")
    buckets = len(ddp_buckets(gradients, 25 * MIB, MIB))  # DDP's default, one ring each, one after the other
    ring_bytes = 2 * 7 / 8 * sum(gradients)  # each host's link carries 2(n-1)/n of the gradients each way
    per_step = ring_bytes * 8 * (1 / 250e6 - 1 / 1e9)
    assert slow["wall_s"] - fast["wall_s"] == pytest.approx(20 * per_step, rel=1e-6)
    assert fast["wall_s"] == pytest.approx(20 * (0.05 + buckets * 14 * 25e-6 + ring_bytes * 8 / 1e9), rel=1e-6)


@pytest.mark.parametrize("algorithm", INTER_METHODS)
def test_cross_traffic_slows_methods_across_hosts_and_is_seeded(algorithm: str) -> None:
    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return r["wall_s"], r["mean_comm_s"], r["mean_wait_s"], r["sim"]["events"]

    none = _sim(algorithm)
    zero = _sim(algorithm, cross_traffic="bursts:0:20")
    assert key(zero) == key(none)  # P = 0: no burst, not a float of difference
    loaded = _sim(algorithm, cross_traffic="bursts:0.3:20")
    assert loaded["wall_s"] > none["wall_s"] * 1.02
    report = loaded["sim"]["cross_traffic"]
    assert report["delay_s"] > 0 and report["transfers_delayed"] > 0 and report["traffic"] == "bursts:0.3:20"
    assert key(_sim(algorithm, cross_traffic="bursts:0.3:20")) == key(loaded)
    assert key(_sim(algorithm, cross_traffic="bursts:0.3:20", seed=1)) != key(loaded)


def test_cross_traffic_stays_off_a_single_host() -> None:
    one = dict(nodes=1, link_rate=None)
    assert _sim("allreduce", cross_traffic="bursts:1:20", **one)["wall_s"] == _sim("allreduce", **one)["wall_s"]


def test_lossy_hosts_hierarchy_moves_fewer_inter_host_bytes_than_one_ring() -> None:
    flat = _sim("lossy", link_rate="100mbit", options={"hierarchy": "flat", "max_loss": 0.0})
    hosts = _sim("lossy", link_rate="100mbit", options={"hierarchy": "hosts", "max_loss": 0.0})
    assert flat["algorithm_stats"][0]["hierarchy"] == "flat"
    assert hosts["algorithm_stats"][0]["hierarchy"] == "hosts (4 hosts)"
    # Over 4 hosts of 2 ranks: 2(H-1)/H = 1.5 of the bytes on each host link, against 2(n-1)/n = 1.75.
    comm_flat, comm_hosts = flat["mean_comm_s"][0], hosts["mean_comm_s"][0]
    assert comm_hosts / comm_flat == pytest.approx(1.5 / 1.75, rel=0.03)
    assert hosts["throughput_samples_per_s"] > flat["throughput_samples_per_s"]
    # One rank per host, or one host: the hierarchy is one ring, and says so.
    for kw in ({"nproc": 4, "nodes": 4}, {"nodes": 1, "link_rate": None}):
        same = [_sim("lossy", options={"hierarchy": h}, steps=5, **kw) for h in ("hosts", "flat")]
        assert same[0]["algorithm_stats"][0]["hierarchy"] == "flat"
        assert same[0]["wall_s"] == same[1]["wall_s"]


def test_lossy_drops_chunks_that_bursts_make_late_within_the_bound() -> None:
    # One stream: a burst halves its pace (four streams would keep 4/5 of it, and rarely miss the deadline).
    options = {"max_loss": 0.25, "streams": 1}
    quiet = _sim("lossy", nodes=2, steps=60, options=options)
    loaded = _sim("lossy", nodes=2, steps=60, cross_traffic="bursts:0.2:10", options=options)
    assert quiet["algorithm_stats"][0]["steps_with_drops"] == 0
    stats = loaded["algorithm_stats"][0]
    assert stats["steps_with_drops"] > 0 and stats["max_dropped_share"] <= 0.25


@pytest.mark.parametrize("flags,match", [
    (["--link-rate", "1gbit"], "--link-rate acts on the links of emulated hosts; give --hosts"),
    (["--cross-traffic", "bursts:0.3:20"], "--cross-traffic acts on the links of emulated hosts; give --hosts"),
    (["--hosts", "3"], "--nproc 8 is not a multiple of --hosts 3"),
    (["--hosts", "4", "--nodes", "2"], "--nodes 2 differs from --hosts 4"),
    (["--hosts", "4", "--inter-gbps", "10"], "--inter-gbps 10.0 and --hosts both set the inter-node bandwidth"),
    (["--hosts", "4", "--link-rate", "fast"], "--link-rate 'fast' is not a rate"),
    (["--hosts", "4", "--cross-traffic", "bursts:2:20"], "--cross-traffic 'bursts:2:20' is not valid"),
])
def test_bad_host_flags_are_config_errors(tmp_path: Path, flags: list[str], match: str) -> None:
    args = _parse(["--algorithms", "allreduce", "--nproc", "8", "--steps", "2", "--out", str(tmp_path / "o"), *flags])
    with pytest.raises(ConfigError, match=match.replace("(", r"\(")):
        cmd_simulate(args)
    assert not (tmp_path / "o" / "bench.json").exists()


def test_node_crossings_are_both_directions_of_each_node() -> None:
    assert node_crossings((0, 3)) == ((0, "out"), (0, "in"), (3, "out"), (3, "in"))
