"""``lossy`` in simulated time: chunked all-reduce over parallel streams, a deadline, an agreed mask.

Mirrors :mod:`prague.algorithms.lossy.runtime` with its decision code (:mod:`.decisions`: the chunk
plan, the priority order, the deadline, the stop rule). Every iteration all n workers meet, as for
``allreduce``; when the last one arrives the exchange is played out chunk by chunk:

* the ``--streams`` streams share the ring's bottleneck link (the inter-host link with ``--hosts``):
  each chunk on a stream takes the alpha-beta ring time of its bytes at ``1/streams`` of the bandwidth,
  times ``cluster.allreduce_exposed`` (the gloo all-reduce's measured distance from the ideal ring),
  one chunk after the other per stream;
* the deadline starts when stream 0's first chunk completes; a stream stops at the chunks it had
  started by then, or at its share of the ``1 - --max-loss`` prefix (:func:`.decisions.stop_points`,
  every worker's proposal the same here, since all start together);
* the exchange ends when the last stream reaches its stop, plus one small control all-reduce; the
  deadline observes the step's rate as the runtime's does.

With links of constant speed every chunk takes its expected time, so steps drop only when the rate
changes (contention with concurrent transfers); the runtime's drops come from queues on real links.
With ``--math real`` the arithmetic applies the full average every step (drops are not modelled in it).
"""

from __future__ import annotations

from typing import Any

from prague.algorithms.lossy import drops_report
from prague.algorithms.lossy.decisions import (
    Deadline, dropped_chunks, dropped_share, next_ages, plan_chunks, priority_order, required_count, stop_points,
    stream_queues,
)
from prague.metrics.decisions import Decision
from prague.sim.costs import BYTES_PER_FLOAT32, group_link
from prague.sim.engine import Process
from prague.sim.method import SimMethod


class SimLossy(SimMethod):
    """``lossy`` in simulated time; see the module docstring."""

    def __init__(self, world: Any, options: Any) -> None:
        super().__init__(world, options)
        elements = int(world.state_bytes // BYTES_PER_FLOAT32)
        self.plan = plan_chunks(elements, options.chunk_elements(), options.streams, options.priority_tiers)
        self.magnitudes = [0.0] * self.plan.count  # no gradient values are simulated: the order is by tier
        self.ages = [0] * self.plan.count
        self.deadline = Deadline(options.deadline_slack)
        self.shares: list[float] = []
        self.deadlines_s: list[float] = []
        self.control_s = 0.0

    def exchange_s(self, step: int, full_ring_s: float) -> float:
        """Play out step ``step``'s exchange (``full_ring_s``: the ring time of the whole state on the
        bottleneck link at the bandwidth share it starts with); returns its duration."""
        world, plan, opts = self.world, self.plan, self.options
        n = world.n
        everyone = tuple(range(n))
        alpha = 2 * (n - 1) * group_link(everyone, world.topology, world.cluster).latency_s
        per_element = max(0.0, full_ring_s - alpha) / max(1, plan.total)
        exposed = world.cluster.allreduce_exposed
        order = priority_order(plan, self.magnitudes, self.ages)
        queues = stream_queues(order, opts.streams)
        # Each stream's chunks back to back, each at 1/streams of the link: start and end times.
        starts: list[list[float]] = []
        ends: list[list[float]] = []
        for q in queues:
            t, s_times, e_times = 0.0, [], []
            for c in q:
                s_times.append(t)
                t += exposed * (alpha + opts.streams * per_element * plan.sizes[c])
                e_times.append(t)
            starts.append(s_times)
            ends.append(e_times)
        first_s = ends[0][0]
        rest = plan.total - plan.sizes[order[0]]
        budget = self.deadline.budget_s(rest)
        if budget is None:
            proposal = [len(q) for q in queues]
        else:
            self.deadlines_s.append(budget)
            proposal = [sum(1 for t in s_times if t < first_s + budget) for s_times in starts]
        stops = stop_points([proposal], required_count(plan, order, opts.max_loss), [len(q) for q in queues])
        done_s = max((e[stop - 1] for e, stop in zip(ends, stops) if stop), default=first_s)
        control = exposed * alpha
        self.control_s += control
        dropped = dropped_chunks(queues, stops)
        self.deadline.observe(rest - sum(plan.sizes[c] for c in dropped), done_s - first_s)
        self.ages = next_ages(self.ages, dropped)
        share = dropped_share(plan, dropped)
        self.shares.append(share)
        if world.decisions is not None:
            for log in world.decisions:
                log.write(Decision.of_drop(step, tuple(dropped), share))
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

            def cost(ring_s: float, k: int = k) -> float:
                return self.exchange_s(k, ring_s)

            yield world.meet(("lossy", k), everyone, cost_s=cost, setup=False, on_done=update)
            world.record(w, compute, engine.now - t0, 0.0)

    def stats(self) -> dict[str, Any]:
        return drops_report(self.options, chunks=self.plan.count, shares=self.shares, deadlines_s=self.deadlines_s,
                            control_s=self.control_s)
