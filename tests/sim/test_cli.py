"""``prague simulate`` end to end: the files of ``prague bench``, with the runtime summary's fields."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

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
    records = json.loads((out / "bench.json").read_text())
    assert len(records) == 6
    keys = record_keys()
    for record in records:
        assert set(record) == keys, set(record) ^ keys
        assert record["simulated"] is True
        assert record["sim"]["cluster"]["inter"]["bandwidth_gbps"] == pytest.approx(10)
    smart = next(r for r in records if r["variant"] == "smart")
    assert smart["algorithm_stats"][0]["group_size"] == 2 and smart["sim"]["nodes"] == 2
    md = (out / "bench.md").read_text()
    assert "(simulated)" in md and "simulate" in md
    assert "prague:smart [paper:5, simulated]" in capsys.readouterr().out


def test_calibrate_writes_report_and_a_reusable_cluster(tmp_path: Path) -> None:
    bench = tmp_path / "bench"
    assert cmd_simulate(_parse(["--algorithms", "allreduce,prague:ready", "--scenarios", "homogeneous",
                                "--nproc", "4", "--model", "mlp", "--steps", "10", "--cluster", "local",
                                "--compute-ms", "300", "--out", str(bench), "--quiet"])) == 0
    records = json.loads((bench / "bench.json").read_text())
    for r in records:
        r["simulated"] = False
    (bench / "bench.json").write_text(json.dumps(records))
    out = tmp_path / "cal"
    assert cmd_simulate(_parse(["--calibrate", str(bench / "bench.json"), "--out", str(out)])) == 0
    report = json.loads((out / "calibration.json").read_text())
    assert [row["method"] for row in report["rows"]] == ["allreduce", "prague:ready"]
    again = tmp_path / "again"
    assert cmd_simulate(_parse(["--algorithms", "prague:ready", "--scenarios", "homogeneous", "--nproc", "4",
                                "--model", "mlp", "--steps", "10", "--cluster", str(out / "cluster.toml"),
                                "--out", str(again), "--quiet"])) == 0


def test_bad_input_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="valid choices"):
        cmd_simulate(_parse(["--algorithms", "allreduce,nope", "--out", str(tmp_path)]))
    with pytest.raises(ConfigError, match="neither a preset"):
        cmd_simulate(_parse(["--cluster", "missing.toml", "--out", str(tmp_path)]))
