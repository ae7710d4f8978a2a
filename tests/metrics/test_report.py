"""Tests for prague.metrics.report: the benchmark table, the report files and reading them back."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from matplotlib.patches import Rectangle

from prague.errors import ConfigError
from prague.metrics import report
from prague.metrics.record import SCHEMA_VERSION, RunRecord, host_facts
from prague.metrics.report import bench_table, load_records, method_label, write_bench

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
INF = float("inf")


def run(
    algorithm: str,
    scenario: str,
    throughput: float,
    *,
    variant: str | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """A complete run summary with sensible defaults; ``overrides`` replace any field."""
    record: dict[str, Any] = {
        "algorithm": algorithm,
        "variant": variant,
        "nproc": 4,
        "compute_mode": "emulated",
        "compute_ms": 50.0,
        "scenario": scenario,
        "model": "mlp",
        "data": "synthetic",
        "batch_size": 32,
        "steps": 100,
        "seed": 0,
        "throughput_samples_per_s": throughput,
        "no_wait_limit_samples_per_s": 2560.0,
        "fraction_of_limit": throughput / 2560.0,
        "wall_s": 10.0,
        "test_accuracy": None,
        "target_accuracy": None,
        "time_to_target_s": None,
        "eval_history": [],
        "consensus_distance": None,
        "simulated": False,
    }
    record.update(overrides)
    return record


def rows(table: str, which: int = 1) -> dict[tuple[str, str], dict[str, str]]:
    """Parse one of the markdown tables' bodies into {(method, scenario): {column: cell}}: ``which`` 0 is
    the time-to-accuracy table, 1 the throughput table."""
    blocks: list[list[str]] = []
    for line in table.splitlines():
        if line.startswith("|"):
            if not blocks or not blocks[-1] or not blocks[-1][-1].startswith("|"):
                blocks.append([])
            blocks[-1].append(line)
        elif blocks and blocks[-1]:
            blocks.append([])
    lines = [b for b in blocks if b][which]
    columns = [c.strip() for c in lines[0].strip("|").split("|")]
    parsed = {}
    for line in lines[2:]:
        cells = dict(zip(columns, (c.strip() for c in line.strip("|").split("|"))))
        parsed[(cells["method"], cells["scenario"])] = cells
    return parsed


def table_order(table: str) -> list[tuple[str, str]]:
    return list(rows(table))


@pytest.fixture
def records() -> list[dict[str, Any]]:
    return [
        run("allreduce", "homogeneous", 2000.0),
        run("prague", "homogeneous", 2200.0, variant="smart"),
        run("allreduce", "paper:5", 1000.0),
        run("prague", "paper:5", 2030.0, variant="smart"),
        run("adpsgd", "paper:5", 1500.0),
    ]


# ------------------------------------------------------------------------------------------------
# method_label


def test_method_label_without_and_with_variant() -> None:
    assert method_label(run("allreduce", "homogeneous", 1.0)) == "allreduce"
    assert method_label(run("prague", "homogeneous", 1.0, variant="smart")) == "prague:smart"


# ------------------------------------------------------------------------------------------------
# bench_table


def test_ratios_use_the_same_scenarios_allreduce(records: list[dict[str, Any]]) -> None:
    table = rows(bench_table(records))
    assert table[("allreduce", "homogeneous")]["vs allreduce"] == "1.00x"
    assert table[("prague:smart", "homogeneous")]["vs allreduce"] == "1.10x"
    assert table[("allreduce", "paper:5")]["vs allreduce"] == "1.00x"
    assert table[("prague:smart", "paper:5")]["vs allreduce"] == "2.03x"
    assert table[("adpsgd", "paper:5")]["vs allreduce"] == "1.50x"


def test_ratios_against_homogeneous_allreduce(records: list[dict[str, Any]]) -> None:
    table = rows(bench_table(records))
    column = "vs homogeneous allreduce"
    assert table[("allreduce", "homogeneous")][column] == "1.00x"
    assert table[("allreduce", "paper:5")][column] == "0.50x"
    assert table[("prague:smart", "paper:5")][column] == "1.01x"
    assert table[("adpsgd", "paper:5")][column] == "0.75x"


def test_allreduce_with_a_variant_is_not_the_baseline() -> None:
    records = [
        run("allreduce", "paper:5", 900.0, variant="fp16"),
        run("allreduce", "paper:5", 1000.0),
        run("prague", "paper:5", 2000.0),
    ]
    table = rows(bench_table(records))
    assert table[("allreduce:fp16", "paper:5")]["vs allreduce"] == "0.90x"
    assert table[("prague", "paper:5")]["vs allreduce"] == "2.00x"


def test_missing_allreduce_gives_na() -> None:
    records = [
        run("allreduce", "homogeneous", 2000.0),
        run("prague", "straggler:1:3", 1800.0, variant="smart"),
    ]
    table = rows(bench_table(records))
    row = table[("prague:smart", "straggler:1:3")]
    assert row["vs allreduce"] == "n/a"
    assert row["vs homogeneous allreduce"] == "0.90x"


def test_missing_homogeneous_allreduce_gives_na() -> None:
    records = [run("allreduce", "paper:5", 1000.0), run("prague", "paper:5", 1500.0)]
    table = rows(bench_table(records))
    assert table[("prague", "paper:5")]["vs allreduce"] == "1.50x"
    assert table[("prague", "paper:5")]["vs homogeneous allreduce"] == "n/a"
    assert table[("allreduce", "paper:5")]["vs homogeneous allreduce"] == "n/a"


def test_zero_baseline_throughput_gives_na() -> None:
    table = rows(bench_table([run("allreduce", "paper:5", 0.0), run("prague", "paper:5", 10.0)]))
    assert table[("prague", "paper:5")]["vs allreduce"] == "n/a"


def test_rows_grouped_by_scenario_in_first_seen_order() -> None:
    records = [
        run("allreduce", "paper:5", 1000.0),
        run("allreduce", "homogeneous", 2000.0),
        run("prague", "paper:5", 2000.0),
        run("prague", "homogeneous", 2100.0),
    ]
    assert table_order(bench_table(records)) == [
        ("allreduce", "paper:5"),
        ("prague", "paper:5"),
        ("allreduce", "homogeneous"),
        ("prague", "homogeneous"),
    ]


def test_cells_format_throughput_fraction_accuracy_and_mode() -> None:
    record = run(
        "prague",
        "homogeneous",
        1894.44,
        variant="smart",
        fraction_of_limit=0.74,
        test_accuracy=0.91234,
        simulated=True,
    )
    row = rows(bench_table([record]))[("prague:smart", "homogeneous")]
    assert row["throughput (samples/s)"] == "1894.4"
    assert row["of no-wait limit"] == "74%"
    assert rows(bench_table([record]), 0)[("prague:smart", "homogeneous")]["final accuracy"] == "91.23%"
    assert row["mode"] == "emulated, 50 ms (simulated)"


def test_real_mode_without_compute_time() -> None:
    record = run("allreduce", "homogeneous", 1.0, compute_mode="real", compute_ms=None)
    assert rows(bench_table([record]))[("allreduce", "homogeneous")]["mode"] == "real"


def test_fraction_falls_back_to_limit_and_then_dash() -> None:
    from_limit = run("allreduce", "a", 640.0, fraction_of_limit=None)
    neither = run("prague", "a", 640.0, fraction_of_limit=None, no_wait_limit_samples_per_s=None)
    table = rows(bench_table([from_limit, neither]))
    assert table[("allreduce", "a")]["of no-wait limit"] == "25%"
    assert table[("prague", "a")]["of no-wait limit"] == "-"


def test_accuracy_and_time_to_target_placeholders() -> None:
    no_target = run("allreduce", "s", 1.0)
    not_reached = run("prague", "s", 1.0, test_accuracy=0.5, target_accuracy=0.9)
    reached = run(
        "adpsgd", "s", 1.0, test_accuracy=0.95, target_accuracy=0.9, time_to_target_s=12.34
    )
    table = rows(bench_table([no_target, not_reached, reached]), 0)
    assert table[("allreduce", "s")]["final accuracy"] == "-"
    assert table[("allreduce", "s")]["time to target (s)"] == "n/a"
    assert table[("prague", "s")]["time to target (s)"] == "-"
    assert table[("adpsgd", "s")]["final accuracy"] == "95.00%"
    assert table[("adpsgd", "s")]["time to target (s)"] == "12.3"


def test_header_line_names_the_shared_settings(records: list[dict[str, Any]]) -> None:
    header = bench_table(records).splitlines()[0]
    assert not header.startswith("|")
    for expected in ("nproc 4", "model mlp", "data synthetic", "compute emulated"):
        assert expected in header


def test_header_line_names_the_machines_the_records_ran_on(records: list[dict[str, Any]]) -> None:
    assert "; on " not in bench_table(records).splitlines()[0]  # records without a host: nothing said
    xeon = {"cpu": "Xeon", "logical_cpus": 2, "cpu_features": ["avx2", "avx512f"], "python": "3.11.7", "torch": "2.13.0"}
    epyc = {**xeon, "cpu": "EPYC", "cpu_features": []}
    header = bench_table([{**r, "host": xeon} for r in records]).splitlines()[0]
    assert header.endswith("; on Xeon, 2 CPUs, avx2 avx512f")
    mixed = [{**r, "host": xeon if i % 2 else epyc} for i, r in enumerate(records)]
    assert bench_table(mixed).splitlines()[0].endswith("; on EPYC, 2 CPUs / Xeon, 2 CPUs, avx2 avx512f")


def test_host_facts_read_the_cpu_model_and_features_that_matter() -> None:
    cpuinfo = ("processor : 0\nmodel name : Test CPU @ 2GHz\nflags : fpu sse avx2 avx512f amx_tile\n\n"
               "processor : 1\nmodel name : Test CPU @ 2GHz\nflags : fpu sse avx2 avx512f amx_tile\n")
    facts = host_facts(cpuinfo)
    assert facts["cpu"] == "Test CPU @ 2GHz"
    assert facts["cpu_features"] == ["avx2", "avx512f", "amx_tile"]  # in CPU_FEATURES order, others left out
    assert facts["logical_cpus"] >= 1 and facts["torch"] and facts["python"]
    bare = host_facts("")  # no /proc/cpuinfo (another system): still a model string, no features
    assert bare["cpu"] and bare["cpu_features"] == []
    # a record carries it through its JSON form
    record = RunRecord.from_dict({"algorithm": "prague", "scenario": "s", "throughput_samples_per_s": 1.0,
                                  "host": facts})
    assert record.to_dict()["host"] == facts


#: JSON-like values as records hold them (and a few that JSON lacks: tuples, numpy numbers, a dataclass).
_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5)
    | st.builds(np.float64, st.floats(allow_nan=False)),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=3), inner, max_size=4)
    | st.builds(lambda v: dataclasses.make_dataclass("Inner", [("v", object)])(v), inner),
    max_leaves=20)


@given(stats=st.lists(st.dictionaries(st.text(max_size=3), _VALUES, max_size=4), max_size=3),
       samples=st.lists(st.integers(0, 10**6), max_size=50))
def test_record_to_dict_is_asdict_and_shares_nothing_mutable(stats: list[dict[str, Any]], samples: list[int]) -> None:
    record = RunRecord(algorithm="prague", scenario="s", throughput_samples_per_s=1.0, algorithm_stats=stats,
                       worker_samples=samples, sim={"nested": {"lists": [samples, (1, [2])]}})
    out = record.to_dict()
    expected = dataclasses.asdict(record)
    assert out == expected
    assert repr(out) == repr(expected)  # the same types too: tuples stay tuples, numpy numbers numpy numbers
    out["worker_samples"].append(-1)
    out["sim"]["nested"]["lists"][0].append(-1)
    for entry in out["algorithm_stats"]:
        entry["added"] = True
    assert record.sim is not None and record.worker_samples == samples and -1 not in record.sim["nested"]["lists"][0]
    assert all("added" not in entry for entry in record.algorithm_stats)


def test_table_shape_is_valid_markdown(records: list[dict[str, Any]]) -> None:
    lines = [line for line in bench_table(records).splitlines() if line.startswith("|")]
    assert len(lines) == 2 * (2 + len(records))  # one row per cell (one seed each), then one per run
    assert {line.count("|") for line in lines[:2 + len(records)]} == {len(report._TTA_COLUMNS) + 1}
    assert {line.count("|") for line in lines[2 + len(records):]} == {len(report._COLUMNS) + 1}


def test_bench_table_rejects_records_without_required_keys() -> None:
    bad = run("allreduce", "homogeneous", 1.0)
    del bad["throughput_samples_per_s"]
    with pytest.raises(ConfigError, match="throughput_samples_per_s"):
        bench_table([bad])


# ------------------------------------------------------------------------------------------------
# write_bench


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > 2000


def test_write_bench_writes_all_files(tmp_path: Path, records: list[dict[str, Any]]) -> None:
    records[1]["eval_history"] = [
        {"wall_s": 1.0, "step": 10, "accuracy": 0.3},
        {"wall_s": 2.0, "step": 20, "accuracy": 0.6},
    ]
    records[1]["target_accuracy"] = 0.5
    paths = write_bench(tmp_path / "out", records, command="prague bench --nproc 4")
    assert set(paths) == {"json", "md", "throughput", "accuracy"}
    assert {p.name for p in paths.values()} == {
        "bench.json",
        "bench.md",
        "throughput.png",
        "accuracy.png",
    }
    written = json.loads(paths["json"].read_text())
    assert written["records"] == [RunRecord.from_dict(r).to_dict() for r in records]
    assert written["schema_version"] == SCHEMA_VERSION and written["command"] == "prague bench --nproc 4"
    assert [(c["method"], c["scenario"]) for c in written["cells"]] == [
        (report.method_label(r), r["scenario"]) for r in records]
    assert [r.label for r in load_records(paths["json"])] == [report.method_label(r) for r in records]
    markdown = paths["md"].read_text()
    assert markdown.startswith("# ")
    assert "```\nprague bench --nproc 4\n```" in markdown
    assert bench_table(records) in markdown
    assert_png(paths["throughput"])
    assert_png(paths["accuracy"])
    # Only the four reports: no temporary files left behind.
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        p.name for p in paths.values()
    )


def test_resume_reads_back_what_the_bench_wrote_and_refuses_anything_else(tmp_path: Path,
                                                                          records: list[dict[str, Any]]) -> None:
    out = tmp_path / "out"
    assert report.load_resume(out, ["bench"]) == ([], [])  # nothing finished yet: start afresh
    argv = ["bench", "--nproc", "4"]
    runs = [f"runs/r{i}" for i in range(len(records))]
    write_bench(out, records, command="prague bench --nproc 4", resume={"argv": argv, "runs": runs})
    kept, kept_runs = report.load_resume(out, argv)
    assert kept == [RunRecord.from_dict(r).to_dict() for r in records] and kept_runs == runs
    with pytest.raises(ConfigError, match=r"prague bench --nproc 4.*not by these arguments"):
        report.load_resume(out, ["bench", "--nproc", "8"])
    write_bench(out, records, command="prague bench --nproc 4")  # no resume part: not resumable
    with pytest.raises(ConfigError, match="does not say which runs"):
        report.load_resume(out, argv)


def test_a_resumed_bench_may_grow_by_methods_scenarios_and_seeds_only(tmp_path: Path,
                                                                       records: list[dict[str, Any]]) -> None:
    out = tmp_path / "out"
    argv = ["bench", "--algorithms", "allreduce,localsgd", "--scenarios=homogeneous", "--nproc", "8", "--repeat", "2"]
    runs = [f"runs/r{i}" for i in range(len(records))]
    write_bench(out, records, command="prague bench", resume={"argv": argv, "runs": runs})
    grown = ["bench", "--algorithms=allreduce,localsgd,prague", "--scenarios", "homogeneous,paper:5", "--nproc", "8",
             "--repeat", "5"]
    assert report.load_resume(out, grown)[1] == runs
    for argv_, error in [
            (grown[:-1] + ["1"], "ran --repeat 2; pass at least as many seeds"),
            (["bench", "--algorithms", "prague", "--scenarios", "homogeneous", "--nproc", "8", "--repeat", "2"],
             "holds runs of --algorithms allreduce,localsgd, which these arguments leave out"),
            (grown[:4] + ["--nproc", "4", "--repeat", "5"], "not by these arguments; run that command with --resume")]:
        with pytest.raises(ConfigError, match=error):
            report.load_resume(out, argv_)
    write_bench(out, records, command="prague bench", resume={"argv": ["bench", "--algorithms", "a"], "runs": runs})
    with pytest.raises(ConfigError, match="ran one seed, whose runs are not named by seed"):
        report.load_resume(out, ["bench", "--algorithms", "a", "--repeat", "3"])


def test_write_bench_single_record_no_allreduce_no_accuracy(tmp_path: Path) -> None:
    record = run(
        "prague", "straggler:1:3", 1234.5, variant="smart", no_wait_limit_samples_per_s=None
    )
    paths = write_bench(tmp_path, [record])
    assert "n/a" in paths["md"].read_text()
    assert "```" not in paths["md"].read_text()
    assert_png(paths["throughput"])
    assert_png(paths["accuracy"])


def test_throughput_figure_has_one_bar_per_record_and_one_limit_per_scenario(
    records: list[dict[str, Any]],
) -> None:
    records[0]["no_wait_limit_samples_per_s"] = None  # homogeneous keeps the limit of records[1]
    ax = report._throughput_figure(records).axes[0]
    bars = [p for p in ax.patches if isinstance(p, Rectangle)]
    assert sorted(p.get_height() for p in bars) == sorted(
        r["throughput_samples_per_s"] for r in records
    )
    assert [t.get_text() for t in ax.get_xticklabels()] == ["homogeneous", "paper:5"]
    assert len(ax.collections) == 2  # one dashed no-wait limit per scenario
    legend_box = ax.get_legend()
    assert legend_box is not None
    legend = [t.get_text() for t in legend_box.get_texts()]
    assert legend == ["allreduce", "prague:smart", "adpsgd", "no-wait limit"]


def test_accuracy_figure_without_data_says_so(records: list[dict[str, Any]]) -> None:
    ax = report._accuracy_figure(records).axes[0]
    assert [t.get_text() for t in ax.texts] == ["no accuracy data (emulated compute)"]
    assert len(ax.lines) == 0


def test_accuracy_figure_one_line_per_run_with_history(records: list[dict[str, Any]]) -> None:
    records[0]["eval_history"] = [
        {"wall_s": 2.0, "step": 20, "accuracy": 0.6},
        {"wall_s": 1.0, "step": 10, "accuracy": 0.3},
    ]
    records[3]["eval_history"] = [{"wall_s": 1.5, "step": 10, "accuracy": 0.4}]
    records[3]["target_accuracy"] = 0.5
    fig = report._accuracy_figure(records)
    assert [ax.get_title() for ax in fig.axes] == ["homogeneous", "paper:5"]  # one panel per scenario
    curves = [[line for line in ax.lines if line.get_label() != "target"] for ax in fig.axes]
    assert [[line.get_label() for line in panel] for panel in curves] == [["allreduce"], ["prague:smart"]]
    assert np.asarray(curves[0][0].get_xdata()).tolist() == [1.0, 2.0]  # sorted by time
    assert np.asarray(curves[0][0].get_ydata()).tolist() == pytest.approx([30.0, 60.0])  # percent
    assert all(len(ax.texts) == 0 for ax in fig.axes)


def test_accuracy_figure_draws_the_median_seed_and_shades_the_range(records: list[dict[str, Any]]) -> None:
    """Three seeds of one method: at each time the median of the seeds' accuracies (each seed holding its
    last evaluation), the min-max shaded."""
    seeds = [run("prague", "homogeneous", 1.0, seed=s, eval_history=[
        {"wall_s": 0.0, "accuracy": 0.1}, {"wall_s": t, "accuracy": a}]) for s, (t, a) in enumerate(
        [(1.0, 0.5), (2.0, 0.9), (3.0, 0.7)])]
    ax = report._accuracy_figure(seeds).axes[0]
    (line,) = [line for line in ax.lines if line.get_label() != "target"]
    assert line.get_label() == "prague (3 seeds)"
    assert np.asarray(line.get_xdata()).tolist() == [0.0, 1.0, 2.0, 3.0]
    # at 1 s: 0.5, 0.1, 0.1 -> 0.1; at 2 s: 0.5, 0.9, 0.1 -> 0.5; at 3 s: 0.5, 0.9, 0.7 -> 0.7
    assert np.asarray(line.get_ydata()).tolist() == pytest.approx([10.0, 10.0, 50.0, 70.0])
    assert len(ax.collections) == 1  # the shaded range


def test_existing_report_survives_unserialisable_record(
    tmp_path: Path, records: list[dict[str, Any]]
) -> None:
    paths = write_bench(tmp_path, records)
    before = {name: p.read_bytes() for name, p in paths.items()}
    bad = [*records, run("prague", "paper:5", 1.0, seed=object())]
    with pytest.raises(TypeError, match="JSON"):
        write_bench(tmp_path, bad)
    assert {name: p.read_bytes() for name, p in paths.items()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in paths.values())


def test_existing_json_survives_when_the_dump_raises(
    tmp_path: Path, records: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = write_bench(tmp_path, records)
    old = paths["json"].read_text()

    def failing_dumps(*args: Any, **kwargs: Any) -> str:
        raise OSError("disk full")

    # Fail inside the atomic writer itself, after the report was rendered.
    monkeypatch.setattr("prague.io.json.dumps", failing_dumps)
    with pytest.raises(OSError, match="disk full"):
        write_bench(tmp_path, records[:2])
    assert paths["json"].read_text() == old
    assert load_records(paths["json"]) == [RunRecord.from_dict(r) for r in records]


def test_existing_file_survives_when_writing_the_bytes_fails(
    tmp_path: Path, records: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = write_bench(tmp_path, records)
    old = paths["json"].read_bytes()

    def failing_replace(src: Any, dst: Any) -> None:
        raise OSError("rename failed")

    monkeypatch.setattr("prague.io.os.replace", failing_replace)
    with pytest.raises(OSError, match="rename failed"):
        write_bench(tmp_path, records[:1])
    assert paths["json"].read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in paths.values())


def test_nan_is_rejected_before_writing(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="JSON"):
        write_bench(tmp_path, [run("allreduce", "homogeneous", 1.0, wall_s=float("nan"))])
    assert list(tmp_path.iterdir()) == []


def test_write_bench_rejects_empty_and_malformed_records(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no run records"):
        write_bench(tmp_path, [])
    with pytest.raises(ConfigError, match="record 1 lacks required key"):
        write_bench(tmp_path, [run("allreduce", "a", 1.0), {"algorithm": "x"}])
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------
# load_records


def test_load_records_round_trip(tmp_path: Path, records: list[dict[str, Any]]) -> None:
    paths = write_bench(tmp_path, records)
    assert load_records(paths["json"]) == [RunRecord.from_dict(r) for r in records]
    assert load_records(tmp_path) == [RunRecord.from_dict(r) for r in records]  # the directory holding bench.json


def test_load_records_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope" / "bench.json"
    with pytest.raises(ConfigError, match="do not exist") as info:
        load_records(path)
    assert str(path) in str(info.value)
    assert "re-run the benchmark" in str(info.value)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"algorithm": "allreduce"}', "must hold a list of run records, got dict"),
        ("[]", "holds no run records"),
        ("[1, 2]", "record 0 is a int"),
        ('[{"algorithm": "allreduce", "scenario": "homogeneous"}]', "'throughput_samples_per_s'"),
        (
            '[{"algorithm": "allreduce", "scenario": "h", "throughput_samples_per_s": "fast"}]',
            "must be a number",
        ),
        ('[{"algorithm": 3, "scenario": "h", "throughput_samples_per_s": 1}]', "algorithm=3"),
    ],
)
def test_load_records_malformed(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bench.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message) as info:
        load_records(path)
    assert str(path) in str(info.value)
    assert "re-run the benchmark" in str(info.value)


def test_load_records_accepts_minimal_records(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    minimal = [{"algorithm": "allreduce", "scenario": "homogeneous", "throughput_samples_per_s": 5}]
    path.write_text(json.dumps(minimal))
    loaded = load_records(path)
    assert [(r.algorithm, r.scenario, r.throughput_samples_per_s, r.schema_version) for r in loaded] == [
        ("allreduce", "homogeneous", 5, SCHEMA_VERSION)]
    assert loaded[0].variant is None and loaded[0].eval_history == []
    # A minimal record must still render: every optional field falls back to a placeholder.
    row = rows(bench_table(minimal))[("allreduce", "homogeneous")]
    assert row["mode"] == "?"
    tta = rows(bench_table(minimal), 0)[("allreduce", "homogeneous")]
    assert tta["final accuracy"] == "-" and tta["time to target (s)"] == "n/a" and tta["job time (s)"] == "n/a"


# ------------------------------------------------------------------------------------------------
# cells: seeds of one (method, scenario)


def test_cells_give_median_and_range_over_seeds_and_count_a_missed_target_as_never() -> None:
    def seed_run(algorithm: str, seed: int, tta: float | None, job: float, acc: float) -> dict[str, Any]:
        return run(algorithm, "paper:5", 100.0, seed=seed, target_accuracy=0.9, time_to_target_s=tta, job_s=job,
                   test_accuracy=acc, samples=6400)

    records = [seed_run("allreduce", s, t, j, a) for s, (t, j, a) in enumerate(
        [(20.0, 30.0, 0.95), (24.0, 31.0, 0.96), (22.0, 29.0, 0.94)])]
    records += [seed_run("prague", s, t, j, a) for s, (t, j, a) in enumerate(
        [(10.0, 15.0, 0.95), (None, 16.0, 0.89), (11.0, 14.0, 0.95)])]
    table = {c["method"]: c for c in report.cells(records)}
    # three seeds: the 95% bootstrap interval of the median is the range
    assert table["allreduce"]["time_to_target_s"] == {"median": 22.0, "min": 20.0, "max": 24.0,
                                                      "ci_low": 20.0, "ci_high": 24.0}
    assert table["allreduce"]["seeds"] == [0, 1, 2] and table["allreduce"]["reached"] == 3
    assert table["prague"]["time_to_target_s"]["median"] == 11.0  # 10, 11, never
    assert table["prague"]["time_to_target_s"]["max"] == INF and table["prague"]["reached"] == 2
    assert table["prague"]["time_to_target_s"]["ci_high"] == INF
    assert table["prague"]["test_accuracy"] == {"median": 0.95, "min": 0.89, "max": 0.95, "ci_low": 0.89,
                                                "ci_high": 0.95}
    assert table["prague"]["job_s"] == {"median": 15.0, "min": 14.0, "max": 16.0}  # no interval
    row = rows(bench_table(records), 0)[("prague", "paper:5")]
    assert row["time to target (s)"] == "11.0 [10.0, -] (2/3 reached)"
    # 22/11; resampled, prague's median is never in 7/27 of the draws (ratio 0) and 24/10 at most
    assert row["speed-up vs allreduce"] == "2.00x [0.00, 2.40]" and row["seeds"] == "3"
    assert row["speed-up vs best baseline"] == row["speed-up vs allreduce"]
    assert row["final accuracy"] == "95.00% [89.00, 95.00]" and row["samples"] == "6400"
    json_cell = report._json_cells(report.cells(records))[1]
    assert json_cell["time_to_target_s"]["max"] is None and json_cell["time_to_target_s"]["ci_high"] is None  # no inf
    assert json_cell["speedup_vs_allreduce"] == {"ratio": 2.0, "ci_low": 0.0, "ci_high": 2.4}


def test_local_step_share_weights_workers_by_their_steps() -> None:
    record = run("prague", "s", 1.0, completed_steps=[30, 10], ranks=[0, 1],
                 algorithm_stats=[{"local_step_share": 0.5}, {"local_step_share": 0.1}])
    assert report.local_share(record) == pytest.approx((0.5 * 30 + 0.1 * 10) / 40)
    assert rows(bench_table([record]))[("prague", "s")]["local steps"] == "40%"
    assert report.local_share(run("allreduce", "s", 1.0)) is None


# ------------------------------------------------------------------------------------------------
# Bootstrap intervals


def test_bootstrap_median_is_deterministic_and_contains_the_median() -> None:
    values = [31.0, 20.0, 55.0, 42.0, 39.0, 27.0, 48.0, 35.0, 61.0]
    first = report.bootstrap_median(values)
    assert first == report.bootstrap_median(list(reversed(values)))  # a pure function of the values
    assert first is not None and first.value == 39.0
    assert first.low <= first.value <= first.high and 20.0 <= first.low and first.high <= 61.0
    assert first.low < first.high
    narrower = report.bootstrap_median(values, confidence=0.5)
    assert narrower is not None and first.low <= narrower.low <= narrower.high <= first.high
    assert report.bootstrap_median([7.5]) == report.Interval(7.5, 7.5, 7.5)  # one seed: the value itself
    assert report.bootstrap_median([2.0, 2.0, 2.0]) == report.Interval(2.0, 2.0, 2.0)
    assert report.bootstrap_median([]) is None


def test_bootstrap_median_of_an_even_count_is_a_seeds_figure() -> None:
    interval = report.bootstrap_median([4.0, 1.0, 3.0, 2.0])
    assert interval is not None and interval.value == 2.0  # the lower middle value, not 2.5


def test_bootstrap_refuses_nan_and_bad_settings() -> None:
    with pytest.raises(ConfigError, match="NaN"):
        report.bootstrap_median([1.0, float("nan")])
    with pytest.raises(ConfigError, match="resamples must be a positive integer, got 0"):
        report.bootstrap_median([1.0, 2.0], resamples=0)
    with pytest.raises(ConfigError, match="confidence must be in"):
        report.bootstrap_ratio([1.0], [2.0], confidence=1.0)


def test_bootstrap_ratio_resamples_each_sample_and_keeps_never_infinite() -> None:
    assert report.bootstrap_ratio([10.0, 10.0], [5.0, 5.0, 5.0]) == report.Interval(2.0, 2.0, 2.0)
    ratio = report.bootstrap_ratio([20.0, 22.0, 24.0, 26.0, 21.0], [10.0, 11.0, 12.0, 9.0, 10.5])
    assert ratio == report.bootstrap_ratio([20.0, 22.0, 24.0, 26.0, 21.0], [10.0, 11.0, 12.0, 9.0, 10.5])
    assert ratio is not None and ratio.value == pytest.approx(22.0 / 10.5)
    assert 20.0 / 12.0 <= ratio.low < ratio.value < ratio.high <= 26.0 / 9.0
    # the baseline never reached the target in most draws: the speed-up has no upper bound
    unbounded = report.bootstrap_ratio([30.0, INF, INF], [10.0, 11.0, 12.0])
    assert unbounded is not None and unbounded.value == INF and unbounded.high == INF
    assert report.bootstrap_ratio([INF], [INF]) is None  # neither reached: no ratio
    assert report.bootstrap_ratio([], [1.0]) is None


def tta_run(algorithm: str, scenario: str, tta: float | None, *, seed: int = 0, variant: str | None = None,
            **overrides: Any) -> dict[str, Any]:
    return run(algorithm, scenario, 100.0, variant=variant, seed=seed, target_accuracy=0.9, time_to_target_s=tta,
               test_accuracy=0.93, job_s=40.0, samples=6400, **overrides)


def test_a_seed_that_never_reached_the_target_makes_the_upper_bound_infinite() -> None:
    records = [tta_run("prague", "s", t, seed=i) for i, t in enumerate([12.0, None, 10.0])]
    cell = report.cells(records)[0]
    assert cell["time_to_target_s"]["ci_high"] == INF and cell["time_to_target_s"]["median"] == 12.0
    row = rows(report.tta_table(records), 0)[("prague", "s")]
    assert row["time to target (s)"] == "12.0 [10.0, -] (2/3 reached)"
    assert row["speed-up vs allreduce"] == "n/a" and row["speed-up vs best baseline"] == "n/a"


def test_a_cell_piloted_twice_shows_its_newest_pilot_and_says_so() -> None:
    """A resumed bench whose pilot ran again: the records are in the order they ran, the last one's pilot
    is the newest, the one the report shows."""
    older = [{"lr": 0.002, "seed": 0, "time_to_target_s": 108.0, "test_accuracy": 0.448},
             {"lr": 0.004, "seed": 0, "time_to_target_s": None, "test_accuracy": 0.43}]
    newer = [{**older[0], "time_to_target_s": 106.0}, older[1]]
    records = [tta_run("allreduce", "s", 12.0, seed=0, lr_pilot=older), tta_run("allreduce", "s", 11.0, seed=1,
                                                                                lr_pilot=older),
               tta_run("allreduce", "s", 13.0, seed=2, lr_pilot=newer), tta_run("prague", "s", 9.0, lr_pilot=older)]
    text = bench_table(records)
    assert ("- allreduce / s: lr 0.002 (0.002: 106.0 s; 0.004: 43.00%) (the newest of the 2 pilots this cell's "
            "records carry)") in text
    assert "- prague / s: lr 0.002 (0.002: 108.0 s; 0.004: 43.00%)\n" in text  # one pilot: nothing more said
    assert "108.0 s; 0.004: 43.00%) (the newest" not in text


# ------------------------------------------------------------------------------------------------
# The best baseline


def test_the_best_baseline_is_the_fastest_baseline_method_per_scenario() -> None:
    records = [
        tta_run("allreduce", "a", 20.0), tta_run("allreduce", "a", 15.0, variant="backup"),
        tta_run("localsgd", "a", 18.0), tta_run("prague", "a", 5.0), tta_run("adpsgd", "a", 4.0),
        tta_run("allreduce", "b", 30.0), tta_run("diloco", "b", 12.0), tta_run("prague", "b", 10.0),
        tta_run("prague", "c", 10.0), tta_run("dssync", "c", 8.0),
    ]
    table = {(c["method"], c["scenario"]): c for c in report.cells(records)}
    assert {s: table[("prague", s)]["best_baseline"] for s in "abc"} == {"a": "allreduce:backup", "b": "diloco",
                                                                        "c": None}
    assert table[("prague", "a")]["speedup_vs_best_baseline"] == {"ratio": 3.0, "ci_low": 3.0, "ci_high": 3.0}
    text = report.tta_table(records)
    parsed = rows(text, 0)
    assert parsed[("prague", "a")]["speed-up vs best baseline"] == "3.00x"
    assert parsed[("prague", "a")]["speed-up vs allreduce"] == "4.00x"
    assert parsed[("allreduce:backup", "a")]["speed-up vs best baseline"] == "1.00x"
    assert parsed[("allreduce", "a")]["speed-up vs best baseline"] == "0.75x"
    assert parsed[("prague", "b")]["speed-up vs best baseline"] == "1.20x"
    assert parsed[("prague", "c")]["speed-up vs best baseline"] == "n/a"  # no baseline method ran in c
    assert text.rstrip().splitlines()[-1].endswith("a: allreduce:backup; b: diloco; c: n/a")
    assert report.report_json(records)["best_baselines"] == {"a": "allreduce:backup", "b": "diloco", "c": None}


def test_a_baseline_that_never_reached_the_target_is_named() -> None:
    records = [tta_run("allreduce", "s", None), tta_run("prague", "s", 9.0)]
    row = rows(report.tta_table(records), 0)[("prague", "s")]
    assert row["speed-up vs allreduce"] == "allreduce never" and row["speed-up vs best baseline"] == "allreduce never"


# ------------------------------------------------------------------------------------------------
# Newer fields: the worst replica, the smoothed and loss targets, the pace


def test_records_without_the_newer_fields_render_as_before(tmp_path: Path) -> None:
    old = [tta_run(a, "s", t, seed=i) for a, t in (("allreduce", 20.0), ("prague", 10.0)) for i in range(2)]
    for record in old:
        record["schema_version"] = 4
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"schema_version": 4, "command": "prague bench", "records": old, "cells": []}))
    bench = report.read_bench(path)
    text = report.report_markdown(bench.records, bench.command)
    header = rows(text, 0)[("prague", "s")]
    assert list(header) == list(report._TTA_COLUMNS)  # no worst replica, smoothed or loss column
    assert header["speed-up vs allreduce"] == "2.00x"
    assert text.splitlines()[4] == "nproc 4, model mlp, data synthetic, compute emulated, nominal step 50 ms"


def test_newer_fields_add_columns_the_pace_and_cells() -> None:
    probe = {"ms": 120.0, "step_ms": 80.0, "probed": True}
    records = [tta_run("allreduce", "s", 20.0 + i, seed=i, compute_mode="paced", compute_ms=120.0, pace_probe=probe,
                       worst_replica_accuracy=0.90 + i / 100, best_replica_accuracy=0.95,
                       time_to_target_smoothed_s=22.0 + i, target_loss=0.3, time_to_target_loss_s=25.0 + i)
               for i in range(3)]
    records += [tta_run("prague", "s", 10.0, seed=i, compute_mode="paced", compute_ms=120.0, pace_probe=probe,
                        worst_replica_accuracy=0.80, time_to_target_smoothed_s=None, target_loss=0.3,
                        time_to_target_loss_s=None if i == 0 else 12.0)
                for i in range(3)]
    text = report.bench_table(records)
    assert text.splitlines()[0] == "nproc 4, model mlp, data synthetic, compute paced, pace 120 ms (probed)"
    parsed = rows(text, 0)
    allreduce, prague = parsed[("allreduce", "s")], parsed[("prague", "s")]
    assert list(allreduce) == ["method", "scenario", "time to target (s)", "speed-up vs allreduce",
                               "speed-up vs best baseline", "time to target, smoothed (s)", "time to loss 0.3 (s)",
                               "final accuracy", "worst replica accuracy", "job time (s)", "samples", "seeds"]
    assert allreduce["time to target, smoothed (s)"] == "23.0 [22.0, 24.0]"
    assert allreduce["time to loss 0.3 (s)"] == "26.0 [25.0, 27.0]"
    assert allreduce["worst replica accuracy"] == "91.00%"  # the median over seeds
    assert prague["time to target, smoothed (s)"] == "-"  # never on the smoothed curve
    assert prague["time to loss 0.3 (s)"] == "12.0 [12.0, -]"
    cell = {c["method"]: c for c in report.report_json(records)["cells"]}["allreduce"]
    assert cell["time_to_target_smoothed_s"] == {"median": 23.0, "min": 22.0, "max": 24.0, "ci_low": 22.0,
                                                 "ci_high": 24.0}
    assert cell["worst_replica_accuracy"]["min"] == 0.90 and cell["best_replica_accuracy"]["median"] == 0.95
    assert cell["target_loss"] == 0.3


def test_a_given_pace_is_not_called_probed() -> None:
    record = tta_run("allreduce", "s", 20.0, compute_mode="paced", compute_ms=40.0)
    assert report.bench_table([record]).splitlines()[0].endswith("compute paced, pace 40 ms")


# ------------------------------------------------------------------------------------------------
# prague report


def test_prague_report_prints_what_bench_md_holds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from prague.cli import main

    records = [tta_run(a, s, t, seed=i) for s in ("homogeneous", "paper:5") for a, t in (("allreduce", 20.0),
                                                                                       ("prague", 11.0))
               for i in range(2)]
    paths = write_bench(tmp_path, records, command="prague bench --repeat 2")
    assert main(["report", str(paths["json"])]) == 0
    printed = capsys.readouterr().out
    assert paths["md"].read_text() == report.BENCH_MD_TITLE + printed
    assert printed.startswith("```\nprague bench --repeat 2\n```\n")
    assert main(["report", str(tmp_path), "--markdown"]) == 0  # the folder holding bench.json
    assert capsys.readouterr().out == printed
    assert main(["report", str(paths["json"]), "--json"]) == 0
    written = json.loads(paths["json"].read_text())
    assert json.loads(capsys.readouterr().out) == {k: written[k] for k in ("schema_version", "command", "cells",
                                                                           "best_baselines")}


@pytest.mark.parametrize(("content", "message"), [(None, "do not exist"), ("{not json", "not valid JSON"),
                                                  ('{"records": []}', "holds no run records")])
def test_prague_report_on_a_bad_file_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           content: str | None, message: str) -> None:
    from prague.cli import main

    path = tmp_path / "bench.json"
    if content is not None:
        path.write_text(content)
    assert main(["report", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("prague report: error: ")
    assert message in captured.err and str(path) in captured.err and "re-run the benchmark" in captured.err


def test_an_atomic_write_gives_the_file_what_open_would(tmp_path: Path) -> None:
    """A new file: 0o666 less the umask, as open() gives it (not the temporary file's 0o600); a rewritten
    file keeps its own mode."""
    from prague.io import atomic_write_text

    old = os.umask(0o027)
    try:
        atomic_write_text(tmp_path / "new.md", "a")
    finally:
        os.umask(old)
    assert (tmp_path / "new.md").stat().st_mode & 0o777 == 0o640
    (tmp_path / "new.md").chmod(0o604)
    atomic_write_text(tmp_path / "new.md", "b")
    assert (tmp_path / "new.md").stat().st_mode & 0o777 == 0o604 and (tmp_path / "new.md").read_text() == "b"
