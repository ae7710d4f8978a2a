"""``lossy`` in simulated time: chunked all-reduce over parallel streams, a deadline, an agreed mask.

Mirrors :mod:`prague.algorithms.lossy.runtime` with its decision code (:mod:`.decisions`: the chunk
plan, the priority order, the deadline, the stop rule, the two-level :class:`.decisions.Hierarchy`).
Every iteration all n workers meet, as for ``allreduce``; when the last one arrives the exchange is
played out chunk by chunk on the group's :class:`~prague.sim.costs.Transfer` (its link, its share of
it, the cross traffic it meets):

* the ``--streams`` streams share the links: each chunk on a stream moves at ``1/streams`` of the
  group's bandwidth, each phase's alpha-beta time times ``cluster.allreduce_ring_factor`` (the gloo
  all-reduce's measured distance from the ideal ring). As in the runtime's stream threads, a stream
  has up to :data:`.decisions.IN_FLIGHT` chunks in flight and each phase runs on a communicator of
  its own, one chunk at a time in queue order: while one chunk crosses the nodes the next is reduced
  inside its node (:meth:`SimLossy.stream_times`);
* a chunk's path is the runtime's. ``--hierarchy flat`` (or ``hosts`` on one node, or with one rank per
  node): one ring all-reduce over every rank, on the inter-node link as soon as the ranks span nodes
  (``2(n-1)`` steps, ``2(n-1)/n`` of the chunk's bytes on each node's link). ``hosts`` with several
  ranks on a node and several nodes: a reduce inside the node (half a ring over its k ranks on the
  intra-node link), a ring over stream s's leaders, one rank per node (each node's local rank ``s mod
  k``: ``2(H-1)`` steps, ``2(H-1)/H`` of the bytes on the inter-node link), then a broadcast inside the
  node (the other half ring). Every rank of a node shares the node's link, so which local rank leads a
  stream does not change its time here (in the runtime it spreads the streams' work over the ranks);
  the hosts are the simulated nodes (``--nodes``, or ``--hosts``), as the runtime finds them from the
  ranks' host labels;
* cross traffic (``--cross-traffic``) slows the stages on the inter-node link while a burst occupies a
  link they cross (:meth:`~prague.sim.costs.Transfer.delay_s`; the ``--streams`` flows compete with the
  burst's one), so chunks started during a burst take longer: this is where the deadline drops;
* the deadline starts when stream 0's first chunk completes and lasts ``--deadline-slack`` x the time
  :func:`.decisions.deadline_elements` take at the ``--deadline-quantile`` of recent steps' rates
  (:class:`.decisions.Deadline`); a stream stops at the chunks it had started by then, or at its share
  of the ``1 - --max-loss`` prefix (:func:`.decisions.stop_points`, every worker's proposal the same
  here, since all start together);
* the exchange ends when the last stream reaches its stop, plus one small control all-reduce over every
  rank; the deadline observes the step's rate as the runtime's does.

With links of constant speed and no cross traffic every chunk takes its expected time, so steps drop
only when the rate changes (contention with concurrent transfers, bursts); the runtime's drops come
from queues on real links. With ``--math real`` the arithmetic applies the full average every step
(drops are not modelled in it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prague.algorithms.lossy import drops_report
from prague.algorithms.lossy.decisions import IN_FLIGHT, Deadline, Hierarchy, Steps, plan_chunks, stop_points
from prague.metrics.decisions import Decision
from prague.sim.costs import BYTES_PER_FLOAT32, Transfer, group_link, ring_allreduce_s
from prague.sim.engine import Process
from prague.sim.method import SimMethod


class SimLossy(SimMethod):
    """``lossy`` in simulated time; see the module docstring."""

    def __init__(self, world: Any, options: Any) -> None:
        super().__init__(world, options)
        elements = int(world.state_bytes // BYTES_PER_FLOAT32)
        self.plan = plan_chunks(elements, options.chunk_elements(), options.streams, options.priority_tiers,
                                options.min_chunk_elements())
        self.magnitudes = [0.0] * self.plan.count  # no gradient values are simulated: the order is by tier
        self.steps = Steps(self.plan, options.streams, options.max_loss,
                           Deadline(options.deadline_slack, options.deadline_quantile))
        self.control_s = 0.0
        # The simulated nodes are the hosts: the runtime finds them from each rank's host label.
        self.layout = Hierarchy.of([world.topology.node_of(r) for r in range(world.n)])
        self.two_level = options.hierarchy == "hosts" and self.layout.two_level
        self.hierarchy = f"hosts ({len(self.layout.hosts)} hosts)" if self.two_level else "flat"

    def phases(self, transfer: Transfer, stream: int) -> list[Callable[[float, int], float]]:
        """``stream``'s chunk collective as its phases, in order, each a function of (the time it starts,
        the chunk's elements) to the time it completes on every rank, along the path of the module
        docstring: one ring, or a reduce inside the node, a ring over the stream's leaders, a broadcast."""
        world, streams = self.world, self.options.streams
        factor = world.cluster.allreduce_ring_factor
        intra = world.cluster.intra

        def ring(members: int) -> Callable[[float, int], float]:
            latency_s = ring_allreduce_s(members, 0.0, transfer.link)

            def run(t: float, elements: int) -> float:
                size = elements * BYTES_PER_FLOAT32
                work_s = factor * (ring_allreduce_s(members, size, transfer.link, transfer.share / streams)
                                    - latency_s)
                t += factor * latency_s
                return t + work_s + transfer.delay_s(work_s, t, flows=streams)

            return run

        if not self.two_level:
            return [ring(world.n)]
        node_ranks = len(self.layout.hosts[0])  # every node holds as many

        def half_ring(t: float, elements: int) -> float:  # a reduce, or a broadcast, inside the node
            return t + factor * ring_allreduce_s(node_ranks, elements * BYTES_PER_FLOAT32, intra, 1.0 / streams) / 2

        return [half_ring, ring(len(self.layout.leaders(stream))), half_ring]

    def stream_times(self, transfer: Transfer, stream: int, chunks: list[int]) -> tuple[list[float], list[float]]:
        """When each of ``stream``'s ``chunks`` starts and completes, from the exchange's start, as the
        runtime's stream thread runs them: up to :data:`.decisions.IN_FLIGHT` chunks in flight (a chunk
        starts when the one that many places before it has completed), each phase on a communicator of
        its own that takes the chunks one at a time, in order (while one chunk crosses the nodes, the
        next is reduced inside its node)."""
        phases = self.phases(transfer, stream)
        t0 = transfer.start_s
        free = [t0] * len(phases)  # when each phase's communicator is done with the previous chunk
        starts: list[float] = []
        ends: list[float] = []
        for k, c in enumerate(chunks):
            t = start = t0 if k < IN_FLIGHT else ends[k - IN_FLIGHT]
            for p, phase in enumerate(phases):
                t = free[p] = phase(max(t, free[p]), self.plan.sizes[c])
            starts.append(start)
            ends.append(t)
        return [t - t0 for t in starts], [t - t0 for t in ends]

    def exchange_s(self, step: int, transfer: Transfer) -> float:
        """Play out step ``step``'s exchange over ``transfer`` (the group of every rank, begun now); returns
        its duration."""
        world, steps = self.world, self.steps
        everyone = tuple(range(world.n))
        planned = steps.plan(self.magnitudes)
        times = [self.stream_times(transfer, s, q) for s, q in enumerate(planned.queues)]
        starts = [t[0] for t in times]
        ends = [t[1] for t in times]
        first_s = ends[0][0]
        budget = steps.budget_s(planned, IN_FLIGHT)
        proposal = planned.lengths if budget is None else [sum(1 for t in s_times if t < first_s + budget)
                                                           for s_times in starts]
        stops = stop_points([proposal], steps.required(planned), planned.lengths)
        done_s = max((e[stop - 1] for e, stop in zip(ends, stops) if stop), default=first_s)
        control = world.cluster.allreduce_ring_factor * ring_allreduce_s(
            world.n, 0.0, group_link(everyone, world.topology, world.cluster))
        self.control_s += control
        settled = steps.settle(planned, stops, done_s - first_s)
        if world.decisions is not None:
            for log in world.decisions:
                log.write(Decision.of_drop(step, tuple(settled.dropped), settled.share))
        return done_s + control

    def worker(self, w: int) -> Process:
        world = self.world
        engine, math = world.engine, world.math
        everyone = tuple(range(world.n))
        for k in range(world.steps):
            compute = world.compute_s(w, k)
            yield compute
            t0 = engine.now

            def update(members: tuple[int, ...], k: int = k) -> None:
                math.allreduce_step(members, k)

            def exchange(transfer: Transfer, k: int = k) -> float:
                return self.exchange_s(k, transfer)

            yield world.meet(("lossy", k), everyone, exchange_s=exchange, setup=False, on_done=update)
            world.record(w, compute, engine.now - t0, 0.0)

    def stats(self) -> dict[str, Any]:
        return drops_report(self.options, chunks=self.plan.count, shares=self.steps.shares,
                            deadlines_s=self.steps.deadlines_s, control_s=self.control_s, hierarchy=self.hierarchy)
