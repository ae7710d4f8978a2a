"""Flat views of a model's state: one contiguous buffer of all parameters and floating buffers.

P-Reduce and model averaging move one buffer, never tensor by tensor. Point-to-point transfers of such a
buffer over a backend that cannot reach its memory (gloo and a CUDA buffer) go through a
:class:`StagingBuffer`, placed where :func:`staging_device` says.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from prague.errors import ConfigError

P2P_BACKENDS = ("gloo", "nccl")


def staging_device(backend: str, device: torch.device) -> torch.device | None:
    """Where a tensor on ``device`` must be copied before ``backend`` sends or receives it point to point;
    None when it can be used as it is.

    Gloo's send and receive read and write host memory only (it has no CUDA path for them), so a CUDA
    tensor is staged on the CPU; NCCL reaches device memory only, so a host tensor is staged on the
    current CUDA device. Pure: tests call it with any device, no GPU needed.
    """
    if backend == "gloo":
        return None if device.type == "cpu" else torch.device("cpu")
    if backend == "nccl":
        return None if device.type == "cuda" else torch.device("cuda")
    raise ConfigError(f"unknown point-to-point backend {backend!r}; valid choices: {', '.join(P2P_BACKENDS)}")


class StagingBuffer:
    """The tensor that point-to-point transfers of ``tensor`` use (:attr:`wire`).

    ``device`` None (what :func:`staging_device` says for a tensor the backend can reach): :attr:`wire`
    *is* ``tensor`` and both copies are no-ops. Otherwise :attr:`wire` is a buffer of the same shape and
    dtype on ``device`` (pinned host memory when it stages a CUDA tensor, so the copies are plain DMA):
    call :meth:`outgoing` before sending (copies ``tensor`` in) and :meth:`land` after a receive has
    completed (copies it back into ``tensor``). Slices of :attr:`wire` may be sent and received as usual.
    Not thread-safe: one owner.
    """

    def __init__(self, tensor: torch.Tensor, device: torch.device | None) -> None:
        self.tensor = tensor
        self.staged = device is not None
        if device is None:
            self.wire = tensor
        else:
            pin = tensor.is_cuda and device.type == "cpu"
            self.wire = torch.empty(tensor.shape, dtype=tensor.dtype, device=device, pin_memory=pin)

    @classmethod
    def for_backend(cls, tensor: torch.Tensor, backend: str) -> StagingBuffer:
        return cls(tensor, staging_device(backend, tensor.device))

    def outgoing(self) -> torch.Tensor:
        """:attr:`wire` holding ``tensor``'s current values, ready to send."""
        if self.staged:
            self.wire.copy_(self.tensor)
        return self.wire

    def land(self) -> None:
        """Take what a completed receive left in :attr:`wire` into ``tensor``."""
        if self.staged:
            self.tensor.copy_(self.wire)


def state_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Parameters, then floating-point buffers (BatchNorm statistics), in a fixed order on every rank."""
    tensors = [p.data for p in module.parameters()]
    tensors += [b for b in module.buffers() if b.is_floating_point()]
    return tensors


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate ``tensors`` into one new 1-D buffer."""
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0)


def views_of(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Consecutive views of ``flat`` shaped like the tensors of ``like`` (no copies)."""
    out, offset = [], 0
    for t in like:
        n = t.numel()
        out.append(flat[offset:offset + n].view_as(t))
        offset += n
    return out


def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` back into ``tensors`` in place."""
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


def average_into(source: nn.Module, target: nn.Module, group: dist.ProcessGroup | None = None,
                 average: Callable[[torch.Tensor], object] | None = None) -> None:
    """Set ``target``'s state to the mean of ``source``'s state over ``group`` (default: all ranks), or by
    ``average`` (averages a flat tensor in place: over the living ranks, :mod:`prague.comm.collectives`).

    Collective: every rank of the group must call it with models of the same architecture. Integer
    buffers (e.g. ``num_batches_tracked``) are taken from ``source`` unchanged.
    """
    flat = flatten(state_tensors(source))
    if average is not None:
        average(flat)
    else:
        flat /= _all_sum(flat, group)
    target.load_state_dict(source.state_dict())
    unflatten_into(flat, state_tensors(target))


def consensus_distance(module: nn.Module, group: dist.ProcessGroup | None = None) -> float:
    """Mean over ranks of ||x_i - mean_j x_j|| (parameters and float buffers). Collective."""
    flat = flatten(state_tensors(module))
    mean = flat.clone()
    n = _all_sum(mean, group)
    mean /= n
    dev = torch.tensor([float(torch.linalg.vector_norm(flat - mean))], device=flat.device)
    _all_sum(dev, group)
    return float(dev.item()) / n


def _all_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> int:
    """Sum ``tensor`` in place over ``group`` (None: all ranks; else any process group, also one built
    outside ``torch.distributed``'s registry, such as the survivors' after a failure); returns its size."""
    if group is None:
        dist.all_reduce(tensor)
        return dist.get_world_size()
    group.allreduce([tensor]).wait()
    return group.size()


def bind_flat(module: nn.Module, momentum_of: torch.optim.Optimizer | None = None) -> torch.Tensor:
    """Move ``module``'s parameters and floating buffers into one contiguous buffer and return it.

    Afterwards each parameter's ``.data`` (and each floating buffer) is a view into the returned tensor,
    so averaging the buffer in place averages the model with no copies. Parameter objects are kept, so
    an optimizer built before the call still holds the right parameters.

    With ``momentum_of`` (a ``torch.optim.SGD`` with momentum), the buffer also holds, after the state,
    one momentum buffer per parameter (its current one, or zeros before the first step, which SGD's
    first step then fills with the gradient as it would have), bound as the optimizer's
    ``momentum_buffer`` state: SGD updates it in place, so averaging the flat buffer averages the
    momentum too (:func:`momentum_bound` tells whether a loaded state replaced it since).
    """
    params = [p for p in module.parameters()]
    buffers = [(owner, name, b) for owner in module.modules() for name, b in owner._buffers.items()
               if b is not None and b.is_floating_point()]
    tensors = [p.data for p in params] + [b for _, _, b in buffers]
    if momentum_of is not None:
        tensors += [_momentum(momentum_of, p) for p in params]
    flat = flatten(tensors)
    offset = 0
    for p in params:
        n = p.numel()
        p.data = flat[offset : offset + n].view_as(p)
        offset += n
    for owner, name, b in buffers:
        n = b.numel()
        owner._buffers[name] = flat[offset : offset + n].view_as(b)
        offset += n
    if momentum_of is not None:
        for p in params:
            n = p.numel()
            momentum_of.state[p]["momentum_buffer"] = flat[offset : offset + n].view_as(p)
            offset += n
    return flat


def _momentum(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> torch.Tensor:
    buffer = optimizer.state.get(param, {}).get("momentum_buffer")
    return torch.zeros_like(param.data) if buffer is None else buffer.detach()


def momentum_bound(optimizer: torch.optim.Optimizer, module: nn.Module, flat: torch.Tensor) -> bool:
    """Whether every parameter's ``momentum_buffer`` is still the view of ``flat`` that
    :func:`bind_flat` made (a loaded optimizer state replaces them with tensors of its own)."""
    lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    for p in module.parameters():
        buffer = optimizer.state.get(p, {}).get("momentum_buffer")
        if buffer is None or not lo <= buffer.data_ptr() < hi:
            return False
    return True
