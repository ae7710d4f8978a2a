"""What every simulated method shares: the clock, the workers' compute times and logs, groups meeting.

One :class:`World` per simulated run. A method (its ``sim.py`` beside its runtime, :mod:`prague.sim.method`) starts one process per worker
on ``world.engine``; each process calls :meth:`World.compute_s` for the length of its compute, and
:meth:`World.record` once per iteration with the same split the runtime's
:class:`~prague.train.trainer.DistributedTrainer` writes (compute, communication, waiting), so the
throughput and no-wait limit of :mod:`prague.metrics.summary` apply unchanged.

Compute: ``(cluster.compute_s x speed(rank) x scenario.slowdown(rank, step, n) + overhead) x jitter``
(see :class:`~prague.sim.cluster.Cluster`); its last ``cluster.backward_share x compute_s x speed(rank) x
jitter`` is backward (:meth:`World.backward_s`), which DDP's all-reduce overlaps with. The slowdown
is the runtime's own :class:`~prague.hetero.spec.Scenario` (same seed: the same slow iterations as a
real run). The jitter comes from one seeded generator per worker (drawn a block of steps at a time), so
a worker's compute times depend only on (seed, rank, step), never on the order of events.

Steps: every worker runs ``steps`` steps, or, under a job-wide budget for a method whose workers take
unequal shares, claims batches from one counter with the runtime's own rule until the budget is spent
(:meth:`World.steps_of`).

Links: every transfer goes through :attr:`World.fabric` (:class:`~prague.sim.costs.Fabric`), which shares
links among concurrent transfers and, with ``cross_traffic`` (``--cross-traffic``), slows the transfers
that cross nodes while the seeded bursts of :mod:`prague.sim.traffic` (:attr:`World.bursts`) occupy
their nodes' links.

Failures (``crash:R:S``, ``hang:R:S``, ``failures:P``, for a method whose model says it survives them,
:attr:`~prague.sim.method.SimMethod.models_failures`): a worker that reaches its fault's step stops there
(:meth:`World.stop_here`; its processes end, and a group it had joined but that had not started no longer
counts it). It is declared failed as the runtime's launcher would: a crash at the launcher's next look
(:data:`~prague.runtime.liveness.LAUNCHER_TICK_S`), a hang once its heartbeat (every
:data:`~prague.runtime.liveness.HEARTBEAT_S`) has not moved for ``lease_s``, decided by the launcher's own
:class:`~prague.runtime.liveness.LeaseWatch`. From then on groups run over their live members, as the
runtime's :class:`~prague.comm.surviving.LiveGroups` averages (a group waiting for the failed member starts
without it), and the method hears of it (:meth:`World.on_declared`). The record lists the failures as the
runtime's ``failures``.

Decision log: with a ``decisions`` folder, :attr:`World.decisions` holds every simulated worker's
:class:`~prague.metrics.decisions.DecisionLog` (the files a real run with ``--log-decisions`` writes)
and methods open their services' traces there with :meth:`World.open_file`; :meth:`World.close`
closes them all. Without it :attr:`World.decisions` is None and nothing is logged.
"""

from __future__ import annotations

import math
import struct
from array import array
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from prague.comm.cache import CommunicatorCache, group_needs_setup
from prague.groups.api import Topology
from prague.hetero.spec import Scenario
from prague.io import JsonLines
from prague.metrics.decisions import DecisionLog
from prague.metrics.summary import WorkerTiming
from prague.runtime.liveness import HEARTBEAT_S, LAUNCHER_TICK_S, Failure, LeaseWatch
from prague.net.traffic import CrossTraffic
from prague.sim.cluster import Cluster
from prague.sim.costs import Collective, Fabric, Transfer
from prague.sim.engine import Engine, Signal
from prague.sim.math import NoMath
from prague.sim.traffic import Bursts
from prague.workload.budget import SharedBatches


#: What a worker's log holds for each iteration, side by side: when it ended, its compute, its slowdown, its
#: communication and its waiting (:meth:`World.record`).
_FIELDS = 5
_ROW = struct.Struct(f"={_FIELDS}d")  # one step's fields, written into a log in one call
DEFAULT_COMM_CACHE = 64  # the default of the ``--comm-cache`` option of the methods that use P-Reduce


class Jitter:
    """One worker's compute-time multipliers, of mean 1 and coefficient of variation ``cv``, from a
    generator seeded by (seed, rank) only; drawn ``block`` at a time as steps need them (a worker taking
    batches from a job-wide budget has no step count known up front). The first block is the same draws
    whatever comes later."""

    def __init__(self, dist: str, cv: float, seed: int, rank: int, block: int) -> None:
        self.dist, self.cv, self.block = dist, cv, max(1, block)
        self._rng = np.random.default_rng([seed & 0xFFFFFFFF, rank, 0x5EED])
        self.draws = array("d")  # raw doubles: 8 bytes a step, where a list of floats takes 32

    def __getitem__(self, step: int) -> float:
        while step >= len(self.draws):
            self.draws.frombytes(self._draw(self.block).tobytes())
        return self.draws[step]

    def _draw(self, count: int) -> np.ndarray:
        rng, cv = self._rng, self.cv
        if self.dist == "uniform":
            half = cv * math.sqrt(3.0)
            draws = rng.uniform(1.0 - half, 1.0 + half, count)
        elif self.dist == "normal":
            draws = np.maximum(rng.normal(1.0, cv, count), 0.05)  # truncated far in the tail: times stay > 0
        else:  # lognormal of mean 1
            sigma = math.sqrt(math.log1p(cv * cv))
            draws = rng.lognormal(-sigma * sigma / 2.0, sigma, count)
        return draws.astype(np.float64, copy=False)  # doubles, as the array they are appended to


def jitter_for(dist: str, cv: float, seed: int, rank: int, steps: int) -> Jitter | None:
    """A worker's :class:`Jitter`, its first block ``steps`` long; None when there is no jitter."""
    if cv == 0.0 or dist == "constant":
        return None
    return Jitter(dist, cv, seed, rank, steps)


_NO_SLOWDOWNS: dict[int, float] = {}  # every rank's paper slowdowns before its first block is drawn (never written)


class _Rank:
    """One worker's compute and log state, side by side in one object: a step reads a few fields of it, where a
    list per field cost a likely cache miss per field at 16,384 workers.

    ``base_s``: its nominal compute time; ``jitter``: its multipliers (None: none); ``slow_step``, ``slow_factor``:
    the step whose slowdown :meth:`World.compute_s` drew last, and that slowdown (:meth:`World.record` logs it);
    ``paper_block``, ``paper``: the block of steps whose paper slowdowns were drawn last, and its slowed steps;
    ``log``: its log of raw doubles (8 bytes each; a list of floats takes 32), :data:`_FIELDS` a step side by
    side, made ``steps`` steps long at once and written in place, ``logged`` steps of it so far (it grows by as much
    again only under a claimed budget: a log grown one step at a time was copied as it grew). At 16,384 workers x
    1,000 steps the logs are the run's largest objects."""

    def __init__(self, base_s: float, jitter: Jitter | None, log: array[float]) -> None:
        self.base_s = base_s
        self.jitter = jitter
        self.slow_step = -1
        self.slow_factor = 1.0
        self.paper_block = -1
        self.paper = _NO_SLOWDOWNS
        self.log = log
        self.logged = 0


class MemoryStore:
    """The part of the job's store that :class:`~prague.workload.budget.SharedBatches` uses, in memory: the
    simulated workers claim their batches from the runtime's own counter logic."""

    def __init__(self) -> None:
        self._values: dict[str, bytes] = {}

    def add(self, key: str, value: int) -> int:
        total = int(self._values.get(key, b"0")) + value
        self._values[key] = str(total).encode()
        return total

    def set(self, key: str, value: str) -> None:
        self._values[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self._values[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self._values for k in keys)

    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes:
        current = self._values.get(key)
        if (current is None and expected_value == "") or current == expected_value.encode():
            self._values[key] = desired_value.encode()
        return self._values[key]


class World:
    """Clock, cluster, topology, scenario, model size and per-worker logs of one simulated run."""

    def __init__(self, *, cluster: Cluster, topology: Topology, scenario: Scenario, steps: int,
                 state_bytes: float, seed: int, math: NoMath | None = None,
                 trace: list[tuple[Any, ...]] | None = None, decisions: Path | None = None,
                 cross_traffic: CrossTraffic | None = None, gradient_bytes: Sequence[float] | None = None,
                 claimed: int | None = None, lease_s: float = 10.0) -> None:
        """``claimed``: the job-wide budget's batches, which the workers take from one counter as the
        runtime's methods with unequal shares do (:meth:`steps_of`); ``steps`` is then only the size of the
        compute-time draws made at once. None: every worker runs ``steps`` steps."""
        self.engine = Engine()
        self.cluster = cluster
        self.topology = topology
        self.n = topology.size
        self.scenario = scenario
        self.steps = steps
        self.state_bytes = float(state_bytes)
        # The gradients' sizes in the order backward produces them (DDP's buckets are cut from them); one
        # tensor of the whole state when not given.
        self.gradient_bytes = tuple(float(b) for b in gradient_bytes) if gradient_bytes else (self.state_bytes,)
        self.seed = seed
        self.math = math if math is not None else NoMath()
        self.trace = trace  # when a list: every Group Generator call, in order (tests replay it)
        # Bursts on the links between nodes, at the inter-node link's rate (the emulated hosts' --link-rate).
        self.bursts = None if cross_traffic is None else Bursts(cross_traffic, seed, cluster.inter)
        self.fabric = Fabric(topology, cluster, self.bursts, clock=lambda: self.engine.now)
        self._block = max(1, steps)
        # The fields read apart (_columns), with the steps logged when they were (a count that only grows).
        self._read: tuple[int, list[list[array[float]]]] | None = None
        self._meetings: dict[Any, list[Any]] = {}  # key -> [signal, members arrived (a set), members]
        self.groups_run = 0
        self.group_members = 0
        # A communicator cache per worker (the runtime's LRU policy), to charge set-up for new member sets;
        # its capacity is the method's ``--comm-cache`` (:meth:`use_comm_cache`).
        self._comm_cache = [CommunicatorCache[bool](DEFAULT_COMM_CACHE) for _ in range(self.n)]
        self.communicators_created = 0
        self.communicators_evicted = 0
        self._backward_share = cluster.backward_share
        self._overhead_s = cluster.compute_overhead_s
        # Each worker's compute and log state, side by side in one object (:class:`_Rank`).
        self._ranks = [_Rank(cluster.compute_s * cluster.speed(w),
                             jitter_for(cluster.compute_dist, cluster.compute_cv, seed, w, steps), self._blank_log())
                       for w in range(self.n)]
        self.claimed = claimed
        store = MemoryStore()
        self._shares = None if claimed is None else [SharedBatches(store, claimed, self.n) for _ in range(self.n)]
        self.batch_index: list[list[int]] = [[] for _ in range(self.n)]  # claimed: each step's job-wide batch
        self._out_of_batches = [False] * self.n
        self._slow = not scenario.is_homogeneous
        self._stragglers = bool(scenario.stragglers)  # the paper terms alone need no call per step
        self.faulty = scenario.has_faults  # some worker crashes or hangs (fault_at)
        self._fail_at_s = [scenario.failure_time_s(w) for w in range(self.n)] if scenario.rates else None
        self._math_on = self.math.enabled
        if self._math_on:
            self.math.attach(self.engine, lambda: all(self.finished(w) for w in range(self.n)))
        # Failures: the ranks whose process stopped (crashed or hung), those declared failed (in order), and
        # who is told of a declaration.
        self.lease_s = lease_s
        self.stopped: set[int] = set()
        self.declared: dict[int, Failure] = {}
        self._declared_hooks: list[Callable[[int], None]] = []
        self._files = ExitStack()  # last: nothing after it can fail and leak the files
        self.decision_dir = None if decisions is None else Path(decisions)
        self.decisions: list[DecisionLog] | None = None  # per worker, when decisions are logged
        if decisions is not None:
            self.decisions = [self._files.enter_context(DecisionLog(Path(decisions), w)) for w in range(self.n)]

    def open_file(self, path: Path) -> JsonLines:
        """A JSON-lines file (a service's trace) closed with the world."""
        return self._files.enter_context(JsonLines(path))

    def close(self) -> None:
        """Close the decision logs and traces (after the run)."""
        self._files.close()

    # -- the steps a worker runs -----------------------------------------------------------------------
    def steps_of(self, w: int) -> Iterator[int]:
        """Worker ``w``'s step numbers: ``0 .. steps - 1``, or, with a claimed budget, one more each time it
        claims a batch at the start of a step (:class:`~prague.workload.budget.SharedBatches`, the runtime's
        rule: a fast worker takes more) until the budget is spent."""
        if self._shares is None:
            yield from range(self.steps)
            return
        shares, indices = self._shares[w], self.batch_index[w]
        while (index := shares.next()) is not None:
            indices.append(index)
            yield len(indices) - 1
        self._out_of_batches[w] = True

    def finished(self, w: int) -> bool:
        """Whether ``w`` has run all its steps (with a claimed budget: found it spent), or failed."""
        if w in self.stopped:
            return True
        if self._shares is None:
            return self._ranks[w].logged >= self.steps
        return self._out_of_batches[w] and self._ranks[w].logged == len(self.batch_index[w])

    def steps_run(self, w: int) -> int:
        """The iterations ``w`` has recorded."""
        return self._ranks[w].logged

    # -- compute ------------------------------------------------------------------------------------
    def compute_s(self, rank: int, step: int) -> float:
        """This worker's compute time at ``step`` (0 <= step < steps), slowdowns included."""
        r = self._ranks[rank]
        t = r.base_s
        if self._slow:
            factor = self._slowdown(r, rank, step)
            r.slow_step = step  # :meth:`record` logs it
            r.slow_factor = factor
            t *= factor
        t += self._overhead_s
        return t if r.jitter is None else t * r.jitter[step]

    def _slowdown(self, r: _Rank, rank: int, step: int) -> float:
        """``scenario.slowdown(rank, step, n)``, its paper draws made a block of steps at a time (``r``: the rank's
        state)."""
        block = step // self._block
        if block != r.paper_block:
            r.paper_block = block
            r.paper = self.scenario.paper_slowdowns(rank, block * self._block, (block + 1) * self._block, self.n)
        factor = r.paper.get(step, 1.0)
        return self.scenario.straggler_slowdown(rank, step, factor) if self._stragglers else factor

    def backward_s(self, rank: int, step: int) -> float:
        """The backward at the end of :meth:`compute_s` (rank, step): ``cluster.backward_share`` of the nominal
        compute, with its speed and jitter. The scenario's extra time and the overhead are not in it: the
        runtime sleeps a slowdown's extra time before forward."""
        r = self._ranks[rank]
        t = self._backward_share * r.base_s
        return t if r.jitter is None else t * r.jitter[step]

    def record(self, rank: int, compute_s: float, comm_s: float, wait_s: float) -> None:
        """Log one finished iteration of ``rank`` at the current time."""
        r, now = self._ranks[rank], self.engine.now
        log, step = r.log, r.logged
        at = _FIELDS * step
        factor = 1.0
        if self._slow:
            factor = r.slow_factor if r.slow_step == step else self._slowdown(r, rank, step)
        if at == len(log):  # a claimed budget's worker ran past the steps made room for
            log.extend(self._blank_log())
        _ROW.pack_into(log, 8 * at, now, compute_s, factor, comm_s, wait_s)  # in the order of _FIELDS
        r.logged = step + 1
        if self._math_on:
            self.math.reached(rank, step, now)

    def _blank_log(self) -> array[float]:
        """Room for ``steps`` steps of one worker's log (zeros, written in place by :meth:`record`)."""
        return array("d", bytes(8 * _FIELDS * self._block))

    def _columns(self) -> list[list[array[float]]]:
        """Each field of :data:`_FIELDS`, per worker, one value a step: read apart once for what is recorded."""
        logged = sum(r.logged for r in self._ranks)
        if self._read is None or self._read[0] != logged:
            self._read = (logged, [[r.log[i:_FIELDS * r.logged:_FIELDS] for r in self._ranks] for i in range(_FIELDS)])
        return self._read[1]

    @property
    def end_s(self) -> list[array[float]]:
        """Per worker, the simulated time each iteration ended."""
        return self._columns()[0]

    @property
    def compute_log(self) -> list[array[float]]:
        """Per worker, each iteration's compute time."""
        return self._columns()[1]

    @property
    def slowdown_log(self) -> list[array[float]]:
        """Per worker, each iteration's slowdown factor (the scenario's)."""
        return self._columns()[2]

    @property
    def comm_log(self) -> list[array[float]]:
        """Per worker, each iteration's communication time."""
        return self._columns()[3]

    @property
    def wait_log(self) -> list[array[float]]:
        """Per worker, each iteration's waiting time."""
        return self._columns()[4]

    def timings(self) -> list[WorkerTiming]:
        ends, computes, slowdowns, comms, waits = self._columns()
        return [WorkerTiming(end_s=ends[w], compute_s=computes[w], comm_s=comms[w], slowdown=slowdowns[w],
                             wait_s=waits[w]) for w in range(self.n)]

    # -- groups -------------------------------------------------------------------------------------
    def use_comm_cache(self, capacity: int) -> None:
        """Give every worker a communicator cache of ``capacity`` member sets (before the run starts)."""
        self._comm_cache = [CommunicatorCache[bool](capacity) for _ in range(self.n)]

    def _setup_s(self, members: tuple[int, ...]) -> float:
        """Communicator set-up the group pays: the members lacking one for this member set build it."""
        if self.cluster.preduce_setup_s == 0.0:
            return 0.0
        missing, evicted = group_needs_setup((self._comm_cache[m] for m in members), members)
        self.communicators_evicted += evicted
        if missing:
            self.communicators_created += len(members)  # every member builds its end
            return self.cluster.preduce_setup_s
        return 0.0

    def meet(self, key: Any, members: tuple[int, ...], size_bytes: float | None = None,
             on_done: Callable[[tuple[int, ...]], None] | None = None,
             cost_s: Callable[[float], float] | None = None, setup: bool = True,
             exchange_s: Callable[[Transfer], float] | None = None, rank: int | None = None,
             collective: Collective | None = None) -> Signal:
        """Join the ring all-reduce ``key`` over ``members``; the returned signal fires when it completes.

        Blocking semantics of the runtime: it starts when the last live member joins (members declared
        failed are left out, as the runtime's surviving P-Reduce leaves them) and takes the ring's
        alpha-beta time on its bottleneck link, shared with groups already running on the same nodes
        and slowed by the cross traffic it meets (:class:`~prague.sim.costs.Fabric`), plus (``setup``)
        communicator set-up for a member set new to a member.
        ``collective(members, size_bytes, link, share)`` replaces the ring all-reduce's time (a ring
        all-gather of compressed messages, :func:`~prague.sim.costs.ring_allgather_s`; ``size_bytes`` is
        then one member's message). ``cost_s`` maps the ring time to the charged time (all-reduce's overlap); ``exchange_s``, for a
        method that plays out a collective of its own, replaces the ring: it gets the group's
        :class:`~prague.sim.costs.Transfer` (link, share, bursts) when the last member joins and returns
        the duration. ``on_done(members)`` runs at completion, before anyone resumes (the group average,
        in real-arithmetic mode), with the members that took part. ``rank``: who joins (needed only when
        a member may fail: the one that stops leaves the groups it joined).
        """
        entry = self._meetings.get(key)
        if entry is None:
            entry = self._meetings[key] = [Signal(self.engine), set(), members, size_bytes, on_done, cost_s, setup,
                                           exchange_s, collective]
        arrived: set[Any] = entry[1]
        arrived.add(len(arrived) if rank is None else rank)
        sig: Signal = entry[0]
        self._try_start(key, entry)
        return sig

    def _try_start(self, key: Any, entry: list[Any]) -> None:
        """Start meeting ``key`` once every live member has joined."""
        members: tuple[int, ...] = entry[2]
        if not self.declared:
            if len(entry[1]) < len(members) or not members:
                return
            live = members
        else:
            arrived: set[Any] = entry[1]
            if len(members) == self.n and len(arrived) < self.n - len(self.declared):
                return  # every worker (a last average) with some failed: counted, not listed again at each join
            live = tuple(m for m in members if m not in self.declared)
            if len(arrived) < len(live) or not live:
                return
        sig, _, _, size_bytes, on_done, cost_s, setup, exchange_s, collective = entry
        del self._meetings[key]
        self._start_group(live, sig, self.state_bytes if size_bytes is None else size_bytes, on_done, cost_s,
                          setup, exchange_s, collective)

    # -- failures -----------------------------------------------------------------------------------------
    def fault_at(self, rank: int, step: int) -> str | None:
        """``crash`` or ``hang`` when the scenario stops ``rank`` as it reaches ``step`` now, else None (a
        failure rate's crash: the first step ``rank`` starts once its failure time has passed)."""
        if not self.faulty:
            return None
        if self._fail_at_s is not None and self.engine.now >= self._fail_at_s[rank]:
            return "crash"
        if self.scenario.crashes_at(rank, step):
            return "crash"
        if self.scenario.hangs_at(rank, step):
            return "hang"
        return None

    def stop_here(self, rank: int, step: int, kind: str) -> None:
        """``rank``'s process stops now, as it reaches ``step`` (a crash or a hang): it leaves the groups
        it joined that have not started, and it is declared failed as the launcher would declare it."""
        self.stopped.add(rank)
        for entry in self._meetings.values():
            entry[1].discard(rank)
        now = self.engine.now
        if kind == "crash":  # the process exits: the launcher sees it at its next look
            declared_at = (math.floor(now / LAUNCHER_TICK_S) + 1) * LAUNCHER_TICK_S
        else:  # frozen: its heartbeat stops; the launcher's lease runs out
            leases = LeaseWatch(self.lease_s)
            beats = int(now // HEARTBEAT_S)  # the last beat before it froze, and when the launcher saw it
            seen_at = (math.floor(beats * HEARTBEAT_S / LAUNCHER_TICK_S) + 1) * LAUNCHER_TICK_S
            leases.observe({rank: beats}, seen_at)
            ticks = 1
            while not leases.observe({rank: beats}, seen_at + ticks * LAUNCHER_TICK_S + 1e-9):
                ticks += 1
            declared_at = seen_at + ticks * LAUNCHER_TICK_S
        failure = Failure(rank, step, kind, "simulated")
        self.engine.at(max(declared_at, now), self._declare, failure)

    def on_declared(self, hook: Callable[[int], None]) -> None:
        """Call ``hook(rank)`` when a rank is declared failed (after the groups that waited for it went on)."""
        self._declared_hooks.append(hook)

    def _declare(self, failure: Failure) -> None:
        self.declared[failure.rank] = failure
        for key, entry in list(self._meetings.items()):
            if failure.rank in entry[2]:
                self._try_start(key, entry)
        for hook in self._declared_hooks:
            hook(failure.rank)

    def _start_group(self, members: tuple[int, ...], sig: Signal, size_bytes: float,
                     on_done: Callable[[tuple[int, ...]], None] | None,
                     cost_s: Callable[[float], float] | None, setup: bool,
                     exchange_s: Callable[[Transfer], float] | None = None,
                     collective: Collective | None = None) -> None:
        if exchange_s is not None:
            token = self.fabric.begin(members)
            ring_s = exchange_s(token)
        else:
            ring_s, token = self.fabric.start(members, size_bytes, collective)
            if cost_s is not None:
                ring_s = cost_s(ring_s)
        duration = ring_s + (self._setup_s(members) if setup else 0.0)
        self.groups_run += 1
        self.group_members += len(members)

        def done(_: Any) -> None:
            self.fabric.end(token)
            if on_done is not None:
                on_done(members)
            sig.fire()

        self.engine.after(duration, done)

    def comm_stats(self) -> dict[str, float | int]:
        """P-Reduce counters summed over the workers, as the runtime's ``CommStats.report`` names them."""
        return {"preduces": self.group_members, "communicators_created": self.communicators_created,
                "communicator_create_s": self.communicators_created * self.cluster.preduce_setup_s,
                "communicators_evicted": self.communicators_evicted}

    @property
    def open_meetings(self) -> int:
        """Groups some member joined but not all (non-zero at the end means a deadlock); a group whose
        members all stopped is not open."""
        return sum(1 for entry in self._meetings.values() if entry[1])
