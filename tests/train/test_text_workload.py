"""The second workload: the character-level transformer (``--model gpt``) on the standard library's text
(``--data pytext``), trained by real workers and scored on every next character."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from prague_testing import run_cli

pytestmark = pytest.mark.timeout(150)


def test_prague_trains_the_transformer_on_text_and_scores_each_next_character(tmp_path: Path) -> None:
    out = tmp_path / "gpt"
    res = run_cli("run", "--nproc", "2", "--model", "gpt", "--data", "pytext", "--steps", "4", "--batch-size", "8",
                  "--algorithm", "prague", "--lr", "0.3", "--eval-every-s", "0.5", "--report-to", "tensorboard,csv",
                  "--out", str(out), timeout_s=120)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    history = summary["eval_history"]
    assert len(history) >= 2
    # scored on 512 held-out windows of 64 characters: an accuracy of k / 32,768, a loss per character
    # that starts near ln 256 (the model's first logits are small) and falls
    for point in history:
        assert 0 <= point["accuracy"] <= 1 and abs(point["accuracy"] * 32768 - round(point["accuracy"] * 32768)) < 1e-6
    first, last = history[0]["loss"], history[-1]["loss"]
    assert abs(first - math.log(256)) < 0.5 and last < first, history
    # --report-to: each rank's steps, and rank 0's evaluation on the common clock, in CSV and TensorBoard
    rows = (out / "metrics" / "rank0.csv").read_text().splitlines()
    assert sum(",train/loss," in r for r in rows) == 4 and sum(",eval/loss," in r for r in rows) == len(history)
    assert sum(",train/loss," in r for r in (out / "metrics" / "rank1.csv").read_text().splitlines()) == 4
    assert list((out / "tensorboard" / "rank0").glob("events.out.tfevents.*"))


def test_a_model_and_data_of_different_kinds_are_refused_before_any_worker_starts(tmp_path: Path) -> None:
    res = run_cli("run", "--nproc", "2", "--model", "cnn", "--data", "pytext", "--steps", "1", "--out",
                  str(tmp_path / "x"), timeout_s=60)
    assert res.returncode == 2 and "reads images, but data set 'pytext' holds text; pass --model gpt" in res.stderr
    assert not (tmp_path / "x" / "logs").exists()
