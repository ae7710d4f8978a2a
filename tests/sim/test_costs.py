"""The cost model against closed forms: a homogeneous all-reduce run is the alpha-beta formula exactly."""

from __future__ import annotations

import pytest

from prague.groups.api import Topology
from prague.sim.cluster import Cluster, Link
from prague.sim.costs import (
    MIB, Fabric, Queue, bucket_ready_s, ddp_buckets, exchange_s, exposed_allreduce_s, group_link,
    overlapped_allreduce_s, ring_allreduce_s,
)
from prague.simulate.run import SimConfig, gradient_sizes, simulate

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


def test_ddp_buckets_keep_tensors_whole_and_close_at_the_cap() -> None:
    assert ddp_buckets([10, 10, 10, 10, 5], 20) == [20, 20, 5]
    assert ddp_buckets([30, 5], 20) == [30, 5]  # a tensor over the cap is a bucket of its own
    assert ddp_buckets([5, 5], 20) == [10]
    # ResNet-18's gradients at DDP's 25 MB: the buckets torch 2.13's DDP rebuilt after its first iteration
    # (``_get_ddp_logging_data()["rebuilt_bucket_sizes"]``, bucket_cap_mb=25 passed explicitly).
    assert ddp_buckets(gradient_sizes("resnet18", "synthetic"), 25 * MIB) == [28872744, 15823104]
    # DDP's default (bucket_cap_mb left unset): a first bucket of 1 MiB. The MNIST CNN's as torch 2.13 rebuilt
    # them: fc2 and fc1 first, the convolutions after.
    assert ddp_buckets(gradient_sizes("cnn", "mnist"), 25 * MIB, MIB) == [1611304, 75264]
    assert ddp_buckets([10, 10, 10, 10, 5], 20, 5) == [10, 20, 15]


def test_backward_produces_the_buckets_at_an_even_rate() -> None:
    assert bucket_ready_s(0.3, [1, 1, 1]) == pytest.approx([0.1, 0.2, 0.3])
    assert bucket_ready_s(0.4, [3, 1], start_s=1.0) == pytest.approx([1.3, 1.4])
    assert bucket_ready_s(0.0, [3, 1], start_s=1.0) == [1.0, 1.0]


def test_communication_shorter_than_backward_exposes_only_the_last_bucket() -> None:
    # Ready at 0.1, 0.2, 0.3; each all-reduce 0.05: done at 0.15, 0.25, 0.35.
    assert exposed_allreduce_s(0.3, [1, 1, 1], lambda size: 0.05) == pytest.approx(0.05)


def test_a_model_bigger_than_one_bucket_queues_its_all_reduces_on_one_stream() -> None:
    # Ready at 0.1, 0.2, 0.3; each all-reduce 0.2: each starts when the previous one is done
    # (0.1 -> 0.3 -> 0.5 -> 0.7), so 0.4 of the 0.6 is left after backward.
    assert exposed_allreduce_s(0.3, [1, 1, 1], lambda size: 0.2) == pytest.approx(0.4)
    assert overlapped_allreduce_s([0.1, 0.2, 0.3], lambda i, start: 0.2) == pytest.approx([0.3, 0.5, 0.7])
    # One bucket (the whole model): nothing overlaps.
    assert exposed_allreduce_s(0.3, [3], lambda size: 0.2) == pytest.approx(0.2)
    # A bucket's time may depend on when it starts (cross traffic): asked with its start.
    starts: list[float] = []

    def timed(i: int, start_s: float) -> float:
        starts.append(start_s)
        return 0.1

    assert overlapped_allreduce_s([0.0, 0.05], timed) == pytest.approx([0.1, 0.2])
    assert starts == pytest.approx([0.0, 0.1])


def test_zero_compute_exposes_every_bucket() -> None:
    assert exposed_allreduce_s(0.0, [1, 2, 3], lambda size: 0.1 * size) == pytest.approx(0.6)
    assert exposed_allreduce_s(0.0, [], lambda size: 1.0) == 0.0


@pytest.mark.parametrize("nproc,nodes", [(8, 1), (16, 4)])
@pytest.mark.parametrize("backward_share", [0.0, 2 / 3])
def test_homogeneous_allreduce_step_is_compute_plus_the_exposed_buckets(nproc: int, nodes: int,
                                                                        backward_share: float) -> None:
    cluster = Cluster(compute_s=0.05, intra=Link.of(10, 80), inter=Link.of(25, 45), backward_share=backward_share)
    steps, batch = 20, 64
    record = simulate(SimConfig.of(algorithm="allreduce", nproc=nproc, nodes=nodes, steps=steps, batch_size=batch,
                                model="resnet18", data="synthetic", cluster=cluster, warmup_steps=0)).to_dict()
    link = cluster.inter if nodes > 1 else cluster.intra
    buckets = ddp_buckets(gradient_sizes("resnet18", "synthetic"), 25 * MIB, MIB)  # DDP's default buckets
    alpha, beta = link.latency_s, link.bandwidth_bytes_per_s

    def ring_s(size: float) -> float:
        return 2 * (nproc - 1) * alpha + 2 * (nproc - 1) / nproc * size / beta

    iteration_s = 0.05 + exposed_allreduce_s(backward_share * 0.05, buckets, ring_s)
    if backward_share == 0:  # nothing hidden: every bucket's ring, one after the other
        assert iteration_s == pytest.approx(0.05 + sum(ring_s(b) for b in buckets))
    else:  # the first bucket's ring hides behind backward
        assert iteration_s < 0.05 + sum(ring_s(b) for b in buckets[1:]) + 1e-9
    assert record["wall_s"] == pytest.approx(steps * iteration_s, rel=1e-9)
    assert record["throughput_samples_per_s"] == pytest.approx(nproc * batch / iteration_s, rel=1e-9)
    assert record["fraction_of_limit"] == pytest.approx(0.05 / iteration_s, rel=1e-9)
    assert record["mean_comm_s"] == pytest.approx([iteration_s - 0.05] * nproc, rel=1e-9)
    stats = record["algorithm_stats"][0]
    exposed = (iteration_s - 0.05) / sum(ring_s(b) for b in buckets)
    assert stats["buckets"] == len(buckets) and stats["exposed_fraction"] == pytest.approx(exposed, rel=1e-9)


def test_ring_factor_scales_the_all_reduce_and_smaller_buckets_hide_more() -> None:
    def comm(bucket_cap_mb: float = 25.0, **cluster: float) -> float:
        c = Cluster(compute_s=0.05, **cluster)
        return simulate(SimConfig.of(algorithm="allreduce", nproc=4, steps=5, model="resnet18", cluster=c,
                                  warmup_steps=0, options={"bucket_cap_mb": bucket_cap_mb})).to_dict()["mean_comm_s"][0]

    assert comm(backward_share=0.0, allreduce_ring_factor=2.0) == pytest.approx(2 * comm(backward_share=0.0), rel=1e-9)
    assert comm() < comm(backward_share=0.0)
    assert comm(bucket_cap_mb=5.0) < comm()  # more, smaller buckets: less is left after backward


def test_the_slowest_worker_s_backward_sets_when_a_bucket_is_ready() -> None:
    # Rank 0's compute takes twice as long (its backward too): the others wait for it, and the exposed part
    # is what is left after rank 0's backward, as if every worker were as slow as rank 0.
    cluster = Cluster(compute_s=0.05, speeds=(2.0, 1.0, 1.0, 1.0))
    slow = simulate(SimConfig.of(algorithm="allreduce", nproc=4, steps=5, model="resnet18", cluster=cluster,
                              warmup_steps=0)).to_dict()
    uniform = simulate(SimConfig.of(algorithm="allreduce", nproc=4, steps=5, model="resnet18", warmup_steps=0,
                                 cluster=Cluster(compute_s=0.1))).to_dict()
    assert slow["wall_s"] == pytest.approx(uniform["wall_s"], rel=1e-9)
    assert slow["mean_comm_s"][1] == pytest.approx(slow["mean_comm_s"][0] + 0.05, rel=1e-9)
