"""A job-wide budget and paced compute in real runs (``prague run``, real worker processes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from prague_testing import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PACED = ["--compute", "paced", "--compute-ms", "15", "--data", "digits", "--model", "mlp", "--quiet"]
DIGITS_BATCHES = 1437 // 32  # the digits training split in batches of 32


def _summary(out: Path) -> dict[str, Any]:
    return json.loads((out / "summary.json").read_text())


def _records(out: Path, rank: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()]


def test_an_epoch_budget_uses_every_batch_once_and_fast_workers_take_more(tmp_path: Path) -> None:
    """``prague`` (ready) with one worker 4x slower, one epoch for the job: the ranks' batches together are
    every batch of the epoch exactly once; the slow rank took fewer; every step is paced."""
    out = tmp_path / "run"
    res = run_cli("run", "--algorithm", "prague", "--nproc", "3", "--budget", "epochs:1", "--slowdown",
                  "straggler:2:4", *PACED, "--out", str(out), timeout_s=180)
    assert res.returncode == 0, res.stderr
    s = _summary(out)
    batches = [r["batch"] for rank in range(3) for r in _records(out, rank)]
    assert sorted(batches) == list(range(DIGITS_BATCHES))
    assert s["budget"] == "epochs:1" and s["shares"] == "claimed"
    assert s["samples"] == DIGITS_BATCHES * 32 == sum(s["worker_samples"])
    assert s["worker_samples"][2] < min(s["worker_samples"][:2])
    assert s["job_s"] >= s["completed_steps"][2] * 4 * 0.015  # the slow rank's paced steps at the least
    for rank in range(3):
        for r in _records(out, rank):
            assert r["compute_s"] >= 0.015 * r["slowdown"] * 0.999  # padded to the pace times the slowdown


def test_a_time_budget_stops_a_lockstep_method_on_one_step(tmp_path: Path) -> None:
    """``allreduce`` needs every rank in every step: equal shares, dealt round robin, and under a time
    budget every rank stops after the same step once the clock has passed it."""
    out = tmp_path / "run"
    res = run_cli("run", "--algorithm", "allreduce", "--nproc", "3", "--budget", "seconds:1.5", *PACED,
                  "--out", str(out), timeout_s=180)
    assert res.returncode == 0, res.stderr
    s = _summary(out)
    steps = s["completed_steps"]
    assert s["shares"] == "equal" and len(set(steps)) == 1 and steps[0] > 5
    assert s["job_s"] >= 1.5
    for rank in range(3):
        assert [r["batch"] for r in _records(out, rank)] == list(range(rank, 3 * steps[0], 3))


def test_a_pace_the_machine_cannot_hold_is_refused_naming_the_measured_time(tmp_path: Path) -> None:
    res = run_cli("run", "--nproc", "2", "--steps", "80", "--compute", "paced", "--compute-ms", "0.001",
                  "--data", "digits", "--model", "cnn", "--quiet", "--out", str(tmp_path / "run"), timeout_s=120)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "--compute paced" in lines[0] and "ms of compute (median of its last 20 steps" in lines[0]
    assert "raise --compute-ms" in lines[0]


def test_emulated_compute_takes_a_budget_without_data(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = run_cli("run", "--algorithm", "adpsgd", "--nproc", "2", "--budget", "samples:640", "--compute",
                  "emulated", "--compute-ms", "5", "--data", "synthetic", "--model", "mlp", "--quiet",
                  "--out", str(out), timeout_s=120)
    assert res.returncode == 0, res.stderr
    s = _summary(out)
    assert s["samples"] == 640 and s["test_accuracy"] is None and s["eval_history"] == []


@pytest.mark.parametrize("algorithm", ["allreduce", "prague"])
def test_stop_at_target_stops_every_worker_soon_after_the_target(tmp_path: Path, algorithm: str) -> None:
    """The evaluator beside the workers finds the target reached and every worker stops long before its
    500 steps: on one agreed step for a lockstep method (allreduce), each on its own otherwise."""
    out = tmp_path / "run"
    res = run_cli("run", "--algorithm", algorithm, "--nproc", "3", "--steps", "500", *PACED, "--target-accuracy",
                  "0.8", "--stop-at-target", "--eval-every-s", "0.25", "--out", str(out), timeout_s=180)
    assert res.returncode == 0, res.stderr
    s = _summary(out)
    assert (out / "eval" / "STOP").read_text().startswith("point ")
    assert max(s["completed_steps"]) < 500 and s["time_to_target_s"] is not None
    # the evaluator's point is scored too: the reported time is never after the point that stopped the job
    from prague.train.evaluator import stop_point

    stopped = stop_point(out)
    assert stopped is not None and s["time_to_target_s"] <= stopped * 0.25 + 1e-9
    assert s["test_accuracy"] >= 0.75  # the model kept training while the point was scored
    if algorithm == "allreduce":
        assert len(set(s["completed_steps"])) == 1


def test_stop_at_target_needs_a_target() -> None:
    from prague.errors import ConfigError
    from prague.train.config import RunConfig

    with pytest.raises(ConfigError, match="--stop-at-target"):
        RunConfig(stop_at_target=True)
    with pytest.raises(ConfigError, match="--stop-at-target"):
        RunConfig(stop_at_target=True, target_accuracy=0.9, compute="emulated")


def test_real_compute_slowdowns_multiply_one_nominal_time_measured_by_the_launcher(tmp_path: Path) -> None:
    """Under --compute real without --compute-ms the launcher measures one step once: every worker's
    injected slowdown sleeps (factor - 1) times that, not its own running average."""
    out = tmp_path / "run"
    res = run_cli("run", "--nproc", "2", "--steps", "6", "--slowdown", "straggler:1:3", "--data", "digits",
                  "--model", "mlp", "--quiet", "--out", str(out), timeout_s=120)
    assert res.returncode == 0, res.stderr
    nominal_ms = _summary(out)["compute_ms"]
    assert nominal_ms is not None and nominal_ms > 0 and f"nominal compute {nominal_ms:g} ms" in res.stdout
    assert all(r["compute_s"] >= 2 * nominal_ms / 1e3 for r in _records(out, 1))
