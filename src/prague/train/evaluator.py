"""``--stop-at-target``: a process beside the workers that scores the average model while they train, and
tells them to stop once it reaches the target accuracy.

Each worker writes its state at the common clock's grid points to ``OUT/eval/rR/pJ.pt`` (and its state at
its end to ``final.pt``; :class:`StateFiles`), the same states :mod:`prague.train.evaluation` keeps in
memory. The evaluator (``python -m prague.train.evaluator``, started by ``prague run`` as a service of the
job) waits for the newest point every rank has written (a rank that has finished contributes its final
state to the points after its end), averages the states, scores the average on the test set and, once it
reaches the target, writes ``OUT/eval/STOP``; every worker checks for that file before each step
(:func:`stop_requested`). It scores only the newest complete point, so it never falls behind by more
than one scoring; files of older points are removed. The run's reported time to target is computed after
training, by the same procedure as without ``--stop-at-target``; the job's time includes the scoring lag
(one pass over the test set, on this machine's spare cores).

The evaluator needs the workers' files on its own disk: one machine (``prague run``, ``prague bench``).
Under torchrun a worker refuses ``--stop-at-target`` with a message saying so.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import sys
import time
from pathlib import Path

import torch

from prague.io import atomic_write_bytes, atomic_write_text

EVAL_DIR = "eval"
STOP_FILE = "STOP"
READY_FILE = "evaluator.ready"
_POINT = re.compile(r"^p(\d+)\.pt$")


def eval_dir(out: Path) -> Path:
    return Path(out) / EVAL_DIR


def stop_requested(out: Path) -> bool:
    """Whether the evaluator has found the target reached (``OUT/eval/STOP`` exists)."""
    return (eval_dir(out) / STOP_FILE).exists()


def stop_point(out: Path) -> int | None:
    """The grid index at which the evaluator found the target reached (``OUT/eval/STOP``: ``point J
    accuracy A``), or None (no stop, or a file that does not say)."""
    try:
        words = (eval_dir(out) / STOP_FILE).read_text().split()
    except OSError:
        return None
    if len(words) >= 2 and words[0] == "point" and words[1].isdigit():
        return int(words[1])
    return None


class StateFiles:
    """One rank's states at the grid points, written for the evaluator (atomically: a reader sees a whole
    file or none)."""

    def __init__(self, out: Path, rank: int) -> None:
        self.folder = eval_dir(out) / f"r{rank}"
        self.folder.mkdir(parents=True, exist_ok=True)

    def write(self, point: int, state: torch.Tensor) -> None:
        self._save(self.folder / f"p{point}.pt", state)

    def write_final(self, state: torch.Tensor) -> None:
        self._save(self.folder / "final.pt", state)

    @staticmethod
    def _save(path: Path, state: torch.Tensor) -> None:
        buffer = io.BytesIO()
        torch.save(state.detach().to("cpu"), buffer)
        atomic_write_bytes(path, buffer.getvalue())


def newest_complete(points: dict[int, set[int]], finished: set[int], nproc: int) -> int | None:
    """The newest grid point whose state every rank can give: each unfinished rank has written it, and a
    finished rank has written it or ended before it (its final state stands for it). None if none yet."""
    if len(finished) == nproc:
        written = set().union(*points.values()) if points else set()
        return max(written, default=None)
    live = [points.get(r, set()) for r in range(nproc) if r not in finished]
    common = set.intersection(*live) if live else set()
    for r in finished:
        last = max(points.get(r, set()), default=-1)
        common = {j for j in common if j > last or j in points.get(r, set())}
    return max(common, default=None)


def _scan(folder: Path, nproc: int) -> tuple[dict[int, set[int]], set[int]]:
    points: dict[int, set[int]] = {}
    finished: set[int] = set()
    for r in range(nproc):
        rank_dir = folder / f"r{r}"
        if not rank_dir.is_dir():
            continue
        for name in os.listdir(rank_dir):
            match = _POINT.match(name)
            if match:
                points.setdefault(r, set()).add(int(match.group(1)))
            elif name == "final.pt":
                finished.add(r)
    return points, finished


def _load(folder: Path, rank: int, point: int) -> torch.Tensor:
    path = folder / f"r{rank}" / f"p{point}.pt"
    if not path.exists():
        path = folder / f"r{rank}" / "final.pt"
    state: torch.Tensor = torch.load(path, map_location="cpu", weights_only=True)
    return state


def serve(out: Path, nproc: int, data_name: str, data_dir: Path | None, model_name: str, seed: int,
          target: float, poll_s: float = 0.2) -> None:
    """Score the newest complete point until the target is reached; then write STOP and idle until the
    launcher stops this process (a service that exits early fails the job)."""
    from prague.comm.flat import state_tensors, unflatten_into
    from prague.train.evaluation import score
    from prague.workload.data import load_dataset
    from prague.workload.models import build_model

    torch.set_num_threads(1)
    os.nice(5)  # the workers' compute comes first
    data = load_dataset(data_name, data_dir, seed=seed)
    model = build_model(model_name, data.input_shape, data.num_classes)
    folder = eval_dir(out)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / READY_FILE, "ready\n")
    scored = -1
    while not (folder / STOP_FILE).exists():
        points, finished = _scan(folder, nproc)
        point = newest_complete(points, finished, nproc)
        if point is None or point <= scored:
            time.sleep(poll_s)
            continue
        try:
            mean = torch.stack([_load(folder, r, point) for r in range(nproc)]).mean(dim=0)
        except (OSError, RuntimeError, EOFError):  # a file removed or replaced under us: next round
            time.sleep(poll_s)
            continue
        unflatten_into(mean, state_tensors(model))
        accuracy = score(model, data.test_x, data.test_y, torch.device("cpu")) / data.test_targets
        scored = point
        if accuracy >= target:
            atomic_write_text(folder / STOP_FILE, f"point {point} accuracy {accuracy:.6f}\n")
        for r, indices in points.items():  # older points are of no more use
            for j in indices:
                if j < point:
                    (folder / f"r{r}" / f"p{j}.pt").unlink(missing_ok=True)
    while True:
        time.sleep(3600)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prague.train.evaluator")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--data-dir", type=Path)
    parser.add_argument("--model", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", type=float, required=True)
    args = parser.parse_args(argv)
    serve(args.out, args.nproc, args.data, args.data_dir, args.model, args.seed, args.target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
