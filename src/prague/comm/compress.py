"""Compressed averaging: a group's members exchange their values in 8 bits, with error feedback.

A P-Reduce in full precision moves ``2 (p - 1) / p`` times the model's bytes per member (a ring
all-reduce of 32-bit values). With ``--compress int8`` each member instead sends one code per value
(8 bits) plus a 32-bit offset and step per block of :data:`BLOCK` values, and the members gather every
member's codes: ``(p - 1)`` payloads of about a quarter of the model each, ``(p - 1) / 4`` of the model's
bytes against ``2 (p - 1) / p`` (2.7x fewer bytes for a group of 3, 2x for a pair).

The rule is the error-compensated gossip of DeepSqueeze (Tang, Lian, Qiu, Yuan, Liu, "DeepSqueeze:
Decentralization Meets Error-Compensated Compression", 2019), with the group average as the mixing step;
CHOCO-SGD (Koloskova, Stich, Jaggi, "Decentralized Stochastic Optimization and Gossip Algorithms with
Compressed Communication", ICML 2019) showed that decentralized averaging tolerates compression. Member
i holds values x_i and a residual e_i (the part of its values that earlier messages did not carry):

* it sends q_i = Q(x_i + e_i) and keeps e_i <- x_i + e_i - q_i (:class:`ErrorFeedback`);
* every member decodes every q_j in member order, so all get the same bits of a = mean_j q_j;
* member i's values become x_i + (a - q_i).

Over the group the changes ``a - q_i`` sum to zero, so the group's mean of the values is what it was, up
to float rounding: compression moves no mass between workers, it only delays the part of each member's
values that its message did not carry, and that part (the residual) is sent with the next message
instead of being lost. Member i ends at ``a + (x_i - q_i)``: the group's average of what was sent, plus
its own untransmitted part.

The codes are affine per block: ``Q(v) = lo + step * round((v - lo) / step)`` with ``lo`` the block's
minimum and ``step`` its range over 255, so the error of one value is at most ``step / 2``. Rounding is
to nearest (deterministic): error feedback, not randomness, keeps it unbiased over time.

The byte counts the simulator charges and the runtime reports are :mod:`prague.comm.codecs` (no torch);
the exchange itself is :func:`prague.comm.preduce.preduce_compressed`.
"""

from __future__ import annotations

import torch

from prague.comm.codecs import BLOCK, META_PER_BLOCK, blocks, payload_bytes

_LEVELS = 255  # codes 0..255 per block

def _parts(numel: int, block: int) -> tuple[int, int]:
    """``(whole blocks, values in the partial last block)`` of ``numel`` values."""
    return numel // block, numel % block


def encode(values: torch.Tensor, out: torch.Tensor | None = None, block: int = BLOCK) -> torch.Tensor:
    """The int8 message of the flat tensor ``values``: a uint8 tensor of :func:`payload_bytes` bytes,
    the blocks' float32 offsets and steps first (so that they stay aligned), then one code per value.
    ``out`` (that size, uint8) is reused when given. The whole blocks are coded as one (blocks x
    ``block``) view, the partial last block apart, so no padded copy of the values is made."""
    numel = values.numel()
    nb = blocks(numel, block)
    size = payload_bytes(numel, "int8", block=block)
    if out is None or out.numel() != size or out.dtype != torch.uint8 or out.device != values.device:
        out = torch.empty(size, dtype=torch.uint8, device=values.device)
    meta = out[: 4 * META_PER_BLOCK * nb].view(torch.float32).view(META_PER_BLOCK, nb)
    codes = out[4 * META_PER_BLOCK * nb:]
    v = values.detach().reshape(-1).float()  # no copy for float32 values
    whole, tail = _parts(numel, block)
    lo, hi = meta[0], meta[1]  # the step is written over the maximum below
    if whole:
        grid = v[: whole * block].view(whole, block)
        torch.amin(grid, dim=1, out=lo[:whole])
        torch.amax(grid, dim=1, out=hi[:whole])
    if tail:
        rest = v[whole * block:]
        lo[whole], hi[whole] = rest.min(), rest.max()
    step = hi.sub_(lo).div_(_LEVELS)
    scale = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))  # a constant block codes as zeros
    q = torch.empty(numel, dtype=torch.float32, device=v.device)
    if whole:
        q[: whole * block].view(whole, block).copy_(v[: whole * block].view(whole, block)) \
            .sub_(lo[:whole, None]).mul_(scale[:whole, None])
    if tail:
        q[whole * block:].copy_(v[whole * block:]).sub_(lo[whole]).mul_(scale[whole])
    codes.copy_(q.round_().clamp_(0, _LEVELS))
    return out


def decode(payload: torch.Tensor, numel: int, out: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """The values a message of :func:`encode` carries, written into ``out`` (flat, ``numel`` values, any
    float dtype) in place; returns ``out``. ValueError for a payload of the wrong size."""
    nb = blocks(numel, block)
    if payload.numel() != payload_bytes(numel, "int8", block=block) or payload.dtype != torch.uint8:
        raise ValueError(f"an int8 message of {numel} values has {payload_bytes(numel, 'int8', block=block)} "
                         f"bytes of uint8, got {payload.numel()} of {payload.dtype}")
    meta = payload[: 4 * META_PER_BLOCK * nb].view(torch.float32).view(META_PER_BLOCK, nb)
    lo, step = meta[0].to(out.dtype), meta[1].to(out.dtype)
    codes = payload[4 * META_PER_BLOCK * nb:]
    whole, tail = _parts(numel, block)
    if whole:
        out[: whole * block].view(whole, block).copy_(codes[: whole * block].view(whole, block)) \
            .mul_(step[:whole, None]).add_(lo[:whole, None])
    if tail:
        out[whole * block:].copy_(codes[whole * block:]).mul_(step[whole]).add_(lo[whole])
    return out


class ErrorFeedback:
    """One member's residual: what its earlier messages did not carry (see the module docstring).

    Owned by the thread that runs the member's groups. :meth:`encode` builds the message of
    ``values + residual`` and keeps the new residual aside; :meth:`commit` makes it the residual once
    the group has averaged. A group that fails and is retried, or that ends with nobody to average with,
    never commits, so the residual is not charged for a message nobody used."""

    def __init__(self, block: int = BLOCK) -> None:
        self.block = block
        self.residual: torch.Tensor | None = None
        self._pending: torch.Tensor | None = None
        self._payload: torch.Tensor | None = None
        self.sent: torch.Tensor | None = None  # the values the latest message carries, decoded
        self._sums: tuple[torch.Tensor, torch.Tensor] | None = None

    def sums(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Two float32 buffers shaped as the values (after :meth:`encode`): a group's mean of the decoded
        messages and one decoded message, kept for the next group."""
        assert self.residual is not None, "sums() after encode()"
        if self._sums is None or self._sums[0].shape != self.residual.shape \
                or self._sums[0].device != self.residual.device:
            self._sums = (torch.empty_like(self.residual), torch.empty_like(self.residual))
        return self._sums

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """The message for ``values`` (flat) plus the residual; :attr:`sent` holds what it carries."""
        if self.residual is None or self.residual.shape != values.shape or self.residual.device != values.device:
            self.residual = torch.zeros_like(values, dtype=torch.float32)
            self._pending = torch.empty_like(self.residual)
            self.sent = torch.empty_like(values)
        assert self._pending is not None and self.sent is not None
        carried = self._pending.copy_(values).add_(self.residual)
        self._payload = encode(carried, self._payload, self.block)
        decode(self._payload, values.numel(), self.sent, self.block)
        carried.sub_(self.sent)  # the new residual, kept aside until commit
        return self._payload

    def commit(self) -> None:
        """The latest message was used by the group: its untransmitted part is the residual now."""
        if self._pending is None or self.residual is None:
            raise RuntimeError("ErrorFeedback.commit before encode")
        self.residual, self._pending = self._pending, self.residual
