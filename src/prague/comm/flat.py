"""Flat views of a model's state: one contiguous buffer of all parameters and floating buffers.

P-Reduce and model averaging move one buffer, never tensor by tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def state_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Parameters, then floating-point buffers (BatchNorm statistics), in a fixed order on every rank."""
    tensors = [p.data for p in module.parameters()]
    tensors += [b for b in module.buffers() if b.is_floating_point()]
    return tensors


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate ``tensors`` into one new 1-D buffer."""
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0)


def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` back into ``tensors`` in place."""
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


def average_into(source: nn.Module, target: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Set ``target``'s state to the mean of ``source``'s state over ``group`` (default: all ranks).

    Collective: every rank of the group must call it with models of the same architecture. Integer
    buffers (e.g. ``num_batches_tracked``) are taken from ``source`` unchanged.
    """
    flat = flatten(state_tensors(source))
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    target.load_state_dict(source.state_dict())
    unflatten_into(flat, state_tensors(target))


def consensus_distance(module: nn.Module, group: dist.ProcessGroup | None = None) -> float:
    """Mean over ranks of ||x_i - mean_j x_j|| (parameters and float buffers). Collective."""
    flat = flatten(state_tensors(module))
    mean = flat.clone()
    dist.all_reduce(mean, group=group)
    n = dist.get_world_size(group)
    mean /= n
    dev = torch.tensor([float(torch.linalg.vector_norm(flat - mean))], device=flat.device)
    dist.all_reduce(dev, group=group)
    return float(dev.item()) / n


def bind_flat(module: nn.Module) -> torch.Tensor:
    """Move ``module``'s parameters and floating buffers into one contiguous buffer and return it.

    Afterwards each parameter's ``.data`` (and each floating buffer) is a view into the returned tensor,
    so averaging the buffer in place averages the model with no copies. Parameter objects are kept, so
    an optimizer built before the call still holds the right parameters.
    """
    params = [p for p in module.parameters()]
    buffers = [(owner, name, b) for owner in module.modules() for name, b in owner._buffers.items()
               if b is not None and b.is_floating_point()]
    tensors = [p.data for p in params] + [b for _, _, b in buffers]
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
    return flat
