"""``allreduce:backup`` in simulated time: rounds that average the first n - b gradients to arrive.

Mirrors :mod:`prague.algorithms.allreduce.backup` with the same decision code
(:mod:`prague.algorithms.allreduce.backup_rules`: each round's arrival counter, which gradients it
takes, which arrival starts it). One driver process plays every worker's round thread (each round is
one all-reduce over everyone):

* a worker that has applied rounds 0..r-1 offers its gradient to round ``r``: taken if among the first
  n - b, dropped if later (or if the round has already started);
* round ``r`` starts when its counter is complete (n - b gradients, or every worker still training has
  given one) and lasts the ring all-reduce of the model over all workers (``cluster.allreduce_ring_factor``
  times the alpha-beta ring time: the runtime's collective on the flat gradient, nothing to overlap);
* the worker waits until round ``r`` is done, then applies every finished round in order; the time it
  waits is its wait time, as the runtime counts it;
* a worker that has run its last step marks every later round as finished; the round in which every
  worker has finished is the last.

Workers take batches from the job-wide counter (:meth:`~prague.sim.world.World.steps_of`). Not
modelled: the bound on unapplied rounds a worker holds (:data:`~prague.algorithms.allreduce.backup.MAX_PENDING`).
"""

from __future__ import annotations

from typing import Any

from prague.algorithms.allreduce.backup_rules import FINISHED, GRADIENT, accepted, quorum, starts
from prague.algorithms.allreduce.scaling import lr_factor
from prague.metrics.decisions import Decision
from prague.sim.engine import Process, Signals
from prague.sim.method import SimRounds


class SimBackupAllReduce(SimRounds):
    """``allreduce:backup`` in simulated time; see the module docstring."""

    def __init__(self, world: Any, options: Any) -> None:
        super().__init__(world, options)
        n = world.n
        self.applied = [0] * n
        self.finished = [False] * n
        self.arrived = [-1] * n  # the last round each worker added to (a gradient or its finish)
        self.started = 0  # rounds taken
        self.completed = 0
        self._counters: dict[int, int] = {}
        self._taken: dict[int, list[Any]] = {}  # round -> the gradients it takes (None without real math)
        self._activated = Signals(world.engine)
        self._done = Signals(world.engine)
        self._results: dict[int, tuple[Any, int]] = {}  # round -> (gradient sum, count) until all applied it
        self._waiting: int | None = None  # the round the driver waits for
        self._over = world.engine.signal()
        self.gradients = 0
        self.accepted = 0
        self.dropped = 0
        self.waits = 0

    def _arrive(self, w: int, round_id: int, added: int, grad: Any = None) -> bool:
        """Worker ``w`` adds ``added`` to round ``round_id``'s counter (a gradient, ``grad``, or its finish);
        returns whether the round takes the gradient. The round starts after the gradient is in (a
        signal resumes its waiters at once)."""
        value = self._counters.get(round_id, 0) + added
        self._counters[round_id] = value
        self.arrived[w] = round_id
        taken = added == GRADIENT and accepted(value, self.world.n, self.options.backup)
        if taken:
            self._taken.setdefault(round_id, []).append(grad)
        if starts(value, added, self.world.n, self.options.backup):
            self._activated[round_id].fire()
        return taken

    # -- the round threads, in lock step --------------------------------------------------------------
    def rounds(self) -> Process:
        world = self.world
        everyone = tuple(range(world.n))
        round_id = 0
        while True:
            for w in everyone:  # a finished worker's thread marks the round as it reaches it
                if self.finished[w] and round_id > self.arrived[w]:
                    self._arrive(w, round_id, FINISHED)
            start = self._activated[round_id]
            if not start.fired:
                self._waiting = round_id
                yield start
                self._waiting = None
            self.started = round_id + 1
            last = all(self.finished)
            grads = self._taken.pop(round_id, [])
            self._counters.pop(round_id, None)
            total = None
            for g in grads:
                if g is not None:
                    total = g if total is None else total + g
            yield self.all_reduce(("allreduce:backup", round_id))
            self.gradients += len(grads)
            self._results[round_id] = (total, len(grads))
            self.completed = round_id + 1
            self._done[round_id].fire()
            if last:
                self._over.fire()
                return
            round_id += 1

    # -- the workers --------------------------------------------------------------------------------
    def worker(self, w: int) -> Process:
        world = self.world
        engine, math = world.engine, world.math
        for k in world.steps_of(w):
            compute = world.compute_s(w, k)
            yield compute
            t0 = engine.now
            round_id = self.applied[w]
            grad = math.gradient(w, k)
            taken = self.started <= round_id and self._arrive(w, round_id, GRADIENT, grad)
            self.accepted += taken
            self.dropped += not taken
            if world.decisions is not None:
                world.decisions[w].write(Decision.of_arrival(k, round_id, taken))
            done = self._done[round_id]
            if not done.fired:
                self.waits += 1
                yield done
            self._apply(w)
            world.record(w, compute, 0.0, engine.now - t0)
        self.finished[w] = True
        waiting = self._waiting
        if waiting is not None and waiting > self.arrived[w]:  # the round its thread waits for
            self._arrive(w, waiting, FINISHED)
        if not self._over.fired:
            yield self._over
        self._apply(w)

    def _apply(self, w: int) -> None:
        """Worker ``w`` applies every finished round it has not applied yet, in order."""
        math = self.world.math
        while self.applied[w] < self.completed:
            r = self.applied[w]
            total, count = self._results[r]
            if total is not None and count:
                math.apply(w, total / count, lr_factor(self.options, quorum(self.world.n, self.options.backup), r))
            self.applied[w] += 1
            if min(self.applied) > r:
                del self._results[r]

    def check_done(self) -> None:
        super().check_done()
        if not self._over.fired:
            raise RuntimeError(f"simulated allreduce:backup stopped after {self.completed} rounds, before the last")

    def stats(self) -> dict[str, Any]:
        return {"backup": self.options.backup, "lr_scaling": self.options.lr_scaling, "rounds": self.completed,
                "mean_gradients_per_round": self.gradients / self.completed if self.completed else 0.0,
                "accepted": self.accepted, "dropped": self.dropped, "waits": self.waits}
