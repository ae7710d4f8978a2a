"""``allreduce`` in simulated time: DDP's bucketed ring all-reduce over all n workers, overlapped with backward.

Mirrors :mod:`prague.algorithms.allreduce.runtime` (PyTorch DDP; Li et al., VLDB 2020). The gradients,
in the order backward produces them (:attr:`~prague.sim.world.World.gradient_bytes`), are cut into DDP's
buckets of ``--bucket-cap-mb`` (:func:`~prague.sim.costs.ddp_buckets`). Every worker's backward is the
last :meth:`~prague.sim.world.World.backward_s` of its compute and produces the bytes at an even rate;
bucket i's ring all-reduce starts once every worker has produced it and bucket i - 1's is done (one
stream), and takes ``cluster.allreduce_ring_factor`` x its alpha-beta ring time
(:func:`~prague.sim.costs.ring_allreduce_s`, on the fabric's link and share, slowed by the cross traffic it
meets) (:func:`~prague.sim.costs.overlapped_allreduce_s`). Iteration k ends for everyone when the last
bucket's all-reduce is done, so what a worker waits after its own compute (the exposed communication, and
the time a fast worker waits for the slowest inside DDP) counts as communication, as in the runtime.

Not modelled: DDP's broadcast of the buffers (BatchNorm statistics) before forward, and its first
iteration's single bucket (DDP rebuilds the buckets after it).
"""

from __future__ import annotations

from typing import Any

from prague.algorithms.allreduce import DDP_BUCKET_MB, DDP_FIRST_BUCKET_MB
from prague.algorithms.allreduce.scaling import lr_factor
from prague.sim.costs import MIB, Transfer, bucket_ready_s, ddp_buckets, overlapped_allreduce_s, ring_allreduce_s
from prague.sim.engine import Process
from prague.sim.method import SimMethod


class SimAllReduce(SimMethod):
    """``allreduce`` in simulated time; see the module docstring."""

    def __init__(self, world: Any, options: Any) -> None:
        super().__init__(world, options)
        cap = options.bucket_cap_mb
        self.buckets = (ddp_buckets(world.gradient_bytes, DDP_BUCKET_MB * MIB, DDP_FIRST_BUCKET_MB * MIB) if cap is None
                        else ddp_buckets(world.gradient_bytes, cap * MIB))
        self._backward: dict[int, list[tuple[float, float]]] = {}  # step -> (compute end, backward) per worker
        self.exposed_s = 0.0  # summed over steps: time from the last worker's compute end to the step's end
        self.allreduce_s = 0.0  # summed over steps: the buckets' all-reduce times (exposed_s is a share of it)

    def exchange_s(self, step: int, transfer: Transfer, n: int | None = None) -> float:
        """Play out step ``step``'s buckets once the last of its ``n`` workers (default: all) has finished
        its compute (now); return the time from now until the last bucket's all-reduce is done."""
        world = self.world
        now = world.engine.now
        arrivals = self._backward.pop(step)
        per_worker = [bucket_ready_s(backward, self.buckets, end - backward) for end, backward in arrivals]
        ready = [max(times) for times in zip(*per_worker)]
        factor, n = world.cluster.allreduce_ring_factor, world.n if n is None else n
        latency_s = ring_allreduce_s(n, 0.0, transfer.link)

        def bucket_s(i: int, start_s: float) -> float:
            ring_s = ring_allreduce_s(n, self.buckets[i], transfer.link, transfer.share)
            work_s = factor * (ring_s - latency_s)
            duration = factor * latency_s + work_s + transfer.delay_s(work_s, start_s + factor * latency_s)
            self.allreduce_s += duration
            return duration

        done = overlapped_allreduce_s(ready, bucket_s)
        exposed = max(0.0, done[-1] - now)
        self.exposed_s += exposed
        return exposed

    def worker(self, w: int) -> Process:
        world = self.world
        engine, math = world.engine, world.math
        everyone = tuple(range(world.n))

        for k in range(world.steps):
            compute = world.compute_s(w, k)
            yield compute
            t0 = engine.now
            self._backward.setdefault(k, []).append((t0, world.backward_s(w, k)))

            def update(members: tuple[int, ...], k: int = k) -> None:
                math.allreduce_step(members, k, lr_factor(self.options, len(members), k))

            def exchange(transfer: Transfer, k: int = k) -> float:
                return self.exchange_s(k, transfer)

            yield world.meet(("allreduce", k), everyone, setup=False, on_done=update, exchange_s=exchange)
            world.record(w, compute, engine.now - t0, 0.0)

    def stats(self) -> dict[str, Any]:
        return {"bucket_cap_mb": self.options.bucket_cap_mb, "lr_scaling": self.options.lr_scaling,
                "buckets": len(self.buckets),
                "exposed_fraction": self.exposed_s / self.allreduce_s if self.allreduce_s > 0 else 0.0}
