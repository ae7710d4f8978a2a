"""Benchmark reports: two markdown tables, one JSON file and two plots for a set of runs.

A benchmark runs every method in every scenario on the same machine, with one or more seeds
(``--repeat``), and produces one record per (method, scenario, seed) run (see docs/ARCHITECTURE.md). A
*cell* is one (method, scenario) pair over its seeds (:func:`cells`). This module turns the records into

- ``bench.json``: ``{"schema_version", "command", "records", "cells", "best_baselines"}``: every seed's
  record, and per cell the median, min and max of each figure, the 95% bootstrap interval of the median
  of the times to target and of the final accuracy, and the speed-ups (:func:`report_json`);
- ``bench.md``: a title, then :func:`report_markdown`: the command that produced the run and
  :func:`bench_table`: time to accuracy first (per cell the median over seeds and its 95% bootstrap
  interval, the speed-up over ``allreduce`` and over the scenario's best baseline, final accuracy at the
  budget, median job time and samples), then throughput (with the share of purely local steps for methods that skip
  averages). ``prague report BENCH_JSON`` prints the same text from ``bench.json``, and the tables in the
  docs are that text between ``<!-- prague report FILE -->`` and ``<!-- end report -->`` (a test keeps
  them current);
- ``accuracy.png``: test accuracy against time on the common clock, one panel per scenario, one line per
  method (the median over seeds, the min-max shaded);
- ``throughput.png``: throughput per scenario, one bar per method, the no-wait limit dashed.

Intervals are percentile bootstrap intervals (:func:`bootstrap_median`, :func:`bootstrap_ratio`), seeded,
so a report is the same every time it is rendered. Ratios are to ``allreduce`` in the same scenario
(throughput also to ``allreduce`` in ``homogeneous``) and, for the time to target, to the scenario's best
baseline (:data:`BASELINE_METHODS`). Absolute numbers from different benchmark runs should not be
compared: the machines are noisy.

Everything is rendered in memory first and only then written, each file atomically
(:mod:`prague.io`), so a failure leaves the previous report untouched.
"""

from __future__ import annotations

import io
import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from prague.errors import ConfigError
from prague.metrics.pilot import pilot_lines
from prague.metrics.record import SCHEMA_VERSION, RunRecord, method_label_of
from prague.metrics.summary import nominal_compute_s, scenario_limit
from prague.io import atomic_write_bytes, atomic_write_json, atomic_write_text

__all__ = [
    "BASELINE_METHODS",
    "BENCH_MD_TITLE",
    "Bench",
    "Interval",
    "bench_table",
    "bootstrap_median",
    "bootstrap_ratio",
    "cells",
    "load_records",
    "method_label",
    "read_bench",
    "report_json",
    "report_markdown",
    "tta_table",
    "write_bench",
]

#: The methods a new method has to beat. Per scenario, the *best baseline* is the cell with the lowest
#: median time to target among those whose method is one of these, with any variant or none
#: (``allreduce``, ``allreduce:backup``, ``allreduce:balanced``, ``allreduce:drop``, ``localsgd``, ``diloco``).
BASELINE_METHODS: frozenset[str] = frozenset({"allreduce", "localsgd", "diloco"})
#: Every interval of a report: this many bootstrap resamples, this coverage, a ``random.Random`` of this
#: seed (fixed: the same records always give the same report, byte for byte).
BOOTSTRAP_RESAMPLES = 10_000
CONFIDENCE = 0.95
BOOTSTRAP_SEED = 0

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
#: The time-to-accuracy table's columns; :func:`tta_table` adds the smoothed time to target, the time to
#: the loss target and the worst replica's accuracy where some record has them.
_TTA_COLUMNS = (
    "method",
    "scenario",
    "time to target (s)",
    "speed-up vs allreduce",
    "speed-up vs best baseline",
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


@dataclass(frozen=True)
class Bench:
    """What a ``bench.json`` holds: its run records (their JSON form, checked through :class:`RunRecord`)
    and the command line that produced them (None in files that do not say)."""

    path: Path
    records: list[dict[str, Any]]
    command: str | None


def read_bench(path: Path) -> Bench:
    """Read a ``bench.json`` written by :func:`write_bench` (or, before schema 3, a bare list of records).

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
    command = None
    if isinstance(data, dict) and "records" in data:  # {"records": [...], "cells": [...]}; a list before schema 3
        command = data.get("command") if isinstance(data.get("command"), str) else None
        data = data["records"]
    return Bench(path, _check_records(data, f"benchmark results {str(path)!r}", fix), command)


def load_records(path: Path) -> list[RunRecord]:
    """The run records of a ``bench.json`` as :class:`RunRecord` objects (:func:`read_bench`, whose
    errors it raises)."""
    return [RunRecord.from_dict(r) for r in read_bench(path).records]


def load_resume(out_dir: Path, argv: Sequence[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """The records of an unfinished bench in ``out_dir`` and the run folder of each (relative to
    ``out_dir``), for ``prague bench --resume``. ``argv`` is the bench's arguments without ``--resume``:
    ConfigError unless ``bench.json`` was written by a bench with the same ones, or with fewer methods,
    scenarios or seeds and otherwise the same (the bench grows: its finished runs are kept, the new cells
    run beside them, at the same settings) (a bench that never finished its first run has none: starting
    afresh is then right)."""
    path = Path(out_dir) / "bench.json"
    if not path.is_file():
        return [], []
    records = read_bench(path).records
    data = json.loads(path.read_text(encoding="utf-8"))
    resume = data.get("resume") if isinstance(data, dict) else None
    if not isinstance(resume, dict) or not isinstance(resume.get("runs"), list) \
            or len(resume["runs"]) != len(records) or not isinstance(resume.get("argv"), list):
        raise ConfigError(f"--resume: {str(path)!r} does not say which runs it holds (written before --resume "
                          "existed, or edited); pass a new --out, or run the bench without --resume")
    if list(resume["argv"]) != list(argv):
        _check_growth(path, [str(a) for a in resume["argv"]], list(argv))
    return records, [str(r) for r in resume["runs"]]


#: The flags a resumed bench may grow: more methods, scenarios or seeds.
_GROWABLE = ("--algorithms", "--scenarios", "--repeat")


def _split_growable(argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """``argv`` without :data:`_GROWABLE`'s flags, and their values (``--flag V`` or ``--flag=V``)."""
    rest: list[str] = []
    values: dict[str, str] = {}
    words = iter(argv)
    for word in words:
        name, equals, value = word.partition("=")
        if name in _GROWABLE:
            values[name] = value if equals else next(words, "")
        else:
            rest.append(word)
    return rest, values


def _check_growth(path: Path, before: list[str], after: list[str]) -> None:
    """ConfigError unless ``after`` is ``before`` with more methods, scenarios or seeds."""
    written = f"`prague {' '.join(before)}`"
    old_rest, old = _split_growable(before)
    new_rest, new = _split_growable(after)
    if old_rest != new_rest:
        raise ConfigError(f"--resume: {str(path)!r} was written by {written}, not by these arguments; run that "
                          "command with --resume (adding methods, scenarios or seeds if you like), or pass another "
                          "--out")

    def items(values: dict[str, str], flag: str) -> list[str]:
        return [v.strip() for v in values.get(flag, "").split(",") if v.strip()]

    for flag in ("--algorithms", "--scenarios"):
        dropped = [v for v in items(old, flag) if v not in items(new, flag)]
        if dropped:
            raise ConfigError(f"--resume: {str(path)!r} holds runs of {flag} {','.join(dropped)}, which these "
                              f"arguments leave out; a resumed bench keeps every cell it ran: add them back to "
                              f"{flag}, or pass another --out")
    repeat_before, repeat_after = int(old.get("--repeat", "1") or 1), int(new.get("--repeat", "1") or 1)
    if repeat_after < repeat_before:
        raise ConfigError(f"--resume: {str(path)!r} ran --repeat {repeat_before}; pass at least as many seeds")
    if repeat_before == 1 < repeat_after:
        raise ConfigError(f"--resume: {str(path)!r} ran one seed, whose runs are not named by seed; more seeds "
                          "need a bench that began with --repeat 2 or more: pass another --out")


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


def _pace(records: Sequence[Record]) -> str:
    """The step time the records' compute was paced (or emulated, or scaled) to, ``40 ms``, with
    ``(probed)`` where a probe of the machine chose it (``pace_probe``: ``{"ms", "probed"}``); distinct
    values joined with ``/``, empty when no record says."""
    values: list[str] = []
    for record in records:
        ms, probe = record.get("compute_ms"), record.get("pace_probe")
        probed = False
        if isinstance(probe, Mapping):
            ms, probed = probe.get("ms", ms), bool(probe.get("probed"))
        if isinstance(ms, (int, float)) and not isinstance(ms, bool):
            text = f"{float(ms):g} ms" + (" (probed)" if probed else "")
            if text not in values:
                values.append(text)
    return "/".join(values)


def _host(records: Sequence[Record]) -> str:
    """The machines the records ran on (``host``), ``Intel(R) Xeon(R) Processor, 2 CPUs, avx2 avx512f``;
    distinct ones joined with `` / ``, empty when no record says."""
    values: list[str] = []
    for record in records:
        host = record.get("host")
        if isinstance(host, Mapping) and host.get("cpu"):
            features = host.get("cpu_features")
            text = (f"{host['cpu']}, {host.get('logical_cpus', '?')} CPUs"
                    + (f", {' '.join(str(f) for f in features)}" if isinstance(features, list) and features else ""))
            if text not in values:
                values.append(text)
    return " / ".join(values)


def _header(records: Sequence[Record]) -> str:
    budget = _distinct(records, "budget")
    modes = _distinct(records, "compute_mode")
    pace = _pace(records)
    return (
        f"nproc {_distinct(records, 'nproc')}, model {_distinct(records, 'model')}, "
        f"data {_distinct(records, 'data')}, compute {modes}"
        + ("" if not pace else f", {'pace' if 'paced' in modes.split('/') else 'nominal step'} {pace}")
        + ("" if budget == "?" else f", budget {budget}")
        + ("" if not any(r.get("optimizer") not in (None, "sgd") for r in records)
           else f", optimizer {_distinct(records, 'optimizer')}")
        + ("" if not (host := _host(records)) else f"; on {host}")
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


def _spread(values: Sequence[float], *, interval: bool = False) -> dict[str, float] | None:
    """``{median, min, max}`` of ``values`` (None when empty), and with ``interval`` the 95% bootstrap
    interval of the median, ``ci_low`` and ``ci_high`` (:func:`bootstrap_median`). The median of an even
    count is the lower middle value, so it is one seed's figure (infinite times stay infinite)."""
    if not values:
        return None
    ordered = sorted(values)
    out = {"median": _median(ordered), "min": ordered[0], "max": ordered[-1]}
    if interval and (ci := bootstrap_median(ordered)) is not None:
        out.update(ci_low=ci.low, ci_high=ci.high)
    return out


# --------------------------------------------------------------------------------------------------
# Intervals


@dataclass(frozen=True)
class Interval:
    """A statistic (``value``) and its bootstrap interval ``[low, high]``; a bound may be infinite
    (``high``: the data cannot bound it, e.g. seeds that never reached a target)."""

    value: float
    low: float
    high: float


def _median(ordered: Sequence[float]) -> float:
    """The median of sorted values: the lower middle one for an even count, so always one seed's value."""
    return ordered[(len(ordered) - 1) // 2]


def _check_bootstrap(values: Sequence[float], resamples: int, confidence: float) -> list[float]:
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise ConfigError(f"bootstrap resamples must be a positive integer, got {resamples!r}; pass e.g. "
                          f"{BOOTSTRAP_RESAMPLES}")
    if not 0.0 < confidence < 1.0:
        raise ConfigError(f"bootstrap confidence must be in (0, 1), got {confidence!r}; pass e.g. {CONFIDENCE}")
    ordered = sorted(float(v) for v in values)
    if any(math.isnan(v) for v in ordered):
        raise ConfigError(f"cannot bootstrap {list(values)!r}: NaN has no order; leave out the runs without "
                          "the figure, or count a missed target as infinitely late (inf)")
    return ordered


def _resampled_median(ordered: Sequence[float], draw: Any) -> float:
    """The median of ``len(ordered)`` values drawn with replacement from sorted ``ordered`` with
    ``draw() -> [0, 1)``: the value at the median of the drawn indices, since the values are sorted."""
    n = len(ordered)
    picks = sorted([int(draw() * n) for _ in range(n)])
    return ordered[picks[(n - 1) // 2]]


def _percentile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` percentile of sorted bootstrap replications: the ``ceil(B q)``-th value (1-based; Efron &
    Tibshirani's B*alpha-th value), no interpolation, so an infinite replication is never averaged."""
    k = math.ceil(round(len(ordered) * q, 9))
    return ordered[min(len(ordered), max(1, k)) - 1]


def bootstrap_median(values: Sequence[float], *, resamples: int = BOOTSTRAP_RESAMPLES,
                     confidence: float = CONFIDENCE, seed: int = BOOTSTRAP_SEED) -> Interval | None:
    """The median of ``values`` (the lower middle value for an even count) and its percentile bootstrap
    interval (Efron & Tibshirani, "An Introduction to the Bootstrap", 1993, ch. 13).

    ``resamples`` times, draw ``len(values)`` values with replacement (from ``random.Random(seed)``) and
    take their median; the interval is the ``(1 - confidence) / 2`` and ``(1 + confidence) / 2``
    percentiles of those medians. Pure and deterministic: the same arguments give the same interval.
    ``inf`` (a seed that never reached a target: infinitely late) sorts last, so a bound that falls on it
    is infinite. One value, or all equal: the interval is that value. None when ``values`` is empty;
    :class:`ConfigError` for NaN, ``resamples < 1`` or ``confidence`` outside (0, 1).
    """
    ordered = _check_bootstrap(values, resamples, confidence)
    if not ordered:
        return None
    median = _median(ordered)
    if ordered[0] == ordered[-1]:
        return Interval(median, median, median)
    draw = random.Random(seed).random
    replications = sorted(_resampled_median(ordered, draw) for _ in range(resamples))
    return Interval(median, _percentile(replications, (1 - confidence) / 2),
                    _percentile(replications, (1 + confidence) / 2))


def _divide(numerator: float, denominator: float) -> float | None:
    """``numerator / denominator`` of two times, with ``x / inf = 0`` and ``inf / x = inf`` (one side never
    reached the target); None when undefined (both infinite, or both zero)."""
    if math.isinf(numerator) and math.isinf(denominator) or numerator == denominator == 0:
        return None
    if math.isinf(numerator) or denominator == 0:
        return math.inf
    return numerator / denominator


def bootstrap_ratio(numerator: Sequence[float], denominator: Sequence[float], *,
                    resamples: int = BOOTSTRAP_RESAMPLES, confidence: float = CONFIDENCE,
                    seed: int = BOOTSTRAP_SEED) -> Interval | None:
    """The ratio of medians ``median(numerator) / median(denominator)`` and its percentile bootstrap
    interval (Efron & Tibshirani, "An Introduction to the Bootstrap", 1993, ch. 13). A speed-up is
    ``bootstrap_ratio(baseline_times, times)``.

    Each replication resamples the two samples independently, each with replacement and its own size
    (from one ``random.Random(seed)``, the numerator first), and divides the resampled medians; the
    interval is the ``(1 - confidence) / 2`` and ``(1 + confidence) / 2`` percentiles of the
    replications. Infinite values count as infinitely late: ``x / inf = 0``, ``inf / x = inf``; a
    replication with both medians infinite is undefined and counts as 0 for the lower bound and as inf
    for the upper one, so the interval covers whatever it would have been. Pure and deterministic. None
    when either sample is empty or the ratio of the medians themselves is undefined; :class:`ConfigError`
    for NaN or bad settings (as :func:`bootstrap_median`).
    """
    top = _check_bootstrap(numerator, resamples, confidence)
    bottom = _check_bootstrap(denominator, resamples, confidence)
    if not top or not bottom:
        return None
    value = _divide(_median(top), _median(bottom))
    if value is None:
        return None
    if top[0] == top[-1] and bottom[0] == bottom[-1]:
        return Interval(value, value, value)
    draw = random.Random(seed).random
    lows: list[float] = []
    highs: list[float] = []
    for _ in range(resamples):
        ratio = _divide(_resampled_median(top, draw), _resampled_median(bottom, draw))
        lows.append(0.0 if ratio is None else ratio)
        highs.append(math.inf if ratio is None else ratio)
    lows.sort()
    highs.sort()
    return Interval(value, _percentile(lows, (1 - confidence) / 2), _percentile(highs, (1 + confidence) / 2))


# --------------------------------------------------------------------------------------------------
# Cells: one (method, scenario) over its seeds


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


def _times(records: Sequence[Record], key: str) -> list[float]:
    """Each record's ``key`` (a time to a target), ``inf`` where it never reached it: no time, or the run
    diverged (the model it left is broken, whatever the record says)."""
    return [float(r[key]) if r.get(key) is not None and not r.get("diverged") else math.inf for r in records]


def times_to_target(records: Sequence[RecordLike]) -> dict[tuple[str, str], list[float]]:
    """Each cell's times to the accuracy target over its seeds, keyed ``(method, scenario)`` in first-seen
    order: what :func:`cells`' figures and speed-ups are computed from (``inf``: a seed that never reached
    the target, or diverged). Cells without a target are left out."""
    groups: dict[tuple[str, str], list[Record]] = {}
    for record in _check_records(list(records), "bench records", _RECORDS_FIX):
        if record.get("target_accuracy") is not None:
            groups.setdefault(_label_of_cell(record), []).append(record)
    return {key: _times(group, "time_to_target_s") for key, group in groups.items()}


def _speedup_figure(baseline: list[float], times: list[float]) -> dict[str, float] | None:
    if baseline is times:  # a cell over itself: 1 by definition, not two independent resamplings of one sample
        return {"ratio": 1.0, "ci_low": 1.0, "ci_high": 1.0} if times and math.isfinite(_median(sorted(times))) \
            else None
    ratio = bootstrap_ratio(baseline, times)
    return None if ratio is None else {"ratio": ratio.value, "ci_low": ratio.low, "ci_high": ratio.high}


def cells(records: Sequence[RecordLike]) -> list[dict[str, Any]]:
    """One entry per (method, scenario), in first-seen order, over its seeds.

    Each has ``seeds``, ``reached`` (seeds that reached the target), ``diverged`` (seeds whose run
    diverged: each counts as never reaching any target, whatever its record says, since the model it left
    is broken), ``target_accuracy`` and ``target_loss``, and per figure ``{median, min, max}`` (None where
    no seed has it): ``time_to_target_s`` (a seed that never reached the target counts as infinitely late:
    null in JSON), ``time_to_target_smoothed_s`` (when some record of the bench has it) and
    ``time_to_target_loss_s`` (seeds with a ``target_loss``) and ``test_accuracy``, each of these four
    with ``ci_low``/``ci_high``, the 95% bootstrap interval of the median (:func:`bootstrap_median`); and
    ``job_s``, ``samples``, ``throughput_samples_per_s``, ``local_step_share``,
    ``worst_replica_accuracy`` and ``best_replica_accuracy``.

    Speed-ups in the time to target, ``{ratio, ci_low, ci_high}`` (the ratio of the medians and its
    bootstrap interval, :func:`bootstrap_ratio`; a cell over itself: exactly 1), or None without the two
    cells' times or when neither median is finite:
    ``speedup_vs_allreduce`` (over ``allreduce`` without a variant in the same scenario) and
    ``speedup_vs_best_baseline`` over ``best_baseline``, the scenario's fastest cell (lowest median time
    to target, the first on ties) whose method is one of :data:`BASELINE_METHODS` (None without one).
    """
    groups: dict[tuple[str, str], list[Record]] = {}
    for record in _check_records(list(records), "bench records", _RECORDS_FIX):
        groups.setdefault(_label_of_cell(record), []).append(record)
    everything = [r for group in groups.values() for r in group]
    smoothed = any(r.get("time_to_target_smoothed_s") is not None for r in everything)
    out: list[dict[str, Any]] = []
    times: dict[tuple[str, str], list[float]] = {}
    baselines: dict[str, list[dict[str, Any]]] = {}
    for (method, scenario), group in groups.items():
        targeted = [r for r in group if r.get("target_accuracy") is not None]
        loss_targeted = [r for r in group if r.get("target_loss") is not None]

        def figures(key: str, group: list[Record] = group) -> list[float]:
            return [float(r[key]) for r in group if r.get(key) is not None]

        tta = times[(method, scenario)] = _times(targeted, "time_to_target_s")
        cell: dict[str, Any] = {
            "method": method, "scenario": scenario, "seeds": [r.get("seed") for r in group],
            "target_accuracy": targeted[0]["target_accuracy"] if targeted else None,
            "target_loss": loss_targeted[0]["target_loss"] if loss_targeted else None,
            "reached": sum(math.isfinite(t) for t in tta),
            "time_to_target_s": _spread(tta, interval=True),
            "time_to_target_smoothed_s": _spread(_times(targeted, "time_to_target_smoothed_s") if smoothed else [],
                                                 interval=True),
            "time_to_target_loss_s": _spread(_times(loss_targeted, "time_to_target_loss_s"), interval=True),
            "job_s": _spread(figures("job_s") or figures("wall_s")),
            "test_accuracy": _spread(figures("test_accuracy"), interval=True),
            "worst_replica_accuracy": _spread(figures("worst_replica_accuracy")),
            "best_replica_accuracy": _spread(figures("best_replica_accuracy")),
            "samples": _spread(figures("samples")),
            "throughput_samples_per_s": _spread(figures("throughput_samples_per_s")),
            "local_step_share": _spread([v for r in group if (v := local_share(r)) is not None]),
            "diverged": sum(bool(r.get("diverged")) for r in group),
        }
        out.append(cell)
        if group[0]["algorithm"] in BASELINE_METHODS and tta:
            baselines.setdefault(scenario, []).append(cell)
    best = {scenario: min(candidates, key=lambda c: c["time_to_target_s"]["median"])
            for scenario, candidates in baselines.items()}
    for cell in out:
        key = (cell["method"], cell["scenario"])
        allreduce = times.get((_BASELINE_ALGORITHM, cell["scenario"]))
        fastest = best.get(cell["scenario"])
        cell["speedup_vs_allreduce"] = _speedup_figure(allreduce, times[key]) if allreduce and times[key] else None
        cell["best_baseline"] = fastest["method"] if fastest else None
        if fastest is not None and fastest["method"] == _BASELINE_ALGORITHM:  # the same figure: resample once
            cell["speedup_vs_best_baseline"] = cell["speedup_vs_allreduce"]
        else:
            cell["speedup_vs_best_baseline"] = (_speedup_figure(times[(fastest["method"], fastest["scenario"])],
                                                                times[key]) if fastest and times[key] else None)
    return out


def _best_baselines(table: Sequence[dict[str, Any]]) -> dict[str, str | None]:
    """Each scenario's best baseline (first-seen order), None where it has none."""
    return {c["scenario"]: c["best_baseline"] for c in table}


def _json_cells(table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``cells`` with infinite values (a seed never reached the target; an interval without an upper
    bound) written as null."""
    def clean(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        return None if isinstance(value, float) and not math.isfinite(value) else value
    return [clean(c) for c in table]


# --------------------------------------------------------------------------------------------------
# Tables


def _bound(value: float, spec: str) -> str:
    return format(value, spec) if math.isfinite(value) else "-"


def with_interval(value: float, low: float | None, high: float | None, spec: str, unit: str = "") -> str:
    """``12.3 [11.0, 14.1]``: a value and its interval, the interval left out where it is the value
    itself at this precision; an infinite value or bound is ``-``."""
    text = _bound(value, spec) + (unit if math.isfinite(value) else "")
    if low is None or high is None:
        return text
    low_text, high_text = _bound(low, spec), _bound(high, spec)
    if low_text == high_text == _bound(value, spec):
        return text
    return f"{text} [{low_text}, {high_text}]"


def _seconds(spread: dict[str, float] | None) -> str:
    """The median time over seeds and its 95% interval (``-`` for never); ``n/a`` for no figure."""
    if spread is None:
        return "n/a"
    return spread_text(spread, ".1f")


def spread_text(spread: dict[str, float], spec: str, unit: str = "", scale: float = 1.0) -> str:
    """A ``{median, ci_low, ci_high}`` figure as :func:`with_interval` writes it, scaled by ``scale``."""
    low, high = spread.get("ci_low"), spread.get("ci_high")
    return with_interval(scale * spread["median"], None if low is None else scale * low,
                         None if high is None else scale * high, spec, unit)


def percent_text(spread: dict[str, float] | None, *, interval: bool = True) -> str:
    """A fraction's ``{median, ...}`` figure in percent, with its interval unless ``interval`` is False."""
    if spread is None:
        return "-"
    if not interval:
        return f"{100 * spread['median']:.2f}%"
    return spread_text(spread, ".2f", "%", scale=100)


def _speedup(cell: dict[str, Any], baseline: dict[str, Any] | None, figure: dict[str, float] | None) -> str:
    """A speed-up's cell: ``2.00x [1.50, 3.10]``; ``-`` when ``cell`` never reached the target, ``NAME
    never`` when only the baseline did not, ``n/a`` without the two cells' times."""
    mine = cell["time_to_target_s"]
    if baseline is None or not mine or not baseline["time_to_target_s"]:
        return "n/a"
    if not math.isfinite(mine["median"]) or mine["median"] <= 0 or figure is None:
        return "-"
    if not math.isfinite(baseline["time_to_target_s"]["median"]):
        return f"{baseline['method']} never"
    return ratio_text(figure)


def ratio_text(figure: dict[str, float]) -> str:
    """A speed-up's ``{ratio, ci_low, ci_high}``: ``2.00x [1.50, 3.10]``."""
    return with_interval(figure["ratio"], figure["ci_low"], figure["ci_high"], ".2f", "x")


def _targets(table: Sequence[dict[str, Any]], key: str) -> str:
    return "/".join(f"{v:g}" for v in sorted({c[key] for c in table if c[key] is not None}))


def _tta_text(table: Sequence[dict[str, Any]]) -> str:
    """The time-to-accuracy table of ``cells``, and under it each scenario's best baseline."""
    by_method = {(c["method"], c["scenario"]): c for c in table}
    best = _best_baselines(table)
    targets = sorted({c["target_accuracy"] for c in table if c["target_accuracy"] is not None})
    title = ("Time to " + "/".join(f"{100 * t:g}%" for t in targets) + " test accuracy"
             if targets else "No --target-accuracy: no time to target")
    optional = {  # column: shown when some cell has the figure
        "time to target, smoothed (s)": any(c["time_to_target_smoothed_s"] for c in table),
        f"time to loss {_targets(table, 'target_loss')} (s)": any(c["time_to_target_loss_s"] for c in table),
        "worst replica accuracy": any(c["worst_replica_accuracy"] for c in table),
    }
    columns = list(_TTA_COLUMNS)
    for name, shown in optional.items():
        if shown:
            columns.insert(columns.index("job time (s)" if name.endswith("accuracy") else "final accuracy"), name)
    lines = [f"{title} (median over seeds [95% percentile-bootstrap interval of the median]; speed-up: the "
             "ratio of the medians [95% bootstrap interval]; `-`: not reached, or no upper bound)", "",
             "| " + " | ".join(columns) + " |",
             "|" + "|".join("---" if i < 2 else "---:" for i in range(len(columns))) + "|"]
    for cell in table:
        seeds = len(cell["seeds"])
        tta = _seconds(cell["time_to_target_s"])
        if cell["time_to_target_s"] is not None and seeds > 1 and cell["reached"] < seeds:
            tta += f" ({cell['reached']}/{seeds} reached)"
        best_cell = by_method.get((best[cell["scenario"]], cell["scenario"])) if best[cell["scenario"]] else None
        speedups = [_speedup(cell, by_method.get((_BASELINE_ALGORITHM, cell["scenario"])),
                             cell["speedup_vs_allreduce"]),
                    _speedup(cell, best_cell, cell["speedup_vs_best_baseline"])]
        if cell["diverged"]:
            tta += f" ({cell['diverged']}/{seeds} DIVERGED)"
            speedups = ["diverged" if s in ("-", "n/a") else f"{s}, {cell['diverged']} diverged" for s in speedups]
        samples = cell["samples"]
        values = {
            "method": cell["method"], "scenario": cell["scenario"], "time to target (s)": tta,
            "speed-up vs allreduce": speedups[0], "speed-up vs best baseline": speedups[1],
            "time to target, smoothed (s)": _seconds(cell["time_to_target_smoothed_s"]),
            f"time to loss {_targets(table, 'target_loss')} (s)": _seconds(cell["time_to_target_loss_s"]),
            "final accuracy": percent_text(cell["test_accuracy"]),
            "worst replica accuracy": percent_text(cell["worst_replica_accuracy"], interval=False),
            "job time (s)": "n/a" if cell["job_s"] is None else f"{cell['job_s']['median']:.1f}",
            "samples": "-" if samples is None else f"{samples['median']:.0f}", "seeds": str(seeds),
        }
        lines.append("| " + " | ".join(_cell(values[c]) for c in columns) + " |")
    if targets:
        names = ", ".join(f"`{m}`" for m in sorted(BASELINE_METHODS))
        lines += ["", f"Best baseline per scenario (the fastest of {names}, with any variant): "
                  + "; ".join(f"{scenario}: {method or 'n/a'}" for scenario, method in best.items())]
    return "\n".join(lines) + "\n"


def tta_table(records: Sequence[RecordLike]) -> str:
    """The time-to-accuracy table: one row per (method, scenario) over its seeds (:func:`cells`): the
    median time to target and its 95% bootstrap interval, the speed-ups over ``allreduce`` and over the
    scenario's best baseline (named under the table), final accuracy, the median job time and samples;
    and where some record has them, the smoothed time to target, the time to the loss target and the
    worst replica's final accuracy (the median over seeds). Raises :class:`ConfigError` if a record lacks
    a required key."""
    return _tta_text(cells(records))


def _throughput_text(checked: Sequence[Record]) -> str:
    """The throughput table of checked, harmonized records: one row per run (per seed)."""
    lines = ["Throughput (samples/s after warm-up, over the window in which every worker trains; it ignores "
             "when the job ends: read it with the job time above)", "",
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


def _tables(checked: Sequence[Record], table: Sequence[dict[str, Any]], tta_only: bool = False) -> str:
    parts = [_header(checked), "", _tta_text(table)] + _lr_text(checked)
    return "\n".join(parts if tta_only else parts + [_throughput_text(checked)])


def _lr_text(records: Sequence[Record]) -> list[str]:
    """When a learning-rate pilot chose each cell's rate (``lr_pilot``): one line per cell, every value's
    time to target (or final accuracy) and the one chosen; nothing otherwise.

    A bench resumed after some of its pilot's runs were made again carries two pilots for a cell: its
    records are in the order they ran, so the last one's is the newest, the one shown, and the line says
    how many the cell's records carry."""
    piloted: dict[tuple[str, str], list[dict[str, Any]]] = {}
    seen: dict[tuple[str, str], list[list[dict[str, Any]]]] = {}
    for record in records:
        runs = record.get("lr_pilot")
        if runs:
            cell = (method_label(record), str(record.get("scenario")))
            piloted[cell] = list(runs)  # the newest wins
            pilots = seen.setdefault(cell, [])
            if list(runs) not in pilots:
                pilots.append(list(runs))
    if not piloted:
        return []
    lines = pilot_lines(piloted)
    for i, cell in enumerate(piloted):
        if len(seen[cell]) > 1:
            lines[i] += f" (the newest of the {len(seen[cell])} pilots this cell's records carry)"
    return ["", "Learning rate per cell, chosen by the pilot (time to target on the pilot's budget, or the final "
                "accuracy where it was not reached):", ""] + [f"- {line}" for line in lines] + [""]


def _checked(records: Sequence[RecordLike], source: str) -> list[dict[str, Any]]:
    return harmonize_limits(_check_records(list(records), source, _RECORDS_FIX))


def bench_table(records: Sequence[RecordLike]) -> str:
    """Render runs as GitHub markdown, preceded by a one-line header of the shared settings: the time to
    accuracy first (:func:`tta_table`), then one throughput row per run (per seed).

    Throughput rows are grouped by scenario in first-seen order. Ratios are taken against the
    ``allreduce`` record without a variant of the same scenario (and seed) and of scenario ``homogeneous``;
    ``n/a`` when that record is missing. Raises :class:`ConfigError` if a record lacks a required key.
    """
    checked = _checked(records, "bench_table records")
    return _tables(checked, cells(checked))


def _report_text(checked: Sequence[Record], table: Sequence[dict[str, Any]], command: str | None,
                 tta_only: bool = False) -> str:
    return "\n".join((["```", command, "```", ""] if command else []) + [_tables(checked, table, tta_only)])


def report_markdown(records: Sequence[RecordLike], command: str | None = None, *, tta_only: bool = False) -> str:
    """What ``bench.md`` holds under its title and ``prague report`` prints: the command that produced the
    runs (a fenced block, when given), then :func:`bench_table`; ``tta_only`` (``prague report --tta``):
    the time-to-accuracy table without the throughput rows of every seed. The docs' generated tables are
    this text. Raises :class:`ConfigError` if a record lacks a required key."""
    checked = _checked(records, "report records")
    return _report_text(checked, cells(checked), command, tta_only)


def _summary(table: list[dict[str, Any]], command: str | None) -> dict[str, Any]:
    return {"schema_version": SCHEMA_VERSION, "command": command, "cells": _json_cells(table),
            "best_baselines": _best_baselines(table)}


def report_json(records: Sequence[RecordLike], command: str | None = None) -> dict[str, Any]:
    """``prague report --json``: ``{"schema_version", "command", "cells", "best_baselines"}``, the cells as
    ``bench.json`` holds them (:func:`cells`, infinite values as null) and each scenario's best baseline
    (null without one). Raises :class:`ConfigError` if a record lacks a required key."""
    return _summary(cells(_checked(records, "report records")), command)


# --------------------------------------------------------------------------------------------------
# Plots


def _methods(records: Sequence[Record]) -> list[str]:
    return list(dict.fromkeys(method_label(r) for r in records))


def method_colours(methods: Sequence[str]) -> dict[str, Any]:
    """One colour per method, shared by both plots so a method looks the same in each."""
    cmap = colormaps["tab10" if len(methods) <= 10 else "tab20"]
    return {method: cmap(i % cmap.N) for i, method in enumerate(methods)}


def png_bytes(fig: Figure) -> bytes:
    """Render ``fig`` with the Agg backend (no display, no pyplot global state) to PNG bytes."""
    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120, bbox_inches="tight")
    return buffer.getvalue()


def _throughput_figure(records: Sequence[Record]) -> Figure:
    groups = _by_scenario(records)
    methods = _methods(records)
    colours = method_colours(methods)
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
    colours = method_colours(_methods(records))
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


#: ``bench.md``'s first lines; :func:`report_markdown` follows.
BENCH_MD_TITLE = "# prague benchmark\n\n"


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
    checked = _checked(records, "write_bench records")
    try:
        # allow_nan=False: NaN would make bench.json unreadable by strict JSON parsers.
        json.dumps(checked, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"benchmark records cannot be written as JSON ({exc}); keep record values to "
            "str, int, float (finite), bool, None, lists and dicts"
        ) from exc
    table = cells(checked)
    markdown = BENCH_MD_TITLE + _report_text(checked, table, command)
    throughput_png = png_bytes(_throughput_figure(checked))
    accuracy_png = png_bytes(_accuracy_figure(checked))

    out_dir = Path(out_dir)
    paths = {
        "json": out_dir / "bench.json",
        "md": out_dir / "bench.md",
        "throughput": out_dir / "throughput.png",
        "accuracy": out_dir / "accuracy.png",
    }
    document: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "command": command, "records": checked,
                                **_summary(table, command)}
    if resume is not None:
        document["resume"] = dict(resume)
    atomic_write_json(paths["json"], document)
    atomic_write_text(paths["md"], markdown)
    atomic_write_bytes(paths["throughput"], throughput_png)
    atomic_write_bytes(paths["accuracy"], accuracy_png)
    return paths
