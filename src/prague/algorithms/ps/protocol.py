"""The wire protocol between parameter-server workers and server shards (``ps`` and ``ps-eager``).

The model state is one flat float32 vector of length ``total`` (:func:`prague.comm.flat.bind_flat`:
parameters first, ``n_params`` of them, then floating buffers such as BatchNorm statistics). Shard ``k``
of ``K`` owns the contiguous slice ``shard_bounds(total, K)[k]``; a worker talks to each shard over its
own two-member gloo communicator (shard side rank 0, worker side rank 1), built from the job's store
under :func:`pair_prefix`. Only the two ends take part in building it.

Every request is a header of :data:`HEADER_LEN` int64 ``[op, base_version, step, worker_rank]`` (tag
:data:`TAG_REQUEST`), followed for :data:`OP_INIT` and :data:`OP_PUSH` by the payload slice (tag
:data:`TAG_PAYLOAD`). Every request except :data:`OP_INIT` gets a reply: a header ``[version, tau,
accepted, wait_us]`` (tag :data:`TAG_REPLY`) and the shard's current slice (tag :data:`TAG_STATE`).
Messages on one pair are matched in order, so a worker may send its next request before reading the
previous reply only in the order push-then-reply (``ps-eager`` does exactly that). After the reply to
:data:`OP_BYE` (the final values) the worker sends :data:`OP_CLOSED`, so a shard never exits (and
closes the connection) before every worker has read everything.

A push payload holds the gradient for the parameter part of the slice and the worker's current values
for the buffer part (buffers have no gradient; the shard averages them, see
:mod:`prague.algorithms.ps.server`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist

from prague.algorithms.ps import MODES, MOMENTUM_MODES, STALENESS_RULES, check_shards
from prague.errors import ConfigError

KEY_PREFIX = "prague/ps"
LAYOUT_KEY = f"{KEY_PREFIX}/layout"
#: The decisions folder in which every shard writes its trace (empty: none); set by worker rank 0 just
#: before :data:`LAYOUT_KEY`, so a shard that has read the layout finds it.
DECISIONS_KEY = f"{KEY_PREFIX}/decisions"

HEADER_LEN = 4
OP_INIT, OP_PULL, OP_PUSH, OP_BYE, OP_CLOSED = 1, 2, 3, 4, 5
TAG_REQUEST, TAG_PAYLOAD, TAG_REPLY, TAG_STATE = 10, 11, 12, 13
SHARD_SIDE, WORKER_SIDE = 0, 1
#: The backend of every worker-shard communicator (:func:`pair_group`), whatever the job's backend.
PAIR_BACKEND = "gloo"


@dataclass(frozen=True)
class Layout:
    """What every shard must know before serving: sizes and the optimizer's update rule.

    Published by worker rank 0 under :data:`LAYOUT_KEY`; every other worker checks its own model
    against it. ``lr`` etc. are those of ``torch.optim.SGD`` (the only rule the shards implement).
    """

    total: int
    n_params: int
    lr: float
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool

    def __post_init__(self) -> None:
        if not 0 <= self.n_params <= self.total:
            raise ConfigError(f"parameter count {self.n_params} must be within 0..{self.total} (the flat state size)")

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, text: str | bytes) -> "Layout":
        return cls(**json.loads(text))


def shard_bounds(total: int, shards: int) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` slice of a flat state of ``total`` elements owned by each of ``shards`` shards."""
    check_shards(shards, total)
    cuts = [k * total // shards for k in range(shards + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def pair_prefix(shard: int, worker: int) -> str:
    return f"{KEY_PREFIX}/pair/{shard}/{worker}"


def stats_key(shard: int, worker: int) -> str:
    return f"{KEY_PREFIX}/stats/{shard}/{worker}"


def pair_group(store: dist.Store, shard: int, worker: int, side: int, timeout: timedelta) -> dist.ProcessGroup:
    """The two-member communicator between ``shard`` and ``worker``; both ends call it (blocks until
    the other end arrives, at most ``timeout``)."""
    pg = dist.ProcessGroupGloo(dist.PrefixStore(pair_prefix(shard, worker), store), side, 2, timeout)
    # A gloo backend has send/recv at run time; torch's type stubs declare them on ProcessGroup only.
    return cast(dist.ProcessGroup, pg)


def request_header(op: int, base_version: int = 0, step: int = 0, worker: int = 0) -> torch.Tensor:
    return torch.tensor([op, base_version, step, worker], dtype=torch.int64)


@dataclass(frozen=True)
class Reply:
    """A shard's answer header: its version after the request, the staleness it measured for a push,
    whether the push was applied, and how long the request waited at the shard (microseconds)."""

    version: int
    tau: int
    accepted: bool
    wait_us: int

    def encode(self) -> torch.Tensor:
        return torch.tensor([self.version, self.tau, int(self.accepted), self.wait_us], dtype=torch.int64)

    @classmethod
    def decode(cls, header: torch.Tensor) -> "Reply":
        v, tau, acc, wait = (int(x) for x in header.tolist())
        return cls(v, tau, bool(acc), wait)


def shard_argv(shard: int, shards: int, nproc: int, mode: str, staleness_lr: str, max_staleness: int,
               momentum: str, timeout_s: float, ready_file: Path, exit_when_done: bool) -> list[str]:
    """The command that runs one shard, :mod:`prague.algorithms.ps.server` (for the launcher, or rank 0 under torchrun)."""
    argv = [sys.executable, "-m", "prague.algorithms.ps.server", "--shard", str(shard), "--shards", str(shards),
            "--nproc", str(nproc), "--mode", mode, "--staleness-lr", staleness_lr,
            "--max-staleness", str(max_staleness), "--momentum", momentum, "--timeout-s", str(timeout_s),
            "--ready-file", str(ready_file)]
    return argv + (["--exit-when-done"] if exit_when_done else [])
