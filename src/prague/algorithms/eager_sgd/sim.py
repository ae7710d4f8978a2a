"""``eager-sgd`` in simulated time: rounds of gradient all-reduce that start without the slowest worker.

Mirrors :mod:`prague.algorithms.eager_sgd.runtime` with the same decision code
(:mod:`prague.algorithms.eager_sgd.decisions`: who starts a round, which rounds are synchronous, the
per-worker :class:`~prague.algorithms.eager_sgd.decisions.Ledger`). One driver process plays every
worker's round thread (they move in lock step: each round is one all-reduce over everyone):

* round ``t`` starts when activated (``solo``: the first worker to finish gradient ``t``; ``majority``:
  round ``t``'s initiator) or, for a synchronous round, when every worker has finished gradient ``t``;
  never before round ``t - 1`` is done, nor while a worker holds as many unapplied results as the
  runtime allows;
* it takes every worker's ledger (and, with ``--math real``, the gradient sum beside it) and lasts the
  ring all-reduce of the model over all workers (``cluster.allreduce_ring_factor`` times the alpha-beta
  ring time, the collective the runtime runs on the flat gradient after backward: nothing to overlap);
* a worker, after computing gradient ``t``, waits until round ``t`` is done, then applies every result
  it has not applied yet, in order; the time it waits is its wait time, as the runtime counts it;
* after the last step a final synchronous round carries what is left.

Failures (``crash``, ``hang``, ``failures:P``), as the runtime recovers from them: a failed worker stops
at its step and deposits nothing more. A round that includes it waits for its declaration (its
all-reduce cannot complete before the launcher declares it), breaks, and the survivors recover: the
round's contributions are lost (``lost_gradients``), a new communicator is built over the survivors
(``preduce_setup_s`` of the cluster), and from then on a round's mean and ``majority``'s initiators are
over the survivors, a synchronous round waits for the survivors only, and the rounds they had reached
are activated again.
"""

from __future__ import annotations

from typing import Any

from prague.algorithms.eager_sgd import rounds_report
from prague.algorithms.eager_sgd.decisions import (
    START, SYNC, Ledger, RoundTally, activation, is_sync_round, result_capacity, stale_weight,
)
from prague.sim.engine import Process, Signal, Signals
from prague.sim.method import SimRounds


class SimEagerSGD(SimRounds):
    """``eager-sgd`` in simulated time; see the module docstring."""

    models_failures = True

    def __init__(self, world: Any, options: Any) -> None:
        super().__init__(world, options)
        n = world.n
        self.ledgers = [Ledger() for _ in range(n)]
        self.sums: list[Any] = [None] * n  # --math real: each worker's gradient sum not contributed yet
        self.applied = [0] * n
        self.finished = 0
        self.completed = 0
        self.started = 0  # rounds taken: a gradient deposited now goes into round `started` or later
        self.capacity = result_capacity(options.sync_every)
        self._activated = Signals(world.engine)  # round -> fired when it may start
        self._done = Signals(world.engine)  # round -> fired when its result is in
        self._results: dict[int, Any] = {}  # round -> (sum, count) until every worker applied it
        self._room: Signal | None = None  # fired when a worker applies results
        self.tally = RoundTally()
        self.waits = 0
        self.live: tuple[int, ...] = tuple(range(n))  # the ranks the rounds run over (survivors after a recovery)
        self.recoveries = 0
        self.lost_gradients = 0
        world.on_declared(self._declared)

    # -- the round threads, in lock step --------------------------------------------------------------
    def rounds(self) -> Process:
        world = self.world
        round_id = 0
        while True:
            final = round_id == world.steps
            while max((self.completed - self.applied[w] for w in self._running()), default=0) >= self.capacity:
                self._room = world.engine.signal()
                yield self._room
            start = self._activated[round_id]
            if not start.fired:
                yield start
            members = self.live
            taken = [self.ledgers[w].take(round_id) for w in members]
            self.started = round_id + 1
            sums = self.sums
            self.sums = [None] * world.n
            count = sum(c.count for c in taken)
            weight = sum(c.weight for c in taken)
            self.tally.add(final or is_sync_round(round_id, self.options.sync_every), count,
                           sum(c.fresh for c in taken), [lag for c in taken for lag in c.staleness])
            total = None
            for s in (sums[w] for w in members):
                if s is not None:
                    total = s if total is None else total + s
            yield self.all_reduce(("eager-sgd", round_id), members)
            if any(w in world.stopped for w in members):  # it waited for a failed member: broken everywhere
                self.lost_gradients += count
                total, count, weight = None, 0, 0.0
                yield world.cluster.preduce_setup_s  # the survivors' new communicator
            self._results[round_id] = (total, count, weight, len(self.live))
            self.completed = round_id + 1
            self._done[round_id].fire()
            if final:
                return
            round_id += 1

    # -- the workers --------------------------------------------------------------------------------
    def worker(self, w: int) -> Process:
        world = self.world
        engine, math = world.engine, world.math
        opts = self.options
        n = world.n
        for k in range(world.steps):
            fault = world.fault_at(w, k) if world.faulty else None
            if fault is not None:  # crash or hang: this worker deposits nothing more
                world.stop_here(w, k, fault)
                self._final_if_done()
                return
            compute = world.compute_s(w, k)
            yield compute
            grad = math.gradient(w, k, lookahead=opts.lookahead == "on")
            weight = stale_weight(opts.stale_weight, self.started - self.applied[w])
            if grad is not None:
                grad = grad * weight if weight != 1.0 else grad
                self.sums[w] = grad if self.sums[w] is None else self.sums[w] + grad
            self.ledgers[w].deposit(self.applied[w], weight)
            act = activation(opts.quorum, opts.sync_every, w, k, n, opts.eager_seed,
                             None if len(self.live) == n else self.live)
            if act == SYNC:
                self._sync_if_ready(k)
            elif act == START:
                start = self._activated[k]
                if not start.fired:
                    start.fire()
            t0 = engine.now
            done = self._done[k]
            if not done.fired:
                self.waits += 1
                yield done
            self._apply(w)
            world.record(w, compute, 0.0, engine.now - t0)
        self.finished += 1
        self._final_if_done()
        done = self._done[world.steps]
        if not done.fired:
            yield done
        self._apply(w)

    def _running(self) -> list[int]:
        """The workers that have not stopped (failed)."""
        stopped = self.world.stopped
        return [w for w in range(self.world.n) if w not in stopped]

    def _sync_if_ready(self, k: int) -> None:
        """Synchronous round ``k`` starts once every worker still running has deposited gradient ``k``."""
        if all(self.ledgers[w].deposited > k for w in self._running()):
            start = self._activated[k]
            if not start.fired:
                start.fire()

    def _final_if_done(self) -> None:
        """The final round starts once every worker still running has run its last step."""
        start = self._activated[self.world.steps]
        if self.finished == len(self._running()) and not start.fired:
            start.fire()

    def _declared(self, rank: int) -> None:
        """``rank`` was declared failed: the rounds go on over the survivors, and the rounds they had
        reached are activated again (the initiator of a ``majority`` round is drawn among them)."""
        if rank not in self.live:
            return
        self.recoveries += 1
        self.live = tuple(w for w in self.live if w != rank)
        n, opts = self.world.n, self.options
        reached = max((self.ledgers[w].deposited for w in self._running()), default=0)
        for k in range(self.started, reached):
            if is_sync_round(k, opts.sync_every):
                self._sync_if_ready(k)
            elif not self._activated[k].fired and any(
                    self.ledgers[w].deposited > k and activation(opts.quorum, opts.sync_every, w, k, n, opts.eager_seed,
                                                                 self.live) == START for w in self.live):
                self._activated[k].fire()
        self._final_if_done()
        if self._room is not None:  # a failed worker's unapplied results no longer hold the rounds back
            room, self._room = self._room, None
            room.fire()

    def _apply(self, w: int) -> None:
        """Worker ``w`` applies every finished round it has not applied yet, in order."""
        math = self.world.math
        while self.applied[w] < self.completed:
            r = self.applied[w]
            total, count, weight, size = self._results[r]
            if total is not None and count:
                math.apply(w, total / (weight if self.options.renormalize == "on" else size))
            self.applied[w] += 1
            if min((self.applied[v] for v in self._running()), default=r + 1) > r:
                del self._results[r]
        if self._room is not None:
            room, self._room = self._room, None
            room.fire()

    def check_done(self) -> None:
        super().check_done()
        if self.completed != self.world.steps + 1:
            raise RuntimeError(f"simulated eager-sgd ran {self.completed} rounds, expected {self.world.steps + 1}")

    def stats(self) -> dict[str, Any]:
        t = self.tally
        return rounds_report(quorum=self.options.quorum, rounds=self.completed, sync_rounds=t.sync_rounds,
                             gradients=t.gradients, fresh=t.fresh, staleness=t.staleness, waits=self.waits,
                             recoveries=self.recoveries, lost_gradients=self.lost_gradients)
