"""The cost model: closed-form alpha-beta costs, and the shared state that makes concurrent transfers slower.

Pure formulas first (they are what the tests check the simulator against):

* ring all-reduce (and P-Reduce, which is a ring all-reduce over the group's members) of m bytes over p
  members: ``2 (p - 1)`` steps, each moving ``m / p`` bytes over the slowest link of the ring::

      T = 2 (p - 1) alpha + 2 (p - 1) / p * m / beta

  The slowest link is the inter-node one as soon as the members span two nodes (a ring ordered by node
  crosses each node's network card once in each direction), the intra-node one otherwise;
* a point-to-point transfer: ``alpha + m / beta`` (AD-PSGD's exchange is two of them, one each way);
* DDP's all-reduce overlapped with backward (:func:`ddp_buckets`, :func:`bucket_ready_s`,
  :func:`overlapped_allreduce_s`, :func:`exposed_allreduce_s`): the gradients, in the order backward
  produces them, are cut into buckets of ``--bucket-cap-mb``; backward produces the bytes at an even
  rate, a bucket is ready when its last gradient is, and its ring all-reduce starts when it is ready on
  every member and the previous bucket's is done (one communication stream). What is left after
  backward ends is the step's exposed communication: with buckets whose all-reduce is shorter than the
  backward between them, only the last bucket's;
* a queue with one server (the PS's network card, the Group Generator's thread): a job that arrives at
  ``t`` starts at ``max(t, free_at)``; this is where parameter-server incast and GG load come from.

Contention (:class:`Fabric`): while k groups that cross nodes are running and use a node's network
card, each gets ``1/k`` of its bandwidth (likewise for groups inside one node and its intra-node
fabric). A group's share is fixed when it starts, from the groups running then: a static approximation
of fair sharing that keeps one event per group. Cross traffic (:mod:`prague.sim.traffic`, ``--cross-traffic``)
slows a group that crosses nodes while a burst occupies one of its nodes' links: the fabric adds that
delay to every transfer it times, so every method whose transfers cross nodes meets the bursts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prague.groups.api import Topology
from prague.sim.cluster import Cluster, Link
from prague.sim.traffic import Bursts, node_crossings

BYTES_PER_FLOAT32 = 4
MIB = 2**20  # DDP's "MB" of --bucket-cap-mb


def ddp_buckets(tensor_bytes: Sequence[float], bucket_cap_bytes: float,
                first_cap_bytes: float | None = None) -> list[float]:
    """The bytes of each of DDP's gradient buckets, in the order backward fills them.

    ``tensor_bytes``: the gradients' sizes in the order backward produces them (the reverse of
    ``model.parameters()``). As DDP's reducer once it has rebuilt its buckets after the first iteration
    (``torch.distributed._compute_bucket_assignment_by_size``): tensors stay whole, and a bucket closes
    as soon as it holds its cap or more, so a bucket may exceed the cap and the last one is the rest. The
    first bucket's cap is ``first_cap_bytes`` (DDP's 1 MiB when its bucket size is left at the default:
    the runtime's ``--bucket-cap-mb`` unset), the others' ``bucket_cap_bytes``.
    """
    buckets: list[float] = []
    filled = 0.0
    for size in tensor_bytes:
        filled += size
        cap = first_cap_bytes if first_cap_bytes is not None and not buckets else bucket_cap_bytes
        if filled >= cap:
            buckets.append(filled)
            filled = 0.0
    if filled > 0 or not buckets:
        buckets.append(filled)
    return buckets


def bucket_ready_s(backward_s: float, bucket_bytes: Sequence[float], start_s: float = 0.0) -> list[float]:
    """When each bucket is ready on one worker whose backward starts at ``start_s`` and lasts
    ``backward_s``: backward produces the gradient bytes at an even rate, so bucket i is ready once the
    bytes of buckets 0..i are; the last is ready when backward ends."""
    total = float(sum(bucket_bytes))
    ready: list[float] = []
    done = 0.0
    for size in bucket_bytes:
        done += size
        ready.append(start_s + (backward_s * done / total if total > 0 else backward_s))
    if ready:
        ready[-1] = start_s + backward_s  # exactly, whatever the rounding
    return ready


def overlapped_allreduce_s(ready_s: Sequence[float], allreduce_s: Callable[[int, float], float]) -> list[float]:
    """When each bucket's all-reduce completes, on one communication stream.

    ``ready_s[i]``: when bucket i is ready on every member (the latest member's :func:`bucket_ready_s`);
    ``allreduce_s(i, start_s)``: how long bucket i's collective takes when it starts at ``start_s``.
    Bucket i starts at ``max(ready_s[i], done of bucket i - 1)``, as DDP launches a bucket's all-reduce
    when it is full and the collectives of one process group run one after the other.
    """
    done: list[float] = []
    free = -math.inf
    for i, ready in enumerate(ready_s):
        start = max(ready, free)
        free = start + allreduce_s(i, start)
        done.append(free)
    return done


def exposed_allreduce_s(backward_s: float, bucket_bytes: Sequence[float],
                        bucket_allreduce_s: Callable[[float], float]) -> float:
    """The communication one step leaves exposed when every worker's backward lasts ``backward_s``: how
    long after backward ends the last bucket's all-reduce completes (``bucket_allreduce_s(bytes)`` is one
    bucket's collective). 0 <= it <= the sum of the buckets' times; all of it with no backward."""
    if not bucket_bytes:
        return 0.0
    done = overlapped_allreduce_s(bucket_ready_s(backward_s, bucket_bytes),
                                  lambda i, _: bucket_allreduce_s(bucket_bytes[i]))
    return max(0.0, done[-1] - backward_s)


def ring_allreduce_s(members: int, size_bytes: float, link: Link, bandwidth_share: float = 1.0) -> float:
    """Time of a ring all-reduce of ``size_bytes`` over ``members`` workers on ``link`` (0 for one member)."""
    if members <= 1:
        return 0.0
    steps = 2 * (members - 1)
    return steps * link.latency_s + steps * size_bytes / (members * link.bandwidth_bytes_per_s * bandwidth_share)


def ring_allgather_s(members: int, size_bytes: float, link: Link, bandwidth_share: float = 1.0) -> float:
    """Time of a ring all-gather of one message of ``size_bytes`` per member over ``members`` workers on
    ``link``: ``p - 1`` steps, each moving one message (0 for one member). Compressed P-Reduce
    (:mod:`prague.comm.compress`) gathers every member's codes this way."""
    if members <= 1:
        return 0.0
    steps = members - 1
    return steps * link.latency_s + steps * size_bytes / (link.bandwidth_bytes_per_s * bandwidth_share)


#: A collective's duration: ``(members, size_bytes, link, bandwidth_share) -> seconds``.
Collective = Callable[[int, float, Link, float], float]


def exchange_s(members: int, size_bytes: float, link: Link, bandwidth_share: float = 1.0) -> float:
    """AD-PSGD's pairwise exchange: the active's values to the passive, then the mean back (two messages
    of ``size_bytes``, one after the other)."""
    return 2.0 * (link.latency_s + size_bytes / (link.bandwidth_bytes_per_s * bandwidth_share))


def spans_nodes(members: tuple[int, ...], topology: Topology) -> bool:
    wpn = topology.workers_per_node
    first = members[0] // wpn
    for m in members:
        if m // wpn != first:
            return True
    return False


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

    def reserve(self, now: float, service_s: float,
                delay_s: Callable[[float, float], float] | None = None) -> float:
        """Queue a job arriving at ``now`` that needs ``service_s``; ``delay_s(start, service_s)``, when
        given, adds the time the job loses once started (a message slowed by cross traffic)."""
        start = now if now >= self.free_at else self.free_at
        if delay_s is not None:
            service_s += delay_s(start, service_s)
        self.queued_s += start - now
        self.free_at = start + service_s
        self.busy_s += service_s
        self.jobs += 1
        return self.free_at


@dataclass(slots=True)
class Transfer:
    """A transfer running on the :class:`Fabric`, from :meth:`Fabric.begin` to :meth:`Fabric.end`: its
    bottleneck ``link``, the ``share`` of it the transfer got when it began, the nodes whose network cards
    (``kind`` ``"nic"``) or intra-node fabric (``"bus"``) it uses, and the cross traffic it meets."""

    kind: str
    nodes: tuple[int, ...]
    link: Link
    share: float
    start_s: float
    bursts: Bursts | None = None

    def delay_s(self, work_s: float, start_s: float | None = None, flows: int = 1) -> float:
        """What cross traffic adds to ``work_s`` seconds of this transfer's bytes (at its share) started at
        ``start_s`` (default: when the transfer began) over ``flows`` flows; 0.0 inside one node or without
        cross traffic (:meth:`prague.sim.traffic.Bursts.delay_s`)."""
        if self.bursts is None or self.kind != "nic":
            return 0.0
        return self.bursts.delay_s(node_crossings(self.nodes), self.start_s if start_s is None else start_s, work_s,
                                   flows, self.share)


class Fabric:
    """Which node resources running groups use, to share bandwidth between concurrent groups, and the cross
    traffic on the nodes' links (``bursts``; ``clock`` gives the simulated time a transfer begins at)."""

    def __init__(self, topology: Topology, cluster: Cluster, bursts: Bursts | None = None,
                 clock: Callable[[], float] = lambda: 0.0) -> None:
        self.topology = topology
        self.cluster = cluster
        self.bursts = bursts
        self.clock = clock
        self.nic = [0] * topology.nodes  # running node-crossing groups using each node's network card
        self.bus = [0] * topology.nodes  # running single-node groups on each node's intra-node fabric
        self.max_share_denominator = 1

    def begin(self, members: tuple[int, ...]) -> Transfer:
        """Register a transfer among ``members`` now (it shares their links until :meth:`end`); the
        returned :class:`Transfer` says its link and share, and times its bytes through the bursts."""
        wpn = self.topology.workers_per_node
        if spans_nodes(members, self.topology):
            nodes = tuple(sorted({m // wpn for m in members}))
            loads, kind, link = self.nic, "nic", self.cluster.inter
        else:
            nodes = (members[0] // wpn,)
            loads, kind, link = self.bus, "bus", self.cluster.intra
        worst = 0
        for node in nodes:
            load = loads[node] = loads[node] + 1
            if load > worst:
                worst = load
        share = 1.0
        if self.cluster.contention:
            if worst > self.max_share_denominator:
                self.max_share_denominator = worst
            share = 1.0 / worst
        return Transfer(kind, nodes, link, share, self.clock(), self.bursts)

    def start(self, members: tuple[int, ...], size_bytes: float,
              cost: Collective | None = None,
              ) -> tuple[float, Transfer]:
        """Begin a transfer among ``members``; return its duration and the token for :meth:`end`.

        ``cost(members, size_bytes, link, bandwidth_share)`` gives the duration; the default is the ring
        all-reduce, :func:`ring_allreduce_s`. Its bytes' part (all but ``cost`` of 0 bytes) is slowed by
        the bursts it meets (:meth:`Transfer.delay_s`).
        """
        transfer = self.begin(members)
        cost = cost or ring_allreduce_s
        duration = cost(len(members), size_bytes, transfer.link, transfer.share)
        if transfer.bursts is not None and transfer.kind == "nic":
            latency = cost(len(members), 0.0, transfer.link, 1.0)
            duration += transfer.delay_s(duration - latency, transfer.start_s + latency)
        return duration, transfer

    def end(self, token: Transfer) -> None:
        loads = self.nic if token.kind == "nic" else self.bus
        for node in token.nodes:
            loads[node] -= 1
