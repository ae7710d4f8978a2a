"""Calibration recovers a cluster from benchmark records and compares throughput method by method, on the
records it was fitted on (in-sample) and on records it did not see (out-of-sample)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prague.errors import ConfigError
from prague.simulate.calibrate import calibrate, calibration_report, calibration_table
from prague.sim.cluster import Cluster, Link
from prague.simulate.run import SimConfig, simulate

# Emulated compute (what these stand-in records claim): no backward for the all-reduce to hide behind.
TRUTH = Cluster(name="truth", compute_s=0.2, compute_overhead_s=0.02, compute_cv=0.02, compute_dist="normal",
                intra=Link(80e-6, 6e8), inter=Link(80e-6, 6e8), backward_share=0.0, allreduce_ring_factor=2.0,
                gg_rtt_s=3e-3, server=Link(80e-6, 9e8))


def write_bench(folder: Path, scenarios: tuple[str, ...], algorithms: tuple[str, ...], compute_s: float = 0.2,
                nproc: int = 8) -> Path:
    """Records simulated on ``TRUTH`` stand in for a real benchmark (marked not simulated)."""
    records = []
    for scenario in scenarios:
        for algorithm in algorithms:
            # The GG's round trip shows only where it blocks the worker: smart without overlap, on the paper's
            # step rule, whose groups do not follow the step times a fit moves (the time rule's do).
            options = {"overlap": "off", "threshold": "steps"} if algorithm == "prague:smart" else {}
            r = simulate(SimConfig.of(algorithm=algorithm, scenario=scenario, nproc=nproc, steps=12, batch_size=32,
                                   model="resnet18", data="digits", cluster=TRUTH, compute_ms=compute_s * 1e3,
                                   warmup_steps=2, options=options)).to_dict()
            r["simulated"] = False
            r.pop("sim")
            records.append(r)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "bench.json").write_text(json.dumps(records))
    return folder / "bench.json"


def test_calibration_recovers_a_known_cluster(tmp_path: Path) -> None:
    bench = write_bench(tmp_path, ("homogeneous", "paper:5"),
                        ("allreduce", "prague:smart", "prague:ready", "dssync", "ps:sync"))
    cal = calibrate(bench)
    assert len(cal.rows) == 10
    assert all(abs(row["error"]) < 0.15 for row in cal.rows), calibration_table(cal)
    assert abs(cal.cluster.intra.bandwidth_bytes_per_s / 6e8 - 1) < 0.15
    assert abs(cal.cluster.gg_rtt_s + cal.cluster.gg_service_s - 3e-3) < 3e-4
    assert cal.cluster.backward_share == 0.0 and abs(cal.cluster.allreduce_ring_factor / 2.0 - 1) < 0.15
    table = calibration_table(cal)
    assert "| prague:ready | paper:5 |" in table and "measured (samples/s)" in table
    # Leave-one-scenario-out: every record predicted once, by the fit on the other scenario.
    assert [(r["method"], r["scenario"]) for r in cal.held_out] == [(r["method"], r["scenario"]) for r in cal.rows]
    assert {r["fitted_on"] for r in cal.held_out if r["scenario"] == "paper:5"} == {"scenarios homogeneous"}
    assert set(cal.held_out_clusters) == {"scenarios homogeneous", "scenarios paper:5"}
    # The stand-in records come from the model itself: fitted on one scenario, it predicts the other well too.
    assert all(abs(r["error"]) < 0.15 for r in cal.held_out), table
    assert "Out-of-sample (leave-one-scenario-out" in table
    assert "| prague:smart | homogeneous | scenarios paper:5 |" in table
    report = calibration_report(cal, bench, None)
    assert len(report["in_sample"]["rows"]) == len(report["out_of_sample"]["rows"]) == 10
    assert 0 < report["in_sample"]["mean_abs_error"] <= report["in_sample"]["max_abs_error"] < 0.15
    assert "record" not in report["out_of_sample"]["rows"][0]
    json.dumps(report)  # plain JSON values


def test_check_predicts_another_benchmark(tmp_path: Path) -> None:
    """Fitted at 200 ms on one scenario, checked on another scenario at 100 ms: every check record is
    predicted at its own compute time, by the one fitted cluster."""
    methods = ("allreduce", "prague:ready")
    fit_on = write_bench(tmp_path / "fit", ("homogeneous",), methods)
    other = write_bench(tmp_path / "other", ("straggler:3:3",), methods, compute_s=0.1)
    cal = calibrate(fit_on, check=other)
    assert [(r["method"], r["scenario"]) for r in cal.held_out] == [(m, "straggler:3:3") for m in methods]
    assert {r["fitted_on"] for r in cal.held_out} == {str(fit_on)} and set(cal.held_out_clusters) == {str(fit_on)}
    assert all(abs(r["error"]) < 0.15 for r in cal.held_out), calibration_table(cal)
    assert "checked against" in cal.held_out_how
    report = calibration_report(cal, fit_on, other)
    assert report["check"] == str(other) and report["out_of_sample"]["runs"] == 2


def test_bad_input_says_what_to_pass(tmp_path: Path) -> None:
    one = write_bench(tmp_path / "one", ("homogeneous",), ("allreduce",), nproc=2)
    with pytest.raises(ConfigError, match=r"holds one scenario \(homogeneous\).*--check OTHER/bench.json"):
        calibrate(one)
    with pytest.raises(ConfigError, match="--calibrate: .* do not exist"):
        calibrate(tmp_path / "missing" / "bench.json")
    with pytest.raises(ConfigError, match="--check: .* do not exist"):
        calibrate(one, check=tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="is the benchmark --calibrate fits"):
        calibrate(one, check=one.parent)
    simulated = json.loads(one.read_text())
    for r in simulated:
        r["simulated"] = True
    (tmp_path / "sim.json").write_text(json.dumps(simulated))
    with pytest.raises(ConfigError, match="--check .* holds only simulated records"):
        calibrate(one, check=tmp_path / "sim.json")
