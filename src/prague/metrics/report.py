"""Benchmark reports: two markdown tables, one JSON file and two plots for a set of runs.

A benchmark runs every method in every scenario on the same machine, with one or more seeds
(``--repeat``), and produces one record per (method, scenario, seed) run (see docs/ARCHITECTURE.md). A
*cell* is one (method, scenario) pair over its seeds (:func:`cells`). This module turns the records into

- ``bench.json``: ``{"schema_version", "command", "records", "cells"}``: every seed's record, and per cell
  the median, min and max of the time to target, the job time, the final accuracy and the throughput;
- ``bench.md``: a title, the command that produced the run, and :func:`bench_table`: time to accuracy
  first (median and min-max over seeds, its speed-up over ``allreduce``, final accuracy at the budget, job
  time, samples), then throughput (with the share of purely local steps for methods that skip averages);
- ``accuracy.png``: test accuracy against time on the common clock, one panel per scenario, one line per
  method (the median over seeds, the min-max shaded);
- ``throughput.png``: throughput per scenario, one bar per method, the no-wait limit dashed.

Ratios are to ``allreduce`` in the same scenario (throughput also to ``allreduce`` in ``homogeneous``).
Absolute numbers from different benchmark runs should not be compared: the machines are noisy.

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
from prague.metrics.record import SCHEMA_VERSION, RunRecord, method_label_of
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
    "local steps",
)
_TTA_COLUMNS = (
    "method",
    "scenario",
    "time to target (s)",
    "speed-up vs allreduce",
    "final accuracy",
    "job time (s)",
    "samples",
    "seeds",
)

Record = Mapping[str, Any]


# --------------------------------------------------------------------------------------------------
# Labels and validation


def method_label(record: Record) -> str:
    """Name a run's method: ``"allreduce"``, or ``"prague:smart"`` when the record has a variant."""
    return method_label_of(str(record["algorithm"]), record.get("variant"))


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
    if isinstance(data, dict) and "records" in data:  # {"records": [...], "cells": [...]}; a list before schema 3
        data = data["records"]
    return [RunRecord.from_dict(r) for r in _check_records(data, f"benchmark results {str(path)!r}", fix)]


def load_resume(out_dir: Path, argv: Sequence[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """The records of an unfinished bench in ``out_dir`` and the run folder of each (relative to
    ``out_dir``), for ``prague bench --resume``. ``argv`` is the bench's arguments without ``--resume``:
    ConfigError unless ``bench.json`` was written by a bench with the same ones (a bench that never
    finished its first run has none: starting afresh is then right)."""
    path = Path(out_dir) / "bench.json"
    if not path.is_file():
        return [], []
    records = [r.to_dict() for r in load_records(path)]
    data = json.loads(path.read_text(encoding="utf-8"))
    resume = data.get("resume") if isinstance(data, dict) else None
    if not isinstance(resume, dict) or not isinstance(resume.get("runs"), list) \
            or len(resume["runs"]) != len(records) or not isinstance(resume.get("argv"), list):
        raise ConfigError(f"--resume: {str(path)!r} does not say which runs it holds (written before --resume "
                          "existed, or edited); pass a new --out, or run the bench without --resume")
    if list(resume["argv"]) != list(argv):
        raise ConfigError(f"--resume: {str(path)!r} was written by `prague {' '.join(resume['argv'])}`, not by these "
                          "arguments; run that command with --resume, or pass another --out")
    return records, [str(r) for r in resume["runs"]]


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
    budget = _distinct(records, "budget")
    return (
        f"nproc {_distinct(records, 'nproc')}, model {_distinct(records, 'model')}, "
        f"data {_distinct(records, 'data')}, compute {_distinct(records, 'compute_mode')}"
        + ("" if budget == "?" else f", budget {budget}")
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


def _label_of_cell(record: Record) -> tuple[str, str]:
    return method_label(record), str(record["scenario"])


def _spread(values: Sequence[float]) -> dict[str, float] | None:
    """``{median, min, max}`` of ``values`` (None when empty); the median of an even count is the lower
    middle value, so it is one seed's figure (infinite times stay infinite)."""
    if not values:
        return None
    ordered = sorted(values)
    return {"median": ordered[(len(ordered) - 1) // 2], "min": ordered[0], "max": ordered[-1]}


def local_share(record: Record) -> float | None:
    """The share of a run's steps that averaged with nobody (``local_step_share`` of methods that skip
    averages, weighted by each worker's steps), or None for methods that do not report it."""
    stats = record.get("algorithm_stats") or []
    shares = [s.get("local_step_share") for s in stats]
    if not shares or any(v is None for v in shares):
        return None
    steps = record.get("completed_steps") or []
    ranks = record.get("ranks") or list(range(len(shares)))
    weights = [float(steps[r]) if r < len(steps) else 1.0 for r in ranks][:len(shares)]
    total = sum(weights)
    return sum(float(v) * w for v, w in zip(shares, weights)) / total if total > 0 else None


def cells(records: Sequence[RecordLike]) -> list[dict[str, Any]]:
    """One entry per (method, scenario), in first-seen order, over its seeds: ``seeds``, ``reached`` (seeds
    that reached the target), and ``{median, min, max}`` of ``time_to_target_s`` (a seed that never reached
    it counts as infinitely late: null in JSON), ``job_s``, ``test_accuracy``, ``samples``,
    ``throughput_samples_per_s`` and ``local_step_share`` (None where no seed has the figure), and
    ``diverged`` (seeds whose run diverged: each counts as never reaching the target, whatever its record
    says, since the model it left is broken)."""
    groups: dict[tuple[str, str], list[Record]] = {}
    for record in _check_records(list(records), "bench records", _RECORDS_FIX):
        groups.setdefault(_label_of_cell(record), []).append(record)
    out = []
    for (method, scenario), group in groups.items():
        targeted = [r for r in group if r.get("target_accuracy") is not None]

        def figures(key: str, group: list[Record] = group) -> list[float]:
            return [float(r[key]) for r in group if r.get(key) is not None]

        tta = [float(r["time_to_target_s"]) if r.get("time_to_target_s") is not None and not r.get("diverged")
               else math.inf for r in targeted]
        out.append({
            "method": method, "scenario": scenario, "seeds": [r.get("seed") for r in group],
            "target_accuracy": targeted[0]["target_accuracy"] if targeted else None,
            "reached": sum(math.isfinite(t) for t in tta),
            "time_to_target_s": _spread(tta),
            "job_s": _spread(figures("job_s") or figures("wall_s")),
            "test_accuracy": _spread(figures("test_accuracy")),
            "samples": _spread(figures("samples")),
            "throughput_samples_per_s": _spread(figures("throughput_samples_per_s")),
            "local_step_share": _spread([v for r in group if (v := local_share(r)) is not None]),
            "diverged": sum(bool(r.get("diverged")) for r in group),
        })
    return out


def _json_cells(table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``cells`` with infinite times (a seed never reached the target) written as null."""
    def clean(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        return None if isinstance(value, float) and not math.isfinite(value) else value
    return [clean(c) for c in table]


def _seconds(spread: dict[str, float] | None) -> str:
    """``12.3 [11.0-14.1]``: the median and the range over seeds (``-`` for never)."""
    if spread is None:
        return "n/a"

    def one(v: float) -> str:
        return f"{v:.1f}" if math.isfinite(v) else "-"
    if one(spread["min"]) == one(spread["max"]):
        return one(spread["median"])
    return f"{one(spread['median'])} [{one(spread['min'])}-{one(spread['max'])}]"


def _speedup(cell: dict[str, Any], baseline: dict[str, Any] | None) -> str:
    mine, theirs = cell["time_to_target_s"], baseline and baseline["time_to_target_s"]
    if not mine or not theirs or not math.isfinite(mine["median"]) or mine["median"] <= 0:
        return "n/a" if not theirs or not mine else "-"
    if not math.isfinite(theirs["median"]):
        return "allreduce never"
    return f"{theirs['median'] / mine['median']:.2f}x"


def _percent(spread: dict[str, float] | None) -> str:
    if spread is None:
        return "-"
    low, high = f"{100 * spread['min']:.2f}", f"{100 * spread['max']:.2f}"
    text = f"{100 * spread['median']:.2f}%"
    return text if low == high else f"{text} [{low}-{high}]"


def tta_table(records: Sequence[RecordLike]) -> str:
    """The time-to-accuracy table: one row per (method, scenario) over its seeds."""
    table = cells(records)
    baselines = {c["scenario"]: c for c in table if c["method"] == _BASELINE_ALGORITHM}
    targets = sorted({c["target_accuracy"] for c in table if c["target_accuracy"] is not None})
    title = ("Time to " + "/".join(f"{100 * t:g}%" for t in targets) + " test accuracy"
             if targets else "No --target-accuracy: no time to target")
    lines = [f"{title} (median [min-max] over seeds; `-`: not reached)", "",
             "| " + " | ".join(_TTA_COLUMNS) + " |",
             "|" + "|".join("---" if i < 2 else "---:" for i in range(len(_TTA_COLUMNS))) + "|"]
    for cell in table:
        tta = _seconds(cell["time_to_target_s"])
        if cell["time_to_target_s"] is not None and len(cell["seeds"]) > 1 and cell["reached"] < len(cell["seeds"]):
            tta += f" ({cell['reached']}/{len(cell['seeds'])} reached)"
        speedup = _speedup(cell, baselines.get(cell["scenario"]))
        if cell["diverged"]:
            tta += f" ({cell['diverged']}/{len(cell['seeds'])} DIVERGED)"
            speedup = "diverged" if speedup in ("-", "n/a") else f"{speedup}, {cell['diverged']} diverged"
        samples = cell["samples"]
        row = (cell["method"], cell["scenario"], tta, speedup,
               _percent(cell["test_accuracy"]), _seconds(cell["job_s"]),
               "-" if samples is None else f"{samples['median']:.0f}", str(len(cell["seeds"])))
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return "\n".join(lines) + "\n"


def bench_table(records: Sequence[RecordLike]) -> str:
    """Render runs as GitHub markdown, preceded by a one-line header of the shared settings: the time to
    accuracy first (:func:`tta_table`), then one throughput row per run (per seed).

    Throughput rows are grouped by scenario in first-seen order. Ratios are taken against the
    ``allreduce`` record without a variant of the same scenario (and seed) and of scenario ``homogeneous``;
    ``n/a`` when that record is missing. Raises :class:`ConfigError` if a record lacks a required key.
    """
    checked = harmonize_limits(_check_records(list(records), "bench_table records", _RECORDS_FIX))
    lines = [_header(checked), "", tta_table(checked), "Throughput (samples/s after warm-up, over the window in "
             "which every worker trains; it ignores when the job ends: read it with the job time above)", "",
             "| " + " | ".join(_COLUMNS) + " |",
             "|" + "|".join("---" if i < 3 else "---:" for i in range(len(_COLUMNS))) + "|"]
    for seed in dict.fromkeys(r.get("seed") for r in checked):
        same_seed = [r for r in checked if r.get("seed") == seed]
        baselines = _baseline_throughputs(same_seed)
        homogeneous = baselines.get(_HOMOGENEOUS_SCENARIO)
        for scenario, group in _by_scenario(same_seed):
            for record in group:
                throughput = float(record["throughput_samples_per_s"])
                share = local_share(record)
                diverged = record.get("diverged")
                cells_ = (
                    method_label(record) + (f" (DIVERGED at step {diverged['step']})" if diverged else ""),
                    scenario,
                    _mode(record) + (f", seed {seed}" if len(set(r.get("seed") for r in checked)) > 1 else ""),
                    f"{throughput:.1f}",
                    _ratio(throughput, baselines.get(scenario)),
                    _ratio(throughput, homogeneous),
                    _fraction_of_limit(record),
                    "-" if share is None else f"{100 * share:.0f}%",
                )
                lines.append("| " + " | ".join(_cell(c) for c in cells_) + " |")
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


def _curve(record: Record) -> list[tuple[float, float]]:
    return sorted(
        (float(p["wall_s"]), 100.0 * float(p["accuracy"]))
        for p in record.get("eval_history") or []
        if p.get("wall_s") is not None and p.get("accuracy") is not None
    )


def _at(curve: list[tuple[float, float]], t: float) -> float:
    """A curve's accuracy at ``t``: the last point at or before it (a model is what it was at the last
    evaluation; after the job's end, its final accuracy)."""
    value = curve[0][1]
    for time_s, accuracy in curve:
        if time_s > t:
            break
        value = accuracy
    return value


def _accuracy_figure(records: Sequence[Record]) -> Figure:
    """One panel per scenario; per method, the median over seeds of the accuracy at each time, the
    min-max over seeds shaded (one seed: its curve)."""
    curves = [r for r in records if _curve(r)]
    if not curves:
        fig = Figure(figsize=(7.0, 4.5))
        ax = fig.add_subplot()
        ax.set_axis_off()
        ax.text(0.5, 0.5, _NO_ACCURACY_TEXT, ha="center", va="center", transform=ax.transAxes)
        return fig
    colours = _colours(_methods(records))
    scenarios = [scenario for scenario, group in _by_scenario(curves)]
    fig = Figure(figsize=(6.0 * len(scenarios) + 2.0, 4.5))
    axes = fig.subplots(1, len(scenarios), sharey=True, squeeze=False)[0]
    targets = sorted({float(r["target_accuracy"]) for r in records if r.get("target_accuracy")})
    for ax, scenario in zip(axes, scenarios):
        for method in _methods(curves):
            runs = [_curve(r) for r in curves if str(r["scenario"]) == scenario and method_label(r) == method]
            if not runs:
                continue
            times = sorted({t for run in runs for t, _ in run})
            at = [_spread([_at(run, t) for run in runs]) or {} for t in times]  # each time: the seeds' spread
            median = [v["median"] for v in at]
            ax.plot(times, median, color=colours[method], marker="." if len(runs) == 1 else None, drawstyle="steps-post",
                    label=method if len(runs) == 1 else f"{method} ({len(runs)} seeds)")
            if len(runs) > 1:
                ax.fill_between(times, [v["min"] for v in at], [v["max"] for v in at], color=colours[method],
                                alpha=0.2, step="post", linewidth=0)
        for i, target in enumerate(targets):
            ax.axhline(100.0 * target, color="grey", linestyle="dotted", label="target" if i == 0 else None)
        ax.set_title(scenario, fontsize="medium")
        ax.set_xlabel("time on the common clock (s)")
        ax.grid(alpha=0.3)
    if targets:  # zoom on the target: the climb from chance would flatten the crossing that matters
        finals = [_curve(r)[-1][1] for r in curves]
        axes[0].set_ylim(max(0.0, min([100.0 * targets[0], *finals]) - 5.0), 100.0)
    axes[0].set_ylabel("test accuracy of the average model (%)")
    axes[-1].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(f"Test accuracy ({_header(records)})", fontsize="medium")
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
    out_dir: Path, records: Sequence[RecordLike], *, command: str | None = None,
    resume: Mapping[str, Any] | None = None,
) -> dict[str, Path]:
    """Write ``bench.json``, ``bench.md``, ``throughput.png`` and ``accuracy.png`` into ``out_dir``.

    Called by the benchmark driver (one process) after each run, with every record so far.
    ``command`` is the command line that produced the runs, quoted in ``bench.md``; ``resume`` (what
    ``prague bench --resume`` needs to go on: the bench's arguments and the run folder of each record)
    is kept in ``bench.json`` as it is. ``accuracy.png``
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
    document: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "command": command, "records": checked,
                                "cells": _json_cells(cells(checked))}
    if resume is not None:
        document["resume"] = dict(resume)
    atomic_write_json(paths["json"], document)
    atomic_write_text(paths["md"], markdown)
    atomic_write_bytes(paths["throughput"], throughput_png)
    atomic_write_bytes(paths["accuracy"], accuracy_png)
    return paths
