"""What every method with numbered all-reduce rounds in a background thread shares (``eager-sgd``,
``allreduce:backup``): the round buffers, the finished results the worker applies in order, and how a
result's gradient goes through the worker's own optimizer.

A round buffer holds the flat gradient, the floating buffers (BatchNorm statistics) and a few extra
elements a method defines. The thread swaps the buffer it fills for a spare when it takes a round,
all-reduces it, and hands the result to the worker (:meth:`RoundResults.publish`); the worker takes the
results oldest first (:meth:`RoundResults.take_results`), applies them and hands each buffer back
(:meth:`RoundResults.recycle`). A worker holds at most ``capacity`` results unapplied: the thread waits
for room (:meth:`RoundResults.has_room`) before it takes another round, which bounds how far the others
get ahead of it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from prague.algorithms.api import Algorithm, StepTimes
from prague.comm.flat import bind_flat, views_of
from prague.comm.owned import shutdown_group
from prague.errors import CommError
from prague.runtime.background import BackgroundWork


#: How long one wait of a round thread for an activation lasts before it checks that it should go on.
#: Long: a store wait that times out costs the store a reconnection (50 ms slices tripled a round's time).
WAKE_S = 5.0


class RoundResults(BackgroundWork):
    """A round thread's buffers and finished results (see the module docstring); ``size`` elements a
    buffer, one lock (:attr:`cond`) for all of it. The subclass runs the thread."""

    def __init__(self, what: str, name: str, *, rank: int, size: int, dtype: torch.dtype, device: torch.device,
                 capacity: int, group: dist.ProcessGroup | None, store: dist.Store, timeout_s: float) -> None:
        super().__init__(what, name)
        self.pg = group  # the rounds' communicator
        self.store = store  # the thread's own store connection: it blocks in wait() there
        self.timeout_s = timeout_s
        self.rank = rank
        self.size, self.dtype, self.device = size, dtype, device
        self.capacity = capacity
        self._free: list[torch.Tensor] = []
        self._allocated = 1  # the buffer being filled
        self._results: deque[tuple[int, torch.Tensor, int]] = deque()  # (round, result, ranks in it)
        self.completed = 0  # rounds whose result is in

    def new_buffer(self) -> torch.Tensor:
        return torch.zeros(self.size, dtype=self.dtype, device=self.device)

    def spare(self) -> torch.Tensor:
        """A buffer to fill next (a recycled one holds an old round's values); call holding :attr:`cond`."""
        if self._free:
            return self._free.pop()
        self._allocated += 1
        return self.new_buffer()

    def has_room(self) -> bool:
        """Whether the worker holds fewer than ``capacity`` results unapplied; call holding :attr:`cond`."""
        return self._allocated - 1 - len(self._free) < self.capacity

    def publish(self, round_id: int, result: torch.Tensor, size: int) -> None:
        """Round ``round_id``'s result (over ``size`` ranks) is in; call holding :attr:`cond`."""
        self._results.append((round_id, result, size))
        self.completed = round_id + 1
        self.cond.notify_all()

    def wait_for(self, round_id: int, timeout_s: float) -> bool:
        """Block until round ``round_id`` is done; returns whether it had to wait."""
        with self.cond:
            if self.completed > round_id:
                self.raise_if_failed()
                return False
        if not self.wait_until(lambda: self.completed > round_id, timeout_s):
            raise CommError(f"rank {self.rank}: {self.what}: round {round_id} did not finish within {timeout_s:g} s")
        return True

    def take_results(self) -> list[tuple[int, torch.Tensor, int]]:
        """The finished rounds not handed out yet, oldest first, each as (round, result, how many ranks
        took part); hand each buffer back with :meth:`recycle`."""
        with self.cond:
            self.raise_if_failed()
            out = list(self._results)
            self._results.clear()
            return out

    def recycle(self, buffer: torch.Tensor) -> None:
        with self.cond:
            self._free.append(buffer)
            self.cond.notify_all()

    def wait_key(self, key: str, round_id: int, check: Callable[[Exception], None] = lambda exc: None) -> bool:
        """Wait, on the thread's store connection, until ``key`` (round ``round_id``'s activation) is set; False
        when the worker is stopping meanwhile. Waits in slices of :data:`WAKE_S`, after each of which
        ``check(timeout)`` may raise (a peer failed); raises CommError once the job's timeout has passed."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                self.store.wait([key], timedelta(seconds=WAKE_S))
                return True
            except RuntimeError as exc:  # a timeout slice (DistStoreError); look again
                with self.cond:
                    if self.stopping:
                        return False
                check(exc)
                if time.monotonic() > deadline:
                    raise CommError(f"rank {self.rank}: {self.what}: round {round_id} was not started within "
                                    f"{self.timeout_s:g} s; not enough workers reached it ({exc})") from exc

    def shutdown(self, failed: bool, timeout_s: float) -> bool:
        """Stop and join the thread; its communicator is released once it has ended (after a failure a
        thread stuck in a collective keeps it)."""
        ended = super().shutdown(failed, timeout_s)
        if ended:
            pg, self.pg = self.pg, None
            if pg is not None:
                shutdown_group(pg)
        return ended


def step_with(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], gradient: torch.Tensor) -> None:
    """Put the flat ``gradient`` (a round's result, already divided) into ``params``' gradients and take
    the optimizer's step with it: every replica applying the same results takes the same steps."""
    for param, g in zip(params, views_of(gradient, params)):
        if param.grad is None:
            param.grad = g.clone()
        else:
            param.grad.copy_(g)
    optimizer.step()


class RoundsAlgorithm(Algorithm):
    """The worker's side of a method with rounds: the flat state, the rounds applied in order, the waits.
    A subclass sets :attr:`rounds` in ``setup`` (after :meth:`bind`; None alone) and applies one result in
    :meth:`apply_round`."""

    sends_gradients_in_step = True
    rounds: RoundResults | None = None

    def bind(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        """The model's flat state (gradients' parameters first, floating buffers after) and the optimizer."""
        self.optimizer = optimizer
        self.params = list(model.parameters())
        self.flat = bind_flat(model)
        self.n_grads = sum(p.numel() for p in self.params)
        self.applied = 0  # round results applied, in order
        self.waits = 0
        self.rounds = None

    def gradients(self) -> list[torch.Tensor]:
        """This step's gradient of every parameter (zeros for one that has none)."""
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]

    def wait_round(self, round_id: int, times: StepTimes) -> None:
        """Wait until round ``round_id`` is done, counting the wait."""
        assert self.rounds is not None
        t0 = time.perf_counter()
        if self.rounds.wait_for(round_id, self.ctx.timeout_s):
            self.waits += 1
            times.wait_s += time.perf_counter() - t0

    def apply_update(self, optimizer: torch.optim.Optimizer | None, step: int) -> None:
        if self.rounds is None:
            super().apply_update(optimizer, step)
            return
        self.apply_ready()

    def apply_ready(self) -> None:
        """Apply every finished round not applied yet, in order (one handed out again after a recovery,
        and applied already, is skipped)."""
        rounds = self.rounds
        assert rounds is not None
        for round_id, result, size in rounds.take_results():
            if round_id >= self.applied:
                if round_id != self.applied:
                    raise CommError(f"rank {self.ctx.rank}: {rounds.what} got round {round_id} while expecting "
                                    f"{self.applied}")
                self.apply_round(result, size)
                self.applied += 1
            rounds.recycle(result)

    def apply_buffers(self, result: torch.Tensor, n: int) -> None:
        """A result's floating buffers (BatchNorm statistics): their mean over the round's ``n`` ranks."""
        p = self.n_grads
        self.flat[p:].copy_(result[p:self.flat.numel()]).div_(n)

    def apply_round(self, result: torch.Tensor, n: int) -> None:
        """Apply one round's result (over ``n`` ranks)."""
        raise NotImplementedError
