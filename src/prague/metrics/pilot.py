"""A bench's learning-rate pilot: every method at its best learning rate.

A method's speed-up can be a learning rate that suits it better than the reference, not its
synchronisation. ``prague bench --lr 0.025,0.05,0.1,0.2`` therefore first runs every (method, scenario)
cell at every value on a short budget (``--pilot-budget``, with the bench's first seed), keeps each
cell's best, then runs the full bench with it; every record carries the value it trained with (``lr``)
and its cell's pilot (``lr_pilot``), and the report says which was chosen.

The best value reaches the bench's target soonest; when none does within the pilot's budget, the one
with the highest final accuracy. The pilot's results are kept in ``OUT/pilot.json`` as they come, so a
resumed bench (``--resume``) does not run them again. This module runs nothing itself: the bench hands
it a function that runs one configuration.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from prague.errors import ConfigError
from prague.io import atomic_write_json

PILOT_FILE = "pilot.json"
DEFAULT_PILOT_BUDGET = "epochs:1"
#: The most values one ``--lr`` may list.
MAX_VALUES = 16


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


def best(results: Sequence[dict[str, Any]]) -> float:
    """The learning rate of the best pilot run: the earliest to the target, else the most accurate."""
    if not results:
        raise ValueError("a pilot needs at least one run")

    def key(r: dict[str, Any]) -> tuple[float, float, float]:
        tta = r.get("time_to_target_s")
        accuracy = r.get("test_accuracy")
        return (tta if tta is not None else math.inf, -(accuracy if accuracy is not None else -1.0), r["lr"])

    return float(min(results, key=key)["lr"])


def pilot_entry(record: dict[str, Any]) -> dict[str, Any]:
    """What the pilot keeps of one of its runs."""
    return {"lr": record.get("lr"), "time_to_target_s": record.get("time_to_target_s"),
            "test_accuracy": record.get("test_accuracy")}


def run_pilot(out: Path, cells: Sequence[tuple[str, str]], values: Sequence[float],
              run: Callable[[str, str, float, Path], dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Run every ``(algorithm, scenario)`` cell at every value of ``values`` (``run(algorithm, scenario,
    lr, folder)`` runs one and returns its record), skipping those ``OUT/pilot.json`` already holds; returns
    each cell's results, in the order of ``values``."""
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
            key = f"{algorithm}|{scenario}|{lr!r}"
            if key not in done:
                folder = Path(out) / "pilot" / f"{algorithm.replace(':', '-')}_{scenario.replace(':', '-')}_lr{lr:g}"
                print(f"== pilot: {algorithm} / {scenario} / lr {lr:g}", flush=True)
                done[key] = {"key": key, **pilot_entry({**run(algorithm, scenario, lr, folder), "lr": lr})}
                atomic_write_json(path, list(done.values()))
            entry = {k: v for k, v in done[key].items() if k != "key"}
            results.setdefault((algorithm, scenario), []).append(entry)
    return results


def pilot_lines(results: dict[tuple[str, str], list[dict[str, Any]]]) -> list[str]:
    """One line per cell: every value's time to target (or final accuracy) and the one chosen."""
    lines = []
    for (algorithm, scenario), runs in results.items():
        shown = []
        for r in runs:
            tta, acc = r.get("time_to_target_s"), r.get("test_accuracy")
            what = f"{tta:.1f} s" if tta is not None else ("-" if acc is None else f"{100 * acc:.2f}%")
            shown.append(f"{r['lr']:g}: {what}")
        lines.append(f"{algorithm} / {scenario}: lr {best(runs):g} ({'; '.join(shown)})")
    return lines
