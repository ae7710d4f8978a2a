"""``allreduce:backup``: synchronous SGD with backup workers, in rounds run by a background thread on every worker.

Chen, Pan, Monga, Bengio, Jozefowicz, "Revisiting Distributed Synchronous SGD" (2016): with n workers and
b backup workers, each step applies the mean of the first n - b gradients to arrive; the b late ones are
dropped, so a step waits for the (n - b)-th fastest worker, not the slowest. The paper aggregates on
parameter servers; here the mean is one all-reduce per step over every worker, so every replica applies
the same sequence of means through its own optimizer and the replicas stay bit-identical.

* Round ``r`` is step ``r`` of the job. A worker that has applied rounds 0..r-1 computes its gradient
  on those values and offers it to round ``r``: it adds itself to the round's arrival counter in the
  job's store, one request (:mod:`.backup_rules`). The first n - b are taken; the add that completes the
  round sets its activation key.
* A **round thread** on every worker takes part in every round, in order: it waits for the round's
  activation, then all-reduces the worker's gradient if it was taken (else zeros), the number of
  gradients, the floating buffers (BatchNorm statistics, averaged over all workers) and whether the
  worker has finished. A worker still computing joins every round at once, through its thread.
* The worker waits for the round it offered to (usually only for the all-reduce) and applies every
  finished round in order: ``sum / count`` through its optimizer. A late worker's gradient is dropped;
  it applies the rounds it missed, and its next gradient goes to the newest round. A persistently slow
  worker is late every time and only follows; a worker slowed for a while is back in as soon as it is
  among the first n - b again.
* Workers take their batches from the job-wide counter (a late worker takes fewer). A worker that has
  run its last step marks every later round it takes part in as finished, so the last rounds wait only
  for the workers still training; the round in which every worker has finished is the last.

A training worker holds at most :data:`MAX_PENDING` finished rounds unapplied; one further behind holds
its thread, and so every round, until it applies them. A worker that has finished applies the others'
rounds as they come; one counted out for a collective of the user's loop keeps them all meanwhile (one
result per round) and applies them when it is back. ``allreduce:backup`` does not survive a failed
worker (as ``allreduce``): a broken round fails the job.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from prague.algorithms.allreduce import AllReduceOptions
from prague.algorithms.allreduce.scaling import lr_factor
from prague.algorithms.allreduce.backup_rules import FINISHED, GRADIENT, accepted, quorum, starts
from prague.algorithms.api import StepTimes
from prague.algorithms.rounds import RoundResults, RoundsAlgorithm, step_with
from prague.comm.flat import views_of
from prague.comm.preduce import backend_group
from prague.errors import CommError
from prague.metrics.decisions import Decision
from prague.optim import scaled_lr
from prague.runtime.background import COMMUNICATING

#: Finished rounds a worker may hold before applying them (its thread then waits for room).
MAX_PENDING = 16
#: Extra elements after the state in a round buffer: gradients in it, finished workers.
EXTRAS = 2
_COUNT, _FINISHED = -2, -1


class BackupRounds(RoundResults):
    """One worker's side of every round: the offered gradient, the thread, the finished results.

    The main thread calls :meth:`offer`, :meth:`wait_for`, :meth:`take_results`, :meth:`recycle` and
    :meth:`finish`; the thread runs :meth:`run`, one operation per round (``waiting`` for the round's
    activation, ``communicating`` in its all-reduce). One lock (:attr:`cond`) guards the offered gradient
    and the results.
    """

    def __init__(self, *, group: dist.ProcessGroup, store: dist.Store, main_store: dist.Store, prefix: str,
                 rank: int, nproc: int, backup: int, n_grads: int, buffers: torch.Tensor, timeout_s: float) -> None:
        super().__init__("allreduce:backup round thread", "backup-rounds", rank=rank,
                         size=n_grads + buffers.numel() + EXTRAS, dtype=buffers.dtype, device=buffers.device,
                         capacity=MAX_PENDING, group=group, store=store, timeout_s=timeout_s)
        self.main_store = main_store  # the worker's: arrivals
        self.prefix = prefix
        self.nproc, self.backup = nproc, backup
        self.n_grads, self.state_size = n_grads, n_grads + buffers.numel()
        self.acc = self.new_buffer()
        self.acc[n_grads:self.state_size].copy_(buffers)
        self._offered: tuple[int, bool | None] | None = None  # (round, taken?; None while the store decides)
        self._arrived = -1  # the last round this worker added to (a gradient or its finish)
        self._waiting: int | None = None  # the round the thread waits for, while the worker trains
        self.absent = False  # the worker sends no gradient for now (paused, or finished)
        self.finished = False  # the worker has run its last step
        self.over = False  # the last round is done
        self.started = 0  # rounds the thread has taken
        self.gradients = 0  # gradients averaged in the rounds (every worker's)
        self.accepted = 0  # this worker's gradients taken
        self.dropped = 0  # this worker's gradients that came late
        self.start()

    def _counter(self, round_id: int) -> str:
        return f"{self.prefix}/arrived/{round_id}"

    def _key(self, round_id: int) -> str:
        return f"{self.prefix}/go/{round_id}"

    def _arrive(self, store: dist.Store, round_id: int, added: int) -> int:
        """Add to round ``round_id``'s counter and start the round if this add completes it; the new value."""
        value = store.add(self._counter(round_id), added)
        if starts(value, added, self.nproc, self.backup):
            store.set(self._key(round_id), "go")
        return value

    # -- the worker's side ---------------------------------------------------------------------------
    def offer(self, grads: list[torch.Tensor], buffers: torch.Tensor, round_id: int) -> bool:
        """Offer a gradient (one tensor per parameter) computed on rounds 0..``round_id``-1 to round
        ``round_id``, with the current floating buffers; returns whether the round takes it."""
        with self.cond:
            self.raise_if_failed()
            self.acc[self.n_grads:self.state_size].copy_(buffers)
            if self.started > round_id or self._arrived >= round_id:  # it ran without this gradient, or this
                self.dropped += 1  # worker was marked absent from it (model.averaged_model() in the loop)
                return False
            torch._foreach_copy_(views_of(self.acc, grads), grads)
            if self.acc.is_cuda:  # the round thread's collective must see the finished copy
                torch.cuda.current_stream(self.acc.device).synchronize()
            self._offered = (round_id, None)
            self._arrived = round_id
        taken = accepted(self._arrive(self.main_store, round_id, GRADIENT), self.nproc, self.backup)
        with self.cond:
            self._offered = (round_id, taken)
            self.accepted += taken
            self.dropped += not taken
            self.cond.notify_all()
        return taken

    def pause(self) -> None:
        """The worker leaves its steps for a while (a collective of the user's loop, every rank's own
        time): the rounds count it as absent, as a finished worker, until :meth:`resume`, so those still
        training are not held by it."""
        with self.cond:
            self.absent = True
            waiting, self._waiting = self._waiting, None
            if waiting is not None and waiting > self._arrived:
                self._arrived = waiting
            else:
                waiting = None
            self.cond.notify_all()
        if waiting is not None:
            self._arrive(self.main_store, waiting, FINISHED)

    def resume(self) -> None:
        """Back to the steps after :meth:`pause`: the next gradient goes to the next round it is not
        marked absent from."""
        with self.cond:
            if not self.finished:
                self.absent = False

    def finish(self, timeout_s: float, apply: Callable[[], None]) -> None:
        """This worker has run its last step: it counts as absent in every round from now on (the one its
        thread waits for included, unless its last gradient went there) and says it has finished in each
        round's all-reduce; returns once the last round (every worker finished) is done. Meanwhile it
        applies the rounds the others still run as they finish (``apply``), so that however many steps
        they have left this worker holds few results. ``timeout_s`` counts rounds that do not come."""
        with self.cond:
            self.finished = True
        self.pause()
        while True:
            if not self.wait_until(lambda: self.over or bool(self._results), timeout_s):
                raise CommError(f"rank {self.rank}: no allreduce:backup round finished within {timeout_s:g} s "
                                "while the others went on")
            apply()
            with self.cond:
                if self.over and not self._results:
                    return

    def has_room(self) -> bool:
        """Room for one more unapplied result; always while this worker is counted out of the rounds (it
        applies them once back: a collective of the user's loop must not hold the others' rounds)."""
        return self.absent or super().has_room()

    # -- the thread ----------------------------------------------------------------------------------
    def run(self, index: int) -> None:
        round_id = 0
        while True:
            with self.operation(round_id) as op:
                if not self._start(round_id):
                    return
                op.to(COMMUNICATING)
                if self._run(round_id):  # the last round: every worker has finished
                    with self.cond:
                        self.over = True
                        self.cond.notify_all()
                    return
                round_id += 1

    def _start(self, round_id: int) -> bool:
        """Wait until round ``round_id`` is activated; False when the worker is stopping."""
        with self.cond:  # room for one more result
            self.cond.wait_for(lambda: self.stopping or self.has_room())
            if self.stopping:
                return False
            mark = self.absent and round_id > self._arrived
            if mark:
                self._arrived = round_id
            elif not self.absent:
                self._waiting = round_id
        if mark:
            self._arrive(self.store, round_id, FINISHED)
        if not self.wait_key(self._key(round_id), round_id):  # the activation, through the store
            return False
        with self.cond:
            self._waiting = None
        return True

    def _run(self, round_id: int) -> bool:
        """Round ``round_id``'s all-reduce; returns whether it was the last."""
        with self.cond:
            # A gradient offered to this round is decided before the round can start (the add that
            # completes a round comes after every add it takes); wait out the store's answer.
            self.cond.wait_for(lambda: self._offered is None or self._offered[0] != round_id
                               or self._offered[1] is not None)
            offered = self._offered
            mine = offered is not None and offered[0] == round_id and bool(offered[1])
            spare = self.spare()
            send, self.acc = self.acc, spare
            spare[self.n_grads:self.state_size].copy_(send[self.n_grads:self.state_size])
            finished = self.finished
            self.started = round_id + 1
        if not mine:
            send[:self.n_grads].zero_()
        send[_COUNT] = 1.0 if mine else 0.0
        send[_FINISHED] = 1.0 if finished else 0.0
        pg = self.pg
        if pg is None:
            raise CommError(f"rank {self.rank}: allreduce:backup's communicator was released")
        try:
            pg.allreduce([send]).wait()
        except RuntimeError as exc:
            raise CommError(f"rank {self.rank}: allreduce:backup round {round_id}'s all-reduce failed: {exc}") from None
        if send.is_cuda:
            torch.cuda.synchronize(send.device)
        count, n_finished = int(round(float(send[_COUNT]))), int(round(float(send[_FINISHED])))
        if count > quorum(self.nproc, self.backup):
            raise CommError(f"allreduce:backup round {round_id} averaged {count} gradients, more than n - b = "
                            f"{quorum(self.nproc, self.backup)}")
        with self.cond:
            self.gradients += count
            self.publish(round_id, send, self.nproc)
        return n_finished == self.nproc


class BackupAllReduce(RoundsAlgorithm):
    """See the module docstring."""

    options: AllReduceOptions
    rounds: BackupRounds | None

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> nn.Module:
        ctx = self.ctx
        self.bind(model, optimizer)
        if ctx.world_size == 1:
            return model
        prefix = self.namespace
        group = backend_group(ctx, dist.PrefixStore(f"{prefix}/pg", ctx.store), ctx.rank, ctx.world_size, ctx.timeout)
        self.rounds = self.in_background(BackupRounds(
            group=group, store=ctx.private_store(), main_store=ctx.private_store(), prefix=prefix, rank=ctx.rank,
            nproc=ctx.world_size, backup=self.options.backup, n_grads=self.n_grads, buffers=self.flat[self.n_grads:],
            timeout_s=ctx.timeout_s))
        return model

    @contextlib.contextmanager
    def outside_steps(self) -> Iterator[None]:
        rounds = self.rounds
        if rounds is None or self._closed:
            yield
            return
        rounds.pause()
        try:
            yield
        finally:
            rounds.resume()

    def after_backward(self, step: int, times: StepTimes) -> None:
        rounds = self.rounds
        if rounds is None:
            return
        round_id = self.applied
        taken = rounds.offer(self.gradients(), self.flat[self.n_grads:], round_id)
        if self.decisions is not None:
            self.decisions.write(Decision.of_arrival(step, round_id, taken))
        self.wait_round(round_id, times)  # taken or late, the round is under way

    def apply_round(self, result: torch.Tensor, n: int) -> None:
        """One round's result: its floating buffers (their mean over all workers), then the mean of its
        gradients through the optimizer (a round without any, at the very end, moves nothing)."""
        self.apply_buffers(result, n)
        count = int(round(float(result[_COUNT])))
        if count == 0 or self.optimizer is None:  # no optimizer (emulated compute): nothing to train
            return
        with scaled_lr(self.optimizer, lr_factor(self.options, quorum(self.ctx.world_size, self.options.backup),
                                                 self.applied)):
            step_with(self.optimizer, self.params, result[:self.n_grads].div_(count))

    def finish(self) -> None:
        rounds = self.rounds
        if rounds is None:
            return
        rounds.finish(self.ctx.timeout_s, self.apply_ready)
        rounds.join(self.ctx.timeout_s)

    def stats(self) -> dict[str, Any]:
        rounds = self.rounds
        completed = rounds.completed if rounds is not None else 0
        gradients = rounds.gradients if rounds is not None else 0
        return {"backup": self.options.backup, "lr_scaling": self.options.lr_scaling, "rounds": completed,
                "mean_gradients_per_round": gradients / completed if completed else 0.0,
                "accepted": rounds.accepted if rounds is not None else 0,
                "dropped": rounds.dropped if rounds is not None else 0, "waits": self.waits}
