"""``prague``: local SGD steps, then Partial All-Reduce with a group chosen by the Group Generator.

Prague (Luo, Lin, Zhuo, Qian, "Prague: High-Performance Heterogeneity-Aware Asynchronous Decentralized
Training", ASPLOS 2020; arXiv 1909.08029, also "Ripples"). Each iteration a worker takes a local optimizer
step (its optimizer state stays local), asks the Group Generator which group it belongs to next, and
averages its parameters with that group's members only (:func:`prague.comm.preduce.preduce`). Slow
workers hold back only the few workers they meet, not the whole job.

With ``--overlap on`` (the default) the generator call and P-Reduce leave the worker's thread: after its
local step the worker hands a snapshot of its parameters to a :class:`.overlap.BackgroundAverager` and
computes the next iteration while the snapshot is averaged; the correction (average minus snapshot)
is added when it comes back. At most ``--max-in-flight`` averages are out at once; with that many out,
the worker waits for the oldest (``--when-busy wait``) or takes a local step (``local``). With
``--overlap off`` every iteration blocks on its group, as in the paper.

Generators (``--generator``): ``static`` (a conflict-free schedule computed locally, no round trip),
``smart`` (the paper's: random divisions under a threshold rule, through a group buffer), ``random``
(one random group per request: the naive baseline) and ``ready`` (groups formed only from workers
already waiting at the service); ``static-blind`` and ``smart-blind`` are ``static`` and ``smart`` given one
node holding every rank (:meth:`PragueOptions.topology`), whatever ``--nodes``. Where the groups come
from (and where the service runs) is :mod:`.source`; the policies themselves are :mod:`prague.groups`.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from prague import jobenv
from prague.algorithms.api import Algorithm, JobResources, StepTimes
from prague.algorithms.prague import PragueOptions, final_report, overlap_report
from prague.algorithms.prague.flow import (
    COMMITTED, DRAIN, FINAL, TAKE_OLDEST, TAKE_READY, OverlapCounts, finishing, overlapped_step,
)
from prague.algorithms.prague.overlap import Averaged, BackgroundAverager
from prague.algorithms.prague.weights import SinceAverage
from prague.algorithms.prague.source import (
    GroupSource, ServiceSource, ShardedSource, StaticSource, gg_services,
)
from prague.comm.codecs import member_send_bytes
from prague.comm.compress import ErrorFeedback
from prague.comm.flat import bind_flat, flatten, momentum_bound, state_tensors
from prague.comm.preduce import preduce_compressed, preduce_weighted
from prague.comm.streams import streams_for
from prague.comm.surviving import LiveGroups
from prague.errors import CommError, ConfigError
from prague.groups import Group
from prague.metrics.decisions import Decision, gg_trace_path
from prague.runtime.liveness import mark_done, wait_settled


def check_momentum_optimizer(optimizer: torch.optim.Optimizer | None) -> None:
    """``--share-momentum on`` averages SGD's momentum buffers: ConfigError for anything else."""
    if not isinstance(optimizer, torch.optim.SGD) or not all(g.get("momentum", 0) > 0 for g in optimizer.param_groups):
        raise ConfigError("--share-momentum on averages the momentum buffers of torch.optim.SGD with momentum > 0; "
                          f"this run's optimizer is {type(optimizer).__name__ if optimizer is not None else 'none'}"
                          + (" without momentum" if isinstance(optimizer, torch.optim.SGD) else "")
                          + ": use SGD with momentum, or --share-momentum off")


class GroupTally:
    """What a worker's groups were: counts for the summary."""

    def __init__(self) -> None:
        self.groups_run = 0
        self.local_steps = 0
        self.member_total = 0

    def add(self, group: Group) -> None:
        self.groups_run += 1
        self.member_total += group.size
        self.local_steps += group.is_local

    @property
    def mean_group_size(self) -> float:
        return self.member_total / self.groups_run if self.groups_run else 0.0


class Prague(Algorithm):
    """Local step, then P-Reduce over the group the generator names; see the module docstring."""

    options: PragueOptions

    @classmethod
    def job_resources(cls, options: PragueOptions, nproc: int, out_dir: Path,
                      host: str = "127.0.0.1") -> JobResources:
        options.topology(nproc)
        if not options.uses_service:
            return JobResources()
        specs = gg_services(options, nproc, out_dir, host)
        return JobResources(services=tuple(specs), env={jobenv.GG_TOKEN: secrets.token_hex(16)})

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> nn.Module:
        topology = self.options.topology(self.ctx.world_size)
        self.model, self.optimizer = model, optimizer
        self.shared_momentum = self.options.share_momentum == "on"
        if self.shared_momentum:
            check_momentum_optimizer(optimizer)
        self.flat = bind_flat(model, optimizer if self.shared_momentum else None)
        # survivors leave failed members out
        self.groups = LiveGroups(self.ctx, capacity=self.options.comm_cache, transport=self.options.transport,
                                 namespace=f"{self.namespace}/groups")
        self.comms = self.groups.comms
        self.resources.callback(self.groups.close)
        self.tally = GroupTally()
        # owned by whoever runs this worker's groups: the averaging thread, or this thread with overlap off
        self.feedback = ErrorFeedback() if self.options.compress == "int8" else None
        self.since = SinceAverage() if self.options.average_by == "samples" else None
        self._weighted: torch.Tensor | None = None  # preduce_weighted's work buffer
        self._group_step = -1  # the step the group being run was asked after (the averaging thread's)
        self.sent_bytes = 0.0
        self.steps_done = 0
        self.counts = OverlapCounts()
        self.blocking_s = 0.0  # overlap off: asking plus P-Reduce, all of it on the worker's thread
        self.exposed_s = 0.0  # overlap on: waiting for an earlier average
        self.final_ranks = 0  # --final-average on: the ranks of the last average, and its seconds
        self.final_s = 0.0
        self.final_distance: float | None = None
        self.source: GroupSource
        if self.options.is_static:
            self.source = StaticSource(topology)
        else:
            trace = None if self.decisions is None else gg_trace_path(self.decisions.folder)
            if self.options.shard_count(topology) > 1:
                if self.options.gg_address:
                    raise ConfigError("--gg-address names one Group Generator; with --gg-shards above 1 the job "
                                      "starts its shards itself: drop --gg-address or pass --gg-shards 1")
                self.source = ShardedSource(self.ctx, self.options, self.resources, topology, trace=trace,
                                            membership=self.groups.membership, namespace=self.namespace)
            else:
                self.source = ServiceSource(self.ctx, self.options, self.resources, trace=trace,
                                            membership=self.groups.membership, namespace=self.namespace)
        self.averager: BackgroundAverager | None = None
        if self.options.overlap == "on":
            rank = self.ctx.rank
            # each request says after which step it comes, so the generator counts iterations (smart's threshold)
            self.averager = self.in_background(BackgroundAverager(
                lambda step: self._ask(rank, step), self._reduce,
                name=f"prague-averager-{rank}", streams=streams_for(self.flat.device)))
        return model

    def _ask(self, rank: int, step: int) -> Group:
        """The averaging thread's request: the group after ``step``, which it then runs (:meth:`_reduce`)."""
        self._group_step = step
        return self._checked(self.source.next_group(rank, step))

    def _checked(self, group: Group) -> Group:
        if self.ctx.rank not in group.members:
            raise CommError(f"group generator sent rank {self.ctx.rank} a group it is not in: {group}")
        return group

    def _reduce(self, group: Group, buffer: torch.Tensor) -> bool:
        """Average ``buffer`` over ``group``'s live members (:class:`~prague.comm.surviving.LiveGroups`);
        False when nobody was left to average with."""
        if group.is_local:
            return True
        feedback, since, step = self.feedback, self.since, self._group_step
        if since is not None:
            weight = since.weight(step)
            if self._weighted is None or self._weighted.numel() != buffer.numel() + 1 \
                    or self._weighted.dtype != buffer.dtype or self._weighted.device != buffer.device:
                self._weighted = buffer.new_empty(buffer.numel() + 1)
            work = self._weighted
            live = self.groups.reduce(group.members, buffer,
                                      lambda values, members, comms: preduce_weighted(values, members, comms, weight,
                                                                                       work))
            if len(live) > 1:
                since.averaged(step)
        elif feedback is None:
            live = self.groups.reduce(group.members, buffer)
        else:
            live = self.groups.reduce(group.members, buffer,
                                      lambda values, members, comms: preduce_compressed(values, members, comms,
                                                                                         feedback))
            if len(live) > 1:  # the message was used: what it did not carry waits for the next one
                feedback.commit()
        self.sent_bytes += member_send_bytes(buffer.numel(), len(live), self.options.compress, buffer.element_size())
        return len(live) > 1

    def _record(self, group: Group, step: int) -> None:
        self.tally.add(group)
        if self.decisions is not None:
            self.decisions.write(Decision.of_group(step, group.members, group.seq))

    def _run(self, group: Group, step: int) -> None:
        """Execute ``group`` on the live parameters, on this thread (overlap off, and the committed
        groups after the last step)."""
        self._record(self._checked(group), step)
        self._group_step = step
        self._reduce(group, self.flat)

    def _apply(self, done: Averaged) -> None:
        """Add a finished average's correction to the live parameters (delayed averaging)."""
        self.flat.add_(done.correction)
        assert self.averager is not None
        self.averager.recycle(done)
        self._record(done.group, done.index)

    def after_step(self, step: int, times: StepTimes) -> None:
        self.steps_done = step + 1
        if self.shared_momentum:
            self._keep_momentum_bound()
        if self.averager is None:
            t0 = time.perf_counter()
            group = self.source.next_group(self.ctx.rank, step)
            times.wait_s += time.perf_counter() - t0  # the generator's answer: RPC plus waiting for partners
            self._run(group, step)
            self.blocking_s += time.perf_counter() - t0
            return
        averager, o = self.averager, self.options
        for effect in overlapped_step(lambda: averager.in_flight, o.max_in_flight, o.busy_policy, self.counts):
            if effect == TAKE_READY:
                for done in averager.take_ready():
                    self._apply(done)
            elif effect == TAKE_OLDEST:
                t0 = time.perf_counter()
                done = averager.take_oldest()
                waited = time.perf_counter() - t0
                times.wait_s += waited
                self.exposed_s += waited
                self._apply(done)
            else:  # SUBMIT
                averager.submit(self.flat, step)

    def _keep_momentum_bound(self) -> None:
        """A loaded optimizer state (a checkpoint) replaces the momentum buffers bound into the flat
        buffer: copy the loaded values in and bind them again."""
        assert self.optimizer is not None
        if momentum_bound(self.optimizer, self.model, self.flat):
            return
        if self.averager is not None:  # the corrections still out were computed on the old buffers
            for done in self.averager.drain():
                self._apply(done)
        self.flat = bind_flat(self.model, self.optimizer)

    def finish(self) -> None:
        """Take every average still in flight, run the groups this worker is still committed to, leave
        (see :class:`.source.ServiceSource`), then with ``--final-average on`` average with every living
        worker once (:meth:`_final_average`). Logged with ``step`` = the number of steps run."""
        for effect in finishing(self.options.final_average == "on"):
            if effect == DRAIN and self.averager is not None:
                t0 = time.perf_counter()
                for done in self.averager.drain():
                    self._apply(done)
                self.exposed_s += time.perf_counter() - t0
            elif effect == COMMITTED:
                for group in self.source.finish(self.ctx.rank):
                    self._run(group, self.steps_done)
                self.source.leave()
            elif effect == FINAL:
                self._final_average()

    def _final_average(self) -> None:
        """The replicas end equal: once every rank is done or declared failed (through the store, with a
        timeout that counts inactivity only, as the run's closing: a fast worker waits for a slow one as
        long as it makes progress), one average of the full-precision values over the living ranks, on
        the surviving P-Reduce (a rank that fails during it is left out, as in any group)."""
        membership = self.groups.membership
        if membership is None:  # alone: nothing to average with
            return
        key = f"{self.namespace}/final/"
        mark_done(self.ctx.store, self.ctx.rank, key)
        done = wait_settled(self.ctx.store, membership, self.ctx.timeout_s, key)
        t0 = time.perf_counter()
        before = flatten(state_tensors(self.model))  # a copy: this replica's distance from the average
        self.final_ranks = len(self.groups.reduce(done, self.flat))
        self.final_s = time.perf_counter() - t0
        self.final_distance = float(torch.linalg.vector_norm(before - flatten(state_tensors(self.model))))

    def peers(self) -> Sequence[int] | None:
        return self.groups.current

    def stats(self) -> dict[str, Any]:
        return {
            "generator": self.options.generator,
            "group_size": self.options.group_size,
            "groups_run": self.tally.groups_run,
            "local_steps": self.tally.local_steps,
            "mean_group_size": self.tally.mean_group_size,
            "shrunk_groups": self.groups.shrunk,
            "compress": self.options.compress,
            "average_by": self.options.average_by,
            "averaging_sent_bytes": self.sent_bytes,
            **self._overlap_stats(),
            **final_report(self.options, self.final_ranks, self.final_s, self.final_distance),
            **self.comms.stats.report(),
            "generator_stats": self.source.stats(),
        }

    def _overlap_stats(self) -> dict[str, Any]:
        if self.averager is None:
            averaging_s, exposed_s = self.blocking_s, self.blocking_s
        else:
            averaging_s, exposed_s = self.averager.busy_s, self.exposed_s
        return overlap_report(self.options, steps=self.steps_done, local_steps=self.tally.local_steps,
                              busy_local_steps=self.counts.busy_local_steps,
                              average_waits=self.counts.average_waits,
                              averaging_s=averaging_s, exposed_s=exposed_s)
