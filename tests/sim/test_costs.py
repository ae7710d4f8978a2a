"""The cost model against closed forms: a homogeneous all-reduce run is the alpha-beta formula exactly."""

from __future__ import annotations

import pytest

from prague.groups.api import Topology
from prague.sim.cluster import Cluster, Link
from prague.sim.costs import Fabric, Queue, exchange_s, group_link, ring_allreduce_s
from prague.simulate.run import SimConfig, model_size, simulate

LINK = Link(latency_s=20e-6, bandwidth_bytes_per_s=5e9)


def test_ring_allreduce_formula() -> None:
    m = 44.7e6
    assert ring_allreduce_s(1, m, LINK) == 0.0
    assert ring_allreduce_s(2, m, LINK) == pytest.approx(2 * 20e-6 + m / 5e9)
    assert ring_allreduce_s(16, m, LINK) == pytest.approx(30 * 20e-6 + 2 * 15 / 16 * m / 5e9)
    assert ring_allreduce_s(16, m, LINK, bandwidth_share=0.25) == pytest.approx(30 * 20e-6 + 4 * 2 * 15 / 16 * m / 5e9)
    assert exchange_s(2, m, LINK) == pytest.approx(2 * (20e-6 + m / 5e9))


def test_group_link_is_inter_node_once_a_group_spans_nodes() -> None:
    cluster = Cluster(intra=Link.of(5, 100), inter=Link.of(20, 10))
    topo = Topology(4, 4)
    assert group_link((0, 1, 3), topo, cluster) is cluster.intra
    assert group_link((0, 4), topo, cluster) is cluster.inter


def test_fabric_shares_a_node_network_card_between_concurrent_groups() -> None:
    cluster = Cluster(intra=Link(0.0, 1e9), inter=Link(0.0, 1e9))
    fabric = Fabric(Topology(2, 2), cluster)
    alone, t1 = fabric.start((0, 2), 1e9)
    shared, t2 = fabric.start((1, 3), 1e9)  # same two network cards, while the first runs
    assert shared == pytest.approx(2 * alone)
    fabric.end(t1)
    fabric.end(t2)
    again, _ = fabric.start((1, 3), 1e9)
    assert again == pytest.approx(alone)
    off = Fabric(Topology(2, 2), Cluster(intra=cluster.intra, inter=cluster.inter, contention=False))
    off.start((0, 2), 1e9)
    assert off.start((1, 3), 1e9)[0] == pytest.approx(alone)


def test_queue_serves_first_come_first_served() -> None:
    q = Queue()
    assert q.reserve(0.0, 1.0) == 1.0
    assert q.reserve(0.5, 1.0) == 2.0  # waits 0.5 behind the first
    assert q.reserve(5.0, 1.0) == 6.0  # idle in between
    assert q.queued_s == pytest.approx(0.5) and q.busy_s == pytest.approx(3.0) and q.jobs == 3


@pytest.mark.parametrize("nproc,nodes", [(8, 1), (16, 4)])
def test_homogeneous_allreduce_run_matches_the_closed_form(nproc: int, nodes: int) -> None:
    cluster = Cluster(compute_s=0.05, intra=Link.of(10, 80), inter=Link.of(25, 45), allreduce_exposed=1.0)
    steps, batch = 20, 64
    record = simulate(SimConfig(algorithm="allreduce", nproc=nproc, nodes=nodes, steps=steps, batch_size=batch,
                                model="resnet18", data="synthetic", cluster=cluster, warmup_steps=0)).to_dict()
    link = cluster.inter if nodes > 1 else cluster.intra
    _, state_bytes = model_size("resnet18", "synthetic")
    alpha, beta = link.latency_s, link.bandwidth_bytes_per_s
    iteration_s = 0.05 + 2 * (nproc - 1) * alpha + 2 * (nproc - 1) / nproc * state_bytes / beta
    assert record["wall_s"] == pytest.approx(steps * iteration_s, rel=1e-9)
    assert record["throughput_samples_per_s"] == pytest.approx(nproc * batch / iteration_s, rel=1e-9)
    assert record["fraction_of_limit"] == pytest.approx(0.05 / iteration_s, rel=1e-9)
    assert record["mean_comm_s"] == pytest.approx([iteration_s - 0.05] * nproc, rel=1e-9)


def test_exposed_fraction_scales_the_all_reduce() -> None:
    half = Cluster(compute_s=0.05, allreduce_exposed=0.5)
    full = Cluster(compute_s=0.05, allreduce_exposed=1.0)
    runs = [simulate(SimConfig(algorithm="allreduce", nproc=4, steps=5, model="resnet18", cluster=c, warmup_steps=0)).to_dict()
            for c in (half, full)]
    comm_half, comm_full = (r["mean_comm_s"][0] for r in runs)
    assert comm_half == pytest.approx(comm_full / 2, rel=1e-9)
