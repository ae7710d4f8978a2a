"""The cost model: closed-form alpha-beta costs, and the shared state that makes concurrent transfers slower.

Pure formulas first (they are what the tests check the simulator against):

* ring all-reduce (and P-Reduce, which is a ring all-reduce over the group's members) of m bytes over p
  members: ``2 (p - 1)`` steps, each moving ``m / p`` bytes over the slowest link of the ring::

      T = 2 (p - 1) alpha + 2 (p - 1) / p * m / beta

  The slowest link is the inter-node one as soon as the members span two nodes (a ring ordered by node
  crosses each node's network card once in each direction), the intra-node one otherwise;
* a point-to-point transfer: ``alpha + m / beta`` (AD-PSGD's exchange is two of them, one each way);
* a queue with one server (the PS's network card, the Group Generator's thread): a job that arrives at
  ``t`` starts at ``max(t, free_at)``; this is where parameter-server incast and GG load come from.

Contention (:class:`Fabric`): while k groups that cross nodes are running and use a node's network
card, each gets ``1/k`` of its bandwidth (likewise for groups inside one node and its intra-node
fabric). A group's share is fixed when it starts, from the groups running then: a static approximation
of fair sharing that keeps one event per group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prague.groups.api import Topology
from prague.sim.cluster import Cluster, Link

BYTES_PER_FLOAT32 = 4


def ring_allreduce_s(members: int, size_bytes: float, link: Link, bandwidth_share: float = 1.0) -> float:
    """Time of a ring all-reduce of ``size_bytes`` over ``members`` workers on ``link`` (0 for one member)."""
    if members <= 1:
        return 0.0
    steps = 2 * (members - 1)
    return steps * link.latency_s + steps * size_bytes / (members * link.bandwidth_bytes_per_s * bandwidth_share)


def exchange_s(members: int, size_bytes: float, link: Link, bandwidth_share: float = 1.0) -> float:
    """AD-PSGD's pairwise exchange: the active's values to the passive, then the mean back (two messages
    of ``size_bytes``, one after the other)."""
    return 2.0 * (link.latency_s + size_bytes / (link.bandwidth_bytes_per_s * bandwidth_share))


def spans_nodes(members: tuple[int, ...], topology: Topology) -> bool:
    wpn = topology.workers_per_node
    first = members[0] // wpn
    return any(m // wpn != first for m in members)


def group_link(members: tuple[int, ...], topology: Topology, cluster: Cluster) -> Link:
    """The bottleneck link of a ring over ``members``."""
    return cluster.inter if spans_nodes(members, topology) else cluster.intra


@dataclass
class Queue:
    """One server, first come first served: ``reserve`` returns when a job arriving now completes."""

    free_at: float = 0.0
    busy_s: float = 0.0
    jobs: int = 0
    queued_s: float = 0.0

    def reserve(self, now: float, service_s: float) -> float:
        start = now if now >= self.free_at else self.free_at
        self.queued_s += start - now
        self.free_at = start + service_s
        self.busy_s += service_s
        self.jobs += 1
        return self.free_at


class Fabric:
    """Which node resources running groups use, to share bandwidth between concurrent groups."""

    def __init__(self, topology: Topology, cluster: Cluster) -> None:
        self.topology = topology
        self.cluster = cluster
        self.nic = [0] * topology.nodes  # running node-crossing groups using each node's network card
        self.bus = [0] * topology.nodes  # running single-node groups on each node's intra-node fabric
        self.max_share_denominator = 1

    def start(self, members: tuple[int, ...], size_bytes: float,
              cost: Callable[[int, float, Link, float], float] | None = None,
              ) -> tuple[float, tuple[str, tuple[int, ...]]]:
        """Begin a transfer among ``members``; return its duration and a token for :meth:`end`.

        ``cost(members, size_bytes, link, bandwidth_share)`` gives the duration; the default is the ring
        all-reduce, :func:`ring_allreduce_s`.
        """
        wpn = self.topology.workers_per_node
        if spans_nodes(members, self.topology):
            nodes = tuple(sorted({m // wpn for m in members}))
            loads, kind, link = self.nic, "nic", self.cluster.inter
        else:
            nodes = (members[0] // wpn,)
            loads, kind, link = self.bus, "bus", self.cluster.intra
        for node in nodes:
            loads[node] += 1
        share = 1.0
        if self.cluster.contention:
            worst = max(loads[node] for node in nodes)
            self.max_share_denominator = max(self.max_share_denominator, worst)
            share = 1.0 / worst
        duration = (cost or ring_allreduce_s)(len(members), size_bytes, link, share)
        return duration, (kind, nodes)

    def end(self, token: tuple[str, tuple[int, ...]]) -> None:
        kind, nodes = token
        loads = self.nic if kind == "nic" else self.bus
        for node in nodes:
            loads[node] -= 1
