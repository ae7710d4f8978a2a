"""Benchmark reports: one markdown table, one JSON file and two plots for a set of runs.

A benchmark runs every method in every scenario on the same machine and produces one summary dict
per (method, scenario) run (see docs/ARCHITECTURE.md). This module turns that list into

- ``bench.json``: the records themselves, the source of truth for later comparison;
- ``bench.md``: a title, the command that produced the run, and :func:`bench_table`;
- ``throughput.png``: throughput per scenario, one bar per method, the no-wait limit dashed;
- ``accuracy.png``: test accuracy against wall-clock time for every run that evaluated.

Each method's throughput is shown as a ratio to ``allreduce`` in the same scenario, as a ratio to
``allreduce`` in the ``homogeneous`` scenario, and as a fraction of the no-wait limit. Absolute
numbers from different benchmark runs should not be compared: the machines are noisy.

Everything is rendered in memory first and only then written, each file atomically
(:mod:`prague.io`), so a failure leaves the previous report untouched.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Union

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from prague.errors import ConfigError
from prague.metrics.record import RunRecord
from prague.metrics.summary import nominal_compute_s, scenario_limit
from prague.io import atomic_write_bytes, atomic_write_json, atomic_write_text

__all__ = [
    "bench_table",
    "load_records",
    "method_label",
    "write_bench",
]

_BASELINE_ALGORITHM = "allreduce"
_HOMOGENEOUS_SCENARIO = "homogeneous"
_NO_ACCURACY_TEXT = "no accuracy data (emulated compute)"
_RECORDS_FIX = "pass the run summaries of a benchmark"
_COLUMNS = (
    "method",
    "scenario",
    "mode",
    "throughput (samples/s)",
    "vs allreduce",
    "vs homogeneous allreduce",
    "of no-wait limit",
    "accuracy",
    "time to target (s)",
)

Record = Mapping[str, Any]


# --------------------------------------------------------------------------------------------------
# Labels and validation


def method_label(record: Record) -> str:
    """Name a run's method: ``"allreduce"``, or ``"prague:smart"`` when the record has a variant."""
    variant = record.get("variant")
    algorithm = str(record["algorithm"])
    return f"{algorithm}:{variant}" if variant else algorithm


RecordLike = Union[RunRecord, Mapping[str, Any]]


def _check_records(records: object, source: str, fix: str) -> list[dict[str, Any]]:
    """``records`` (RunRecords, or their JSON form) checked through :class:`RunRecord` and returned in
    their JSON form; raises :class:`ConfigError` naming ``source`` and ``fix``."""
    if not isinstance(records, list):
        raise ConfigError(f"{source} must hold a list of run records, got {type(records).__name__}; {fix}")
    if not records:
        raise ConfigError(f"{source} holds no run records; {fix}")
    out = []
    for index, record in enumerate(records):
        try:
            out.append(RunRecord.from_dict(record, f"{source}: record {index}").to_dict())
        except ConfigError as exc:
            raise ConfigError(f"{exc}; {fix}") from None
    return out


def load_records(path: Path) -> list[RunRecord]:
    """Read the run records of a ``bench.json`` written by :func:`write_bench`.

    ``path`` may also be the directory that holds ``bench.json``. Raises :class:`ConfigError`,
    naming the path and how to fix it, when the file is missing, is not JSON, or is not a non-empty
    list of records each with :data:`~prague.metrics.record.REQUIRED_KEYS`.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "bench.json"
    fix = "pass the bench.json written by a benchmark run, or re-run the benchmark to regenerate it"
    if not path.is_file():
        raise ConfigError(f"benchmark results {str(path)!r} do not exist; {fix}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read benchmark results {str(path)!r} ({exc}); {fix}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"benchmark results {str(path)!r} are not valid JSON ({exc}); {fix}"
        ) from exc
    return [RunRecord.from_dict(r) for r in _check_records(data, f"benchmark results {str(path)!r}", fix)]


# --------------------------------------------------------------------------------------------------
# Table


def _by_scenario(records: Sequence[Record]) -> list[tuple[str, list[Record]]]:
    """Group records by scenario, scenarios in first-seen order, records in input order."""
    groups: dict[str, list[Record]] = {}
    for record in records:
        groups.setdefault(str(record["scenario"]), []).append(record)
    return list(groups.items())


def _baseline_throughputs(records: Sequence[Record]) -> dict[str, float]:
    """Map each scenario to the throughput of its ``allreduce`` run (no variant; first one wins)."""
    baselines: dict[str, float] = {}
    for record in records:
        if record["algorithm"] == _BASELINE_ALGORITHM and not record.get("variant"):
            baselines.setdefault(str(record["scenario"]), float(record["throughput_samples_per_s"]))
    return baselines


def _ratio(value: float, reference: float | None) -> str:
    if reference is None or not math.isfinite(reference) or reference <= 0:
        return "n/a"
    return f"{value / reference:.2f}x"


def _mode(record: Record) -> str:
    mode = str(record.get("compute_mode") or "?")
    compute_ms = record.get("compute_ms")
    if compute_ms is not None:
        mode += f", {float(compute_ms):g} ms"
    if record.get("simulated"):
        mode += " (simulated)"
    return mode


def _fraction_of_limit(record: Record) -> str:
    fraction = record.get("fraction_of_limit")
    if fraction is None:
        # Older or hand-written records may carry only the limit; the fraction follows from it.
        limit = record.get("no_wait_limit_samples_per_s")
        if limit is None or not limit > 0:
            return "-"
        fraction = float(record["throughput_samples_per_s"]) / float(limit)
    return f"{100.0 * float(fraction):.0f}%"


def _accuracy(record: Record) -> str:
    accuracy = record.get("test_accuracy")
    return "-" if accuracy is None else f"{100.0 * float(accuracy):.2f}%"


def _time_to_target(record: Record) -> str:
    if record.get("target_accuracy") is None:
        return "n/a"
    seconds = record.get("time_to_target_s")
    return "-" if seconds is None else f"{float(seconds):.1f}"


def _distinct(records: Sequence[Record], key: str) -> str:
    """The values of ``key`` across records, first-seen order, joined with ``/`` ("?" if absent)."""
    values: list[str] = []
    for record in records:
        value = record.get(key)
        text = "?" if value is None else str(value)
        if text not in values:
            values.append(text)
    return "/".join(values)


def _header(records: Sequence[Record]) -> str:
    return (
        f"nproc {_distinct(records, 'nproc')}, model {_distinct(records, 'model')}, "
        f"data {_distinct(records, 'data')}, compute {_distinct(records, 'compute_mode')}"
    )


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def harmonize_limits(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One no-wait limit per scenario, the same for every method of a benchmark.

    A run's own limit (:func:`prague.metrics.summary.no_wait_limit`) uses its own measured compute, which
    a method's background threads inflate, so its fraction of the limit would flatter it. Here the step
    without slowdown is the least base compute any run of the benchmark measured (the least
    non-communication work a method needs), and each scenario's slowdown draws (the same seed and steps
    for every method) come from that scenario's runs; records without these fields (older files) keep
    their own limit. Returns new dicts; the inputs are not modified."""
    bases = [r["base_compute_s"] for r in records if r.get("base_compute_s")]
    if not bases:
        return [dict(r) for r in records]
    base = min(bases)
    draws: dict[Any, list[float]] = {}
    for r in records:
        if r.get("mean_slowdown"):
            draws.setdefault((r.get("scenario"), r.get("nproc")), r["mean_slowdown"])
    out = []
    for r in records:
        r = dict(r)
        slowdowns = draws.get((r.get("scenario"), r.get("nproc")))
        if slowdowns and r.get("batch_size"):
            nominal = nominal_compute_s(r.get("compute_mode"), r.get("compute_ms"))
            limit = scenario_limit(slowdowns, base, nominal, int(r["batch_size"]))
            r["no_wait_limit_samples_per_s"] = limit
            r["fraction_of_limit"] = r["throughput_samples_per_s"] / limit if limit > 0 else None
        out.append(r)
    return out


def bench_table(records: Sequence[RecordLike]) -> str:
    """Render runs as a GitHub markdown table, preceded by a one-line header of the shared settings.

    One row per record, grouped by scenario in first-seen order. Ratios are taken against the
    ``allreduce`` record without a variant of the same scenario and of scenario ``homogeneous``;
    ``n/a`` when that record is missing. Raises :class:`ConfigError` if a record lacks a required
    key.
    """
    checked = harmonize_limits(_check_records(list(records), "bench_table records", _RECORDS_FIX))
    baselines = _baseline_throughputs(checked)
    homogeneous = baselines.get(_HOMOGENEOUS_SCENARIO)
    lines = [
        _header(checked),
        "",
        "| " + " | ".join(_COLUMNS) + " |",
        "|" + "|".join("---" if i < 3 else "---:" for i in range(len(_COLUMNS))) + "|",
    ]
    for scenario, group in _by_scenario(checked):
        for record in group:
            throughput = float(record["throughput_samples_per_s"])
            cells = (
                method_label(record),
                scenario,
                _mode(record),
                f"{throughput:.1f}",
                _ratio(throughput, baselines.get(scenario)),
                _ratio(throughput, homogeneous),
                _fraction_of_limit(record),
                _accuracy(record),
                _time_to_target(record),
            )
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# Plots


def _methods(records: Sequence[Record]) -> list[str]:
    return list(dict.fromkeys(method_label(r) for r in records))


def _colours(methods: Sequence[str]) -> dict[str, Any]:
    """One colour per method, shared by both plots so a method looks the same in each."""
    cmap = colormaps["tab10" if len(methods) <= 10 else "tab20"]
    return {method: cmap(i % cmap.N) for i, method in enumerate(methods)}


def _png(fig: Figure) -> bytes:
    """Render ``fig`` with the Agg backend (no display, no pyplot global state) to PNG bytes."""
    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120, bbox_inches="tight")
    return buffer.getvalue()


def _throughput_figure(records: Sequence[Record]) -> Figure:
    groups = _by_scenario(records)
    methods = _methods(records)
    colours = _colours(methods)
    width = 0.8 / len(methods)
    fig = Figure(figsize=(min(24.0, max(6.0, 2.0 + 0.4 * len(groups) * len(methods))), 4.5))
    ax = fig.add_subplot()
    labelled: set[str] = set()
    limit_labelled = False
    for x, (_, group) in enumerate(groups):
        for record in group:
            method = method_label(record)
            offset = (methods.index(method) - (len(methods) - 1) / 2) * width
            ax.bar(
                x + offset,
                float(record["throughput_samples_per_s"]),
                width=width,
                color=colours[method],
                label=None if method in labelled else method,
            )
            labelled.add(method)
        limits = [
            float(r["no_wait_limit_samples_per_s"])
            for r in group
            if r.get("no_wait_limit_samples_per_s") is not None
        ]
        if limits:
            # Every run of a scenario shares one limit; take the largest if they disagree.
            ax.hlines(
                max(limits),
                x - 0.45,
                x + 0.45,
                colors="black",
                linestyles="dashed",
                label="_nolegend_" if limit_labelled else "no-wait limit",
            )
            limit_labelled = True
    ax.set_xticks(range(len(groups)), [scenario for scenario, _ in groups])
    ax.set_xlabel("scenario")
    ax.set_ylabel("throughput (samples/s)")
    ax.set_title(f"Throughput ({_header(records)})", fontsize="medium")
    ax.set_ylim(bottom=0)
    # Methods first, in first-seen order, then the limit (matplotlib would list the limit first).
    handles, labels = ax.get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: labels[i] == "no-wait limit")
    ax.legend(
        [handles[i] for i in order],
        [labels[i] for i in order],
        fontsize="small",
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
    )
    ax.grid(axis="y", alpha=0.3)
    return fig


def _accuracy_figure(records: Sequence[Record]) -> Figure:
    fig = Figure(figsize=(7.0, 4.5))
    ax = fig.add_subplot()
    curves = [r for r in records if r.get("eval_history")]
    if not curves:
        ax.set_axis_off()
        ax.text(0.5, 0.5, _NO_ACCURACY_TEXT, ha="center", va="center", transform=ax.transAxes)
        return fig
    colours = _colours(_methods(records))
    scenarios = [scenario for scenario, _ in _by_scenario(records)]
    styles = ("-", "--", ":", "-.")
    for record in curves:
        points = sorted(
            (float(p["wall_s"]), 100.0 * float(p["accuracy"]))
            for p in record["eval_history"]
            if p.get("wall_s") is not None and p.get("accuracy") is not None
        )
        method = method_label(record)
        ax.plot(
            [t for t, _ in points],
            [a for _, a in points],
            color=colours[method],
            linestyle=styles[scenarios.index(str(record["scenario"])) % len(styles)],
            marker=".",
            label=f"{method} / {record['scenario']}",
        )
    targets = sorted({float(r["target_accuracy"]) for r in records if r.get("target_accuracy")})
    for i, target in enumerate(targets):
        ax.axhline(
            100.0 * target,
            color="grey",
            linestyle="dotted",
            label="target" if i == 0 else None,
        )
    ax.set_xlabel("wall-clock time (s)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"Test accuracy ({_header(records)})", fontsize="medium")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    return fig


# --------------------------------------------------------------------------------------------------
# Files


def _markdown(records: Sequence[dict[str, Any]], command: str | None) -> str:
    parts = ["# prague benchmark", ""]
    if command:
        parts += ["```", command, "```", ""]
    parts.append(bench_table(list(records)))
    return "\n".join(parts)


def write_bench(
    out_dir: Path, records: Sequence[RecordLike], *, command: str | None = None
) -> dict[str, Path]:
    """Write ``bench.json``, ``bench.md``, ``throughput.png`` and ``accuracy.png`` into ``out_dir``.

    Called once, after all runs of a benchmark have finished, by the benchmark driver (one process).
    ``command`` is the command line that produced the runs, quoted in ``bench.md``. ``accuracy.png``
    is always written, with a note when no run evaluated, so the file set is the same for every run.

    All four files are rendered in memory before any is written, and each is replaced atomically, so
    bad records (missing keys: :class:`ConfigError`; values that are not JSON: :class:`TypeError`)
    leave an earlier report in ``out_dir`` untouched. Returns the paths keyed ``"json"``, ``"md"``,
    ``"throughput"``, ``"accuracy"``.
    """
    checked = harmonize_limits(_check_records(list(records), "write_bench records", _RECORDS_FIX))
    try:
        # allow_nan=False: NaN would make bench.json unreadable by strict JSON parsers.
        json.dumps(checked, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"benchmark records cannot be written as JSON ({exc}); keep record values to "
            "str, int, float (finite), bool, None, lists and dicts"
        ) from exc
    markdown = _markdown(checked, command)
    throughput_png = _png(_throughput_figure(checked))
    accuracy_png = _png(_accuracy_figure(checked))

    out_dir = Path(out_dir)
    paths = {
        "json": out_dir / "bench.json",
        "md": out_dir / "bench.md",
        "throughput": out_dir / "throughput.png",
        "accuracy": out_dir / "accuracy.png",
    }
    atomic_write_json(paths["json"], checked)
    atomic_write_text(paths["md"], markdown)
    atomic_write_bytes(paths["throughput"], throughput_png)
    atomic_write_bytes(paths["accuracy"], accuracy_png)
    return paths
