"""``adpsgd`` in simulated time: actives average with a random passive; passives never wait.

Mirrors :mod:`prague.algorithms.adpsgd.runtime` (Lian et al., ICML 2018) with its own decision code: the
bipartite split :func:`prague.algorithms.adpsgd.decisions.bipartite_split` and each active's seeded
:class:`prague.algorithms.adpsgd.decisions.NeighbourChooser`, so a simulated active picks the same passives in the
same order as a real one. Time:

* an active computes, then asks its passive; the passive's server thread answers one request at a time
  (FIFO), so the active first waits for it (``wait_s``), then the exchange runs: its values to the
  passive and the mean back (:func:`prague.sim.costs.exchange_s`, sharing links like any transfer);
  then it applies its gradient;
* a passive computes on a snapshot and applies its gradient to its current values; it never waits
  (its server thread works in the background).

Failures (``crash``, ``hang``, ``failures:P``), as the runtime plays them: a failed worker stops at its
step; a failed passive's server stops with it, so the exchanges queued at it or under way break once it
is declared failed (the runtime's active waits for the declaration, :data:`~prague.runtime.liveness.DECLARE_WAIT_S`
at most, restores its values and draws again), and an active draws among the passives not declared failed
(:meth:`~prague.algorithms.adpsgd.decisions.NeighbourChooser.next_live`; none left: a local step).
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Any

from prague.algorithms.adpsgd.decisions import NeighbourChooser, bipartite_split
from prague.metrics.decisions import Decision
from prague.sim.costs import exchange_s
from prague.sim.engine import Process, Signal
from prague.sim.method import SimMethod
from prague.sim.world import World


class SimADPSGD(SimMethod):
    """``adpsgd`` in simulated time; see the module docstring."""

    models_failures = True

    def __init__(self, world: World, options: Any) -> None:
        super().__init__(world, options)
        self.actives, self.passives = bipartite_split(world.n, options.adpsgd_active)
        self._queue: dict[int, deque[tuple[int, Signal]]] = {p: deque() for p in self.passives}
        self._busy: dict[int, bool] = {p: False for p in self.passives}
        self._broken: dict[int, list[Signal]] = {p: [] for p in self.passives}  # a stopped passive's exchanges
        self.broken_exchanges = 0
        world.on_declared(self._declared)
        self.exchanges = 0
        self.chosen: dict[int, list[int]] = {a: [] for a in self.actives}  # each active's passives, in order

    # -- a passive's server thread --------------------------------------------------------------------
    def _request(self, active: int, passive: int) -> Signal:
        """Queue an averaging request; the signal fires with the time it waited to be taken."""
        sig = Signal(self.world.engine)
        self._queue[passive].append((active, sig))
        if not self._busy[passive]:
            self._serve_next(passive)
        return sig

    def _serve_next(self, passive: int) -> None:
        queue = self._queue[passive]
        if not queue or passive in self.world.stopped:  # a stopped server serves no one: see _declared
            self._busy[passive] = False
            return
        self._busy[passive] = True
        active, sig = queue.popleft()
        world = self.world
        pair = (min(active, passive), max(active, passive))
        duration, token = world.fabric.start(pair, world.state_bytes, exchange_s)
        self.exchanges += 1
        taken_at = world.engine.now

        def done(_: Any) -> None:
            world.fabric.end(token)
            if passive in world.stopped:  # it stopped under way: broken, known once it is declared
                self._broken[passive].append(sig)
                self._busy[passive] = False
                return
            world.math.average(pair)
            sig.fire(taken_at)
            self._serve_next(passive)

        world.engine.after(duration, done)

    def _declared(self, rank: int) -> None:
        """``rank`` was declared failed: if a passive, every exchange queued at it or under way breaks now
        (its signal fires with None), and its actives draw again."""
        if rank not in self._queue:
            return
        broken = self._broken[rank] + [sig for _, sig in self._queue[rank]]
        self.broken_exchanges += len(self._broken[rank])  # started, never served
        self._broken[rank], self._queue[rank] = [], deque()
        for sig in broken:
            sig.fire(None)

    # -- workers --------------------------------------------------------------------------------------
    def worker(self, w: int) -> Process:
        world = self.world
        engine, math = world.engine, world.math
        active = w in self.actives and bool(self.passives)
        chooser = NeighbourChooser(self.passives, w, self.options.adpsgd_seed) if active else None
        log = None if world.decisions is None else world.decisions[w]
        for k in world.steps_of(w):
            fault = world.fault_at(w, k) if world.faulty else None
            if fault is not None:  # crash or hang: this worker (and a passive's server) stops here
                world.stop_here(w, k, fault)
                return
            math.snapshot(w)
            compute = world.compute_s(w, k)
            yield compute
            grad = math.gradient(w, k, at_snapshot=True)
            if chooser is None:
                math.apply(w, grad)
                world.record(w, compute, 0.0, 0.0)
                continue
            t0 = engine.now
            taken_at = None
            while taken_at is None and (peer := chooser.next_live(world.declared)) is not None:
                self.chosen[w].append(peer)
                if log is not None:
                    log.write(Decision.of_partner(k, peer))
                taken_at = yield self._request(w, peer)  # None: the exchange broke (the passive failed)
            math.apply(w, grad)
            if taken_at is None:  # every passive failed: a local step
                taken_at = engine.now
            world.record(w, compute, engine.now - taken_at, taken_at - t0)

    def stats(self) -> dict[str, Any]:
        peers: Counter[int] = Counter(p for chosen in self.chosen.values() for p in chosen)
        return {"actives": list(self.actives), "passives": list(self.passives), "requests_initiated": self.exchanges,
                "requests_served": self.exchanges - self.broken_exchanges,
                "peers": {str(p): peers[p] for p in sorted(peers)}}
