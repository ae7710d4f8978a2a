"""Checkpoints of a run, and resuming from the last complete one.

Every ``--checkpoint-every K`` steps each worker writes its own state at that step to
``OUT/checkpoints/step-KKKKKKKK/rankR.pt``: the model, the optimizer, the step records so far (the
summary covers the whole run), the evaluation snapshots, the training clock, the trainer's counters and
the random generators. Workers of a decentralised method reach step K at different times; each writes
when it gets there. A file is written to a temporary name, synced and renamed, so it exists complete or
not at all; a checkpoint is complete once every rank's file is there, and the worker that completes it
(the one that finds all the files after renaming its own) writes ``complete.json`` and removes the
checkpoints older than the one before it. A launcher killed while a checkpoint is being written leaves
that checkpoint incomplete, never corrupt: :func:`latest_complete` passes over it.

Communication in flight at step K (an average still running in the background, an eager-SGD round not
yet reduced, the parameter servers' own state) is not part of a checkpoint: a resumed run continues
from each worker's model at step K, and its Group Generator starts afresh with every worker at step K.
"""

from __future__ import annotations

import io
import pickle
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from prague.errors import ConfigError
from prague.io import atomic_write_bytes, atomic_write_json

CHECKPOINTS_DIR = "checkpoints"
COMPLETE = "complete.json"
FORMAT = 1


def step_dir(out: Path, step: int) -> Path:
    return Path(out) / CHECKPOINTS_DIR / f"step-{step:08d}"


def _rank_file(out: Path, step: int, rank: int) -> Path:
    return step_dir(out, step) / f"rank{rank}.pt"


def _steps(out: Path) -> list[int]:
    """Steps of the checkpoint folders under ``out``, ascending."""
    root = Path(out) / CHECKPOINTS_DIR
    found = []
    for d in root.glob("step-*") if root.is_dir() else ():
        try:
            found.append(int(d.name.removeprefix("step-")))
        except ValueError:
            continue
    return sorted(found)


def is_complete(out: Path, step: int, nproc: int) -> bool:
    return all(_rank_file(out, step, r).is_file() for r in range(nproc))


def latest_complete(out: Path, nproc: int) -> int | None:
    """The step of the newest checkpoint every rank wrote, or None."""
    return next((s for s in reversed(_steps(out)) if is_complete(out, s, nproc)), None)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                             "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class WorkerState:
    """One worker's state after ``step`` steps (what one ``rankR.pt`` holds)."""

    step: int
    model: dict[str, Any]
    optimizer: dict[str, Any] | None
    trainer: dict[str, Any]
    records: list[dict[str, Any]]
    snapshots: list[tuple[int, torch.Tensor]]  # (grid index, flat state): train/evaluation.py SnapshotLog
    wall_s: float
    rng: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, **self.__dict__}


def write(out: Path, rank: int, nproc: int, state: WorkerState) -> bool:
    """Write ``state`` as this rank's file of checkpoint ``state.step`` (atomically); True if that made the
    checkpoint complete (then ``complete.json`` is written and older checkpoints but one are removed)."""
    buffer = io.BytesIO()
    torch.save(state.to_dict(), buffer)
    atomic_write_bytes(_rank_file(out, state.step, rank), buffer.getvalue())
    if not is_complete(out, state.step, nproc):
        return False
    atomic_write_json(step_dir(out, state.step) / COMPLETE, {"step": state.step, "nproc": nproc})
    earlier = [s for s in _steps(out) if s < state.step]
    keep = next((s for s in reversed(earlier) if is_complete(out, s, nproc)), state.step)  # the one before
    for old in (s for s in earlier if s < keep):
        shutil.rmtree(step_dir(out, old), ignore_errors=True)  # every rank is past it: nobody writes there
    return True


def read(out: Path, step: int, rank: int) -> WorkerState:
    """This rank's state in checkpoint ``step``; ConfigError naming the file if it cannot be read."""
    path = _rank_file(out, step, rank)
    try:
        # weights_only=False: the file holds RNG states and records as well as tensors; it is this
        # run's own output, written by this module, never a download.
        data = torch.load(path, map_location="cpu", weights_only=False)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as exc:
        raise ConfigError(f"cannot read checkpoint {str(path)!r}: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ConfigError(f"checkpoint {str(path)!r} is not a prague checkpoint of format {FORMAT}")
    data.pop("format")
    return WorkerState(**data)


def resume_step(out: Path, nproc: int) -> int:
    """The step a resumed run of ``nproc`` workers in ``out`` continues from; ConfigError if none."""
    step = latest_complete(out, nproc)
    if step is None:
        raise ConfigError(f"{str(out)!r} has no complete checkpoint of {nproc} workers to resume from; "
                          "runs write them with --checkpoint-every K")
    return step

