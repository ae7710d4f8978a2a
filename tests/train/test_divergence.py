"""Divergence: the rule (pure), the job-wide report through a store, and real runs that blow up stopping
with one line, ``diverged`` in the summary, and a bench that goes on after such a cell."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from prague_testing import bench_records, run_cli
from prague.errors import EXIT_DIVERGED, ConfigError
from prague.metrics.report import bench_table, cells
from prague.train.divergence import REFERENCE_STEPS, DivergenceFlag, LossWatch, divergence_line


def _feed(watch: LossWatch, losses: list[float]) -> tuple[int, object] | None:
    for step, loss in enumerate(losses):
        found = watch.observe(step, loss)
        if found is not None:
            return step, found
    return None


def test_a_non_finite_loss_diverges_at_once_naming_the_last_finite_one() -> None:
    for bad in (math.nan, math.inf, -math.inf):
        watch = LossWatch(3)
        hit = _feed(watch, [2.3, 2.1, 1.9, bad, 1.0])
        assert hit is not None and hit[0] == 3
        d = hit[1]
        assert d.rank == 3 and d.step == 3 and d.loss is None and d.last_finite_loss == 1.9  # type: ignore[attr-defined]
    assert _feed(LossWatch(0), [math.nan]) is not None  # before any starting loss too


def test_a_loss_above_the_factor_for_the_window_diverges_and_a_shorter_excursion_does_not() -> None:
    start = [2.3] * REFERENCE_STEPS  # starting loss 2.3: the line is 4 x 2.3 = 9.2
    watch = LossWatch(1, factor=4.0, window=5)
    assert _feed(watch, start + [10.0] * 4 + [1.0] + [10.0] * 4) is None  # never 5 in a row
    hit = _feed(LossWatch(1, factor=4.0, window=5), start + [10.0] * 4 + [11.0, 12.0])
    assert hit is not None and hit[0] == REFERENCE_STEPS + 4
    d = hit[1]
    assert d.loss == 11.0 and d.last_finite_loss == 10.0 and "4x" in d.reason  # type: ignore[attr-defined]
    assert _feed(LossWatch(1, factor=0.0, window=1), start + [1e6] * 50) is None  # factor 0: off
    assert _feed(LossWatch(1, factor=4.0, window=1), start + [9.2]) is None  # at the line is not above it


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.01, 9.0), min_size=1, max_size=200), st.floats(0.5, 3.0))
def test_a_loss_that_never_leaves_its_range_never_diverges(losses: list[float], start: float) -> None:
    """A rank whose loss stays within 4x of where it started (the default) is never stopped."""
    head = [start] * REFERENCE_STEPS
    assert _feed(LossWatch(0), head + [min(v, 3.9 * start) for v in losses]) is None


def test_bad_rules_are_refused_naming_the_flag() -> None:
    with pytest.raises(ConfigError, match="--divergence-factor"):
        LossWatch(0, factor=0.5)
    with pytest.raises(ConfigError, match="--divergence-factor"):
        LossWatch(0, factor=math.inf)
    with pytest.raises(ConfigError, match="--divergence-window"):
        LossWatch(0, window=0)


def test_the_first_report_stands_for_every_rank() -> None:
    store = dist.HashStore()
    a, b = DivergenceFlag(store), DivergenceFlag(store)
    assert not a.seen() and a.read() is None and not a.reported
    first = _feed(LossWatch(2), [1.0, math.nan])[1]  # type: ignore[index]
    second = _feed(LossWatch(5), [1.0, 2.0, math.nan])[1]  # type: ignore[index]
    assert a.report(first) == first  # type: ignore[arg-type]
    assert b.report(second) == first  # type: ignore[arg-type]
    assert b.seen() and DivergenceFlag(store).seen() and DivergenceFlag(store).read() == first
    line = divergence_line("eager-sgd:solo", first.as_dict())  # type: ignore[attr-defined]
    assert "eager-sgd:solo diverged on rank 2 at step 1" in line and "last finite loss 1" in line


def test_cells_count_a_diverged_seed_as_never_reaching_the_target() -> None:
    base = {"algorithm": "lossy", "scenario": "homogeneous", "throughput_samples_per_s": 100.0,
            "target_accuracy": 0.9, "test_accuracy": 0.1}
    records = [{**base, "seed": 0, "time_to_target_s": 5.0, "diverged": {"rank": 0, "step": 40, "loss": None,
                                                                          "last_finite_loss": 3.0, "reason": "x"}},
               {**base, "seed": 1, "time_to_target_s": 6.0, "diverged": None},
               {**base, "algorithm": "allreduce", "seed": 0, "time_to_target_s": 12.0}]
    lossy = [c for c in cells(records) if c["method"] == "lossy"][0]
    assert lossy["diverged"] == 1 and lossy["reached"] == 1 and lossy["time_to_target_s"]["max"] == math.inf
    table = bench_table(records)
    assert "1/2 DIVERGED" in table and "lossy (DIVERGED at step 40)" in table


BLOW_UP = ["--nproc", "2", "--steps", "40", "--lr", "1000", "--momentum", "0.9", "--data", "digits", "--model", "mlp",
           "--quiet"]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("algorithm", ["allreduce", "prague"])
def test_a_run_that_blows_up_stops_with_one_line_and_diverged_in_its_summary(tmp_path: Path, algorithm: str) -> None:
    """A gradient method (lockstep: every rank stops on one agreed step) and an averaging method, at a
    learning rate that blows the loss up: exit 3, one line naming method, rank, step and last finite loss,
    and ``diverged`` in summary.json, well before the 40 steps."""
    out = tmp_path / "run"
    res = run_cli("run", "--algorithm", algorithm, *BLOW_UP, "--out", str(out), timeout_s=180)
    assert res.returncode == EXIT_DIVERGED, res.stderr
    lines = [line for line in res.stderr.splitlines() if "diverged on rank" in line]
    assert len(lines) == 1, res.stderr
    s = json.loads((out / "summary.json").read_text())
    d = s["diverged"]
    assert f"{algorithm}" in lines[0] and f"rank {d['rank']} at step {d['step']}" in lines[0]
    assert "last finite loss" in lines[0]
    steps = s["completed_steps"]
    assert d["step"] < 39 and steps[d["rank"]] >= d["step"] + 1
    if algorithm == "allreduce":  # lockstep: every rank stops on the step the stop agreement set
        assert len(set(steps)) == 1 and steps[0] < 40
    else:  # the reporting rank stops right after; a faster one may have run all its steps before the report
        assert steps[d["rank"]] == d["step"] + 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_bench_marks_a_diverged_cell_and_goes_on(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    res = run_cli("bench", "--algorithms", "allreduce,adpsgd", "--scenarios", "homogeneous", *BLOW_UP[:-1],
                  "--target-accuracy", "0.5", "--out", str(out), "--quiet", timeout_s=280)
    assert res.returncode == 0, res.stderr
    records = bench_records(out)
    assert [r["algorithm"] for r in records] == ["allreduce", "adpsgd"]
    assert all(r["diverged"] for r in records)
    md = (out / "bench.md").read_text()
    assert "DIVERGED" in md and md.count("diverged on rank") == 0  # the table says it; the line goes to stderr
    assert res.stderr.count("diverged on rank") == 2
