"""One parameter-server shard: a process of its own that owns a slice of the model and its optimizer.

The server side of ``ps`` and ``ps-eager`` (:mod:`prague.algorithms.ps.runtime`), after Li et al., "Scaling
Distributed Machine Learning with the Parameter Server", OSDI 2014: the model's flat state is split
into K contiguous key ranges, one per server shard; workers push gradients to and pull values from every
shard; each shard applies updates to its range alone, with the optimizer state (SGD momentum) living
on the server. Shards never talk to each other.

Update rules (:class:`ShardState`):

* ``sync``: a shard waits for the pushes of all n workers for the current version, applies their mean
  with exactly ``torch.optim.SGD``'s rule (same lr, momentum, dampening, weight decay, Nesterov) and
  only then answers every worker with the new values. Gradients are summed in rank order (each as soon
  as its predecessors are in, so little is left when the last push arrives): the result is
  deterministic and matches DDP's averaged gradient to float rounding.
* ``async``: each push is applied on arrival, under a lock, and answered with the values right after
  it. Its staleness tau is the number of versions the shard advanced since the values the gradient was
  computed on (the worker sends that base version with the push). The step is scaled by
  :func:`staleness_scale` (Zhang, Gupta, Lian, Liu, "Staleness-aware Async-SGD for Distributed Deep
  Learning", IJCAI 2016: lr/tau) and an update with tau above ``max_staleness`` is rejected and
  counted, not applied (the worker still gets fresh values). Every applied update's tau is recorded per
  worker (a histogram).

  Momentum (``--momentum``): ``worker`` (``ps`` default) keeps **one momentum buffer per worker**: a
  push from worker i does b_i <- m b_i + s g_i, x <- x - lr b_i (s: the staleness scale). By linearity
  the mean of the n buffers then follows exactly sync SGD-momentum on the mean gradient, so with s = 1/n
  (tau = n - 1 in a steady round robin) a round of n asynchronous pushes makes the step of one
  synchronous round. (One buffer shared by all pushes decays by m^n per round instead, much faster
  than the delay on every gradient: measured here, it left a CNN on MNIST unstable.) ``folded``
  (``ps-eager`` default) drops the buffer and takes momentum's steady-state step, lr/(1 - m), at once
  (:meth:`prague.optim.SGDRule.folded`): with gradients two rounds old, heavy-ball momentum
  oscillates, and asynchrony supplies momentum of its own (Mitliagkas et al. 2016).

Buffers (BatchNorm running statistics) have no gradient: a push carries the worker's current values for
them. ``sync`` sets them to the mean over the workers; ``async`` moves them 1/n of the way towards the
pushed values (a running mean over recent pushes).

With a decision log (``--log-decisions``: worker rank 0 names the folder in the store), a shard writes
every push it handles, in the order it handles them, to ``ps-shardK.jsonl`` there
(:class:`prague.metrics.decisions.ShardPush`: worker, step, base version, tau, learning-rate scale,
accepted, version after), so an asynchronous run can be replayed through the simulator's shards.

I/O: one thread per worker, each on its own two-member gloo communicator
(:mod:`prague.algorithms.ps.protocol`), so a slow worker never delays the others' requests. Failure contract:
any error (a worker's connection closed, a sync round or the final barrier waiting longer than
``--timeout-s``, a protocol violation) prints what happened and exits the process with code 1; the
launcher then fails the job naming this shard, and workers blocked on it get an error, not a hang.

Started by ``prague run``'s launcher (one service per shard) or, under torchrun, by worker rank 0::

    python -m prague.algorithms.ps.server --shard 0 --shards 1 --nproc 4 --mode sync --ready-file /tmp/s0

It reads the job's store address from ``MASTER_ADDR``/``MASTER_PORT`` and connects as a client.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from prague import jobenv
from prague.algorithms.ps.protocol import (
    DECISIONS_KEY, HEADER_LEN, LAYOUT_KEY, MODES, MOMENTUM_MODES, OP_BYE, OP_CLOSED, OP_INIT, OP_PULL, OP_PUSH,
    SHARD_SIDE, STALENESS_RULES, TAG_PAYLOAD, TAG_REPLY, TAG_REQUEST, TAG_STATE, WORKER_SIDE, Layout, Reply,
    pair_group, shard_bounds, stats_key,
)
from prague.algorithms.ps.rules import ShardBook, sgd_rule
from prague.errors import CommError, ConfigError, unknown_choice
from prague.io import JsonLines, atomic_write_text
from prague.metrics.decisions import shard_trace_path
from prague.runtime.background import FunctionWork
from prague.runtime.context import attempt_store


class ShardState:
    """The values, optimizer state, version and statistics of one shard's slice; thread-safe.

    Called by the per-worker threads of :func:`serve`. Blocking calls (:meth:`push` in ``sync`` mode,
    :meth:`finish`, :meth:`wait_initialized`) raise :class:`CommError` after ``timeout_s``.
    ``clock`` is injected so tests can drive it. With ``trace``, every push is written there as a
    :class:`~prague.metrics.decisions.ShardPush`, under the lock, in the order the pushes are handled.
    """

    def __init__(self, mode: str, nproc: int, lo: int, hi: int, layout: Layout, *, staleness_lr: str = "none",
                 max_staleness: int = 0, momentum: str = "worker", timeout_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic, trace: JsonLines | None = None) -> None:
        if mode not in MODES:
            raise unknown_choice("parameter-server mode", mode, MODES)
        if staleness_lr not in STALENESS_RULES:
            raise unknown_choice("staleness rule", staleness_lr, STALENESS_RULES)
        if not 0 <= lo < hi <= layout.total:
            raise ConfigError(f"shard slice [{lo}, {hi}) is not inside the state of {layout.total} elements")
        self.mode, self.nproc, self.layout = mode, nproc, layout
        self.staleness_lr, self.max_staleness, self.timeout_s = staleness_lr, max_staleness, timeout_s
        self._clock = clock
        self.size = hi - lo
        self.split = min(max(layout.n_params - lo, 0), self.size)  # [0, split): parameters; the rest: buffers
        self.values = torch.zeros(self.size)
        self.book = ShardBook(mode, nproc, staleness_lr, max_staleness)  # versions and staleness
        self._momentum: torch.Tensor | None = None  # sync: the one buffer of the averaged gradient
        self._momenta: list[torch.Tensor | None] = [None] * nproc  # async: one per worker
        self._rule = sgd_rule(layout)  # sync: exactly the optimizer's rule
        self._async_rule = sgd_rule(layout, momentum)
        self._cond = threading.Condition()
        self._initialized = False
        self._round: dict[int, torch.Tensor] = {}
        self._acc = torch.zeros(self.size) if mode == "sync" else None
        self._summed = 0  # pushes of the current round already in _acc (ranks 0.._summed-1)
        self._finished: set[int] = set()
        self._error: str | None = None
        self._trace = trace

    @property
    def version(self) -> int:
        return self.book.version

    # -- set-up

    def initialize(self, values: torch.Tensor) -> None:
        """Take the initial values (worker rank 0's model) and let pulls proceed."""
        with self._cond:
            self.values.copy_(values)
            self._initialized = True
            self._cond.notify_all()

    def wait_initialized(self) -> None:
        with self._cond:
            self._wait(lambda: self._initialized, "the initial values from worker rank 0")

    def snapshot(self) -> tuple[torch.Tensor, Reply]:
        """A copy of the current values and the version they belong to."""
        with self._cond:
            return self.values.clone(), Reply(self.version, 0, True, 0)

    # -- updates

    def push(self, worker: int, base_version: int, payload: torch.Tensor, out: torch.Tensor | None = None,
             step: int = 0) -> Reply:
        """Apply (or, in sync mode, contribute to) ``worker``'s push of its ``step`` computed on ``base_version``.

        ``payload`` is gradient for the parameter part and buffer values for the rest; it may be
        modified. In async mode the values right after the update are copied into ``out``; in sync mode
        the caller may send :attr:`values` itself, which no one changes until every worker has pushed
        again.
        """
        self._check_worker(worker)
        if self.mode == "sync":
            return self._push_sync(worker, base_version, payload, step)
        if out is None:
            raise ValueError("async pushes need an output buffer")
        return self._push_async(worker, base_version, payload, out, step)

    def _push_sync(self, worker: int, base_version: int, payload: torch.Tensor, step: int) -> Reply:
        with self._cond:
            t0 = self._clock()
            self._raise_if_failed()
            if worker in self._round:
                self._fail(f"worker {worker} pushed twice for version {self.version + 1}")
            if self._finished:
                self._fail(f"worker {worker} pushed for version {self.version + 1} after workers "
                           f"{sorted(self._finished)} had finished; every worker must run the same number of steps")
            self._round[worker] = payload
            self._accumulate()
            record = self.book.contribute(worker, base_version, step)
            if self._trace is not None:
                self._trace.write(record.to_dict())
            target = record.version
            if len(self._round) == self.nproc:
                self._apply_mean()
            else:
                self._wait(lambda: self.version >= target, f"the pushes of version {target}",
                           missing=lambda: sorted(set(range(self.nproc)) - set(self._round)))
            return Reply(self.version, 0, True, int((self._clock() - t0) * 1e6))

    def _accumulate(self) -> None:
        """Sum the pushes in rank order as far as they have arrived: deterministic, and most of the sum
        is done while the last pushes are still in flight."""
        acc = self._acc
        assert acc is not None
        while self._summed < self.nproc and self._summed in self._round:
            push = self._round[self._summed]
            if self._summed == 0:
                acc.copy_(push)
            else:
                acc.add_(push)
            self._summed += 1

    def _apply_mean(self) -> None:
        acc = self._acc
        assert acc is not None and self._summed == self.nproc
        acc.div_(self.nproc)
        s = self.split
        self._momentum = self._rule.step(self.values[:s], acc[:s], self._momentum)
        self.values[s:].copy_(acc[s:])
        self._round.clear()
        self._summed = 0
        self.book.close_round()
        self._cond.notify_all()

    def _push_async(self, worker: int, base_version: int, payload: torch.Tensor, out: torch.Tensor,
                    step: int) -> Reply:
        t0 = self._clock()
        with self._cond:
            waited = self._clock() - t0
            self._raise_if_failed()
            try:
                admitted = self.book.admit(worker, base_version, step)
            except ConfigError as exc:
                self._fail(str(exc))
            if admitted.accepted:
                s = self.split
                self._momenta[worker] = self._async_rule.step(self.values[:s], payload[:s], self._momenta[worker],
                                                              admitted.scale)
                self.values[s:].lerp_(payload[s:], 1.0 / self.nproc)
            if self._trace is not None:
                self._trace.write(admitted.record.to_dict())
            out.copy_(self.values)
            return Reply(self.version, admitted.tau, admitted.accepted, int(waited * 1e6))

    # -- the end

    def finish(self, worker: int) -> Reply:
        """``worker`` is done; block until every worker is, then return the final version."""
        self._check_worker(worker)
        with self._cond:
            t0 = self._clock()
            self._raise_if_failed()
            if self._round and worker not in self._round:
                self._fail(f"worker {worker} finished while version {self.version + 1} still waits for its push "
                           f"(pushed: {sorted(self._round)}); every worker must run the same number of steps")
            self._finished.add(worker)
            self._cond.notify_all()
            self._wait(lambda: len(self._finished) == self.nproc, "every worker to finish",
                       missing=lambda: sorted(set(range(self.nproc)) - self._finished))
            return Reply(self.version, 0, True, int((self._clock() - t0) * 1e6))

    def stats(self, worker: int) -> dict[str, Any]:
        """``worker``'s applied updates by staleness (JSON keys are strings) and its rejected count."""
        with self._cond:
            hist = self.book.histogram[worker]
            return {"staleness_histogram": {str(t): hist[t] for t in sorted(hist)},
                    "applied": sum(hist.values()), "rejected": self.book.rejected[worker], "version": self.version}

    # -- helpers

    def _check_worker(self, worker: int) -> None:
        if not 0 <= worker < self.nproc:
            raise CommError(f"request from worker {worker}, outside 0..{self.nproc - 1}")

    def _wait(self, done: Callable[[], bool], what: str, missing: Callable[[], list[int]] | None = None) -> None:
        """Wait on the condition (lock held) until ``done()``, a failure elsewhere, or the timeout."""
        deadline = self._clock() + self.timeout_s
        while not done():
            self._raise_if_failed()
            left = deadline - self._clock()
            if left <= 0:
                who = f" (still missing: workers {missing()})" if missing else ""
                self._fail(f"waited more than {self.timeout_s:g} s for {what}{who}")
            self._cond.wait(timeout=min(left, 1.0))

    def _fail(self, message: str) -> NoReturn:
        self._error = self._error or message
        self._cond.notify_all()
        raise CommError(message)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise CommError(f"shard failed: {self._error}")


def serve_worker(state: ShardState, store: dist.Store, shard: int, worker: int, timeout: timedelta) -> None:
    """Answer ``worker``'s requests until it says goodbye. Runs in its own thread."""
    pg = pair_group(store, shard, worker, SHARD_SIDE, timeout)
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    payload = torch.empty(state.size)
    out = torch.empty(state.size) if state.mode == "async" else None

    def reply(r: Reply, values: torch.Tensor) -> None:
        works = [pg.send([r.encode()], WORKER_SIDE, TAG_REPLY), pg.send([values], WORKER_SIDE, TAG_STATE)]
        for w in works:
            w.wait()

    while True:
        pg.recv([header], WORKER_SIDE, TAG_REQUEST).wait()
        op, base, step, sender = (int(x) for x in header.tolist())
        if sender != worker:
            raise CommError(f"worker {worker}'s connection carried a request from worker {sender}")
        if op == OP_INIT:
            pg.recv([payload], WORKER_SIDE, TAG_PAYLOAD).wait()
            state.initialize(payload)
        elif op == OP_PULL:
            state.wait_initialized()
            values, r = state.snapshot()
            reply(r, values)
        elif op == OP_PUSH:
            pg.recv([payload], WORKER_SIDE, TAG_PAYLOAD).wait()
            r = state.push(worker, base, payload, out, step)
            reply(r, out if out is not None else state.values)
        elif op == OP_BYE:
            r = state.finish(worker)
            store.set(stats_key(shard, worker), json.dumps(state.stats(worker)))
            reply(r, state.values)  # final: nothing changes any more
            pg.recv([header], WORKER_SIDE, TAG_REQUEST).wait()
            if int(header[0]) != OP_CLOSED:
                raise CommError(f"worker {worker} sent operation {int(header[0])} after goodbye")
            break
        else:
            raise CommError(f"worker {worker} sent unknown operation {op}")
    if hasattr(pg, "shutdown"):
        try:
            pg.shutdown()
        except Exception:  # noqa: BLE001 - the peer may already be gone; nothing left to send
            pass


def serve(state: ShardState, store: dist.Store, shard: int, timeout: timedelta) -> None:
    """Serve every worker from its own thread (one :class:`FunctionWork` of ``nproc`` threads) until all
    have said goodbye. On any thread's error: print it and exit the process with code 1 (see the module
    docstring)."""

    def run(worker: int) -> None:
        try:
            serve_worker(state, store, shard, worker, timeout)
        except BaseException as exc:
            raise CommError(f"ps-shard {shard} failed while serving worker {worker}: {exc!r}") from exc

    work = FunctionWork(f"ps-shard {shard}", f"ps-shard{shard}-w", run, threads=state.nproc)
    try:
        work.wait_ended()
    except CommError as exc:  # the whole shard must fail, loudly
        sys.stderr.write(f"[ps-shard {shard}] " + "".join(traceback.format_exception(exc)))
        sys.stderr.flush()
        os._exit(1)


def main(argv: Sequence[str] | None = None) -> int:
    from prague.runtime.parent import set_parent_death_signal

    p = argparse.ArgumentParser(prog="python -m prague.algorithms.ps.server", description="one parameter-server shard")
    p.add_argument("--shard", type=int, required=True)
    p.add_argument("--shards", type=int, required=True)
    p.add_argument("--nproc", type=int, required=True)
    p.add_argument("--mode", default="sync", choices=MODES)
    p.add_argument("--staleness-lr", default="none", choices=STALENESS_RULES)
    p.add_argument("--max-staleness", type=int, default=0)
    p.add_argument("--momentum", default="worker", choices=MOMENTUM_MODES)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--ready-file", type=Path, required=True)
    p.add_argument("--exit-when-done", action="store_true",
                   help="exit after the last worker said goodbye (else wait to be stopped, as the launcher expects)")
    args = p.parse_args(argv)
    if not 0 <= args.shard < args.shards:
        p.error(f"--shard {args.shard} must be within 0..{args.shards - 1}")

    set_parent_death_signal()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    timeout = timedelta(seconds=args.timeout_s)
    job = jobenv.current()
    store = attempt_store(dist.TCPStore(job.master_addr, job.need("master_port"), is_master=False, timeout=timeout),
                          job)
    atomic_write_text(args.ready_file, f"ps-shard {args.shard} pid {os.getpid()}\n")

    layout = Layout.decode(store.get(LAYOUT_KEY))  # published by worker rank 0 in setup()
    lo, hi = shard_bounds(layout.total, args.shards)[args.shard]
    # Set before the layout by rank 0 (absent if a test or an older worker published the layout alone).
    folder = store.get(DECISIONS_KEY).decode() if store.check([DECISIONS_KEY]) else ""
    trace = JsonLines(shard_trace_path(Path(folder), args.shard)) if folder else None
    state = ShardState(args.mode, args.nproc, lo, hi, layout, staleness_lr=args.staleness_lr,
                       max_staleness=args.max_staleness, momentum=args.momentum, timeout_s=args.timeout_s,
                       trace=trace)
    print(f"ps-shard {args.shard}/{args.shards}: {args.mode}, slice [{lo}, {hi}) of {layout.total}, "
          f"{args.nproc} workers", flush=True)
    serve(state, store, args.shard, timeout)
    print(f"ps-shard {args.shard}: all {args.nproc} workers finished at version {state.version}", flush=True)
    if not args.exit_when_done:
        while True:  # the launcher stops services once the workers have exited
            signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(main())
