"""``prague`` in simulated time: local step, one Group Generator RPC, P-Reduce with the group.

The decisions are the runtime's: the policy object is :func:`prague.groups.make_generator` with the
same :class:`~prague.groups.GeneratorConfig` the service would build (generator, group size, delta_c,
window, seed ``--gg-seed``, which is the run's ``--seed`` unless given), topology from ``--nodes``), driven through the
:class:`~prague.groups.GroupPolicy` protocol with the simulated clock as ``now_s``. Only time is
modelled:

* the RPC: half the round trip (``cluster.gg_rtt_s``) to reach the GG, a FIFO queue in front of its
  single thread (``cluster.gg_service_s`` per call, so the GG's load shows up as queueing), the
  policy call at the start of service, the answer back after the other half;
* ``poll`` at :meth:`~prague.groups.GroupPolicy.next_deadline` (the ready window), as the service's
  timer thread does;
* ``static`` makes no round trip: the runtime computes :func:`~prague.groups.static_group` locally, so
  the simulated worker asks its own :class:`~prague.groups.StaticGenerator` at no cost;
* a worker executes the group it was given, blocking until every member has arrived (groups of one are
  a local step); after its last iteration it calls ``finish`` and executes the groups it is still
  committed to, like :meth:`prague.algorithms.prague.runtime.Prague.close`.

With a decision log each worker logs every group it executes, as the runtime does, and (all but
``static``, which has no service) the Group Generator's calls go to ``gg.jsonl`` in the service's format
(:class:`~prague.groups.trace.PolicyCall`, simulated time as ``now_s``).

Accounting as in the runtime: ``wait_s`` is the time from asking to the answer, ``comm_s`` the P-Reduce
including waiting for partners.
"""

from __future__ import annotations

import time
from typing import Any

from prague.groups import BufferedPolicy, GeneratorConfig, Group, StaticGenerator, make_generator
from prague.groups.api import Answer
from prague.groups.trace import PolicyCall, call_policy
from prague.metrics.decisions import Decision, gg_trace_path
from prague.sim.costs import Queue
from prague.sim.engine import Process, Signal
from prague.sim.method import SimMethod
from prague.sim.world import World

_SAMPLE_EVERY = 4


class SimPrague(SimMethod):
    """``prague`` in simulated time; see the module docstring."""

    def __init__(self, world: World, options: Any) -> None:
        super().__init__(world, options)
        world.use_comm_cache(options.comm_cache)
        o = options
        self.config = GeneratorConfig(
            nproc=world.n, topology=world.topology, group_size=o.group_size, delta_c=o.delta_c,
            seed=o.gg_seed, window_s=o.window_ms / 1000.0,
        )
        self.policy = make_generator(o.generator, self.config)
        self.remote = o.generator != "static"
        # Policies that never set a deadline (the buffered ones) need no poll timer.
        self._timers = not isinstance(self.policy, (BufferedPolicy, StaticGenerator))
        self.queue = Queue()
        self._half_rtt = world.cluster.gg_rtt_s / 2.0
        self._service = world.cluster.gg_service_s
        self._answer: list[Signal | None] = [None] * world.n
        self._armed: float | None = None
        # Real CPU time inside the policy object (what the GG's thread would spend), sampled: a CPU clock
        # read costs about as much as a small decision, and wall clocks count other processes' time.
        self._sampled_ns = 0
        self._sampled = 0
        self.policy_calls = 0
        self.local_steps = 0
        self._gg_trace = (world.open_file(gg_trace_path(world.decision_dir))
                          if world.decision_dir is not None and self.remote else None)

    # -- the Group Generator, as a service --------------------------------------------------------
    def _call(self, what: str, worker: int | None, now: float) -> list[Answer]:
        """Call the policy with ``now_s=now`` (simulated time); every 4th call's CPU time is measured."""
        timed = self.policy_calls % _SAMPLE_EVERY == 0
        if timed:
            t0 = time.thread_time_ns()
        answers = call_policy(self.policy, what, worker, now)
        if timed:
            self._sampled_ns += time.thread_time_ns() - t0
            self._sampled += 1
        self.policy_calls += 1
        if self.world.trace is not None:
            self.world.trace.append((what, worker, now, tuple((w, g.seq, g.members) for w, g in answers)))
        if self._gg_trace is not None:
            self._gg_trace.write(PolicyCall(what, worker, now, tuple(answers)).to_dict())
        return answers

    def _serve_at(self, job: tuple[str, int | None], start: float) -> None:
        """Serve ``job`` at ``start`` (>= now) and send the answers, which arrive after the service
        time and half a round trip."""
        what, worker = job
        answers = self._call(what, worker, start)
        delay = start - self.world.engine.now + self._service + self._half_rtt
        for w, group in answers:
            if what == "finish" and w == worker:
                continue
            sig = self._answer[w]
            self._answer[w] = None
            assert sig is not None, f"the policy answered worker {w}, which is not waiting"
            sig.fire_after(delay, group)
        if what == "finish":
            assert worker is not None
            sig = self._answer[worker]
            self._answer[worker] = None
            assert sig is not None
            sig.fire_after(delay, [g for w, g in answers if w == worker])
        if self._timers:
            self._arm_timer()

    def _serve(self, job: tuple[str, int | None]) -> None:
        self._serve_at(job, self.world.engine.now)

    def _send(self, job: tuple[str, int | None], delay_s: float) -> None:
        """A call that reaches the GG ``delay_s`` from now: it queues behind earlier calls (FIFO), then
        is served. Calls all travel the same ``delay_s``, so sending order is arrival order and the
        queue slot is reserved at once. A policy without timers is then called at once with its
        service start time as ``now_s``: nothing else touches it in between, so the answers are the
        same as an event at that time would get, for one event less per call."""
        engine = self.world.engine
        start = self.queue.reserve(engine.now + delay_s, self._service) - self._service
        if self._timers:
            engine.at(start, self._serve, job)
        else:
            self._serve_at(job, start)

    def _arm_timer(self) -> None:
        deadline = self.policy.next_deadline()
        if deadline is not None and deadline != self._armed:
            self._armed = deadline
            engine = self.world.engine
            engine.at(max(deadline, engine.now), self._on_timer, deadline)

    def _on_timer(self, deadline: float) -> None:
        if self._armed == deadline:
            self._armed = None
        current = self.policy.next_deadline()
        if current is not None and current <= self.world.engine.now:
            self._send(("poll", None), 0.0)
        else:
            self._arm_timer()

    def _ask(self, worker: int, what: str) -> Signal:
        """Send a ``request`` or ``finish`` for ``worker``; the signal fires with the answer."""
        sig = Signal(self.world.engine)
        if not self.remote:  # static: computed locally, no round trip
            answers = self._call(what, worker, self.world.engine.now)
            sig.fire([g for w, g in answers if w == worker] if what == "finish" else answers[0][1])
            return sig
        self._answer[worker] = sig
        self._send((what, worker), self._half_rtt)
        return sig

    # -- the worker -----------------------------------------------------------------------------------
    def _run(self, w: int, group: Group) -> Signal | None:
        if group.is_local:
            self.local_steps += 1
            return None
        return self.world.meet(group.seq, group.members, on_done=self.world.math.average)

    def worker(self, w: int) -> Process:
        world = self.world
        engine, math = world.engine, world.math
        log = None if world.decisions is None else world.decisions[w]
        for k in range(world.steps):
            compute = world.compute_s(w, k)
            yield compute
            math.local_step(w, k)
            asked = engine.now
            group = yield self._ask(w, "request")
            answered = engine.now
            if log is not None:
                log.write(Decision.of_group(k, group.members, group.seq))
            sig = self._run(w, group)
            if sig is not None:
                yield sig
            world.record(w, compute, engine.now - answered, answered - asked)
        remaining = yield self._ask(w, "finish")
        for group in remaining:
            if log is not None:
                log.write(Decision.of_group(world.steps, group.members, group.seq))
            sig = self._run(w, group)
            if sig is not None:
                yield sig

    def stats(self) -> dict[str, Any]:
        wall = self.world.engine.now
        per_call_s = self._sampled_ns * 1e-9 / self._sampled if self._sampled else 0.0
        world = self.world
        executed = world.group_members + self.local_steps  # groups run, summed over their members
        out: dict[str, Any] = {
            "generator": self.options.generator,
            "group_size": self.config.group_size,
            "groups_run": executed,
            "local_steps": self.local_steps,
            "mean_group_size": executed / (world.groups_run + self.local_steps) if executed else 0.0,
            **world.comm_stats(),
            "generator_stats": dict(self.policy.stats()),
            # The simulated GG thread: share of time busy and mean wait in its queue.
            "gg_utilization": self.queue.busy_s / wall if wall > 0 and self.remote else 0.0,
            "gg_mean_queue_s": self.queue.queued_s / self.queue.jobs if self.queue.jobs else 0.0,
            # The real decision code, timed while simulating: its CPU per call, and the share of one
            # core it would need at the simulated request rate.
            "policy_us_per_call": 1e6 * per_call_s,
            "policy_core_share": per_call_s * self.policy_calls / wall if wall > 0 else 0.0,
        }
        return out
