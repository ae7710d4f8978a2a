"""``allreduce``: synchronous data parallelism with PyTorch DistributedDataParallel.

The reference every other method is measured against, as a user would run it: DDP's bucketed gradient
all-reduce overlapped with backward (Li et al., "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training", VLDB 2020; the same collective Horovod uses, Sergeev and Del Balso 2018). The only
addition is a communication hook that wraps DDP's own all-reduce hook to time when the last bucket was
launched, so the time backward spent waiting on communication can be reported.
"""

# No `from __future__ import annotations`: DDP checks the comm hook's annotations at run time.

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from prague.algorithms.allreduce import AllReduceOptions
from prague.algorithms.api import Algorithm, StepTimes
from prague.algorithms.allreduce.scaling import lr_factor
from prague.optim import scaled_lr
from prague.runtime.every_call import EveryCall


class _HookState:
    def __init__(self, process_group: dist.ProcessGroup, algorithm: Algorithm) -> None:
        self.process_group = process_group
        self.last_launch = 0.0
        self.algorithm = algorithm
        self.weight = 1.0  # this rank's gradient enters the mean this many times (allreduce:balanced)


def _timed_allreduce(state: _HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    gate = state.algorithm.gradient_gate
    if gate is not None:  # paced compute: the bucket leaves when its last gradient would be ready
        gate(bucket.parameters())
    if state.weight != 1.0:  # a sample-weighted mean: this rank's share of the step's samples, times n
        bucket.buffer().mul_(state.weight)
    state.last_launch = time.perf_counter()
    if bucket.is_last():  # backward's compute is over: what follows is waiting for the others
        state.algorithm.phase.communicate()
    return default_hooks.allreduce_hook(state.process_group, bucket)


class AllReduce(Algorithm):
    """Gradient all-reduce over all ranks through DDP, then the same optimizer step everywhere."""

    options: AllReduceOptions
    _ddp: DistributedDataParallel | None
    _hook: _HookState | None

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> nn.Module:
        world = dist.group.WORLD
        assert world is not None, "init_process_group has run (prague.init) before setup"
        # Plain closures, not bound methods: copies of the model (deepcopy) must not drag this object along.
        self._forward_called = 0.0
        self._buffer_sync_s = 0.0

        def module_called(grad: bool) -> None:
            if self._forward_called:
                self._buffer_sync_s += time.perf_counter() - self._forward_called
                self._forward_called = 0.0

        self._module_called = EveryCall(module_called)  # a clock read torch.compile keeps as an operator
        self._handles = [model.register_forward_pre_hook(lambda module, args: self._module_called())]
        self.resources.callback(self._release)
        return self.wrap(model, world)

    def wrap(self, model: nn.Module, group: dist.ProcessGroup) -> DistributedDataParallel:
        """DDP over ``group`` for ``model``, with the timing comm hook, as :attr:`_ddp` (replacing, and so
        releasing, the one before)."""
        device_ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        if getattr(self, "_ddp", None) is not None:
            self._unwrap()
        o = self.options
        # broadcast_buffers only when turned off: DDP's default is on, and newer torch warns on the name
        extra: dict[str, Any] = {} if o.broadcast_buffers else {"broadcast_buffers": False}
        self._ddp = DistributedDataParallel(
            model, device_ids=device_ids, bucket_cap_mb=o.bucket_cap_mb, process_group=group,
            find_unused_parameters=o.find_unused_parameters, static_graph=o.static_graph,
            gradient_as_bucket_view=o.gradient_as_bucket_view, **extra,
        )
        self._hook = _HookState(group, self)
        self._ddp.register_comm_hook(self._hook, _timed_allreduce)

        # DDP broadcasts rank 0's buffers (BatchNorm statistics) at the start of every forward: a
        # synchronous collective where a fast rank waits for a slow one. Time it as communication.
        def ddp_called(grad: bool) -> None:
            self._forward_called = time.perf_counter()

        self._ddp_called = EveryCall(ddp_called)
        self._ddp_handle = self._ddp.register_forward_pre_hook(lambda module, args: self._ddp_called())
        return self._ddp

    def _unwrap(self) -> None:
        """Let DDP go (its reducer's hooks on the parameters, its hold on the group) and its hooks with it."""
        self._ddp_handle.remove()
        self._ddp = None
        self._hook = None

    def _release(self) -> None:
        """Forget DDP (which holds the world group) and unhook the user's model, so that the world
        group, and its gloo threads, can go when the process group is destroyed."""
        for handle in self._handles:
            handle.remove()
        if self._ddp is not None:
            self._unwrap()

    def after_backward(self, step: int, times: StepTimes) -> None:
        times.inner_comm_s += self._buffer_sync_s
        self._buffer_sync_s = 0.0
        # DDP has waited for every bucket by the time backward returns; what followed the last launch
        # was communication that compute did not hide.
        if self._hook is not None and self._hook.last_launch:
            times.inner_comm_s += max(0.0, time.perf_counter() - self._hook.last_launch)
            self._hook.last_launch = 0.0

    def apply_update(self, optimizer: torch.optim.Optimizer | None, step: int) -> None:
        if optimizer is None:
            return
        with scaled_lr(optimizer, lr_factor(self.options, self.ctx.world_size, step)):
            optimizer.step()

    def stats(self) -> dict[str, Any]:
        return {"bucket_cap_mb": self.options.bucket_cap_mb, "lr_scaling": self.options.lr_scaling}


class TimedAllReduce(AllReduce):
    """:class:`AllReduce` that measures this rank's compute time of each step (:attr:`compute_s`, set in
    ``after_backward``), for variants that decide from the ranks' speeds (``allreduce:drop``,
    ``allreduce:balanced``): from the start of the step to the launch of DDP's last bucket (when backward's
    compute is over; under paced compute, when the gradients would be ready), less the time the forward
    pass waited in DDP's buffer broadcast for the other ranks."""

    compute_s = 0.0
    _t0 = 0.0

    def before_compute(self, step: int) -> None:
        self._t0 = time.perf_counter()

    def share(self, mine: Sequence[float], ranks: Sequence[int], group: dist.ProcessGroup | None = None) -> list[float]:
        """Every one of ``ranks``' ``mine`` (each the same length), in rank order, laid end to end: one
        all-reduce over ``group`` (None: the world's), whose members are ``ranks``."""
        k = len(mine)
        values = torch.zeros(k * len(ranks), dtype=torch.float64)
        at = list(ranks).index(self.ctx.rank)
        values[at * k:(at + 1) * k] = torch.tensor(list(mine), dtype=torch.float64)
        if self.ctx.backend == "nccl":
            values = values.to(self.ctx.device)
        group = group if group is not None else dist.group.WORLD
        assert group is not None
        group.allreduce([values]).wait()
        return [float(v) for v in values.tolist()]

    def after_backward(self, step: int, times: StepTimes) -> None:
        launched = self._hook.last_launch if self._hook is not None else 0.0
        self.compute_s = max(0.0, (launched or time.perf_counter()) - self._t0 - self._buffer_sync_s)
        super().after_backward(step, times)
