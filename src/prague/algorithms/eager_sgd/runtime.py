"""``eager-sgd``: partial gradient all-reduce in numbered rounds, run by a background thread on every worker.

eager-SGD (Li, Ben-Nun, Di Girolamo, Alistarh, Hoefler, "Taming Unbalanced Training Workloads in Deep
Learning with Partial Collective Operations", PPoPP 2020). Every worker keeps one global sequence of
gradient sums, so every replica stays identical, yet no round waits for the slowest worker:

* after backward the worker adds its gradient to its **accumulator** (a buffer beside a
  :class:`~.decisions.Ledger`; the sum of everything it computed and has not contributed yet);
* a background **round thread** on every worker takes part in every round, in order. Round ``t``
  starts when it is activated (:mod:`.decisions`): under ``solo`` by the first worker to finish its
  gradient of iteration ``t``, under ``majority`` by that round's seeded initiator; every
  ``--sync-every``-th round, and the final one, start on each worker once its own gradient is in. The
  thread then takes the accumulator (possibly empty: a count of 0) and all-reduces it with the others:
  gradient sum, the latest BatchNorm statistics, the number of gradients and how many were fresh;
* the worker waits until round ``t`` is done (usually only for the all-reduce: someone faster started
  it) and applies, in order, every round result it has not applied yet: ``sum / n`` (``--renormalize
  off``, the paper's choice: a missing gradient counts as zero) or ``sum / count`` (``on``), through
  its own optimizer, whose state therefore stays the same on every worker.

Activation travels through the job's store, not through the training loop: the activating worker's
main thread sets the round's key once (one store request, no polling), and every round thread waits
for that key on a store connection of its own (:meth:`prague.runtime.context.DistContext.private_store`),
so a worker that is still computing still joins the round at once and contributes what it has. A
gradient that misses its round (its worker was late) is carried by the next round its thread takes,
so none is lost or counted twice. A worker that falls behind applies the results it missed one by
one; it holds at most ``--sync-every`` of them (16 without synchronous rounds), and its thread waits
for room before taking another round, which bounds how far ahead the others can get.

After its last step every worker's thread runs one final synchronous round with whatever is left, so
the sum of all applied contributions is the sum of all computed gradients. Every rank must run the
same number of steps (as with DDP); a mismatch is detected in the rounds and raised.

Failed workers (:mod:`prague.runtime.liveness`): the launcher declares a crashed or hung worker failed
(and kills a hung one), so a round whose all-reduce involves it breaks on every survivor (gloo reports
a dead peer at once; a survivor whose own peers are alive sees theirs break in turn); a thread waiting
for an activation notices the declaration within :data:`~prague.algorithms.rounds.WAKE_S`. Each survivor's thread then
**recovers** (:meth:`RoundThread._recover`): it drops the broken communicator, publishes in the store
how many rounds it completed, and once every rank that took part is either published or declared
failed, the published ranks are the new set. A round's all-reduce can complete on some
survivors and break on others (a peer failed after its last send); since every round needs every
rank's part of the one before, their counts differ by at most one. They resume after the last round
any of them completed, on a new communicator over that set (a round's mean and ``majority``'s
initiators are over the survivors from then on): the lowest survivor that completed that round first
broadcasts its result to the ones it broke on (``recovered_rounds``), so every survivor applies the
same sequence of results and the replicas stay identical. The rounds the survivors' workers already
reached are re-activated. The contributions carried by a round that broke on every survivor are lost
(one gradient per survivor, counted in ``lost_gradients``). A second failure during a recovery is
fatal.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from prague.algorithms.api import StepTimes
from prague.algorithms.rounds import RoundResults, RoundsAlgorithm, step_with
from prague.algorithms.eager_sgd import EagerSGDOptions, rounds_report
from prague.algorithms.eager_sgd.decisions import (
    START, Contribution, Ledger, RoundTally, activation, is_sync_round, result_capacity, stale_weight,
)
from prague.comm.flat import views_of
from prague.comm.owned import shutdown_group
from prague.comm.preduce import backend_group
from prague.errors import CommError
from prague.runtime.background import COMMUNICATING
from prague.runtime.liveness import DECLARE_WAIT_S, Membership, read_keys

#: Extra elements after the state in a round buffer: gradients' weight, their count, fresh ones, finished flag.
EXTRAS = 4
_WEIGHT, _COUNT, _FRESH, _FINISHED = -4, -3, -2, -1
_FINAL = b"final"


class RoundThread(RoundResults):
    """One worker's side of every round: the accumulator, the thread, the finished results.

    The main thread calls :meth:`deposit`, :meth:`activate`, :meth:`wait_for`, :meth:`take_results`,
    :meth:`recycle` and :meth:`finish`; the thread runs :meth:`run`, each round one operation
    (:class:`~prague.runtime.background.BackgroundWork`: ``waiting`` for its activation,
    ``communicating`` in its all-reduce or a recovery). One lock (:attr:`cond`) guards the accumulator,
    its ledger and the result queue.
    """

    def __init__(self, *, make_group: Callable[[str, int, int], dist.ProcessGroup], store: dist.Store,
                 main_store: dist.Store, prefix: str, rank: int, nproc: int, n_grads: int, buffers: torch.Tensor,
                 options: EagerSGDOptions, timeout_s: float, membership: Membership | None = None) -> None:
        super().__init__("eager-sgd round thread", "eager-sgd-rounds", rank=rank,
                         size=n_grads + buffers.numel() + EXTRAS, dtype=buffers.dtype, device=buffers.device,
                         capacity=result_capacity(options.sync_every), group=make_group(f"{prefix}/pg", rank, nproc),
                         store=store, timeout_s=timeout_s)
        self.make_group = make_group  # (store prefix, this rank's index, size) -> a communicator
        self.membership = membership  # None: a broken round is fatal
        self.live: tuple[int, ...] = tuple(range(nproc))  # the ranks taking part in the rounds
        self.main_store = main_store  # the worker's: activations
        self.prefix = prefix
        self.nproc = nproc
        self.n_grads, self.state_size = n_grads, n_grads + buffers.numel()
        self.options = options
        self.acc = self.new_buffer()
        self.acc[n_grads:self.state_size].copy_(buffers)  # a worker without a gradient yet sends these
        self.ledger = Ledger()
        self.started = 0  # rounds the thread has taken
        self.finished_at: int | None = None  # this worker's step count, once it has finished
        # What the rounds carried (global figures, from the reduced extras) and this worker's share.
        self.tally = RoundTally()
        self.recoveries = 0  # times the rounds went on without failed ranks
        self.lost_gradients = 0  # this worker's gradients in rounds that broke
        self.recovered_rounds = 0  # rounds that broke here and were completed by a survivor, which sent them
        # Survivable rounds: the latest completed result (a survivor it broke on may need it) and what
        # this worker contributed to the round that broke here (counted after all if a survivor completed it).
        self._last: torch.Tensor | None = self.new_buffer() if membership is not None else None
        self._broken: tuple[int, Contribution] | None = None
        self.start()

    def _key(self, round_id: int) -> str:
        return f"{self.prefix}/act/{round_id}"

    # -- the worker's side ---------------------------------------------------------------------------
    def deposit(self, grads: list[torch.Tensor], buffers: torch.Tensor, version: int) -> None:
        """Add a gradient (one tensor per parameter) computed on ``version`` applied rounds, and the
        current floating buffers, to what this worker contributes next; weighted by how late the next
        round this thread takes will be for it (:func:`~.decisions.stale_weight`)."""
        with self.cond:
            self.raise_if_failed()
            acc = self.acc
            views = views_of(acc, grads)
            weight = stale_weight(self.options.stale_weight, self.started - version)
            if self.ledger.pending:
                torch._foreach_add_(views, grads, alpha=weight)
            else:  # the first gradient since the last round: the buffer holds an old round's values
                torch._foreach_copy_(views, grads)
                if weight != 1.0:
                    torch._foreach_mul_(views, weight)
            acc[self.n_grads:self.state_size].copy_(buffers)
            if acc.is_cuda:  # the round thread's collective must see the finished copy
                torch.cuda.current_stream(acc.device).synchronize()
            self.ledger.deposit(version, weight)
            self.cond.notify_all()

    def activate(self, round_id: int) -> bool:
        """Start round ``round_id`` if this worker's quorum rule says so and it has not started; returns
        whether this call set the activation. The round before it is done everywhere (this worker
        waited for it), so its key is dropped."""
        opts = self.options
        with self.cond:
            live = self.live
            if self.started > round_id:
                return False
        if activation(opts.quorum, opts.sync_every, self.rank, round_id, self.nproc, opts.eager_seed, live) != START:
            return False  # a synchronous round starts on every worker by itself; another worker starts this one
        self.main_store.set(self._key(round_id), "go")
        if round_id > 0:
            self.main_store.delete_key(self._key(round_id - 1))
        return True

    def finish(self, timeout_s: float) -> None:
        """This worker has run its last step (one deposit per step): start the final round here and wait
        for it."""
        with self.cond:
            steps = self.finished_at = self.ledger.deposited
            self.cond.notify_all()
        self.main_store.set(self._key(steps), _FINAL.decode())
        if steps > 0:
            self.main_store.delete_key(self._key(steps - 1))
        self.wait_for(steps, timeout_s)

    # -- the thread ----------------------------------------------------------------------------------
    def run(self, index: int) -> None:
        round_id = 0
        while True:
            with self.operation(round_id) as op:
                try:
                    if not self._start(round_id):
                        return
                    op.to(COMMUNICATING)
                    self._run(round_id)
                    round_id += 1
                except _Broken as exc:
                    op.to(COMMUNICATING)
                    round_id = self._recover(exc)

    def _start(self, round_id: int) -> bool:
        """Wait until round ``round_id`` may start here; False when the worker is done (or stopping)."""
        with self.cond:  # room for one more result: the worker holds at most `capacity` unapplied
            self.cond.wait_for(lambda: self.stopping or self.has_room())
            if self.stopping:
                return False
            if self.finished_at is not None and round_id > self.finished_at:
                return False
        if is_sync_round(round_id, self.options.sync_every):
            return self._wait_own_gradient(round_id)
        def check(exc: Exception) -> None:
            lost = self.membership.failed_among(self.live) if self.membership is not None else []
            if lost:
                raise _Broken(f"rank {self.rank}: ranks {lost} failed before eager-sgd round {round_id}") from exc

        if not self.wait_key(self._key(round_id), round_id, check):  # an activation through the store
            return False
        if self.store.get(self._key(round_id)) == _FINAL:
            return self._wait_own_gradient(round_id)
        return True

    def _wait_own_gradient(self, round_id: int) -> bool:
        """A synchronous or final round starts here once this worker's gradient of that iteration is in,
        or once it has finished (the final round)."""
        with self.cond:
            self.cond.wait_for(lambda: self.stopping or self.ledger.deposited > round_id or self.finished_at is not None)
            return not self.stopping

    def _run(self, round_id: int) -> None:
        with self.cond:
            spare = self.spare()  # stale values: the next deposit copies rather than adds
            send, self.acc = self.acc, spare
            spare[self.n_grads:self.state_size].copy_(send[self.n_grads:self.state_size])
            mine = self.ledger.take(round_id)
            finished = self.finished_at is not None and self.ledger.deposited <= round_id
            self.started = round_id + 1
        if mine.count == 0:  # nothing deposited since the buffer was recycled
            send[:self.n_grads].zero_()
        send[_WEIGHT] = mine.weight
        send[_COUNT] = mine.count
        send[_FRESH] = mine.fresh
        send[_FINISHED] = 1.0 if finished else 0.0
        pg = self.pg
        if pg is None:
            raise CommError(f"rank {self.rank}: eager-sgd's communicator was released")
        try:
            pg.allreduce([send]).wait()
            broke = ""
        except RuntimeError as exc:
            broke = str(exc)
        if broke:
            del pg  # the traceback must not keep the communicator alive: _recover destroys it
            with self.cond:
                self.lost_gradients += mine.count
                self._broken = (round_id, mine)
                self.recycle(send)
            raise _Broken(f"rank {self.rank}: eager-sgd round {round_id}'s all-reduce failed: {broke}")
        self._complete(round_id, send, len(self.live), mine)

    def _complete(self, round_id: int, send: torch.Tensor, size: int, mine: Contribution) -> None:
        """Round ``round_id``'s result is in ``send`` (over ``size`` ranks; ``mine``: this worker's part)."""
        if send.is_cuda:
            torch.cuda.synchronize(send.device)
        if self._last is not None:
            self._last.copy_(send)
        n_finished = int(round(float(send[_FINISHED])))
        if n_finished not in (0, size):
            raise CommError(
                f"eager-sgd round {round_id}: {n_finished} of {size} ranks had finished and the others had "
                "not; every rank must run the same number of steps")
        with self.cond:
            self.tally.add(is_sync_round(round_id, self.options.sync_every) or n_finished > 0,
                           int(round(float(send[_COUNT]))), int(round(float(send[_FRESH]))), mine.staleness)
            self.publish(round_id, send, size)

    def _recover(self, broken: _Broken) -> int:
        """Go on without the failed ranks (see the module docstring); returns the round to resume at."""
        membership = self.membership
        lost = membership.wait_declared(self.live, DECLARE_WAIT_S) if membership is not None else []
        if membership is None or not lost:
            raise CommError(f"{broken}; no rank was declared failed") from broken
        old, self.pg = self.pg, None
        if old is not None:  # destroyed here (the last reference): peers still blocked on it see it break
            shutdown_group(old)
            del old
        self.recoveries += 1
        prefix = f"{self.prefix}/recovery{self.recoveries}"
        with self.cond:
            completed = self.completed
        self.store.set(f"{prefix}/{self.rank}", str(completed))
        published = self._gather_survivors(prefix, membership)
        live, size = tuple(sorted(published)), len(self.live)
        resume = max(published.values())
        if min(published.values()) < resume - 1:  # every round needs every rank's part of the one before
            raise CommError(f"rank {self.rank}: eager-sgd recovery: the survivors' completed rounds {published} "
                            "differ by more than one")
        with self.cond:
            self.started = resume
            self.live = live
            reached = self.ledger.deposited
        pg = self.make_group(f"{prefix}/pg", live.index(self.rank), len(live))
        if min(published.values()) < resume:  # round resume - 1 broke on some: its lowest holder sends it
            self._hand_over(pg, resume - 1, live.index(min(r for r, done in published.items() if done == resume)),
                            size)
        self._broken = None
        for round_id in range(resume, reached):  # rounds this worker's thread would have activated
            self.main_store.compare_set(self._key(round_id), "", "go")
        self.pg = pg
        return resume

    def _hand_over(self, pg: dist.ProcessGroup, round_id: int, root: int, size: int) -> None:
        """Round ``round_id`` (over ``size`` ranks) completed on the survivor of index ``root`` in ``pg``
        and broke on others: it broadcasts the result, and those it broke on complete it with that."""
        holds = self.completed > round_id
        buf = self._last if holds else self.new_buffer()
        assert buf is not None
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        pg.broadcast([buf], opts).wait()
        if holds:
            return
        broken = self._broken
        if broken is None or broken[0] != round_id:
            raise CommError(f"rank {self.rank}: eager-sgd recovery: round {round_id} was not the round that broke here")
        with self.cond:
            self.lost_gradients -= broken[1].count  # its gradients are in the result after all
            self.recovered_rounds += 1
        self._complete(round_id, buf, size, broken[1])

    def _gather_survivors(self, prefix: str, membership: Membership) -> dict[int, int]:
        """Wait until every rank of :attr:`live` has published its completed rounds under ``prefix`` or is
        declared failed; returns the published ones (rank -> rounds completed). Failed first, published
        second: a rank that published and then failed is among them on every survivor alike."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            failed = membership.failed()
            published = {r: int(v) for r, v in read_keys(self.store, f"{prefix}/", self.live).items()}
            if all(r in published or r in failed for r in self.live):
                return published
            if time.monotonic() > deadline:
                missing = [r for r in self.live if r not in published and r not in failed]
                raise CommError(f"rank {self.rank}: eager-sgd recovery: ranks {missing} neither rejoined nor "
                                f"failed within {self.timeout_s:g} s")
            time.sleep(0.05)


class _Broken(CommError):
    """A round could not run because a rank taking part failed (or its communicator broke)."""


class EagerSGD(RoundsAlgorithm):
    """See the module docstring."""

    options: EagerSGDOptions
    rounds: RoundThread | None

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> nn.Module:
        ctx = self.ctx
        self.bind(model, optimizer)
        self._saved: torch.Tensor | None = None  # --lookahead on: the parameters while shifted
        self._shifted = False
        if ctx.world_size == 1:
            return model
        prefix = self.namespace

        def make_group(name: str, index: int, size: int) -> dist.ProcessGroup:
            return backend_group(ctx, dist.PrefixStore(name, ctx.store), index, size, ctx.timeout)

        self.rounds = self.in_background(RoundThread(
            make_group=make_group, store=ctx.private_store(), main_store=ctx.private_store(),
            prefix=prefix, rank=ctx.rank, nproc=ctx.world_size, n_grads=self.n_grads,
            buffers=self.flat[self.n_grads:], options=self.options, timeout_s=ctx.timeout_s,
            membership=Membership(ctx.private_store(), ctx.world_size)))
        return model

    def before_compute(self, step: int) -> None:
        if self.options.lookahead == "on" and self.rounds is not None:
            self._look_ahead()

    def _look_ahead(self) -> None:
        """``--lookahead on``: shift the parameters by the momentum part of the next update, -lr m v (the
        estimate of where they will be when this gradient is applied: Hakimi, Barkai, Gabel, Schuster,
        "Taming Momentum in a Distributed Asynchronous Environment", 2019), keeping the values to restore
        exactly after backward (the replicas must stay bit-identical)."""
        if self.optimizer is None or self._shifted:
            return
        shifts = []
        for group in self.optimizer.param_groups:
            momentum, lr = float(group.get("momentum", 0.0) or 0.0), float(group["lr"])
            pairs = [(p, self.optimizer.state[p].get("momentum_buffer")) for p in group["params"]
                     if p in self.optimizer.state]
            pairs = [(p, b) for p, b in pairs if b is not None]
            if momentum and pairs:
                shifts.append((-lr * momentum, pairs))
        if not shifts:
            return
        if self._saved is None:
            self._saved = torch.empty_like(self.flat[:self.n_grads])
        self._saved.copy_(self.flat[:self.n_grads])
        self._shifted = True
        with torch.no_grad():
            for alpha, pairs in shifts:
                torch._foreach_add_([p for p, _ in pairs], [b for _, b in pairs], alpha=alpha)

    def _restore(self) -> None:
        if self._shifted:
            assert self._saved is not None
            self.flat[:self.n_grads].copy_(self._saved)
            self._shifted = False

    # -- hooks

    def after_backward(self, step: int, times: StepTimes) -> None:
        self._restore()  # the gradient was taken at the shifted values; the update applies to the real ones
        rounds = self.rounds
        if rounds is None:
            return
        rounds.deposit(self.gradients(), self.flat[self.n_grads:], self.applied)
        rounds.activate(step)
        self.wait_round(step, times)

    def apply_round(self, result: torch.Tensor, n: int) -> None:
        """One round's result, over ``n`` workers: its floating buffers (their mean), then its gradient step."""
        p = self.n_grads
        self.apply_buffers(result, n)
        count = int(round(float(result[_COUNT])))
        if count == 0 or self.optimizer is None:  # no optimizer (emulated compute): nothing to train
            return
        divisor = float(result[_WEIGHT]) if self.options.renormalize == "on" else n
        step_with(self.optimizer, self.params, result[:p].div_(divisor))

    def finish(self) -> None:
        rounds = self.rounds
        if rounds is None:
            return
        rounds.finish(self.ctx.timeout_s)
        self.apply_ready()
        rounds.stop()
        rounds.join(self.ctx.timeout_s)

    def stats(self) -> dict[str, Any]:
        rounds = self.rounds
        if rounds is None:  # alone: no rounds
            return rounds_report(quorum=self.options.quorum, rounds=0, sync_rounds=0, gradients=0, fresh=0,
                                 staleness={}, waits=self.waits)
        t = rounds.tally
        return rounds_report(quorum=self.options.quorum, rounds=rounds.completed, sync_rounds=t.sync_rounds,
                             gradients=t.gradients, fresh=t.fresh, staleness=t.staleness,
                             waits=self.waits, recoveries=rounds.recoveries, lost_gradients=rounds.lost_gradients,
                             recovered_rounds=rounds.recovered_rounds)
