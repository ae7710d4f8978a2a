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
                  "--algorithm", "prague", "--optimizer", "adamw", "--lr", "0.002", "--eval-every-s", "0.5",
                  "--report-to", "tensorboard,csv", "--out", str(out), timeout_s=120)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["optimizer"] == "adamw" and summary["lr"] == 0.002
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


def test_the_bench_header_names_how_long_an_all_reduce_takes_against_the_backward_part(tmp_path: Path) -> None:
    from prague.cli import link_ratio_line
    from prague.train.config import RunConfig

    def line(rate: str, pace_ms: float = 300.0, hosts: int | None = 4) -> str | None:
        cfg = RunConfig(algorithm="allreduce", nproc=8, out=tmp_path, model="gpt", data="pytext", compute="paced",
                        compute_ms=pace_ms, hosts=hosts, link_rate=rate if hosts else None)
        return link_ratio_line(cfg, pace_ms)

    slow, fast = line("100mbit"), line("200mbit")
    assert slow is not None and fast is not None
    # 1.88 MB of gradients, a ring over 8 workers: 2 x 7/8 of it over each link; the backward part is 2/3 of 300 ms
    assert "1.88 MB" in slow and "about 263 ms, 1.32x the backward part of a step (200 ms)" in slow, slow
    assert "0.66x" in fast
    assert line("100mbit", hosts=None) is None  # no emulated links, nothing to say


def test_the_optimizer_is_sgd_or_adamw_and_the_methods_that_apply_sgd_themselves_refuse_adamw(tmp_path: Path) -> None:
    import torch

    from prague.errors import ConfigError
    from prague.train.config import RunConfig
    from prague.workload.models import build_optimizer

    model = torch.nn.Linear(3, 2)
    adamw = build_optimizer("adamw", model, lr=0.002, momentum=0.9)
    assert isinstance(adamw, torch.optim.AdamW) and adamw.defaults["lr"] == 0.002
    sgd = build_optimizer("sgd", model, lr=0.1, momentum=0.5)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.5
    with pytest.raises(ConfigError, match="unknown optimizer 'adam'; valid choices: adamw, sgd"):
        build_optimizer("adam", model, lr=0.1, momentum=0.0)
    for method in ("ps", "ps-eager:none"):  # their servers apply SGD's rule
        with pytest.raises(ConfigError, match="applies SGD's update rule on its servers; use --optimizer sgd"):
            RunConfig(algorithm=method, nproc=2, out=tmp_path, optimizer="adamw")
    assert RunConfig(algorithm="diloco", nproc=2, out=tmp_path, optimizer="adamw").optimizer == "adamw"
    with pytest.raises(ConfigError, match="unknown --optimizer 'rmsprop'; valid choices: adamw, sgd"):
        RunConfig(algorithm="allreduce", nproc=2, out=tmp_path, optimizer="rmsprop")
    res = run_cli("simulate", "--algorithms", "allreduce", "--nproc", "2", "--steps", "2", "--optimizer", "adamw",
                  "--out", str(tmp_path / "sim"), timeout_s=60)
    assert res.returncode == 2 and "the simulator's arithmetic applies SGD's rule" in res.stderr, res.stderr
