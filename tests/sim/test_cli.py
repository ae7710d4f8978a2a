"""``prague simulate`` end to end: the files of ``prague bench``, with the runtime summary's fields."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from prague_testing import bench_records

from prague.cli import _Parser
from prague.errors import ConfigError
from prague.metrics.record import RunRecord
from prague.simulate.cli import add_simulate_parser, cmd_simulate


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = _Parser(prog="prague")
    add_simulate_parser(parser.add_subparsers(dest="command", parser_class=_Parser))
    return parser.parse_args(["simulate", *argv])


def record_keys() -> set[str]:
    """The fields of the one run record, which the runtime's summary.json also has."""
    return {f.name for f in dataclasses.fields(RunRecord)}


def test_simulate_writes_bench_files_with_runtime_fields(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim"
    args = _parse(["--algorithms", "allreduce,prague:smart,ps:async", "--scenarios", "homogeneous,paper:5",
                   "--nproc", "8", "--nodes", "2", "--model", "mlp", "--steps", "20", "--group-size", "2",
                   "--inter-gbps", "10", "--out", str(out)])
    assert cmd_simulate(args) == 0
    assert {p.name for p in out.iterdir()} >= {"bench.json", "bench.md", "throughput.png", "accuracy.png"}
    records = bench_records(out)
    assert len(records) == 6
    keys = record_keys()
    for record in records:
        assert set(record) == keys, set(record) ^ keys
        assert record["simulated"] is True
        assert record["sim"]["cluster"]["inter"]["bandwidth_gbps"] == pytest.approx(10)
        assert record["worker_samples"] == [20 * 32] * 8 and record["samples"] == 8 * 20 * 32
        assert record["job_s"] == record["wall_s"] > 0
    smart = next(r for r in records if r["variant"] == "smart")
    assert smart["algorithm_stats"][0]["group_size"] == 2 and smart["sim"]["nodes"] == 2
    md = (out / "bench.md").read_text()
    assert "(simulated)" in md and "simulate" in md
    assert "prague:smart [paper:5, simulated]" in capsys.readouterr().out


def _real_bench(folder: Path, scenarios: str) -> Path:
    """A simulated benchmark passed off as a real one (records marked not simulated)."""
    assert cmd_simulate(_parse(["--algorithms", "allreduce,prague:ready", "--scenarios", scenarios,
                                "--nproc", "4", "--model", "mlp", "--steps", "10", "--cluster", "local",
                                "--compute-ms", "300", "--out", str(folder), "--quiet"])) == 0
    records = bench_records(folder)
    for r in records:
        r["simulated"] = False
    (folder / "bench.json").write_text(json.dumps(records))
    return folder / "bench.json"


def test_calibrate_writes_report_and_a_reusable_cluster(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = _real_bench(tmp_path / "bench", "homogeneous,straggler:1:2")
    out = tmp_path / "cal"
    assert cmd_simulate(_parse(["--calibrate", str(bench), "--out", str(out)])) == 0
    report = json.loads((out / "calibration.json").read_text())
    methods = ["allreduce", "prague:ready"] * 2
    assert [row["method"] for row in report["in_sample"]["rows"]] == methods
    assert [row["method"] for row in report["out_of_sample"]["rows"]] == methods
    assert report["out_of_sample"]["how"].startswith("leave-one-scenario-out") and report["check"] is None
    row = report["out_of_sample"]["rows"][0]
    assert row["fitted_on"] == "scenarios straggler:1:2" and row["scenario"] == "homogeneous"
    assert row["error"] == pytest.approx(row["predicted"] / row["measured"] - 1)
    printed = capsys.readouterr().out
    assert "In-sample" in printed and "Out-of-sample" in printed
    assert "Out-of-sample" in (out / "calibration.md").read_text()
    again = tmp_path / "again"
    assert cmd_simulate(_parse(["--algorithms", "prague:ready", "--scenarios", "homogeneous", "--nproc", "4",
                                "--model", "mlp", "--steps", "10", "--cluster", str(out / "cluster.toml"),
                                "--out", str(again), "--quiet"])) == 0


def test_calibrate_checks_against_a_second_benchmark(tmp_path: Path) -> None:
    fit_on = _real_bench(tmp_path / "fit", "homogeneous")
    other = _real_bench(tmp_path / "other", "straggler:1:2")
    with pytest.raises(ConfigError, match="--check OTHER/bench.json"):  # one scenario: nothing to hold out
        cmd_simulate(_parse(["--calibrate", str(fit_on), "--out", str(tmp_path / "no")]))
    with pytest.raises(ConfigError, match="add --calibrate"):
        cmd_simulate(_parse(["--check", str(other), "--out", str(tmp_path / "no")]))
    out = tmp_path / "cal"
    assert cmd_simulate(_parse(["--calibrate", str(fit_on), "--check", str(other), "--out", str(out)])) == 0
    report = json.loads((out / "calibration.json").read_text())
    assert report["check"] == str(other) and report["out_of_sample"]["runs"] == 2
    assert {row["scenario"] for row in report["out_of_sample"]["rows"]} == {"straggler:1:2"}
    assert {row["scenario"] for row in report["in_sample"]["rows"]} == {"homogeneous"}


def test_removed_allreduce_exposed_says_what_replaced_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--backward-share"):
        cmd_simulate(_parse(["--allreduce-exposed", "0.5", "--out", str(tmp_path)]))
    with pytest.raises(ConfigError, match="--backward-share .* between 0 and 1, got 1.5"):
        cmd_simulate(_parse(["--backward-share", "1.5", "--out", str(tmp_path)]))


def test_bad_input_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="valid choices"):
        cmd_simulate(_parse(["--algorithms", "allreduce,nope", "--out", str(tmp_path)]))
    with pytest.raises(ConfigError, match="neither a preset"):
        cmd_simulate(_parse(["--cluster", "missing.toml", "--out", str(tmp_path)]))


def test_real_math_reads_the_data_set_from_data_dir(tmp_path: Path, mnist_dir: Path) -> None:
    """--math real --data mnist trains on the files in --data-dir (the data set a bench would use)."""
    out = tmp_path / "sim"
    assert cmd_simulate(_parse(["--algorithms", "prague", "--scenarios", "homogeneous", "--nproc", "4", "--math",
                                "real", "--model", "mlp",
                                "--data", "mnist", "--data-dir", str(mnist_dir), "--budget", "samples:2560",
                                "--out", str(out), "--quiet"])) == 0
    (record,) = bench_records(out)
    assert record["data"] == "mnist" and record["samples"] == 2560 and record["test_accuracy"] > 0.5
