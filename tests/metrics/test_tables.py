"""`prague report FILE` for the JSON of every benchmark, not only bench.json: the docs' tables come from data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prague.cli import main
from prague.errors import ConfigError
from prague.metrics.tables import report_file


def _write(tmp_path: Path, document: dict) -> Path:
    path = tmp_path / "b.json"
    path.write_text(json.dumps(document))
    return path


def test_the_fault_matrix_has_a_row_per_case_and_counts_the_cases_as_expected(tmp_path: Path) -> None:
    path = _write(tmp_path, {"benchmark": "torchrun_faults", "nodes": 2, "per_node": 2, "steps": 60,
                             "command": "python benchmarks/torchrun_faults.py", "cases": [
        {"method": "prague:ready", "fault": "crash:2:20", "ok": True, "exit_codes": [0, 0], "seconds": 7.84,
         "failures": [{"rank": 2, "step": 20, "kind": "crash"}], "completed_steps": [60, 60, 20, 60], "restarts": None},
        {"method": "allreduce", "fault": "crash:2:20", "ok": False, "exit_codes": [1, 0], "seconds": 17.7,
         "failures": [], "completed_steps": [60, 60, 60, 60], "restarts": 1}]})
    text = report_file(path)
    assert "```\npython benchmarks/torchrun_faults.py\n```" in text
    assert "| prague:ready | crash:2:20 | yes | 0 / 0 | rank 2 (crash) at step 20 | [60, 60, 20, 60] | 0 | 7.8 |" in text
    assert "| allreduce | crash:2:20 | NO | 1 / 0 | none | [60, 60, 60, 60] | 1 | 17.7 |" in text
    assert text.endswith("1 of 2 cases as expected.\n")


def test_the_group_generator_tables_measured_and_simulated(tmp_path: Path) -> None:
    measured = _write(tmp_path, {"benchmark": "group_generator", "generator": "ready", "host": "127.0.0.1", "cpus": 2,
                                 "client_procs": 4, "seconds": 4.0, "results": [
        {"api": "stream", "shards": 4, "clients": 256, "mode": "paced 100 ms", "requests_per_s": 2554.4,
         "p50_ms": 1.171, "p99_ms": 5.539, "server_cpu_us_per_request": 283.2}]})
    assert "| stream | 4 | 256 | paced 100 ms | 2,554 | 1.17 | 5.54 | 283 us |" in report_file(measured)
    simulated = _write(tmp_path, {"benchmark": "group_generator", "simulated": [
        {"workers": 16384, "shards": 64, "p50_ms": 2.79, "p99_ms": 17.56, "busiest_shard": 0.43,
         "local_step_share": 0.013}]})
    assert report_file(simulated).splitlines()[-1] == "| 16,384 | 64 | 2.79 | 17.56 | 43% | 1.3% |"


def test_the_failure_table_puts_each_method_beside_the_others(tmp_path: Path) -> None:
    rows = [{"workers": 1024, "rate_per_hour": rate, "method": m, "job_s": t, "failures": f, "restarts": r}
            for rate, m, t, f, r in [(2e-5, "prague", 61.2, 0, 0), (2e-5, "allreduce", 357.49, 0, 0),
                                     (0.1, "prague", 61.2, 3, 0), (0.1, "allreduce", 2525.9, 84, 84)]]
    text = report_file(_write(tmp_path, {"benchmark": "simulator", "failures": rows}))
    assert "| 1,024 | 2e-5 | 0 | 61.2 | 0 | 357.5 |" in text
    assert "| 1,024 | 0.1 | 3 | 61.2 | 84 (84) | 2,525.9 |" in text


def test_a_benchmark_of_no_known_kind_is_refused_naming_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'preduce' benchmark.*group_generator, simulator, torchrun_faults"):
        report_file(_write(tmp_path, {"benchmark": "preduce"}))
    with pytest.raises(ConfigError, match="do not exist"):
        report_file(tmp_path / "missing.json")


def test_prague_report_prints_a_benchmarks_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = Path(__file__).resolve().parents[2] / "docs" / "bench" / "gg-sim-curve.json"
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| workers | shards |") and out == report_file(path)
