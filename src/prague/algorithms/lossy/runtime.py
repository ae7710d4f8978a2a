"""``lossy``: a gradient all-reduce that stops at a deadline and drops a bounded share of the gradient.

After DLCP (Wang et al., "Domain-specific Communication Optimization for Distributed DNN Training",
arXiv 2008.08445), which exploits SGD's bounded loss tolerance to cut the tail of gradient
communication: late data is dropped by priority (layer, magnitude) instead of waited for, and traffic
is spread over several paths. Here, on top of torch.distributed, one iteration on every rank is:

1. **fold**: the flat gradient plus the residual carried from earlier steps (error feedback, as in
   Seide et al., "1-Bit Stochastic Gradient Descent", Interspeech 2014), so nothing dropped is lost;
2. **send**: the flat buffer is cut into chunks (:func:`.decisions.plan_chunks`), put in priority order
   (:func:`.decisions.priority_order`: chunks dropped last step, then the first layers, then large
   magnitudes) and dealt round-robin to ``--streams`` streams, each with a thread that all-reduces its
   chunks one after the other over communicators of its own (its own connections: several TCP flows
   share a congested link better than one). With ``--hierarchy hosts`` and ranks on several hosts
   (machines or network namespaces, :mod:`prague.comm.hostmap`) a chunk is reduced inside its host,
   all-reduced over a ring of one rank per host and broadcast back (:class:`TwoLevel`,
   :class:`.decisions.Hierarchy`); otherwise it is one ring all-reduce over every rank;
3. **deadline**: once the first chunk is in (a moment all ranks reach together), the rank waits until
   every chunk is in or the deadline passes (:class:`.decisions.Deadline`: ``--deadline-slack`` x the
   time until the last chunk of every stream starts, at the ``--deadline-quantile`` of the rates of
   recent steps); then its threads start no new chunk;
4. **agree**: one small all-reduce on a control communicator carries every rank's count of chunks
   started per stream (and the mean of the floating buffers, and rank 0's magnitudes for the next
   order); every rank computes the same stops (:func:`.decisions.stop_points`: what any rank started
   must be completed; at least ``1 - --max-loss`` of the elements go), the threads complete up to them;
5. **apply**: sent chunks carry the mean gradient, dropped ones zero, on every rank alike, so the
   replicas stay identical; a dropped chunk's folded gradient becomes its residual.

Every rank must run the same number of steps (as with DDP). A failed peer breaks the collectives and
the job stops (the method does not survive failures, like ``allreduce``). On a single rank the
gradient is applied as it is.
"""

from __future__ import annotations

from collections import deque
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from prague.algorithms.api import Algorithm, StepTimes
from prague.algorithms.lossy import LossyOptions, drops_report
from prague.algorithms.lossy.decisions import (
    IN_FLIGHT, ChunkPlan, Deadline, Hierarchy, Settled, Steps, plan_chunks, stop_points,
)
from prague.comm.flat import views_of
from prague.comm.hostmap import host_labels
from prague.comm.owned import shutdown_group
from prague.comm.preduce import backend_group
from prague.errors import CommError
from prague.metrics.decisions import Decision
from prague.runtime.background import COMMUNICATING, BackgroundWork, Operation

#: A chunk's magnitude is the mean |g| of every _SAMPLE-th element: the order needs a ranking, not the exact value.
_SAMPLE = 16
#: The longest a stream thread sleeps between looks at its phases (a completed phase wakes it at once).
_PHASE_POLL_S = 0.05
#: How often a rank stopped by its deadline looks for the other ranks' proposals.
_POLL_S = 0.002


#: A chunk's collective: the phases it goes through, in order; each issues one asynchronous collective on
#: a communicator of its own and returns its handle (a rank that takes no part in a phase has none).
Phases = Callable[[torch.Tensor], list[Callable[[], Any]]]


class _InFlight:
    """A chunk a stream has started: its phases, how many were issued, the last one's handle."""

    def __init__(self, phases: list[Callable[[], Any]], wake: threading.Event) -> None:
        self.phases = phases
        self.issued = 0
        self.work: Any = None
        self._wake = wake

    def issue(self) -> None:
        self.work = self.phases[self.issued]()
        self.issued += 1
        self.work.get_future().add_done_callback(lambda _: self._wake.set())

    def ready(self) -> bool:
        """Whether its last issued phase has completed (raising if it failed)."""
        if self.work is None or not self.work.is_completed():
            return False
        self.work.wait()
        return True

    @property
    def done(self) -> bool:
        return self.issued == len(self.phases) and (not self.phases or self.ready())


class ChunkStreams(BackgroundWork):
    """One thread per stream (:class:`~prague.runtime.background.BackgroundWork`: a stream with chunks
    in flight is ``communicating`` on behalf of the step that began them), each passing its queue of chunks, in order, through the stream's chunk
    collective (phases that leave the sum over every rank in the chunk), with up to ``depth`` chunks
    in flight: while one chunk crosses the hosts, the next is reduced inside its host. Each phase has
    a communicator of its own and is issued for chunk k+1 only after chunk k's, so every communicator
    sees the chunks in queue order on every rank, however the phases interleave.

    The main thread calls :meth:`begin` with this step's queues, waits with :meth:`wait_first` and
    :meth:`wait_all`, stops new starts with :meth:`freeze` (which returns how many chunks each stream
    has started), then lets each stream go on to its agreed stop with :meth:`release` and waits with
    :meth:`wait_stops`. What is in flight at the deadline cannot be dropped. A collective that fails
    ends every wait with :class:`CommError`.
    """

    def __init__(self, collectives: list[Phases], after_collective: Callable[[], None], depth: int = IN_FLIGHT) -> None:
        super().__init__("lossy chunk all-reduce", "lossy-stream", threads=len(collectives))
        self.collectives = collectives
        self._after = after_collective  # CUDA: wait for the collective's kernels before counting it in
        self.depth = depth
        count = len(collectives)
        self.queues: list[list[torch.Tensor]] = [[] for _ in range(count)]
        self.started = [0] * count
        self.completed = [0] * count
        self.stops: list[int] | None = None
        self.frozen = False
        self.first_done_s: float | None = None
        self.step = 0  # the step whose chunks the queues hold
        self.start()

    def begin(self, queues: list[list[torch.Tensor]], step: int = 0) -> None:
        with self.cond:
            self.raise_if_failed()
            self.step = step
            self.queues = queues
            self.started = [0] * len(queues)
            self.completed = [0] * len(queues)
            self.stops = None
            self.frozen = False
            self.first_done_s = None
            self.cond.notify_all()

    def _may_start(self, s: int) -> bool:
        nxt = self.started[s]
        if nxt >= len(self.queues[s]):
            return False
        if not self.frozen:
            return True
        return self.stops is not None and nxt < self.stops[s]

    def run(self, s: int) -> None:
        collective = self.collectives[s]
        flying: deque[_InFlight] = deque()  # started, not completed, oldest first
        wake = threading.Event()  # set when a phase of this stream completes
        op: Operation | None = None  # while chunks are in flight
        while True:
            with self.cond:
                while not (self.stopping or self.error is not None or flying or self._may_start(s)):
                    self.cond.wait()
                if self.stopping or self.error is not None:
                    return
                tensor = None
                if len(flying) < self.depth and self._may_start(s):
                    tensor = self.queues[s][self.started[s]]
                    self.started[s] += 1
                step = self.step
            if tensor is not None:
                if op is None:
                    op = self.begin_operation(step, COMMUNICATING, thread=s)
                flying.append(_InFlight(collective(tensor), wake))
            issued = self._advance(flying)
            finished = 0
            while flying and flying[0].done:
                flying.popleft()
                finished += 1
            if finished:
                self._after()
            elif not issued and tensor is None:
                wake.wait(_PHASE_POLL_S)  # until a phase completes; cleared before looking again
                wake.clear()
            if op is not None and not flying:
                self.end_operation(op)
                op = None
            if finished:
                with self.cond:
                    self.completed[s] += finished
                    if s == 0 and self.first_done_s is None:
                        self.first_done_s = time.perf_counter()
                    self.cond.notify_all()

    @staticmethod
    def _advance(flying: deque[_InFlight]) -> bool:
        """Issue every next phase that may go: its chunk's previous phase has completed and the older
        chunk has issued that phase already. True if anything was issued."""
        issued = False
        for i, chunk in enumerate(flying):
            while chunk.issued < len(chunk.phases) and (chunk.issued == 0 or chunk.ready()):
                if i > 0 and flying[i - 1].issued <= chunk.issued:
                    break
                chunk.issue()
                issued = True
        return issued

    def _wait(self, done: Callable[[], bool], until_s: float | None, timeout_s: float) -> bool:
        """Wait (holding the lock) until ``done()``, or ``until_s`` (perf_counter) passes: False then."""
        limit = time.perf_counter() + timeout_s
        while True:
            self.raise_if_failed()
            if done():
                return True
            now = time.perf_counter()
            if until_s is not None and now >= until_s:
                return False
            if now >= limit:
                raise CommError(f"lossy: no chunk completed for {timeout_s:.0f} s (a peer stopped taking part)")
            self.cond.wait(min(limit, until_s if until_s is not None else limit) - now)

    def wait_first(self, timeout_s: float) -> float:
        """When stream 0's first chunk completed (every rank has entered the step by then)."""
        with self.cond:
            self._wait(lambda: self.first_done_s is not None, None, timeout_s)
            assert self.first_done_s is not None
            return self.first_done_s

    def wait_all(self, until_s: float | None, timeout_s: float) -> None:
        """Until every chunk is in, or ``until_s`` passes."""
        with self.cond:
            self._wait(lambda: self.completed == [len(q) for q in self.queues], until_s, timeout_s)

    def wait_change(self, slice_s: float) -> None:
        """Until a chunk completes or ``slice_s`` passes."""
        with self.cond:
            self.raise_if_failed()
            self.cond.wait(slice_s)

    def all_done(self) -> bool:
        with self.cond:
            return self.completed == [len(q) for q in self.queues]

    def freeze(self) -> list[int]:
        """Start no new chunk; the chunks started on each stream."""
        with self.cond:
            self.frozen = True
            return list(self.started)

    def release(self, stops: list[int]) -> None:
        with self.cond:
            self.stops = stops
            self.cond.notify_all()

    def wait_stops(self, timeout_s: float) -> None:
        with self.cond:
            stops = self.stops
            assert stops is not None
            self._wait(lambda: all(c >= s for c, s in zip(self.completed, stops)), None, timeout_s)



class Ring:
    """A chunk's collective with ``--hierarchy flat``: one ring all-reduce over every rank."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def __call__(self, tensor: torch.Tensor) -> list[Callable[[], Any]]:
        return [lambda: self.group.allreduce([tensor])]


class TwoLevel:
    """A chunk's collective with ``--hierarchy hosts`` (see :class:`.decisions.Hierarchy`): reduce to the
    stream's leader inside the host (``reduce``; ``root`` is the leader's rank in it), all-reduce among
    the hosts' leaders (``cross``: only a leader has it), broadcast back inside the host (``broadcast``:
    a communicator of its own, so a chunk's broadcast and the next chunk's reduce never wait for each
    other). ``reduce`` and ``broadcast`` are None when the host has one rank. Any rank completes a chunk
    only after every rank has entered it (its leader's ring needs every leader, each leader's reduce
    every rank of its host), as with one ring."""

    def __init__(self, reduce: dist.ProcessGroup | None, broadcast: dist.ProcessGroup | None, root: int,
                 cross: dist.ProcessGroup | None) -> None:
        self.reduce, self.broadcast, self.root, self.cross = reduce, broadcast, root, cross

    def __call__(self, tensor: torch.Tensor) -> list[Callable[[], Any]]:
        phases: list[Callable[[], Any]] = []
        if self.reduce is not None:
            phases.append(lambda: self.reduce.reduce(tensor, self.root))  # type: ignore[union-attr]
        if self.cross is not None:
            phases.append(lambda: self.cross.allreduce([tensor]))  # type: ignore[union-attr]
        if self.broadcast is not None:
            phases.append(lambda: self.broadcast.broadcast(tensor, self.root))  # type: ignore[union-attr]
        return phases


class Lossy(Algorithm):
    """See the module docstring."""

    sends_gradients_in_step = True

    options: LossyOptions

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> nn.Module:
        ctx = self.ctx
        self.params = list(model.parameters())
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        total = sum(p.numel() for p in self.params)
        dtype = self.params[0].dtype if self.params else torch.float32
        opts = self.options
        element_bytes = torch.finfo(dtype).bits // 8
        self.plan: ChunkPlan = plan_chunks(total, opts.chunk_elements(element_bytes), opts.streams,
                                           opts.priority_tiers, opts.min_chunk_elements(element_bytes))
        self.steps = Steps(self.plan, opts.streams, opts.max_loss, Deadline(opts.deadline_slack, opts.deadline_quantile))
        self.control_s = 0.0
        self.streams: ChunkStreams | None = None
        self.hierarchy = "flat"
        self.residual = torch.zeros(0)  # what this rank carries into its next step (error feedback)
        if ctx.world_size == 1 or total == 0:
            return model
        self.send = torch.zeros(total, dtype=dtype, device=ctx.device)
        self.residual = torch.zeros_like(self.send)
        self.carrying = False  # whether residual holds anything (most steps drop nothing: no pass over it)
        self.grad_views = views_of(self.send, self.params)
        self.chunk_views = [self.send[s:s + n] for s, n in zip(self.plan.starts, self.plan.sizes)]
        self.magnitudes = [0.0] * self.plan.count  # of the last applied gradient, the same on every rank
        self.pending_magnitudes = [0.0] * self.plan.count  # this rank's; rank 0's go out in the next control round
        n, count = ctx.world_size, opts.streams
        self.n_buffers = sum(b.numel() for b in self.buffers)
        self.control = torch.zeros(self.plan.count + self.n_buffers, dtype=dtype, device=ctx.device)
        prefix = self.prefix = self.namespace
        self.store = ctx.private_store()  # the main thread's proposals and their waits
        self._published: deque[str] = deque()

        def group(name: str, members: Sequence[int] = range(n)) -> dist.ProcessGroup:
            return backend_group(ctx, dist.PrefixStore(f"{prefix}/{name}", ctx.store), list(members).index(ctx.rank),
                                 len(members), ctx.timeout)

        layout = None
        if opts.hierarchy == "hosts":
            layout = Hierarchy.of(host_labels(ctx.store, f"{prefix}/host", ctx.rank, n, ctx.timeout, ctx.job))
        groups: list[dist.ProcessGroup] = []
        collectives: list[Phases] = []
        if layout is not None and layout.two_level:
            self.hierarchy = f"hosts ({len(layout.hosts)} hosts)"
            host = layout.host_of(ctx.rank)
            mates = layout.hosts[host]
            for s in range(count):  # every rank creates its groups in this one order: no rendezvous waits in a circle
                reduce = group(f"s{s}/host{host}/reduce", mates) if len(mates) > 1 else None
                broadcast = group(f"s{s}/host{host}/broadcast", mates) if len(mates) > 1 else None
                leaders = layout.leaders(s)
                cross = group(f"s{s}/cross", leaders) if ctx.rank in leaders else None
                collectives.append(TwoLevel(reduce, broadcast, mates.index(layout.leader(host, s)), cross))
                groups += [g for g in (reduce, broadcast, cross) if g is not None]
        else:
            self.hierarchy = "flat"
            for s in range(count):
                ring = group(f"stream{s}")
                collectives.append(Ring(ring))
                groups.append(ring)
        self.control_group = group("control")
        sync: Callable[[], None] = (lambda: torch.cuda.current_stream().synchronize()) \
            if ctx.device.type == "cuda" else (lambda: None)
        self.resources.callback(self._release, groups)  # after the streams' shutdown, registered next
        self.streams = self.in_background(ChunkStreams(collectives, sync, IN_FLIGHT))
        return model

    def _release(self, groups: list[dist.ProcessGroup]) -> None:
        streams, self.streams = self.streams, None
        if streams is not None and not streams.alive:
            for g in groups:  # a thread still in a collective after a failure keeps its group
                shutdown_group(g)
            shutdown_group(self.control_group)
        del self.control_group

    def after_backward(self, step: int, times: StepTimes) -> None:
        streams = self.streams
        if streams is None:
            return
        ctx, steps = self.ctx, self.steps
        self._gather_grads()
        if self.carrying:
            self.send.add_(self.residual)
        side = self._side_round()
        planned = steps.plan(self.magnitudes)
        streams.begin([[self.chunk_views[c] for c in q] for q in planned.queues], step)
        first_s = streams.wait_first(ctx.timeout_s)
        budget = steps.budget_s(planned, streams.depth)
        streams.wait_all(None if budget is None else first_s + budget, ctx.timeout_s)
        t_agree = time.perf_counter()
        stops = self._agree(step, streams.freeze(), steps.required(planned), planned.lengths)
        self.control_s += time.perf_counter() - t_agree
        streams.release(stops)
        streams.wait_stops(ctx.timeout_s)
        settled = steps.settle(planned, stops, time.perf_counter() - first_s)
        side.wait()
        self._take_side()
        times.dropped = self._settle(step, settled)

    def _agree(self, step: int, proposal: list[int], required: int, lengths: list[int]) -> list[int]:
        """Every rank's stops for this step, the same everywhere (see :func:`.decisions.stop_points`).

        No message when nothing is late: a rank whose chunks are all in knows that every rank entered
        every chunk, so nothing is dropped. A rank stopped by its deadline publishes its proposal in the
        store and waits until either its chunks are all in (then every rank entered every chunk) or every
        rank's proposal is there. It must not wait for its own started chunks alone: one of them may wait
        for a rank that has stopped before it, itself waiting on a chunk of another stream that this
        rank has not started. Each rank either completes every chunk or reaches its deadline and
        publishes, so the wait ends. One store request per stopped rank (and a look per
        :data:`_POLL_S` while it waits), not a collective over the congested links."""
        streams = self.streams
        assert streams is not None
        if streams.all_done():
            return lengths
        key = f"{self.prefix}/p/{step}/"
        self.store.set(key + str(self.ctx.rank), ",".join(map(str, proposal)))
        self._published.append(key + str(self.ctx.rank))
        keys = [key + str(r) for r in range(self.ctx.world_size)]
        limit = time.monotonic() + self.ctx.timeout_s
        while not streams.all_done():
            if self.store.check(keys):
                proposals = [[int(v) for v in raw.decode().split(",")] for raw in self.store.multi_get(keys)]
                return stop_points(proposals, required, lengths)
            if time.monotonic() > limit:
                raise CommError(f"lossy: not every rank stopped or completed step {step} within "
                                f"{self.ctx.timeout_s:g} s")
            streams.wait_change(_POLL_S)
        return lengths

    def _side_round(self) -> Any:
        """Start this step's side all-reduce on the control communicator: the mean of the floating buffers
        (BatchNorm statistics) and rank 0's chunk magnitudes for the next order; it travels beside the
        chunks and is waited for at the end of the step. Also forgets this rank's proposal of two steps
        ago (every rank has read it: all have finished that step)."""
        while len(self._published) > 1:
            self.store.delete_key(self._published.popleft())
        ctl, n = self.control, self.ctx.world_size
        chunks = self.plan.count
        if self.ctx.rank == 0:
            ctl[:chunks] = torch.tensor(self.pending_magnitudes, dtype=ctl.dtype)
        else:
            ctl[:chunks].zero_()
        offset = chunks
        for b in self.buffers:
            ctl[offset:offset + b.numel()].copy_(b.reshape(-1))
            offset += b.numel()
        return self.control_group.allreduce([ctl])

    def _take_side(self) -> None:
        ctl, n, chunks = self.control, self.ctx.world_size, self.plan.count
        self.magnitudes = ctl[:chunks].tolist()  # rank 0's: exactly the same everywhere
        offset = chunks
        for b in self.buffers:
            b.copy_(ctl[offset:offset + b.numel()].view_as(b)).div_(n)
            offset += b.numel()

    def _gather_grads(self) -> None:
        """Make ``send`` hold this step's gradient. Each ``p.grad`` is a view of ``send`` (bound at the
        first step, like DDP's gradient-as-bucket-view), so backward has written it there already; a
        gradient set to None or replaced since (``zero_grad(set_to_none=True)``) is copied in and
        bound again."""
        for p, view in zip(self.params, self.grad_views):
            grad = p.grad
            if grad is None:
                view.zero_()
            elif grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
            else:
                continue
            p.grad = view

    def _settle(self, step: int, settled: Settled) -> float:
        """Carry the dropped chunks, average the sent ones (the parameters' gradients are views of
        ``send``); the dropped share."""
        plan, dropped = self.plan, settled.dropped
        if self.carrying:
            self.residual.zero_()
        for c in dropped:
            self.residual[plan.starts[c]:plan.starts[c] + plan.sizes[c]].copy_(self.chunk_views[c])
            self.chunk_views[c].zero_()
        self.carrying = bool(dropped)
        self.send.div_(self.ctx.world_size)
        if self.ctx.rank == 0:  # only rank 0's magnitudes travel (the order must be the same everywhere)
            self.pending_magnitudes = [float(v[::_SAMPLE].abs().mean()) if v.numel() else 0.0
                                       for v in self.chunk_views]
        if self.decisions is not None:
            self.decisions.write(Decision.of_drop(step, tuple(dropped), settled.share))
        return settled.share

    def stats(self) -> dict[str, Any]:
        return drops_report(self.options, chunks=self.plan.count, shares=self.steps.shares,
                            deadlines_s=self.steps.deadlines_s, control_s=self.control_s, hierarchy=self.hierarchy)
