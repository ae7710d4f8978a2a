"""A script's own collectives, over the ranks still alive: ``prague.live_ranks()``, ``prague.leader()``,
``prague.is_leader()``, ``prague.barrier()``, ``prague.all_reduce(tensor)`` and ``prague.broadcast(tensor)``.

A script's evaluation, barrier or checkpoint made with ``torch.distributed`` on the world group ends the job
when a worker dies: its connections close under every rank's collective. These run instead over the
members of the job not declared failed (the launcher's or guard's failed set, :mod:`prague.runtime.liveness`),
on communicators of their own (:class:`prague.comm.surviving.LiveGroups`, what ``prague``'s P-Reduce survives
failures with): a collective that a failure breaks is retried without the failed rank, so an epoch-end
evaluation, a barrier or the leader's checkpoint goes on for the survivors of a method that survives failures.

The leader is the lowest living rank: rank 0 until it fails, then the next. Use :func:`is_leader` where a
script would test ``rank == 0`` (printing, evaluating, saving), and the job keeps its leader when rank 0
dies; the new leader says so once on the console.

Each is collective: every living rank calls it at the same point, with tensors of the same shape.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import torch

from prague.comm.surviving import LiveGroups
from prague.errors import CommError, ConfigError
from prague.runtime.context import DistContext, context, on_shutdown

OPS = ("sum", "mean", "max", "min")


class JobCollectives:
    """The collectives of one job on one rank: made on first use (collective: every rank's first call is
    at the same point, as any collective's), closed by ``prague.shutdown()``."""

    def __init__(self, ctx: DistContext) -> None:
        self.ctx = ctx
        self.groups = LiveGroups(ctx, capacity=2, namespace="job/collectives")
        self._leader = 0  # the leader this rank last saw
        job = ctx.job  # prague's launcher says when the leader moves (a guard's child says it itself)
        self._says_leader = not job.under_launcher or job.guarded

    def live_ranks(self) -> list[int]:
        membership = self.groups.membership
        failed = set(membership.failed()) if membership is not None else set()
        return [r for r in range(self.ctx.world_size) if r not in failed]

    def leader(self) -> int:
        live = self.live_ranks()
        leader = live[0] if live else self.ctx.rank
        if leader != self._leader:
            if leader == self.ctx.rank and self._says_leader:
                sys.stderr.write(f"prague: rank {leader} leads the job now (rank {self._leader} failed)\n")
                sys.stderr.flush()
            self._leader = leader
        return leader

    @contextlib.contextmanager
    def _paused(self) -> Iterator[None]:
        """While this rank waits in a collective, the prepared methods' rounds go on without it."""
        with contextlib.ExitStack() as stack:
            for pause in list(_PAUSES):
                stack.enter_context(pause())
            yield

    def average(self, tensor: torch.Tensor) -> tuple[int, ...]:
        """Average the floating-point ``tensor`` in place over the living ranks (those that fail meanwhile
        left out); returns the ranks it averaged over."""
        with self._paused():
            return self.groups.reduce(self.live_ranks(), tensor)

    def close(self) -> None:
        self.groups.close()


_COLLECTIVES: JobCollectives | None = None
_PAUSES: list[Callable[[], AbstractContextManager[None]]] = []  # the prepared methods' outside_steps


def _job() -> JobCollectives:
    global _COLLECTIVES
    ctx = context()
    if _COLLECTIVES is None or _COLLECTIVES.ctx is not ctx:
        _COLLECTIVES = JobCollectives(ctx)
        on_shutdown(_close)
    return _COLLECTIVES


def _close() -> None:
    global _COLLECTIVES
    if _COLLECTIVES is not None:
        _COLLECTIVES.close()
        _COLLECTIVES = None


def pause_while_waiting(pause: Callable[[], AbstractContextManager[None]]) -> Callable[[], None]:
    """Register a method's ``outside_steps`` (:meth:`prague.algorithms.api.Algorithm.outside_steps`): entered
    while this rank waits in one of these collectives. Returns the function that unregisters it."""
    _PAUSES.append(pause)
    return lambda: _PAUSES.remove(pause) if pause in _PAUSES else None


def live_ranks() -> list[int]:
    """The ranks of the job not declared failed, in order (every rank when nothing failed, or when the
    job has nobody to declare failures: plain torchrun without ``prague guard``)."""
    return _job().live_ranks()


def leader() -> int:
    """The lowest living rank: the one that prints, evaluates and saves for the job."""
    return _job().leader()


def is_leader() -> bool:
    """Whether this rank leads the job (:func:`leader`): use it where a script tests ``rank == 0``."""
    return _job().leader() == _job().ctx.rank


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduce ``tensor`` in place over the living ranks (``op``: sum, mean, max or min) and return it.
    Integer tensors are reduced exactly up to 2**53 (through float64)."""
    if op not in OPS:
        raise ConfigError(f"prague.all_reduce: unknown op {op!r}; one of {', '.join(OPS)}")
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"prague.all_reduce takes a tensor, got {type(tensor).__name__}")
    job = _job()
    if op in ("max", "min"):  # every rank's value in its own slot, summed, then reduced over the slots
        live = job.live_ranks()
        slots = torch.zeros((len(live), *tensor.shape), dtype=torch.float64, device=tensor.device)
        slots[live.index(job.ctx.rank)] = tensor.to(torch.float64)
        members = job.average(slots)
        rows = slots[[live.index(r) for r in members]] * len(members)
        tensor.copy_(rows.amax(0) if op == "max" else rows.amin(0))
        return tensor
    if op == "mean" and not tensor.is_floating_point():
        raise ConfigError(f"prague.all_reduce(op='mean') takes a floating-point tensor, got {tensor.dtype}")
    work = tensor if tensor.is_floating_point() else tensor.to(torch.float64)
    members = job.average(work)
    if op == "sum":
        work.mul_(len(members))
    if work is not tensor:
        tensor.copy_(work.round())
    return tensor


def broadcast(tensor: torch.Tensor, src: int | None = None) -> torch.Tensor:
    """Set ``tensor`` in place, on every living rank, to ``src``'s (default: the leader's) and return it.
    Raises :class:`CommError` if ``src`` fails before it is done."""
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"prague.broadcast takes a tensor, got {type(tensor).__name__}")
    job = _job()
    src = job.leader() if src is None else src
    if not 0 <= src < job.ctx.world_size:
        raise ConfigError(f"prague.broadcast: src {src} is not a rank of this job (0..{job.ctx.world_size - 1})")
    work = tensor.to(torch.float64)
    if job.ctx.rank != src:
        work.zero_()
    members = job.average(work)
    if src not in members:
        raise CommError(f"prague.broadcast: its source, rank {src}, failed before it was done; broadcast from "
                        "prague.leader() again")
    work.mul_(len(members))
    tensor.copy_(work if tensor.is_floating_point() else work.round())
    return tensor


def average_live(tensor: torch.Tensor) -> int:
    """Average the floating-point ``tensor`` in place over the living ranks; how many (``averaged_model``
    of a method that survives failures)."""
    return len(_job().average(tensor))


def barrier() -> None:
    """Wait until every living rank has called it."""
    _job().average(torch.zeros(1))
