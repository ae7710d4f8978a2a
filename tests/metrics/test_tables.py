"""`prague report FILE` for the JSON of every benchmark, not only bench.json: the docs' tables come from data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prague.cli import main
from prague.errors import ConfigError
from prague.metrics.tables import decision_table, read_decision, report_file, versus_best_figure


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


def _bench(tmp_path: Path, name: str, command: str, cells: dict[tuple[str, str], list[float | None]],
           accuracy: float = 0.985) -> Path:
    """A bench.json of runs with these times to a 98% target (None: never reached), one seed per time."""
    records = []
    for (method, scenario), times in cells.items():
        algorithm, _, variant = method.partition(":")
        for seed, t in enumerate(times):
            records.append({"algorithm": algorithm, "variant": variant or None, "scenario": scenario, "seed": seed,
                            "nproc": 8, "model": "cnn", "data": "mnist", "throughput_samples_per_s": 100.0,
                            "target_accuracy": 0.98, "time_to_target_s": t, "test_accuracy": accuracy,
                            "job_s": (t or 150.0) + 20.0})
    path = tmp_path / name
    path.write_text(json.dumps({"command": command, "records": records}))
    return path


def _decision_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()[2:]]


def test_the_decision_table_names_the_fastest_those_level_with_it_and_the_best_baseline(tmp_path: Path) -> None:
    one = _bench(tmp_path, "one.json", "prague bench --nproc 8", {
        ("allreduce", "straggler:3:4"): [100.0, 110.0, 120.0, 105.0, 115.0],
        ("allreduce:backup", "straggler:3:4"): [60.0, 62.0, 64.0, 61.0, 63.0],
        ("prague", "straggler:3:4"): [40.0, 41.0, 42.0, 43.0, 44.0],
        ("adpsgd", "straggler:3:4"): [41.0, 42.0, 43.0, 40.0, 45.0],
        ("localsgd", "homogeneous"): [30.0, 31.0, 32.0, 30.5, 31.5],
        ("prague", "homogeneous"): [50.0, 51.0, 52.0, 50.5, 51.5],
        ("allreduce", "paper:5"): [None, None, None],
        ("prague", "paper:5"): [None, None, None]})
    two = _bench(tmp_path, "two.json",
                 "prague bench --nproc 8 --hosts 4 --link-rate 300mbit --cross-traffic bursts:0.3:20",
                 {("allreduce", "homogeneous"): [90.0, 92.0], ("prague", "homogeneous"): [45.0, 47.0]})
    rows = _decision_rows(decision_table(read_decision([one, two])))
    assert rows[0][0] == "cnn on mnist to 98%, 8 workers, one machine; rank 3 4x slower throughout (`straggler:3:4`)"
    assert rows[0][1].startswith("`prague` 42 s [")
    assert rows[0][2] == "`adpsgd`"  # its times overlap prague's: level; the baselines are not
    assert rows[0][3].startswith("`prague` 1.48x [") and rows[0][3].endswith("over `allreduce:backup` (62 s [60, 64])")
    assert rows[0][4] == "98.50% / 98.50%" and rows[0][5] == "62.0 s / 82.0 s" and rows[0][6] == "5"
    # a baseline can be the fastest: the project's best method is then shown slower than it
    assert rows[1][1].startswith("`localsgd` 31 s") and rows[1][2] == "none"
    assert rows[1][3].startswith("`prague` 0.6") and "over `localsgd`" in rows[1][3]
    assert rows[2][0].endswith("random 5x slowdowns (`paper:5`)") and rows[2][1] == "none reached the target"
    late = _bench(tmp_path, "late.json", "prague bench --nproc 8", {("allreduce", "paper:5"): [None, None],
                                                                    ("prague", "paper:5"): [110.0, None]})
    assert (_decision_rows(decision_table(read_decision([late])))[0][3]
            == "`prague` reached it, no baseline did (`allreduce` never)")
    assert rows[3][0] == ("cnn on mnist to 98%, 8 workers on 4 hosts at 300mbit, cross-traffic bursts:0.3:20; "
                          "equal workers (`homogeneous`)")
    assert rows[3][3].startswith("`prague` 2.00x") and rows[3][6] == "2"


def test_the_decision_table_needs_benches_with_a_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"records": [{"algorithm": "allreduce", "scenario": "homogeneous",
                                             "throughput_samples_per_s": 1.0}]}))
    with pytest.raises(ConfigError, match="without --target-accuracy"):
        decision_table(read_decision([path]))
    assert main(["report", str(path), str(path)]) == 2
    assert "add --decide to compare several benches" in capsys.readouterr().err
    good = _bench(tmp_path, "good.json", "prague bench", {("prague", "homogeneous"): [1.0]})
    assert main(["report", "--decide", str(good), str(good)]) == 0
    assert capsys.readouterr().out == decision_table(read_decision([good, good]))


def test_a_decision_row_names_the_settings_that_tell_its_bench_from_the_others(tmp_path: Path) -> None:
    cells = {("localsgd", "homogeneous"): [50.0, 52.0]}
    base = "prague bench --algorithms localsgd --nproc 8 --compute-ms 150 --stop-at-target --out runs/h"
    h4 = _bench(tmp_path, "h4.json", f"{base}4 --sync-every-steps 4 --repeat 2", cells)
    h8 = _bench(tmp_path, "h8.json", f"{base}8 --sync-every-steps 8 --repeat 3", cells)
    plain = _bench(tmp_path, "plain.json", "prague bench --algorithms localsgd --nproc 8 --compute-ms 150", cells)
    rows = _decision_rows(decision_table(read_decision([h4, h8, plain])))
    # the folder and the seeds differ too, but every bench varies those: only the settings are named
    assert rows[0][0] == ("cnn on mnist to 98%, 8 workers, one machine; `--stop-at-target`; `--sync-every-steps 4`; "
                          "equal workers (`homogeneous`)")
    assert "; `--sync-every-steps 8`;" in rows[1][0]
    assert rows[2][0] == "cnn on mnist to 98%, 8 workers, one machine; equal workers (`homogeneous`)"
    assert _decision_rows(decision_table(read_decision([h4])))[0][0].startswith(
        "cnn on mnist to 98%, 8 workers, one machine; equal")
    # another workload's bench: its whole recipe differs; its model and data name it, not its flags
    other = _bench(tmp_path, "gpt.json", "prague bench --model gpt --data pytext --lr 0.002 --optimizer adamw", cells)
    rows = _decision_rows(decision_table(read_decision([h4, h8, other])))
    assert "; `--sync-every-steps 4`;" in rows[0][0] and "--lr" not in rows[0][0] and "--optimizer" not in rows[2][0]


def test_the_picture_of_a_workload_is_drawn_beside_the_decision_table(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Scenarios where a method never reached the target, and one where nobody did, are drawn too."""
    bench = _bench(tmp_path, "b.json", "prague bench --nproc 8", {
        ("allreduce:backup", "straggler:3:4"): [60.0, 62.0, 64.0], ("prague", "straggler:3:4"): [40.0, 41.0, 42.0],
        ("adpsgd", "straggler:3:4"): [41.0, None, 43.0], ("localsgd", "homogeneous"): [30.0, 31.0, 32.0],
        ("prague", "homogeneous"): [None, None, None], ("allreduce", "paper:5"): [None, None]})
    assert versus_best_figure(read_decision([bench])).startswith(b"\x89PNG")
    out = tmp_path / "pictures" / "mnist.png"
    out.parent.mkdir()
    assert main(["report", "--decide", str(bench), "--plot", str(out)]) == 0
    assert out.read_bytes().startswith(b"\x89PNG") and capsys.readouterr().out == decision_table(read_decision([bench]))
    assert main(["report", str(bench), "--plot", str(out)]) == 2
    assert "--plot draws the decision table's benches: add --decide" in capsys.readouterr().err


def test_the_pictures_title_holds_what_the_benches_share_and_each_label_what_differs() -> None:
    """Two benches of one scenario on different clusters get different labels; what both share is the title."""
    from prague.metrics.tables import ScenarioCells, _plot_labels

    def cells(where: str, scenario: str, settings: str = "") -> ScenarioCells:
        return ScenarioCells(where, settings, scenario, [], {})

    plain = "cnn on mnist to 98.5%, 8 workers, one machine"
    congested = "cnn on mnist to 98.5%, 8 workers on 4 hosts at 1gbit, cross-traffic bursts:0.3:20"
    title, labels = _plot_labels([cells(plain, "homogeneous"), cells(plain, "paper:5"),
                                  cells(congested, "homogeneous", "; `--group-size 2`")])
    assert title == "cnn on mnist to 98.5%"
    assert labels == ["homogeneous\n8 workers\none machine", "paper:5\n8 workers\none machine",
                      "homogeneous\n8 workers on 4 hosts at 1gbit\ncross-traffic bursts:0.3:20\n--group-size 2"]
    assert _plot_labels([cells(plain, "homogeneous"), cells(plain, "straggler:3:4")]) == (
        plain, ["homogeneous", "straggler:3:4"])
