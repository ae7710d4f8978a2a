"""``prague`` in simulated time: local step, one Group Generator RPC, P-Reduce with the group.

The decisions are the runtime's: the policy object is :func:`prague.groups.make_generator` with the
same :class:`~prague.groups.GeneratorConfig` the service would build (generator, group size, delta_c,
window, seed ``--gg-seed``, which is the run's ``--seed`` unless given), topology from ``--nodes``, or one node
for a ``-blind`` generator, whose cluster keeps its ``--nodes`` for the costs), driven through the
:class:`~prague.groups.GroupPolicy` protocol with the simulated clock as ``now_s``. Only time is
modelled:

* the RPC: half the round trip (``cluster.gg_rtt_s``) to reach the GG, a FIFO queue in front of its
  single thread (``cluster.gg_service_s`` per call, so the GG's load shows up as queueing), the
  policy call at the start of service, the answer back after the other half;
* ``poll`` at :meth:`~prague.groups.GroupPolicy.next_deadline` (the ready window), as the service's
  timer thread does;
* ``static`` (and ``static-blind``) makes no round trip: the runtime computes
  :func:`~prague.groups.static_group` locally, so the simulated worker asks its own
  :class:`~prague.groups.StaticGenerator` at no cost;
* a worker executes the group it was given, blocking until every member has arrived (groups of one are
  a local step); after its last iteration it calls ``finish`` and executes the groups it is still
  committed to, like :meth:`prague.algorithms.prague.runtime.Prague.close`.

With a decision log each worker logs every group it executes, as the runtime does, and (all but
``static``, which has no service) the Group Generator's calls go to ``gg.jsonl`` in the service's format
(:class:`~prague.groups.trace.PolicyCall`, simulated time as ``now_s``).

* ``--overlap on`` (the default): the runtime's background averaging thread is one process per worker
  (:meth:`SimPrague._averager`, waiting for work when there is none): each submitted snapshot's request
  starts when the one before it has finished, asks, meets
  its group and stores the correction (average of the members' snapshots minus this member's, computed
  from the snapshots in real-arithmetic mode, each first caught up on the earlier corrections it lacked
  by the runtime's :class:`~.overlap.Backlog`); the worker applies finished corrections after its next
  local step, and with ``--max-in-flight`` requests out waits for the oldest or takes a local step.

Accounting as in the runtime: ``wait_s`` is the time from asking to the answer, ``comm_s`` the P-Reduce
including waiting for partners; overlapped, ``wait_s`` is the time a worker waited for an earlier
average and ``comm_s`` is 0 (the averaging ran beside compute).
"""

from __future__ import annotations

import functools
import math
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from prague.algorithms.prague import final_report, overlap_report
from prague.algorithms.prague.flow import (
    ASK, CATCH_UP, COMMITTED, DONE, DRAIN, FINAL, REDUCE, TAKE_OLDEST, TAKE_READY, OverlapCounts, averaging, finishing,
    overlapped_step,
)
from prague.algorithms.prague.overlap import Backlog
from prague.algorithms.prague.weights import SinceAverage
from prague.comm.codecs import member_send_bytes, payload_bytes
from prague.groups import BufferedPolicy, GeneratorConfig, Group, StaticGenerator, make_generator
from prague.groups.api import Answer
from prague.groups.shards import ShardedGenerator, ShardPlan
from prague.groups.trace import PolicyCall, call_policy
from prague.metrics.decisions import Decision, gg_trace_path
from prague.sim.costs import Queue, ring_allgather_s
from prague.sim.engine import Process, Signal
from prague.sim.method import SimMethod
from prague.sim.world import World

_SAMPLE_EVERY = 4
# The policy's CPU time is read around every 4th call of the first :data:`_TIMED_EARLY`, then every 64th: a
# thread CPU clock read is a system call, dearer than a small decision, and a large run has calls to spare.
_TIMED_EARLY = 4096
_TIMED_LATE_EVERY = 64
# A call to the service: (what, worker, the step a request comes after, the shard that serves it).
Job = tuple[str, "int | None", "int | None", int]
#: The meeting key of the last average over every worker (``--final-average on``): group keys are ints.
_FINAL = "final-average"


class SimPrague(SimMethod):
    """``prague`` in simulated time; see the module docstring."""

    models_failures = True

    def __init__(self, world: World, options: Any) -> None:
        super().__init__(world, options)
        world.use_comm_cache(options.comm_cache)
        world.math.share_momentum = options.share_momentum == "on"  # the momentum buffers travel with the rows
        o = options
        # Blind generators see one node; the cluster's costs keep world.topology.
        self.config = GeneratorConfig(
            nproc=world.n, topology=o.generator_topology(world.topology), group_size=o.group_size,
            delta_c=o.delta_c, seed=o.gg_seed, window_s=o.window_s, adapt_size=o.adapt_size == "on",
            levels=o.levels, threshold=o.threshold,
        )
        shards = o.shard_count(self.config.topo)
        self.sharded: ShardedGenerator | None = None
        if shards > 1:  # the ready generator in shards, each with its own service queue
            self.sharded = ShardedGenerator(self.config, ShardPlan(self.config.topo, shards, o.gg_epoch_steps, o.gg_seed))
            self.policy: Any = self.sharded
        else:
            self.policy = make_generator(o.base_generator, self.config)
        self.remote = not o.is_static
        # Compressed groups gather one message per member (the runtime's byte count); the values' math
        # stays the exact average (the residual a message leaves is carried to the next, not lost).
        self._numel = int(world.state_bytes // 4)
        self._message_bytes = None if o.compress == "none" else float(payload_bytes(self._numel, o.compress))
        self.sent_bytes = 0.0  # summed over workers
        # --average-by samples: each worker's steps since its last average, and each open group's weights
        self._since = [SinceAverage() for _ in range(world.n)] if o.average_by == "samples" else None
        self._group_weights: dict[int, dict[int, float]] = {}
        # Policies that never set a deadline (the buffered ones) need no poll timer.
        self._timers = not isinstance(self.policy, (BufferedPolicy, StaticGenerator))
        # A shard's next deadline (the ready window of its oldest waiting worker), bound once: asked after every call.
        self._deadline: Callable[[int], float | None] = (
            self.sharded.shard_deadline if self.sharded is not None else lambda shard: self.policy.next_deadline())
        self.queues = [Queue() for _ in range(shards)]
        self._half_rtt = world.cluster.gg_rtt_s / 2.0
        self._service = world.cluster.gg_service_s
        self._armed: list[float | None] = [None] * shards
        # Real CPU time inside the policy object (what the GG's thread would spend), sampled: a CPU clock
        # read costs about as much as a small decision, and wall clocks count other processes' time.
        self._sampled_ns = 0
        self._sampled = 0
        self.policy_calls = 0
        self.local_steps = 0
        self._math_on = world.math.enabled
        self._lanes = [_Lane() for _ in range(world.n)]
        self._snapshots: dict[int, dict[int, Any]] = {}
        self._corrections: dict[tuple[int, int], Any] = {}
        self.counts = OverlapCounts()
        self._asked = 0
        self._everyone: tuple[int, ...] | None = None  # the members of the last average (--final-average)
        self._final_joined = 0.0
        self.final_ranks = 0
        self.final_s = 0.0
        self.final_distance: float | None = None
        self._latencies = array("d")  # sampled request latencies (:meth:`_latency`), raw doubles: kept to the end
        self.averaging_s = 0.0  # asking plus P-Reduce, summed over workers
        self.exposed_s = 0.0  # overlap: waiting for an earlier average (off: all of averaging_s)
        self._gg_trace = (world.open_file(gg_trace_path(world.decision_dir))
                          if world.decision_dir is not None and self.remote else None)
        if self.remote:  # a survivor tells the Group Generator of a declared failure, as the runtime's client does
            world.on_declared(self._exclude)

    def _exclude(self, rank: int) -> None:
        shard = 0 if self.sharded is None else self.sharded.route(rank)
        self._send(("exclude", rank, None, shard), self._half_rtt)

    # -- the Group Generator, as a service --------------------------------------------------------
    def _call(self, what: str, worker: int | None, now: float, iteration: int | None = None) -> list[Answer]:
        """Call the policy with ``now_s=now`` (simulated time); the CPU time of a sample of calls is measured. A
        sharded generator's ``poll`` names its shard as ``worker``."""
        calls = self.policy_calls
        timed = calls % (_SAMPLE_EVERY if calls < _TIMED_EARLY else _TIMED_LATE_EVERY) == 0
        if timed:
            t0 = time.thread_time_ns()
        answers = call_policy(self.policy, what, worker, now, iteration)
        if timed:
            self._sampled_ns += time.thread_time_ns() - t0
            self._sampled += 1
        self.policy_calls += 1
        if self.world.trace is not None:
            self.world.trace.append((what, worker, now, tuple((w, g.seq, g.members) for w, g in answers)))
        if self._gg_trace is not None:
            self._gg_trace.write(PolicyCall(what, worker, now, tuple(answers), iteration).to_dict())
        return answers

    def _serve_at(self, job: Job, start: float) -> None:
        """Serve ``job`` at ``start`` (>= now) and send the answers, which arrive after the service
        time and half a round trip."""
        what, worker, iteration, shard = job
        answers = self._call(what, shard if what == "poll" and self.sharded is not None else worker, start, iteration)
        delay = start - self.world.engine.now + self._service + self._half_rtt
        replies: list[tuple[Signal, Any]] = []
        lanes = self._lanes
        for w, group in answers:
            if what == "finish" and w == worker:
                continue
            lane = lanes[w]
            sig = lane.answer
            lane.answer = None
            assert sig is not None, f"the policy answered worker {w}, which is not waiting"
            replies.append((sig, group))
        if what == "finish":
            assert worker is not None
            lane = lanes[worker]
            sig = lane.answer
            lane.answer = None
            assert sig is not None
            replies.append((sig, [g for w, g in answers if w == worker]))
        if replies:  # one call's answers all arrive together: one event delivers them, in order
            self.world.engine.after(delay, _deliver, replies)
        if self._timers:  # the shards whose deadline the call may have moved (a finish: only those it formed
            # groups at, the others hear of it when next asked)
            for s in (self.sharded.touched if self.sharded is not None else (shard,)):
                self._arm_timer(s)

    def _serve(self, job: Job) -> None:
        self._serve_at(job, self.world.engine.now)

    def _send(self, job: Job, delay_s: float) -> None:
        """A call that reaches the GG ``delay_s`` from now: it queues behind earlier calls (FIFO), then
        is served. Calls all travel the same ``delay_s``, so sending order is arrival order and the
        queue slot is reserved at once. A policy without timers is then called at once with its
        service start time as ``now_s``: nothing else touches it in between, so the answers are the
        same as an event at that time would get, for one event less per call."""
        engine = self.world.engine
        start = self.queues[job[3]].reserve(engine.now + delay_s, self._service) - self._service
        if self._timers:
            engine.at(start, self._serve, job)
        else:
            self._serve_at(job, start)

    def _arm_timer(self, shard: int) -> None:
        deadline = self._deadline(shard)
        if deadline is not None and deadline != self._armed[shard]:
            self._armed[shard] = deadline
            engine = self.world.engine
            engine.at(max(deadline, engine.now), self._on_timer, (shard, deadline))

    def _on_timer(self, armed: tuple[int, float]) -> None:
        shard, deadline = armed
        if self._armed[shard] == deadline:
            self._armed[shard] = None
        current = self._deadline(shard)
        if current is not None and current <= self.world.engine.now:
            self._send(("poll", None, None, shard), 0.0)
        else:
            self._arm_timer(shard)

    def _ask(self, worker: int, what: str, iteration: int | None = None) -> Signal:
        """Send a ``request`` (after step ``iteration``) or ``finish`` for ``worker``; the signal fires with
        the answer."""
        sig = Signal(self.world.engine)
        if not self.remote:  # static: computed locally, no round trip
            answers = self._call(what, worker, self.world.engine.now, iteration)
            sig.fire([g for w, g in answers if w == worker] if what == "finish" else answers[0][1])
            return sig
        self._lanes[worker].answer = sig
        shard = 0 if self.sharded is None else self.sharded.route(worker, iteration)
        self._send((what, worker, iteration, shard), self._half_rtt)
        return sig

    # -- the worker -----------------------------------------------------------------------------------
    def _run(self, w: int, group: Group, step: int) -> Signal | None:
        if group.is_local:
            self.local_steps += 1
            return None
        seq = group.seq
        self._weigh(w, seq, step)
        return self._meet(w, group, lambda members: self.world.math.average(members, self._weights_of(seq)))

    def _weigh(self, w: int, seq: int, step: int) -> None:
        """``--average-by samples``: ``w``'s weight in group ``seq``, asked after ``step`` (the runtime's
        rule, :class:`~.weights.SinceAverage`), kept until the group completes; it then starts again."""
        if self._since is not None:
            self._group_weights.setdefault(seq, {})[w] = self._since[w].weight(step)
            self._since[w].averaged(step)

    def _weights_of(self, seq: int) -> dict[int, float] | None:
        """The weights of group ``seq`` by member (None: the equal mean), forgotten once read."""
        return self._group_weights.pop(seq, None) if self._since is not None else None

    def _meet(self, w: int, group: Group, on_done: Callable[[tuple[int, ...]], None] | None) -> Signal:
        """``w`` joins ``group``'s average (blocking, or on its averaging thread): a ring all-reduce of the
        state, or with ``--compress`` a ring all-gather of every member's message of the runtime's size."""
        self.sent_bytes += member_send_bytes(self._numel, group.size, self.options.compress)
        if self._message_bytes is None:
            return self.world.meet(group.seq, group.members, on_done=on_done, rank=w)
        return self.world.meet(group.seq, group.members, self._message_bytes, on_done=on_done, rank=w,
                               collective=ring_allgather_s)

    def _latency(self, seconds: float) -> None:
        """Keep one request's latency, from asking to the answer (its group formed), every
        :data:`_SAMPLE_EVERY`-th: their quantiles are the Group Generator's latency curve."""
        self._asked += 1
        if self._asked % _SAMPLE_EVERY == 0:
            self._latencies.append(seconds)

    def _log(self, w: int, step: int, group: Group) -> None:
        if self.world.decisions is not None:
            self.world.decisions[w].write(Decision.of_group(step, group.members, group.seq))

    def start(self) -> None:
        super().start()
        if self.options.overlap == "on":
            for w in range(self.world.n):
                self.world.engine.process(self._averager(w))

    def worker(self, w: int) -> Process:
        return self._overlapped(w) if self.options.overlap == "on" else self._blocking(w)

    def _blocking(self, w: int) -> Process:
        world = self.world
        engine, math = world.engine, world.math
        for k in world.steps_of(w):
            fault = world.fault_at(w, k)
            if fault is not None:
                world.stop_here(w, k, fault)
                return
            compute = world.compute_s(w, k)
            yield compute
            math.local_step(w, k)
            asked = engine.now
            group = yield self._ask(w, "request", k)
            answered = engine.now
            self._latency(answered - asked)
            self._log(w, k, group)
            sig = self._run(w, group, k)
            if sig is not None:
                yield sig
            self.averaging_s += engine.now - asked
            world.record(w, compute, engine.now - answered, answered - asked)
        yield from self._end(w)

    def _end(self, w: int) -> Process:
        """After the last step, as :mod:`.flow` says: the averages still out (overlap on), the committed
        groups, then with ``--final-average on`` the last average over every living worker."""
        for effect in finishing(self.options.final_average == "on"):
            if effect == DRAIN:
                t0 = self.world.engine.now
                lane = self._lanes[w]
                while lane.in_flight:
                    yield from self._take_oldest(w, lane)
                self.exposed_s += self.world.engine.now - t0
            elif effect == COMMITTED:
                yield from self._finish(w)
            elif effect == FINAL:
                yield from self._final_average(w)

    def _finish(self, w: int) -> Process:
        """After the last step: the groups ``w`` is still committed to, blocking, as the runtime does."""
        remaining = yield self._ask(w, "finish")
        for group in remaining:
            steps = self.world.steps_run(w)
            self._log(w, steps, group)
            sig = self._run(w, group, steps)
            if sig is not None:
                yield sig

    def _final_average(self, w: int) -> Process:
        """``w`` joins the last average over every worker, which starts when the last living one has
        joined (the runtime's wait until all are done), in full precision on a communicator of them all;
        its duration from that last join is ``final_average_s`` (summed over workers). Its bytes are not the
        groups' (``averaging_sent_bytes``), as in the runtime."""
        world = self.world
        if world.n == 1:
            return
        if self._everyone is None:
            self._everyone = tuple(range(world.n))
        self._final_joined = world.engine.now  # joins come in time order: the last one's stays
        yield world.meet(_FINAL, self._everyone, on_done=self._on_final, rank=w)
        self.final_s += world.engine.now - self._final_joined

    def _on_final(self, members: tuple[int, ...]) -> None:
        self.final_ranks = len(members)
        self.final_distance = self.world.math.spread(members)
        self.world.math.average(members)

    # -- overlapped: the runtime's BackgroundAverager in simulated time ------------------------------
    def _overlapped(self, w: int) -> Process:
        """Compute, local step, then the step's end as :mod:`.flow` says (the averages that came back,
        the busy policy, the snapshot handed over), as
        :meth:`prague.algorithms.prague.runtime.Prague.after_step` performs it on real threads."""
        world, o = self.world, self.options
        engine, math = world.engine, world.math
        lane = self._lanes[w]  # this worker's state, read once
        in_flight, most, busy, counts = (lambda: lane.in_flight), o.max_in_flight, o.busy_policy, self.counts
        math_on = self._math_on  # NoMath's hooks do nothing: not called
        for k in world.steps_of(w):
            fault = world.fault_at(w, k) if world.faulty else None
            if fault is not None:  # crash or hang: this worker's processes end here
                world.stop_here(w, k, fault)
                return
            compute = world.compute_s(w, k)
            yield compute
            if math_on:
                math.local_step(w, k)
            t0 = engine.now
            for effect in overlapped_step(in_flight, most, busy, counts):
                if effect == TAKE_READY:
                    self._take_ready(w, lane)
                elif effect == TAKE_OLDEST:
                    yield from self._take_oldest(w, lane)
                else:  # SUBMIT
                    self._submit(lane, math.values(w) if math_on else None, k)
            waited = engine.now - t0
            self.exposed_s += waited
            world.record(w, compute, 0.0, waited)
        yield from self._end(w)

    def _submit(self, lane: _Lane, snapshot: Any, step: int) -> None:
        """Hand ``snapshot`` to the worker's averaging thread (:meth:`_averager`, ``lane`` its state): it runs
        after the requests before it."""
        index = lane.submitted
        taken = index - lane.in_flight  # corrections applied, oldest first: the snapshot holds these
        lane.submitted = index + 1
        lane.in_flight += 1
        lane.jobs.append((index, taken, snapshot, step))
        idle, lane.idle = lane.idle, None
        if idle is not None:  # the thread waits for work: it starts on this one now
            idle.fire()

    def _averager(self, w: int) -> Process:
        """``w``'s averaging thread, the runtime's :class:`~.overlap.BackgroundAverager`: the submitted
        snapshots one after another, each through :func:`.flow.averaging` (ask for its group, catch up,
        meet it, settle); it waits for work when there is none (and simply never wakes once its worker is
        done)."""
        engine, stopped, lane = self.world.engine, self.world.stopped, self._lanes[w]
        jobs = lane.jobs
        settles = self._math_on or self._since is not None  # whether a group's end has work (_correct)
        while True:
            if not jobs:
                idle = lane.idle = Signal(engine)
                yield idle
                continue
            index, taken, snapshot, step = jobs.popleft()
            if w in stopped:  # its worker failed: the averages it had in flight end with it
                return
            t0 = engine.now
            # Typed, so that the compiled build reads the group's fields in place (an object of unknown type's
            # attributes are looked up by name); the flow asks for it first.
            group: Group | None = None
            correction = None
            flow = averaging()
            effect, argument = next(flow)
            while effect != DONE:
                reply: Any = None
                if effect == ASK:
                    group = reply = cast(Group, (yield self._ask(w, "request", step)))
                    if w in stopped:
                        return
                    self._latency(engine.now - t0)
                elif group is None:
                    raise RuntimeError(f"the averaging flow asked for {effect!r} before its group")
                elif effect == CATCH_UP:
                    if self._math_on:
                        self._snapshots.setdefault(group.seq, {})[w] = lane.backlogged().catch_up(snapshot, taken)
                elif effect == REDUCE:
                    seq = group.seq
                    self._weigh(w, seq, step)
                    # Without values (NoMath) and with equal weights a group has nothing to settle at its end.
                    yield self._meet(w, group, functools.partial(self._correct, seq) if settles else None)
                    if w in stopped:
                        return
                    if self._math_on:  # corrections are computed from values only
                        correction = self._corrections.pop((seq, w), None)
                else:  # SETTLE
                    if group.is_local:
                        self.local_steps += 1
                    if argument and correction is not None:  # None stands for zero: nothing to keep
                        lane.backlogged().finished(index, correction)
                effect, argument = flow.send(reply)
            self.averaging_s += engine.now - t0
            assert group is not None  # the flow asks first
            lane.finished.append((index, group, correction))
            wake, lane.wake = lane.wake, None
            if wake is not None:
                wake.fire()

    def _correct(self, seq: int, members: tuple[int, ...]) -> None:
        """A group's P-Reduce completed over ``members`` (its live ones): each one's correction, from the
        snapshots they sent."""
        snapshots = self._snapshots.pop(seq, None)
        weights = self._weights_of(seq)
        if snapshots and len(snapshots) > len(members):
            snapshots = {m: v for m, v in snapshots.items() if m in members}
        if snapshots:
            for member, delta in self.world.math.corrections(snapshots, weights).items():
                self._corrections[(seq, member)] = delta

    def _apply(self, w: int, lane: _Lane) -> None:
        index, group, correction = lane.finished.popleft()
        lane.in_flight -= 1
        if self._math_on:
            self.world.math.add(w, correction)
        self._log(w, index, group)

    def _take_ready(self, w: int, lane: _Lane) -> None:
        while lane.finished:
            self._apply(w, lane)

    def _take_oldest(self, w: int, lane: _Lane) -> Process:
        while not lane.finished:
            wake = lane.wake = Signal(self.world.engine)
            yield wake
        self._apply(w, lane)

    def stats(self) -> dict[str, Any]:
        wall = self.world.engine.now
        per_call_s = self._sampled_ns * 1e-9 / self._sampled if self._sampled else 0.0
        world = self.world
        # groups run, summed over their members: the generator's (the last average over everyone is not one of them)
        executed = world.group_members - self.final_ranks + self.local_steps
        groups = world.groups_run - (1 if self.final_ranks else 0) + self.local_steps
        shares = [q.busy_s / wall for q in self.queues] if wall > 0 and self.remote else []
        jobs = sum(q.jobs for q in self.queues)
        out: dict[str, Any] = {
            "generator": self.options.generator,
            "group_size": self.config.group_size,
            "groups_run": executed,
            "local_steps": self.local_steps,
            "mean_group_size": executed / groups if executed else 0.0,
            "compress": self.options.compress,
            "average_by": self.options.average_by,
            "averaging_sent_bytes": self.sent_bytes,
            **self._overlap_stats(),
            **final_report(self.options, self.final_ranks, self.final_s, self.final_distance),
            **world.comm_stats(),
            "generator_stats": dict(self.policy.stats()),
            # The simulated GG threads (one per shard): share of time busy (the busiest shard's; each
            # shard's) and mean wait in their queues.
            "gg_shards": len(self.queues),
            "gg_utilization": max(shares) if shares else 0.0,
            "gg_utilization_per_shard": shares,
            "gg_mean_queue_s": sum(q.queued_s for q in self.queues) / jobs if jobs else 0.0,
            # a request's latency, asking to the answer (the group formed), sampled: p50 and p99
            "gg_latency_p50_s": _quantile(self._latencies, 0.50),
            "gg_latency_p99_s": _quantile(self._latencies, 0.99),
            # The real decision code, timed while simulating: its CPU per call, and the share of one
            # core it would need at the simulated request rate.
            "policy_us_per_call": 1e6 * per_call_s,
            "policy_core_share": per_call_s * self.policy_calls / wall if wall > 0 else 0.0,
        }
        return out

    def _overlap_stats(self) -> dict[str, Any]:
        exposed = self.exposed_s if self.options.overlap == "on" else self.averaging_s
        return overlap_report(self.options, steps=sum(map(self.world.steps_run, range(self.world.n))),
                              local_steps=self.local_steps,
                              busy_local_steps=self.counts.busy_local_steps,
                              average_waits=self.counts.average_waits,
                              averaging_s=self.averaging_s, exposed_s=exposed)


class _Lane:
    """One worker's state on the simulated side of the Group Generator and of its averaging thread, side by side
    in one object (each process reads it once; at 16,384 workers a list per field cost a likely cache miss per
    field read): the answer it waits for; with overlap on, the requests submitted and those not yet applied,
    those queued for the averaging thread and those finished, waiting to be applied (oldest first: short queues),
    a wake-up for the thread waiting for work and for a worker waiting for an average, and with values the
    corrections its later snapshots may lack (:class:`~.overlap.Backlog`, made on first use)."""

    def __init__(self) -> None:
        self.answer: Signal | None = None
        self.submitted = 0
        self.in_flight = 0
        # Queues, not lists: a list emptied and filled again at every request gives back and takes again its
        # storage each time (a reallocation per change, 4% of a run at 16,384 workers); a deque keeps its block.
        self.jobs: deque[tuple[int, int, Any, int]] = deque()
        self.finished: deque[tuple[int, Group, Any]] = deque()
        self.idle: Signal | None = None  # the averaging thread waits for work
        self.wake: Signal | None = None
        self.backlog: Backlog | None = None

    def backlogged(self) -> Backlog:
        """The corrections' backlog (real arithmetic only)."""
        if self.backlog is None:
            self.backlog = Backlog()
        return self.backlog


def _deliver(replies: list[tuple[Signal, Any]]) -> None:
    """Fire each signal with its answer, in the order the Group Generator gave them."""
    for sig, answer in replies:
        sig.fire(answer)


def _quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank; 0.0 when empty), selected in linear time (the same element
    sorting would give)."""
    if not values:
        return 0.0
    rank = min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))
    return float(np.partition(np.asarray(values, dtype=np.float64), rank)[rank])
