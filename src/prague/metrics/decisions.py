"""The decision log: what each worker decided, one JSON line per decision, written as it happens.

With ``--log-decisions`` every real worker (``prague run``, ``bench``, ``worker``) appends its decisions
to ``OUT/decisions/rankR.jsonl``, and ``prague simulate`` writes the same files for its simulated
workers (``OUT/runs/<method>_<scenario>/decisions/``, the layout of ``prague bench``). Same seed, same
decisions: a simulated worker of ``prague:static``, ``dssync``, ``adpsgd`` or ``ps:sync`` writes
exactly the lines a real one does. Where a decision depends on the order in which workers reach a
service (the Group Generator of ``prague:smart|random|ready``, the shards of ``ps:async`` and
``ps-eager``), the services write that order beside the logs, so the run can be replayed through the
simulator's own decision objects:

* ``gg.jsonl``: every call of the Group Generator's policy, in order, with the time it was given and
  its answers (:class:`prague.groups.trace.PolicyCall`);
* ``ps-shardK.jsonl``: every push shard K received, in the order it applied them (:class:`ShardPush`).

Kinds of :class:`Decision` (``allreduce`` decides nothing and writes nothing):

* ``group``: ``members`` (sorted ranks, the worker among them; a group of one is a local step) and,
  for ``prague``, ``seq`` (the generator's global sequence number). ``prague`` logs every group it
  executes, also those it runs after its last step (their ``step`` is the number of steps), ``dssync``
  the group of each iteration;
* ``partner``: the passive rank an ``adpsgd`` active worker averaged with (passives log nothing);
* ``drop``: the chunks a ``lossy`` step dropped (``chunks``, their indices in the gradient's chunk plan;
  the same on every rank) and their ``share`` of the gradient's elements, one line per step;
* ``arrival``: an ``allreduce:backup`` gradient offered to round ``seq`` (the job's step it was computed
  for) and whether it was among the round's first n - b (``accepted``), one line per step;
* ``push``: a parameter-server push (``ps``, ``ps-eager``), one line per shard: ``tau`` and
  ``accepted`` as the shard answered, and ``scale``, the factor it applied to the learning rate
  (:func:`prague.algorithms.ps.rules.update_scale`). ``ps-eager`` logs a push when its answer arrives.

Nothing is written, and nothing is built, unless the log is on: callers hold ``None`` otherwise. This
module imports no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from prague.io import JsonLines, read_json_lines

DECISIONS_DIR = "decisions"
GG_TRACE_FILE = "gg.jsonl"
KINDS = ("group", "partner", "push", "drop", "arrival")


def rank_path(folder: Path, rank: int) -> Path:
    """The log of worker ``rank`` in a decisions folder."""
    return Path(folder) / f"rank{rank}.jsonl"


def gg_trace_path(folder: Path) -> Path:
    """The Group Generator's trace in a decisions folder."""
    return Path(folder) / GG_TRACE_FILE


def shard_trace_path(folder: Path, shard: int) -> Path:
    """Parameter-server shard ``shard``'s trace in a decisions folder."""
    return Path(folder) / f"ps-shard{shard}.jsonl"


@dataclass(frozen=True)
class Decision:
    """One decision of one worker: one line of its log (see the module docstring for the kinds).

    ``step`` is the worker's iteration the decision belongs to. Fields a kind does not use are None
    and left out of the line.
    """

    step: int
    kind: str
    members: tuple[int, ...] | None = None
    seq: int | None = None
    partner: int | None = None
    shard: int | None = None
    tau: int | None = None
    scale: float | None = None
    accepted: bool | None = None
    chunks: tuple[int, ...] | None = None
    share: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"decision kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.members is not None:
            object.__setattr__(self, "members", tuple(int(m) for m in self.members))
        if self.chunks is not None:
            object.__setattr__(self, "chunks", tuple(int(c) for c in self.chunks))

    @classmethod
    def of_group(cls, step: int, members: tuple[int, ...], seq: int | None = None) -> Decision:
        return cls(step, "group", members=members, seq=seq)

    @classmethod
    def of_partner(cls, step: int, partner: int) -> Decision:
        return cls(step, "partner", partner=partner)

    @classmethod
    def of_push(cls, step: int, shard: int, tau: int, scale: float, accepted: bool) -> Decision:
        return cls(step, "push", shard=shard, tau=tau, scale=scale, accepted=accepted)

    @classmethod
    def of_arrival(cls, step: int, round_id: int, accepted: bool) -> Decision:
        return cls(step, "arrival", seq=round_id, accepted=accepted)

    @classmethod
    def of_drop(cls, step: int, chunks: tuple[int, ...], share: float) -> Decision:
        return cls(step, "drop", chunks=chunks, share=share)

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if v is not None}
        for name in ("members", "chunks"):
            if out.get(name) is not None:
                out[name] = list(out[name])
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Decision:
        members, chunks = data.get("members"), data.get("chunks")
        return cls(**{**data, "members": tuple(members) if members is not None else None,
                      "chunks": tuple(chunks) if chunks is not None else None})


@dataclass(frozen=True)
class ShardPush:
    """One push as a parameter-server shard handled it: one line of ``ps-shardK.jsonl``, in the order
    the shard applied the pushes. ``base_version``: the shard version the gradient was computed on;
    ``version``: the shard's version right after; ``scale``: the factor applied to the learning rate
    (0 when rejected)."""

    worker: int
    step: int
    base_version: int
    tau: int
    scale: float
    accepted: bool
    version: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShardPush:
        return cls(**data)


class DecisionLog:
    """One worker's decision log, ``FOLDER/rankR.jsonl``, emptied when opened; each :meth:`write` is
    in the file when it returns (:class:`prague.io.JsonLines`).

    Whoever opens it closes it, after the method's ``finish`` (which may still log groups): the worker
    loop for a real worker, the simulator's :class:`~prague.sim.world.World` for simulated ones.
    ``folder`` is where the services' traces go too.
    """

    def __init__(self, folder: Path, rank: int) -> None:
        self.folder = Path(folder)
        self.rank = rank
        self.path = rank_path(self.folder, rank)
        self._file = JsonLines(self.path)

    def write(self, decision: Decision) -> None:
        self._file.write(decision.to_dict())

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> DecisionLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_decisions(path: Path) -> list[Decision]:
    """The decisions of one log, in the order they were written."""
    return [Decision.from_dict(d) for d in read_json_lines(path)]


def read_shard_trace(path: Path) -> list[ShardPush]:
    """The pushes of one shard's trace, in the order the shard applied them."""
    return [ShardPush.from_dict(d) for d in read_json_lines(path)]
