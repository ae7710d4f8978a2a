"""The interface of a simulated method.

A method's simulator model (``prague/algorithms/<name>/sim.py``) mirrors its runtime class in
simulated time: one process per worker on the world's engine, each iteration ``compute -> the method's
synchronisation -> record``, with the time split into compute, communication and waiting the way the
runtime reports it. The decisions come from the method's own pure code, shared with the runtime (group
generator policies, the DS-Sync shuffle, the AD-PSGD split, the parameter server's rules, the
scenario); only the passage of time is modelled here. Options are the method's own options object, as
its description (:mod:`prague.algorithms.spec`) builds it for the runtime.
"""

from __future__ import annotations

from typing import Any

from prague.sim.engine import Process
from prague.sim.world import World


class SimMethod:
    """Base class: ``start`` spawns :meth:`worker` for every rank; subclasses write :meth:`worker`."""

    #: Whether this model plays out crash and hang scenarios (the worker stops at its fault's step through
    #: :meth:`~prague.sim.world.World.stop_here` and the others go on as the runtime's survivors do).
    models_failures = False

    def __init__(self, world: World, options: Any) -> None:
        self.world = world
        self.options = options

    def start(self) -> None:
        for w in range(self.world.n):
            self.world.engine.process(self.worker(w))

    def worker(self, w: int) -> Process:
        raise NotImplementedError

    def check_done(self) -> None:
        """Raise if the run ended with work left (a deadlock in the simulated method)."""
        world = self.world
        short = [w for w in range(world.n) if not world.finished(w)]  # a failed worker is finished
        if short or world.open_meetings:
            what = "their claimed batches" if world.claimed is not None else f"{world.steps} steps"
            raise RuntimeError(
                f"simulated {type(self).__name__} stopped early: workers {short[:8]} did not finish all "
                f"{what}, {world.open_meetings} groups still wait for members"
            )

    def stats(self) -> dict[str, Any]:
        return {}


class SimRounds(SimMethod):
    """A method whose workers' round threads all take part in every round (``eager-sgd``,
    ``allreduce:backup``): one driver process (:meth:`rounds`) plays all of them, beside the workers."""

    def start(self) -> None:
        super().start()
        self.world.engine.process(self.rounds())

    def rounds(self) -> Process:
        raise NotImplementedError

    def all_reduce(self, key: Any, members: tuple[int, ...] | None = None) -> Any:
        """The round ``key``'s all-reduce of the model over ``members`` (default every worker), joined by
        each one's thread (the driver stands for all of them): ``cluster.allreduce_ring_factor`` times the
        alpha-beta ring time, after backward (nothing to overlap). A member that has stopped (failed, not
        yet declared) never joins: the round waits for its declaration, then runs over the others
        (:meth:`~prague.sim.world.World.meet`). Returns the signal to wait for."""
        world = self.world
        members = tuple(range(world.n)) if members is None else members
        factor = world.cluster.allreduce_ring_factor
        joined = None
        for rank in members:
            if rank not in world.stopped:
                joined = world.meet(key, members, cost_s=lambda ring_s: factor * ring_s, setup=False, rank=rank)
        if joined is None:  # every member has stopped: nothing to reduce
            joined = world.engine.signal()
            joined.fire()
        return joined
