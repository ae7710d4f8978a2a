"""``ps`` (``sync`` and ``async``) in simulated time, and the server shards ``ps-eager`` shares.

Mirrors :mod:`prague.algorithms.ps.runtime` and :mod:`prague.algorithms.ps.server`: the flat state is split over K
shards; a worker pushes its gradient to every shard and waits for the new values. Each shard is three
FIFO stages in a row: receiving on its network card (``cluster.server_link``, one message at a time at
full bandwidth, so n pushes arriving together are served one after another: the incast), applying the
update under the shard's lock (``cluster.ps_apply_s``), sending the values back. With
``cluster.ps_full_duplex`` false, receiving and sending share one queue (one machine, where both are
memory copies by the same CPUs). Messages between nodes meet the cross traffic (``--cross-traffic``,
:mod:`prague.sim.traffic`) on the worker's node link: a push on its way out, the values on their way in
(:meth:`prague.sim.traffic.Bursts.delay_s`, a message one flow). The update rules are the runtime's own
(:mod:`prague.algorithms.ps.rules`):
:func:`~prague.algorithms.ps.rules.staleness_scale`, :func:`~prague.algorithms.ps.rules.accepts`, and
the shards' SGD step (:class:`prague.optim.SGDRule`): ``sync`` takes the run's optimizer rule with one
server momentum buffer; ``async`` one momentum buffer per worker, or ``--ps-momentum folded``.

* ``sync``: a shard's round completes when the last of the n pushes is in; every worker then gets the
  new values through the send queue, in arrival order. Runtime accounting: ``wait_s`` is the time the
  shard held the push (until the round completed), the rest of the exchange is communication.
* ``async``: each push is applied when received and answered at once with the values right after it;
  staleness tau = versions applied since the values the gradient was computed on.

With a decision log each worker logs its pushes as the runtime does (one line per shard), and every
shard writes ``ps-shardK.jsonl`` as a real shard does (:class:`~prague.metrics.decisions.ShardPush`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prague.algorithms.ps.rules import ShardBook, update_scale
from prague.metrics.decisions import Decision, DecisionLog, ShardPush, shard_trace_path
from prague.sim.costs import Queue
from prague.sim.engine import Process, Signal
from prague.sim.method import SimMethod
from prague.sim.world import World


@dataclass(frozen=True)
class Answer:
    """A shard's answer to an asynchronous push: when it reaches the worker and what it carries."""

    at_s: float
    version: int
    tau: int
    accepted: bool
    scale: float
    values: Any


def log_push(log: DecisionLog, step: int, shards: int, tau: int, scale: float, accepted: bool) -> None:
    """Log a worker's push of ``step`` as a real worker does: once per shard (all answered alike)."""
    for shard in range(shards):
        log.write(Decision.of_push(step, shard, tau, scale, accepted))


class Shards:
    """The K server shards' network cards, version counter and update rules."""

    def __init__(self, world: World, options: Any, mode: str) -> None:
        shards = options.ps_shards
        link = world.cluster.server_link(world.topology.nodes)
        self.rule = world.math.optimizer  # sync: exactly the workers' optimizer rule
        self.async_rule = (self.rule.folded() if self.rule is not None and options.ps_momentum == "folded"
                           else self.rule)
        self.momentum = options.ps_momentum
        self.count = shards
        self.latency_s = link.latency_s
        self.message_s = world.state_bytes / shards / link.bandwidth_bytes_per_s
        self.apply_s = world.cluster.ps_apply_s
        self.receive = [Queue() for _ in range(shards)]
        # Full duplex: receiving and sending overlap (a real network card). Otherwise one queue serves
        # both, as on one machine where every transfer is a memory copy by the same CPUs.
        self.send = [Queue() for _ in range(shards)] if world.cluster.ps_full_duplex else self.receive
        self.lock = [Queue() for _ in range(shards)]
        # A worker's messages cross its node's link when the shards are on another node (several nodes).
        self.bursts = world.bursts if world.topology.nodes > 1 else None
        self.node_of = world.topology.node_of
        # One book for every shard: they see the pushes in one order (the runtime's shards keep one each).
        self.book = ShardBook(mode, world.n, options.staleness_lr, options.max_staleness)
        folder = world.decision_dir
        self.traces = (None if folder is None else
                       [world.open_file(shard_trace_path(folder, k)) for k in range(shards)])

    def trace(self, push: ShardPush) -> None:
        """Every shard saw ``push`` (one order for all of them): write it to their traces, if tracing."""
        if self.traces is not None:
            for trace in self.traces:
                trace.write(push.to_dict())

    def _bursts(self, w: int, direction: str) -> Callable[[float, float], float] | None:
        """What cross traffic adds to a message of worker ``w`` crossing its node's link in ``direction``."""
        bursts = self.bursts
        if bursts is None:
            return None
        crossing = ((self.node_of(w), direction),)
        return lambda start_s, service_s: bursts.delay_s(crossing, start_s, service_s)

    def push(self, now: float, w: int) -> list[float]:
        """A push sent now by worker ``w``: when each shard has received it."""
        delay = self._bursts(w, "out")
        return [q.reserve(now + self.latency_s, self.message_s, delay) for q in self.receive]

    def apply(self, received: list[float]) -> list[float]:
        """One update per shard, under its lock, once the payload is in: when each is applied."""
        return [q.reserve(t, self.apply_s) for q, t in zip(self.lock, received)]

    def reply(self, ready: list[float], w: int) -> float:
        """Values leaving shard s at ``ready[s]`` for worker ``w``: when the last of them reaches it."""
        delay = self._bursts(w, "in")
        return max(q.reserve(t, self.message_s, delay) for q, t in zip(self.send, ready)) + self.latency_s

    def push_async(self, world: World, w: int, grad: Any, base_version: int, now: float, step: int = 0) -> Answer:
        """Apply worker ``w``'s push of ``step`` at once (in push order, which is receive order), as an
        async shard does.

        Every shard sees pushes in the same order, so one version counter stands for all of them.
        """
        received = self.apply(self.push(now, w))
        admitted = self.book.admit(w, base_version, step)
        if admitted.accepted:
            world.math.server_step([grad], self.async_rule, w, admitted.scale)
        if self.traces is not None:
            self.trace(admitted.record)
        return Answer(self.reply(received, w), admitted.version, admitted.tau, admitted.accepted, admitted.scale,
                      world.math.server_values())

    def stats(self, world: World) -> dict[str, Any]:
        wall = world.engine.now
        histogram, rejected = self.book.totals()
        applied = sum(histogram.values())
        return {
            "shards": self.count,
            "pushes": applied + rejected,
            "staleness_histogram": {str(t): histogram[t] for t in sorted(histogram)},
            "mean_staleness": sum(t * c for t, c in histogram.items()) / applied if applied else 0.0,
            "max_staleness_seen": max(histogram, default=0),
            "applied": applied,
            "rejected": rejected,
            "max_staleness": self.book.max_staleness,
            "staleness_lr": self.book.staleness_lr,
            "momentum": self.momentum,
            "server_versions": [self.book.version] * self.count,
            "server_receive_utilization": max(q.busy_s for q in self.receive) / wall if wall > 0 else 0.0,
        }


class SimPS(SimMethod):
    """``ps`` in simulated time; see the module docstring."""

    def __init__(self, world: World, options: Any) -> None:
        super().__init__(world, options)
        self.shards = Shards(world, options, options.ps_mode)
        self.sync = options.ps_mode == "sync"
        self.sync_scale = update_scale("sync", options.staleness_lr, 0, world.n, True)
        self._round: list[tuple[int, list[float], Any, Signal]] = []
        self._base = [0] * world.n

    def _push_sync(self, w: int, grad: Any, step: int) -> Signal:
        """Contribute to the current round; the signal fires with the shard-side wait when values are back."""
        now = self.world.engine.now
        sig = Signal(self.world.engine)
        book = self.shards.book
        record = book.contribute(w, book.version, step)  # every worker is on the last version in sync mode
        if self.shards.traces is not None:
            self.shards.trace(record)
        self._round.append((w, self.shards.push(now, w), grad, sig))
        if len(self._round) == self.world.n:
            members, self._round = self._round, []
            done = self.shards.apply([max(arrived[s] for _, arrived, _, _ in members)
                                      for s in range(self.shards.count)])
            math = self.world.math
            math.server_step([g for _, _, g, _ in sorted(members, key=lambda m: m[0])], self.shards.rule, "sync")
            book.close_round()
            values = math.server_values()
            for v, arrived, _, s in sorted(members, key=lambda m: (m[1][0], m[0])):
                reply_at = self.shards.reply(done, v)
                math.install(v, values)
                s.fire_after(reply_at - now, max(d - a for d, a in zip(done, arrived)))
        return sig

    def worker(self, w: int) -> Process:
        world = self.world
        engine, math = world.engine, world.math
        log = None if world.decisions is None else world.decisions[w]
        shards = self.shards.count
        for k in world.steps_of(w):
            compute = world.compute_s(w, k)
            yield compute
            grad = math.gradient(w, k)
            t0 = engine.now
            if self.sync:
                wait = yield self._push_sync(w, grad, k)
                if log is not None:
                    log_push(log, k, shards, 0, self.sync_scale, True)
            else:
                answer = self.shards.push_async(world, w, grad, self._base[w], engine.now, k)
                if log is not None:
                    log_push(log, k, shards, answer.tau, answer.scale, answer.accepted)
                self._base[w] = answer.version
                yield answer.at_s - engine.now
                math.install(w, answer.values)
                wait = 0.0
            world.record(w, compute, engine.now - t0 - wait, wait)

    def stats(self) -> dict[str, Any]:
        return {"mode": self.options.ps_mode, **self.shards.stats(self.world)}
