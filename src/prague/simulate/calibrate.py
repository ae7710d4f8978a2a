"""Fit the cost model to a real ``prague bench`` run, and compare simulated with measured throughput.

``prague simulate --calibrate OUT/bench.json``: every record of that benchmark is simulated with the
same method, options, scenario (same seed: the same slow iterations), worker count, steps, warm-up and
batch size, on a :class:`~prague.sim.cluster.Cluster` fitted to it, and the simulated throughput is
shown next to the measured one.

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
* fitted, in this order, each by a one-dimensional search minimising the squared log error between
  simulated and measured throughput: the link bandwidth on the P-Reduce methods (``prague``, ``dssync``,
  ``adpsgd``); the all-reduce's exposed fraction on ``allreduce``; the server link's bandwidth and the
  server's work per push on ``ps`` and ``ps-eager``, with the shard's receiving and sending either
  overlapping (full duplex) or sharing one queue, whichever fits better. A group of methods absent
  from the benchmark keeps the base cluster's value.
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
    """The fitted cluster, where each value came from, and one comparison row per benchmark record."""

    cluster: Cluster
    sources: dict[str, str]
    rows: list[dict[str, Any]]


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
    stats = (record.algorithm_stats or [{}])[0] or {}
    options: dict[str, Any] = {}
    for key, option in (("group_size", "group_size"), ("shards", "ps_shards"), ("max_staleness", "max_staleness"),
                        ("staleness_lr", "staleness_lr"), ("generator", "generator"), ("overlap", "overlap"),
                        ("max_in_flight", "max_in_flight"), ("when_busy", "when_busy")):
        if stats.get(key) is not None:
            options[option] = stats[key]
    return SimConfig(
        algorithm=record.label, scenario=str(record.scenario), nproc=int(record.nproc or 1), nodes=1,
        steps=int(record.steps or 1), batch_size=int(record.batch_size or 32), model=str(record.model),
        data=str(record.data or "digits"), seed=int(record.seed or 0),
        warmup_steps=int(record.warmup_steps or 0), cluster=cluster, options=options,
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


def calibrate(bench_json: Path, base: Cluster = LOCAL) -> Calibration:
    """Fit ``base`` to the benchmark at ``bench_json`` and simulate every record on the result."""
    bench = Path(bench_json)
    if bench.is_dir():
        bench = bench / "bench.json"
    records = [r for r in load_records(bench) if not r.simulated]
    if not records:
        raise ConfigError(f"{str(bench)!r} holds only simulated records; calibrate against a real benchmark")
    nominal, overhead, cv, compute_source = _compute_model(bench, records)
    sources = {"compute": compute_source}
    cluster = base.replace_fields(name=f"calibrated:{bench.parent.name}", compute_s=nominal,
                                  compute_overhead_s=overhead, compute_cv=cv, compute_dist="normal")
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
        exposed = _search(lambda e: _error(allreduce, cluster.replace_fields(allreduce_exposed=e)), 0.05, 20.0)
        cluster = cluster.replace_fields(allreduce_exposed=exposed)
        sources["allreduce_exposed"] = f"fitted on {len(allreduce)} allreduce runs"
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

    rows = []
    for record in records:
        sim = simulate(sim_config(record, cluster))
        measured = float(record.throughput_samples_per_s)
        simulated = float(sim.throughput_samples_per_s)
        rows.append({
            "method": record.label, "scenario": record.scenario, "nproc": record.nproc,
            "measured": measured, "simulated": simulated,
            "error": simulated / measured - 1.0 if measured > 0 else None,
            "measured_fraction_of_limit": record.fraction_of_limit,
            "simulated_fraction_of_limit": sim.fraction_of_limit,
            "record": sim,
        })
    return Calibration(cluster, sources, rows)


def calibration_table(cal: Calibration) -> str:
    """The comparison as a markdown table, with the fitted cluster in a line above it."""
    c = cal.cluster
    lines = [
        f"cluster {c.name}: compute {c.compute_s * 1e3:.1f} ms + {c.compute_overhead_s * 1e3:.1f} ms overhead, "
        f"cv {c.compute_cv:.3f}; link {c.intra.bandwidth_bytes_per_s / 1e6:.0f} MB/s, "
        f"{c.intra.latency_s * 1e6:.0f} us; allreduce exposed {c.allreduce_exposed:.2f}; "
        f"GG round trip {c.gg_rtt_s * 1e3:.2f} ms"
        + (f"; PS server link {c.server.bandwidth_bytes_per_s / 1e6:.0f} MB/s, {c.ps_apply_s * 1e3:.1f} ms per push"
           if c.server else ""),
        "",
        "| method | scenario | measured (samples/s) | simulated (samples/s) | error "
        "| measured / sim of no-wait limit |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in cal.rows:
        err = "n/a" if row["error"] is None else f"{100 * row['error']:+.0f}%"
        mf, sf = row["measured_fraction_of_limit"], row["simulated_fraction_of_limit"]
        frac = f"{100 * mf:.0f}% / {100 * sf:.0f}%" if mf is not None and sf is not None else "-"
        lines.append(f"| {row['method']} | {row['scenario']} | {row['measured']:.1f} | {row['simulated']:.1f} | "
                     f"{err} | {frac} |")
    return "\n".join(lines) + "\n"
