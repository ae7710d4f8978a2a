"""The bench's learning-rate pilot: every cell at every ``--lr`` value on a short budget, the best kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prague.errors import ConfigError
from prague.metrics.pilot import MAX_PILOT_SEEDS, best, check_pilot_seeds, parse_lr_values, pilot_lines, run_pilot
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


def test_over_several_seeds_the_best_reaches_the_target_most_often_then_soonest() -> None:
    def runs(lr: float, *ttas: float | None, accuracy: float = 0.9) -> list[dict[str, object]]:
        return [{"lr": lr, "seed": seed, "time_to_target_s": t, "test_accuracy": accuracy}
                for seed, t in enumerate(ttas)]

    lucky, steady = runs(0.1, 40.0, None, accuracy=0.95), runs(0.05, 50.0, 52.0)
    assert best(lucky + steady) == 0.05  # one seed alone (40 s against 50 s) would pick 0.1
    assert best([lucky[0], steady[0]]) == 0.1
    assert best(runs(0.1, 40.0, 70.0, 71.0) + runs(0.05, 50.0, 52.0, 90.0)) == 0.05  # the median, not the best seed
    assert best(runs(0.1, None, None, accuracy=0.8) + runs(0.2, None, None, accuracy=0.85)) == 0.2
    assert best(runs(0.2, 50.0, 50.0) + runs(0.1, 50.0, 50.0)) == 0.1  # a tie: the smaller value
    assert pilot_lines({("prague", "paper:5"): lucky + steady}) == [
        "prague / paper:5: lr 0.05 (0.1: 40.0 s, 95.00%; 0.05: 50.0 s, 52.0 s)"]
    assert check_pilot_seeds(2) == 2
    for bad in (0, MAX_PILOT_SEEDS + 1):
        with pytest.raises(ConfigError, match="--pilot-seeds must be a number of seeds"):
            check_pilot_seeds(bad)


def test_the_pilot_runs_every_value_on_every_seed_once_and_keeps_the_first_seeds_files(tmp_path: Path) -> None:
    calls: list[tuple[str, float, int, str]] = []

    def run(algorithm: str, scenario: str, lr: float, seed: int, folder: Path) -> dict[str, object]:
        calls.append((algorithm, lr, seed, folder.name))
        return {"time_to_target_s": 10.0 * lr + seed, "test_accuracy": 0.9}

    cells = [("allreduce", "homogeneous"), ("prague:ready", "straggler:3:4")]
    results = run_pilot(tmp_path, cells, (0.1, 0.2), [7, 8], run)
    assert len(calls) == 8 and ("prague:ready", 0.2, 8, "prague-ready_straggler-3-4_lr0.2_seed8") in calls
    assert ("allreduce", 0.1, 7, "allreduce_homogeneous_lr0.1") in calls  # the first seed: the one-seed names
    assert [(r["lr"], r["seed"]) for r in results[cells[1]]] == [(0.1, 7), (0.1, 8), (0.2, 7), (0.2, 8)]
    keys = {entry["key"] for entry in json.loads((tmp_path / "pilot.json").read_text())}
    assert "allreduce|homogeneous|0.1" in keys and "allreduce|homogeneous|0.1|seed8" in keys
    calls.clear()
    assert run_pilot(tmp_path, cells, (0.1, 0.2), [7, 8], run) == results and not calls  # resumed: nothing again
    run_pilot(tmp_path, cells, (0.1, 0.2), [7, 8, 9], run)  # one seed more: only its runs
    assert sorted({c[2] for c in calls}) == [9] and len(calls) == 4


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
    for flags in (["--pilot-budget", "epochs:1"], ["--pilot-seeds", "2", "--lr", "0.1"]):
        bad = run_cli("bench", *flags, "--out", str(tmp_path / "x"), timeout_s=60)
        assert bad.returncode == 2 and f"{flags[0]} sets a learning-rate pilot" in bad.stderr, bad.stderr
    bad = run_cli("bench", "--pilot-seeds", "0", "--lr", "0.1,0.2", "--out", str(tmp_path / "x"), timeout_s=60)
    assert bad.returncode == 2 and "--pilot-seeds must be a number of seeds in 1.." in bad.stderr, bad.stderr
