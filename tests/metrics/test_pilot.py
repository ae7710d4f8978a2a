"""The bench's learning-rate pilot: every cell at every ``--lr`` value on a short budget, the best kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prague.errors import ConfigError
from prague.metrics.pilot import best, parse_lr_values, pilot_lines
from prague_testing import bench_records, run_cli

pytestmark = pytest.mark.timeout(240)


def test_values_parse_and_bad_ones_name_the_form() -> None:
    assert parse_lr_values("0.05") == (0.05,)
    assert parse_lr_values(" 0.025, 0.05,0.1 ") == (0.025, 0.05, 0.1)
    for bad, match in (("fast", "comma-separated"), ("0.1,-1", "finite number > 0"), ("0.1,0.1", "once"),
                       ("0.1,inf", "finite")):
        with pytest.raises(ConfigError, match=match):
            parse_lr_values(bad)


def test_the_best_reaches_the_target_soonest_else_is_most_accurate() -> None:
    runs = [{"lr": 0.01, "time_to_target_s": None, "test_accuracy": 0.7},
            {"lr": 0.1, "time_to_target_s": 9.0, "test_accuracy": 0.9},
            {"lr": 0.2, "time_to_target_s": 5.0, "test_accuracy": 0.85}]
    assert best(runs) == 0.2
    assert best([{**r, "time_to_target_s": None} for r in runs]) == 0.1
    assert best([{"lr": 0.3, "time_to_target_s": None, "test_accuracy": None}, runs[0]]) == 0.01  # a failed run
    assert pilot_lines({("allreduce", "homogeneous"): runs}) == [
        "allreduce / homogeneous: lr 0.2 (0.01: 70.00%; 0.1: 9.0 s; 0.2: 5.0 s)"]


@pytest.mark.slow
def test_a_bench_runs_the_pilot_once_and_every_cell_at_its_best(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    argv = ["bench", "--algorithms", "allreduce,localsgd", "--scenarios", "homogeneous", "--nproc", "2", "--model",
            "mlp", "--data", "digits", "--budget", "epochs:1", "--pilot-budget", "epochs:0.5", "--lr", "0.001,0.2",
            "--target-accuracy", "0.5", "--compute", "paced", "--compute-ms", "10", "--out", str(out), "--quiet"]
    res = run_cli(*argv, timeout_s=180)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "learning rates chosen by the pilot:" in res.stdout and res.stdout.count("== pilot:") == 4
    records = bench_records(out)
    assert [r["lr"] for r in records] == [0.2, 0.2]  # lr 0.001 barely moves in half an epoch
    for r in records:
        assert [p["lr"] for p in r["lr_pilot"]] == [0.001, 0.2]
    pilot = json.loads((out / "pilot.json").read_text())
    assert len(pilot) == 4
    assert "Learning rate per cell, chosen by the pilot" in (out / "bench.md").read_text()
    res = run_cli(*argv, "--resume", timeout_s=120)  # nothing left: neither the pilot nor the runs again
    assert res.returncode == 0 and "== pilot:" not in res.stdout, res.stdout
    bad = run_cli("bench", "--pilot-budget", "epochs:1", "--out", str(tmp_path / "x"), timeout_s=60)
    assert bad.returncode == 2 and "--pilot-budget is the budget of a learning-rate pilot" in bad.stderr
