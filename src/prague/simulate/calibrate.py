"""Fit the cost model to a real ``prague bench`` run, and compare predicted with measured throughput.

``prague simulate --calibrate OUT/bench.json``: every record of that benchmark is simulated with the
same method, options, scenario (same seed: the same slow iterations), worker count, steps, warm-up,
batch size and nominal compute time, on a :class:`~prague.sim.cluster.Cluster` fitted to it, and the
predicted throughput is shown next to the measured one. That is the fit's error, in-sample: it says how
well the model can be bent to the data, not how well it predicts. So every calibration also reports an
out-of-sample error, per (method, scenario), on records the fit did not see:

* ``--check OTHER/bench.json``: the cluster fitted on the first benchmark predicts every record of the
  second (another scenario, worker count, emulated compute time or day; with real compute the fitted
  compute time applies to it too, so check against the same model and batch size);
* without ``--check``, leave-one-scenario-out: each scenario's records are predicted by a cluster fitted
  (compute model, GG round trip and every fitted value) on the benchmark's other scenarios only; a
  benchmark of one scenario cannot be split, and calibration asks for ``--check``.

What is measured and what is fitted (one machine: all workers on one node, so only the intra-node
link matters):

* compute, measured: from the per-step records the benchmark keeps beside ``bench.json``
  (``runs/<method>_<scenario>/metrics/rankR.jsonl``), minus each step's injected slowdown delay
  (``(factor - 1) x compute_ms``, emulated mode): the nominal time is ``compute_ms``, the rest of the
  mean is the fixed overhead, and the spread gives the coefficient of variation. Methods other than
  ``allreduce`` are used (DDP adds work to backward that the all-reduce fit absorbs). Without per-step
  files, the records' ``mean_compute_s`` are used instead.
* the GG round trip, measured: the mean ``wait_s`` of ``prague:smart`` or ``prague:random`` runs
  without slowdowns and with ``--overlap off`` (their answer needs no partner, so their wait is the RPC
  alone; overlapped, the RPC is hidden behind compute and the wait is something else).
* backward's share of the compute, known: 0 when every record ran emulated compute (the runtime's
  :class:`~prague.workload.emulate.EmulatedCompute` waits in forward; backward only fills the gradients,
  so DDP has nothing to hide its all-reduce behind), else the base cluster's (not fitted: with one
  all-reduce method it trades off against the ring factor).
* fitted, in this order, each by a one-dimensional search minimising the squared log error between
  predicted and measured throughput: the link bandwidth on the P-Reduce methods (``prague``, ``dssync``,
  ``adpsgd``); the all-reduce's ring factor on ``allreduce`` (its time over the alpha-beta ring's, its
  buckets played out against backward); the server link's bandwidth and the server's work per push on
  ``ps`` and ``ps-eager``, with the shard's receiving and sending either overlapping (full duplex) or
  sharing one queue, whichever fits better. A group of methods absent from the records fitted on keeps
  the base cluster's value.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean, pstdev
from typing import Any

from prague.errors import ConfigError
from prague.metrics.record import RunRecord
from prague.metrics.report import load_records
from prague.sim.cluster import LOCAL, Cluster, Link
from prague.simulate.run import SimConfig, simulate

_PREDUCE_METHODS = ("prague", "dssync", "adpsgd")
_PS_METHODS = ("ps", "ps-eager")


@dataclass(frozen=True)
class Calibration:
    """The cluster fitted on the whole benchmark, where each value came from, one comparison row per record
    of it (``rows``: in-sample), and one per record predicted by a fit that did not see it (``held_out``:
    out-of-sample, ``held_out_how`` says which records each fit saw; ``held_out_clusters``, those fits by
    their ``fitted_on``). A row: method, scenario, nproc, measured and predicted throughput (samples/s),
    ``error`` (predicted / measured - 1, None when nothing was measured), both fractions of the no-wait
    limit and the simulated ``record``; a held-out row also ``fitted_on``."""

    cluster: Cluster
    sources: dict[str, str]
    rows: list[dict[str, Any]]
    held_out: list[dict[str, Any]]
    held_out_how: str
    held_out_clusters: dict[str, Cluster]


def _run_dir(bench: Path, record: RunRecord) -> Path:
    """Where ``prague bench`` put this record's run (see :func:`prague.cli.cmd_bench`)."""
    label = record.label.replace(":", "-")
    return bench.parent / "runs" / f"{label}_{str(record.scenario).replace(':', '-')}"


def _step_rows(bench: Path, record: RunRecord) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for path in sorted((_run_dir(bench, record) / "metrics").glob("rank*.jsonl")):
        try:
            rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        except (OSError, ValueError):
            return []
    return rows


def _compute_model(bench: Path, records: list[RunRecord]) -> tuple[float, float, float, str]:
    """``(nominal_s, overhead_s, cv, source)`` of the compute time, measured (see the module docstring)."""
    chosen = [r for r in records if r.algorithm != "allreduce"] or records
    nominal = fmean(float(r.compute_ms or 0.0) for r in chosen) / 1e3
    samples: list[float] = []
    for record in chosen:
        warmup = int(record.warmup_steps or 0)
        for row in _step_rows(bench, record):
            if int(row.get("step", 0)) >= warmup:
                samples.append(float(row["compute_s"]) - (float(row.get("slowdown", 1.0)) - 1.0) * nominal)
    if samples:
        mean, source = fmean(samples), "measured per step (metrics/rankR.jsonl)"
        cv = pstdev(samples) / mean if mean > 0 else 0.0
    else:
        per_run = []
        for record in chosen:
            from prague.hetero.spec import parse_scenario

            n = int(record.nproc or 1)
            scenario = parse_scenario(str(record.scenario))
            extra = fmean(scenario.mean_slowdown(r, n) for r in range(n)) - 1.0
            per_run += [float(c) - extra * nominal for c in record.mean_compute_s or []]
        if not per_run:
            raise ConfigError("the benchmark records carry no compute times (mean_compute_s); "
                              "re-run the benchmark with a current prague")
        mean, cv, source = fmean(per_run), 0.0, "measured means (bench.json mean_compute_s)"
    if nominal <= 0:  # real compute: no nominal time, everything scales with slowdowns
        return mean, 0.0, cv, source
    return nominal, max(0.0, mean - nominal), cv, source


def _blocking(record: RunRecord) -> bool:
    """Whether a ``prague`` record ran with ``--overlap off`` (records older than the option did)."""
    stats = (record.algorithm_stats or [{}])[0] or {}
    return stats.get("overlap", "off") == "off"


def _gg_rtt(records: list[RunRecord]) -> float | None:
    waits = [fmean(r.mean_wait_s) for r in records
             if r.algorithm == "prague" and r.variant in ("smart", "random")
             and r.scenario == "homogeneous" and r.mean_wait_s and _blocking(r)]
    return fmean(waits) if waits else None


def sim_config(record: RunRecord, cluster: Cluster) -> SimConfig:
    """The simulated twin of one benchmark record (same method, options, scenario, size and seed)."""
    from prague.algorithms.registry import parse_method

    stats = (record.algorithm_stats or [{}])[0] or {}
    declared = {o.name for o in parse_method(record.label)[0].option_infos}
    options: dict[str, Any] = {}
    for key, option in (("group_size", "group_size"), ("shards", "ps_shards"), ("max_staleness", "max_staleness"),
                        ("staleness_lr", "staleness_lr"), ("generator", "generator"), ("overlap", "overlap"),
                        ("max_in_flight", "max_in_flight"), ("when_busy", "when_busy")):
        if stats.get(key) is not None and option in declared:
            options[option] = stats[key]
    # An emulated run's nominal compute is its setting (--compute-ms), not something fitted: a benchmark
    # at another compute time is predicted at its own.
    nominal_ms = float(record.compute_ms) if record.compute_mode == "emulated" and record.compute_ms else None
    return SimConfig.of(
        algorithm=record.label, scenario=str(record.scenario), nproc=int(record.nproc or 1), nodes=1,
        steps=int(record.steps or 1), batch_size=int(record.batch_size or 32), model=str(record.model),
        data=str(record.data or "digits"), seed=int(record.seed or 0),
        warmup_steps=int(record.warmup_steps or 0), cluster=cluster, options=options, compute_ms=nominal_ms,
    )


def _error(records: Iterable[RunRecord], cluster: Cluster) -> float:
    total = 0.0
    for record in records:
        measured = float(record.throughput_samples_per_s)
        simulated = simulate(sim_config(record, cluster)).throughput_samples_per_s
        if measured > 0 and simulated > 0:
            total += math.log(simulated / measured) ** 2
    return total


def _search(objective: Callable[[float], float], lo: float, hi: float, iterations: int = 16) -> float:
    """Golden-section search of ``objective`` over [lo, hi] in log space (a coarse grid first)."""
    grid = [lo * (hi / lo) ** (i / 12) for i in range(13)]
    best = min(range(13), key=lambda i: objective(grid[i]))
    a, b = math.log(grid[max(best - 1, 0)]), math.log(grid[min(best + 1, 12)])
    g = (math.sqrt(5) - 1) / 2
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = objective(math.exp(c)), objective(math.exp(d))
    for _ in range(iterations):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = objective(math.exp(c))
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = objective(math.exp(d))
    return math.exp((a + b) / 2)


def _load(bench_json: Path, flag: str) -> tuple[Path, list[RunRecord]]:
    """The real (not simulated) records of the benchmark ``bench_json`` (a ``bench.json`` or its folder)."""
    bench = Path(bench_json)
    if bench.is_dir():
        bench = bench / "bench.json"
    try:
        records = [r for r in load_records(bench) if not r.simulated]
    except ConfigError as exc:
        raise ConfigError(f"{flag}: {exc}") from None
    if not records:
        raise ConfigError(f"{flag} {str(bench)!r} holds only simulated records; pass a real benchmark's bench.json")
    return bench, records


def fit(bench: Path, records: list[RunRecord], base: Cluster = LOCAL) -> tuple[Cluster, dict[str, str]]:
    """``base`` fitted to ``records`` of the benchmark at ``bench`` (whose run folders hold the per-step
    files), and where each value came from (see the module docstring)."""
    nominal, overhead, cv, compute_source = _compute_model(bench, records)
    sources = {"compute": compute_source}
    cluster = base.replace_fields(name=f"calibrated:{bench.parent.name}", compute_s=nominal,
                                  compute_overhead_s=overhead, compute_cv=cv, compute_dist="normal")
    if all(r.compute_mode == "emulated" for r in records):
        cluster = cluster.replace_fields(backward_share=0.0)
        sources["backward_share"] = "emulated compute: the wait is in forward, backward only fills the gradients"
    else:
        sources["backward_share"] = f"assumed: the base cluster's {base.backward_share:.3g} (not fitted)"
    rtt = _gg_rtt(records)
    if rtt is not None:
        cluster = cluster.replace_fields(gg_rtt_s=max(0.0, rtt - cluster.gg_service_s))
        sources["gg_rtt"] = "measured: mean wait of prague:smart/random, homogeneous"

    def link(bandwidth: float) -> Link:
        return Link(cluster.intra.latency_s, bandwidth)

    preduce = [r for r in records if r.algorithm in _PREDUCE_METHODS]
    if preduce:
        bw = _search(lambda b: _error(preduce, cluster.replace_fields(intra=link(b), inter=link(b))), 1e7, 1e11)
        cluster = cluster.replace_fields(intra=link(bw), inter=link(bw))
        sources["link"] = f"fitted on {len(preduce)} P-Reduce runs"
    allreduce = [r for r in records if r.algorithm == "allreduce"]
    if allreduce:
        factor = _search(lambda f: _error(allreduce, cluster.replace_fields(allreduce_ring_factor=f)), 0.05, 20.0)
        cluster = cluster.replace_fields(allreduce_ring_factor=factor)
        sources["allreduce_ring_factor"] = f"fitted on {len(allreduce)} allreduce runs"
    ps = [r for r in records if r.algorithm in _PS_METHODS]
    if ps:
        latency = cluster.intra.latency_s
        fits = []
        for duplex in (False, True):  # one machine's loopback may behave as either: keep the better
            fit = cluster.replace_fields(ps_full_duplex=duplex)
            for _ in range(2):  # bandwidth and server work trade off: alternate twice
                bw = _search(lambda b: _error(ps, fit.replace_fields(server=Link(latency, b))), 1e7, 1e11)
                fit = fit.replace_fields(server=Link(latency, bw))
                apply_s = _search(lambda a: _error(ps, fit.replace_fields(ps_apply_s=a)), 1e-4, 1.0)
                fit = fit.replace_fields(ps_apply_s=apply_s)
            fits.append((_error(ps, fit), duplex, fit))
        _, duplex, cluster = min(fits, key=lambda f: f[0])
        sources["server"] = (f"link bandwidth and work per push fitted on {len(ps)} parameter-server runs "
                             f"({'full' if duplex else 'half'} duplex fitted better)")
    return cluster, sources


def compare(records: Iterable[RunRecord], cluster: Cluster, fitted_on: str | None = None) -> list[dict[str, Any]]:
    """One row per record: its measured throughput beside the one simulated on ``cluster`` (see
    :class:`Calibration`); ``fitted_on``, when given, names the records the cluster was fitted on."""
    rows = []
    for record in records:
        sim = simulate(sim_config(record, cluster))
        measured = float(record.throughput_samples_per_s)
        predicted = float(sim.throughput_samples_per_s)
        row: dict[str, Any] = {
            "method": record.label, "scenario": record.scenario, "nproc": record.nproc,
            "measured": measured, "predicted": predicted,
            "error": predicted / measured - 1.0 if measured > 0 else None,
            "measured_fraction_of_limit": record.fraction_of_limit,
            "predicted_fraction_of_limit": sim.fraction_of_limit,
        }
        if fitted_on is not None:
            row["fitted_on"] = fitted_on
        row["record"] = sim
        rows.append(row)
    return rows


def error_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``runs``, ``mean_abs_error`` and ``max_abs_error`` of comparison rows (None without any error)."""
    errors = [abs(row["error"]) for row in rows if row["error"] is not None]
    return {"runs": len(rows), "mean_abs_error": fmean(errors) if errors else None,
            "max_abs_error": max(errors) if errors else None}


def calibrate(bench_json: Path, base: Cluster = LOCAL, check: Path | None = None) -> Calibration:
    """Fit ``base`` to the benchmark at ``bench_json``, simulate every record on the result (in-sample),
    and predict records no fit saw (out-of-sample): every record of the benchmark ``check``, or without it
    each scenario of ``bench_json`` from a fit on its other scenarios.

    Raises ConfigError, before fitting anything, for a missing or unreadable benchmark, one of simulated
    records only, a record the simulator cannot replay, ``check`` naming the fitted benchmark itself, or
    (without ``check``) a benchmark of a single scenario.
    """
    bench, records = _load(bench_json, "--calibrate")
    held: list[RunRecord] = []
    check_path = None
    if check is not None:
        check_path, held = _load(check, "--check")
        if check_path.resolve() == bench.resolve():
            raise ConfigError(f"--check {str(check_path)!r} is the benchmark --calibrate fits; an out-of-sample "
                              "error needs another one: pass the bench.json of a second benchmark")
    for record in records + held:  # a record the simulator cannot replay fails now, not after the fit
        sim_config(record, base)
    scenarios = list(dict.fromkeys(str(r.scenario) for r in records))
    if check is None and len(scenarios) < 2:
        raise ConfigError(
            f"--calibrate {str(bench)!r} holds one scenario ({scenarios[0]}): leave-one-scenario-out needs two or "
            "more for an out-of-sample error; pass --check OTHER/bench.json (a benchmark the fit does not see), "
            "or calibrate on a benchmark of several scenarios (--scenarios homogeneous,paper:5)")
    cluster, sources = fit(bench, records, base)
    rows = compare(records, cluster)
    held_out: list[dict[str, Any]] = []
    clusters: dict[str, Cluster] = {}
    if check_path is not None:
        how = f"fitted on {bench}, checked against {check_path}"
        clusters[str(bench)] = cluster
        held_out = compare(held, cluster, fitted_on=str(bench))
    else:
        how = "leave-one-scenario-out: each scenario predicted by a cluster fitted on the other scenarios"
        for scenario in scenarios:
            others = [s for s in scenarios if s != scenario]
            label = "scenarios " + ",".join(others)
            clusters[label], _ = fit(bench, [r for r in records if str(r.scenario) != scenario], base)
            held_out += compare([r for r in records if str(r.scenario) == scenario], clusters[label], label)
    return Calibration(cluster, sources, rows, held_out, how, clusters)


def _percent(value: float | None, sign: bool = False) -> str:
    return "n/a" if value is None else f"{100 * value:{'+' if sign else ''}.0f}%"


def _summary_line(rows: list[dict[str, Any]]) -> str:
    summary = error_summary(rows)
    return (f"{summary['runs']} runs, mean |error| {_percent(summary['mean_abs_error'])}, "
            f"max |error| {_percent(summary['max_abs_error'])}")


def calibration_table(cal: Calibration) -> str:
    """The comparison as markdown tables, in-sample then out-of-sample, with the fitted cluster above them."""
    c = cal.cluster
    lines = [
        f"cluster {c.name}: compute {c.compute_s * 1e3:.1f} ms + {c.compute_overhead_s * 1e3:.1f} ms overhead, "
        f"cv {c.compute_cv:.3f}, backward {c.backward_share:.2f} of it; link "
        f"{c.intra.bandwidth_bytes_per_s / 1e6:.0f} MB/s, {c.intra.latency_s * 1e6:.0f} us; allreduce ring factor "
        f"{c.allreduce_ring_factor:.2f}; GG round trip {c.gg_rtt_s * 1e3:.2f} ms"
        + (f"; PS server link {c.server.bandwidth_bytes_per_s / 1e6:.0f} MB/s, {c.ps_apply_s * 1e3:.1f} ms per push"
           if c.server else ""),
        "",
        f"In-sample (the fit's own records): {_summary_line(cal.rows)}",
        "",
        "| method | scenario | measured (samples/s) | predicted (samples/s) | error "
        "| measured / predicted of no-wait limit |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in cal.rows:
        mf, pf = row["measured_fraction_of_limit"], row["predicted_fraction_of_limit"]
        frac = f"{100 * mf:.0f}% / {100 * pf:.0f}%" if mf is not None and pf is not None else "-"
        lines.append(f"| {row['method']} | {row['scenario']} | {row['measured']:.1f} | {row['predicted']:.1f} | "
                     f"{_percent(row['error'], sign=True)} | {frac} |")
    lines += [
        "",
        f"Out-of-sample ({cal.held_out_how}): {_summary_line(cal.held_out)}",
        "",
        "| method | scenario | fitted on | measured (samples/s) | predicted (samples/s) | error |",
        "|---|---|---|---:|---:|---:|",
    ]
    for row in cal.held_out:
        lines.append(f"| {row['method']} | {row['scenario']} | {row['fitted_on']} | {row['measured']:.1f} | "
                     f"{row['predicted']:.1f} | {_percent(row['error'], sign=True)} |")
    return "\n".join(lines) + "\n"


def calibration_report(cal: Calibration, bench: Path, check: Path | None) -> dict[str, Any]:
    """The calibration as JSON values (``OUT/calibration.json``): the fitted cluster and its sources, and the
    in-sample and out-of-sample rows with their error summaries."""
    def plain(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in row.items() if k != "record"} for row in rows]

    return {
        "bench": str(bench), "check": None if check is None else str(check),
        "cluster": cal.cluster.describe(), "sources": cal.sources,
        "in_sample": {**error_summary(cal.rows), "rows": plain(cal.rows)},
        "out_of_sample": {**error_summary(cal.held_out), "how": cal.held_out_how,
                          "clusters": {k: v.describe() for k, v in cal.held_out_clusters.items()},
                          "rows": plain(cal.held_out)},
    }
