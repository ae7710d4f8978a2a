"""A bench's learning-rate pilot: every method at its best learning rate.

A method's speed-up can be a learning rate that suits it better than the reference, not its
synchronisation. ``prague bench --lr 0.025,0.05,0.1,0.2`` therefore first runs every (method, scenario)
cell at every value on a short budget (``--pilot-budget``), with the bench's first seed or its first
``--pilot-seeds`` seeds, keeps each cell's best, then runs the full bench with it; every record carries the
value it trained with (``lr``) and its cell's pilot (``lr_pilot``), and the report says which was chosen.

The best value reaches the bench's target on the most pilot seeds, and among those the soonest (the
median of its times to target); when none reaches it, the one with the highest mean final accuracy. One
seed is a weak judge where two values are close: a value that happened to be lucky on it wins. The
pilot's results are kept in ``OUT/pilot.json`` as they come, so a resumed bench (``--resume``) does not run
them again. This module runs nothing itself: the bench hands it a function that runs one configuration.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from prague.errors import ConfigError
from prague.io import atomic_write_json

PILOT_FILE = "pilot.json"
DEFAULT_PILOT_BUDGET = "epochs:1"
#: The most values one ``--lr`` may list.
MAX_VALUES = 16
#: The most seeds a pilot may run each value on (``--pilot-seeds``).
MAX_PILOT_SEEDS = 10


def parse_lr_values(text: str) -> tuple[float, ...]:
    """``"0.05"`` -> (0.05,); ``"0.025,0.05,0.1"`` -> three values; ConfigError naming the form otherwise."""
    parts = [p.strip() for p in str(text).split(",")]
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        raise ConfigError(f"--lr {text!r} is not a learning rate or a comma-separated list of them "
                          "(0.05, or 0.025,0.05,0.1,0.2 for a bench's pilot)") from None
    if not all(0 < v < math.inf for v in values):
        raise ConfigError(f"--lr {text!r}: every learning rate must be a finite number > 0")
    if len(set(values)) != len(values) or len(values) > MAX_VALUES:
        raise ConfigError(f"--lr {text!r}: list each value once, at most {MAX_VALUES} of them")
    return values


def check_pilot_seeds(seeds: int) -> int:
    """``--pilot-seeds``: a number of seeds in 1..MAX_PILOT_SEEDS, else a ConfigError naming the range."""
    if not 1 <= seeds <= MAX_PILOT_SEEDS:
        raise ConfigError(f"--pilot-seeds must be a number of seeds in 1..{MAX_PILOT_SEEDS}, got {seeds}")
    return seeds


def _by_value(results: Sequence[dict[str, Any]]) -> dict[float, list[dict[str, Any]]]:
    """The runs of each learning rate (one per pilot seed), in the order the values first appear."""
    grouped: dict[float, list[dict[str, Any]]] = {}
    for r in results:
        grouped.setdefault(float(r["lr"]), []).append(r)
    return grouped


def _score(runs: Sequence[dict[str, Any]]) -> tuple[int, float, float]:
    """How one value did over its pilot seeds, smaller first: seeds that missed the target, the median
    time to target of those that reached it (inf when none did), minus the mean final accuracy (a failed
    run, with neither, counts as a miss at -1)."""
    reached = [float(r["time_to_target_s"]) for r in runs if r.get("time_to_target_s") is not None]
    accuracies = [float(r["test_accuracy"]) if r.get("test_accuracy") is not None else -1.0 for r in runs]
    return (len(runs) - len(reached), statistics.median(reached) if reached else math.inf,
            -statistics.fmean(accuracies))


def best(results: Sequence[dict[str, Any]]) -> float:
    """The best learning rate of one cell's pilot runs (one or several per value, one per seed): the one
    that reached the target on the most seeds, then the soonest (median), then the most accurate (mean);
    the smallest value on a tie."""
    if not results:
        raise ValueError("a pilot needs at least one run")
    grouped = _by_value(results)
    return min(grouped, key=lambda lr: (*_score(grouped[lr]), lr))


def pilot_entry(record: dict[str, Any]) -> dict[str, Any]:
    """What the pilot keeps of one of its runs."""
    return {"lr": record.get("lr"), "seed": record.get("seed"), "time_to_target_s": record.get("time_to_target_s"),
            "test_accuracy": record.get("test_accuracy")}


def run_pilot(out: Path, cells: Sequence[tuple[str, str]], values: Sequence[float], seeds: Sequence[int],
              run: Callable[[str, str, float, int, Path], dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Run every ``(algorithm, scenario)`` cell at every value of ``values`` on every seed of ``seeds`` (the
    first is the bench's; ``run(algorithm, scenario, lr, seed, folder)`` runs one and returns its record),
    skipping those ``OUT/pilot.json`` already holds; returns each cell's results, by value then seed."""
    path = Path(out) / PILOT_FILE
    done: dict[str, dict[str, Any]] = {}
    if path.exists():
        try:
            done = {entry["key"]: entry for entry in json.loads(path.read_text())}
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path} is not a pilot's results ({exc}); delete it to run the pilot again") from None
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for algorithm, scenario in cells:
        for lr in values:
            for i, seed in enumerate(seeds):
                # the first seed's key and folder carry no seed: a one-seed pilot's files stay as they were
                key = f"{algorithm}|{scenario}|{lr!r}" + (f"|seed{seed}" if i else "")
                if key not in done:
                    name = f"{algorithm.replace(':', '-')}_{scenario.replace(':', '-')}_lr{lr:g}"
                    folder = Path(out) / "pilot" / (name + (f"_seed{seed}" if i else ""))
                    print(f"== pilot: {algorithm} / {scenario} / lr {lr:g}" + (f" / seed {seed}" if len(seeds) > 1 else ""),
                          flush=True)
                    done[key] = {"key": key, **pilot_entry({**run(algorithm, scenario, lr, seed, folder), "lr": lr,
                                                            "seed": seed})}
                    atomic_write_json(path, list(done.values()))
                entry = {k: v for k, v in done[key].items() if k != "key"}
                results.setdefault((algorithm, scenario), []).append(entry)
    return results


def pilot_lines(results: dict[tuple[str, str], list[dict[str, Any]]]) -> list[str]:
    """One line per cell: every value's time to target (or final accuracy), one per pilot seed, and the
    value chosen."""
    lines = []
    for (algorithm, scenario), runs in results.items():
        shown = []
        for lr, seeded in _by_value(runs).items():
            whats = []
            for r in seeded:
                tta, acc = r.get("time_to_target_s"), r.get("test_accuracy")
                whats.append(f"{tta:.1f} s" if tta is not None else ("-" if acc is None else f"{100 * acc:.2f}%"))
            shown.append(f"{lr:g}: {', '.join(whats)}")
        lines.append(f"{algorithm} / {scenario}: lr {best(runs):g} ({'; '.join(shown)})")
    return lines
