"""Every table of the docs from the JSON a measurement wrote: ``prague report FILE``.

A ``bench.json`` (``prague bench``) gives its bench's tables (:func:`prague.metrics.report.report_markdown`);
the JSON of the other measurements says which it is in its ``benchmark`` field, and each kind has one
function here that turns it into the table the docs show:

* ``group_generator`` (``benchmarks/group_generator.py``): the service measured with real gRPC clients
  (``results``), or its latency curve simulated at scale (``simulated``);
* ``torchrun_faults`` (``benchmarks/torchrun_faults.py``): the fault matrix on two emulated machines;
* ``simulator`` (``benchmarks/simulator.py --failures``): time to finish under failure rates.

Several benches together give README's decision table (``prague report --decide FILE...``,
:func:`decision_table`): per scenario of each, the fastest method, the methods level with it, and the
fastest of the project's own methods against the scenario's best baseline.

The docs hold each table between ``<!-- prague report FILE -->`` and ``<!-- end report -->``, and a test
checks that it is exactly what this module prints for FILE, so no table can drift from its data.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prague.errors import ConfigError


def report_file(path: Path, tta_only: bool = False) -> str:
    """The markdown tables of the measurement saved in ``path``: a ``bench.json`` (or the folder holding
    it; ``tta_only``: its time-to-accuracy table alone) or another benchmark's JSON. ConfigError naming the
    file for one that is missing, unreadable, or of no known kind."""
    path = Path(path)
    document = _benchmark_document(path)
    if document is None:
        from prague.metrics.report import read_bench, report_markdown

        bench = read_bench(path)  # its errors name the file and the fix
        return report_markdown(bench.records, bench.command, tta_only=tta_only)
    kind = str(document["benchmark"])
    render = RENDERERS.get(kind)
    if render is None:
        raise ConfigError(f"{path} holds a {kind!r} benchmark, which has no report; prague report reads a "
                          f"bench.json or the JSON of: {', '.join(sorted(RENDERERS))}")
    return render(document)


def _benchmark_document(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path`` when it names its ``benchmark``; None for anything else (a bench.json,
    a folder, a file that is missing or not JSON: :func:`~prague.metrics.report.read_bench` says why)."""
    if not path.is_file():
        return None
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return document if isinstance(document, dict) and "benchmark" in document else None


def _table(header: Sequence[str], align: Sequence[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _count(n: float) -> str:
    return f"{n:,.0f}"


def _rate(rate: float) -> str:
    """A failure rate as the docs write it: 0, 2e-5, 1e-3, 0.5."""
    if rate == 0:
        return "0"
    text = f"{rate:g}"
    return text.replace("e-0", "e-").replace("e+0", "e+")


def _command(document: dict[str, Any]) -> str:
    command = document.get("command")
    return f"```\n{command}\n```\n\n" if command else ""


def group_generator(document: dict[str, Any]) -> str:
    """``benchmarks/group_generator.py``: measured rows (each API, shard count, client count and mode: req/s,
    latency, server CPU per request) or the simulated curve (latency and load per size)."""
    out = _command(document)
    if "simulated" in document:
        rows = [[_count(r["workers"]), _count(r["shards"]), f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}",
                 f"{100 * r['busiest_shard']:.0f}%", f"{100 * r['local_step_share']:.1f}%"]
                for r in document["simulated"]]
        return out + _table(["workers", "shards", "p50 (ms)", "p99 (ms)", "busiest shard", "local steps"],
                            ["---:"] * 6, rows)
    rows = [[r["api"], _count(r.get("shards", 1)), _count(r["clients"]),
             r["mode"],
             _count(r["requests_per_s"]), f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}",
             f"{r['server_cpu_us_per_request']:.0f} us"]
            for r in document["results"]]
    head = (f"{document.get('generator', '?')} generator, server in its own process on {document.get('host', '?')}, "
            f"{document.get('cpus', '?')} CPUs, clients in {document.get('client_procs', '?')} processes, "
            f"{document.get('seconds', '?')} s per row\n\n")
    return out + head + _table(["api", "shards", "clients", "mode", "req/s", "p50 (ms)", "p99 (ms)",
                                "server CPU per request"], ["---", "---:", "---:", "---", "---:", "---:", "---:",
                                                           "---:"], rows)


def torchrun_faults(document: dict[str, Any]) -> str:
    """``benchmarks/torchrun_faults.py``: one row per (method, fault): the machines' exit codes, the
    failures the job reported, each rank's completed steps, restarts, and the job's seconds."""
    rows = []
    for r in document["cases"]:
        failures = r.get("failures") or []
        said = ", ".join(f"rank {f['rank']} ({f['kind']}) at step {f['step']}" for f in failures) or "none"
        rows.append([r["method"], r["fault"], "yes" if r["ok"] else "NO", " / ".join(map(str, r["exit_codes"])),
                     said, str(r.get("completed_steps")), str(r.get("restarts") or 0), f"{r['seconds']:.1f}"])
    passed = sum(bool(r["ok"]) for r in document["cases"])
    head = (f"{document.get('nodes', '?')} machines x {document.get('per_node', '?')} workers, "
            f"--steps {document.get('steps', '?')}\n\n")
    return (_command(document) + head
            + _table(["method", "fault", "as expected", "machines' exit codes", "failures", "steps per rank",
                      "restarts", "job (s)"], ["---", "---", "---", "---", "---", "---", "---:", "---:"], rows)
            + f"\n{passed} of {len(rows)} cases as expected.\n")


def simulator(document: dict[str, Any]) -> str:
    """``benchmarks/simulator.py --failures``: per worker count and failure rate, each method's failures
    (and restarts) and time to finish."""
    rows_in = document["failures"]
    methods = list(dict.fromkeys(r["method"] for r in rows_in))
    keys = list(dict.fromkeys((r["workers"], r["rate_per_hour"]) for r in rows_in))
    by = {(r["workers"], r["rate_per_hour"], r["method"]): r for r in rows_in}
    header = ["workers", "failures per worker-hour"]
    for m in methods:
        header += [f"`{m}`: failures (restarts)", f"`{m}`: time (s)"]
    rows = []
    for workers, rate in keys:
        row = [_count(workers), _rate(rate)]
        for m in methods:
            r = by.get((workers, rate, m))
            row += (["-", "-"] if r is None else
                    [f"{r['failures']:,}" + (f" ({r['restarts']:,})" if r["restarts"] else ""), f"{r['job_s']:,.1f}"])
        rows.append(row)
    return _command(document) + _table(header, ["---:"] * len(header), rows)


RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "group_generator": group_generator,
    "torchrun_faults": torchrun_faults,
    "simulator": simulator,
}


# --------------------------------------------------------------------------------------------------
# Which method to pick: several benches side by side


@dataclass(frozen=True)
class ScenarioCells:
    """One scenario of one bench, as the decision table and its picture read it: ``where`` (the workload,
    workers and network in words, and the settings that tell the bench from the others of its workload),
    ``scenario``, ``cells`` (:func:`~prague.metrics.report.cells`' entries of the scenario that have a time
    to target) and ``times`` (the bench's times to target per cell, for bootstrap ratios)."""

    where: str
    settings: str
    scenario: str
    cells: list[dict[str, Any]]
    times: dict[tuple[str, str], list[float]]


def read_decision(paths: Sequence[Path]) -> list[ScenarioCells]:
    """Every scenario of the ``bench.json`` files ``paths``, in order, each bench read and its cells
    computed once. ConfigError naming the file for one that is not a bench.json with a ``--target-accuracy``."""
    from prague.metrics.report import cells, read_bench, times_to_target

    if not paths:
        raise ConfigError("prague report --decide needs the bench.json of one bench or more")
    out = []
    benches = [read_bench(path) for path in paths]
    for path, bench, settings in zip(paths, benches, _differing([b.command for b in benches])):
        times = times_to_target(bench.records)
        if not times:
            raise ConfigError(f"{path} has no time to a target (its bench ran without --target-accuracy): it "
                              "cannot say which method to pick; pass a bench run with --target-accuracy")
        table = [c for c in cells(bench.records) if (c["method"], c["scenario"]) in times]
        where = _network(bench.command, bench.records)
        for scenario in dict.fromkeys(c["scenario"] for c in table):
            out.append(ScenarioCells(where, settings, scenario, [c for c in table if c["scenario"] == scenario],
                                     times))
    return out


def decision_table(scenarios: Sequence[ScenarioCells]) -> str:
    """README's "which method to pick" from the scenarios of several benches (:func:`read_decision`): one
    row per scenario of each bench (the cluster in words: workers, network, slowdowns), with

    * the fastest method: the lowest median time to the accuracy target, with its 95% interval;
    * the methods *level* with it: those whose slowdown against it, the bootstrap ratio of the two
      cells' median times (:func:`~prague.metrics.report.bootstrap_ratio`), has an interval reaching 1;
    * the fastest method that is not a baseline against the scenario's best baseline (the fastest of
      :data:`~prague.metrics.report.BASELINE_METHODS` with any variant), the ratio of the medians and its
      interval, as the bench's own table gives it;
    * the final accuracy and the job time of those two (medians over seeds), and the seeds."""
    rows = [_decision_row(f"{s.where}{s.settings}; {_slowdowns(s.scenario)}", s.cells, s.times) for s in scenarios]
    header = ["cluster", "fastest", "level with it", "fastest other than a baseline, against the best baseline",
              "final accuracy: those two", "job time: those two", "seeds"]
    return _table(header, ["---", "---", "---", "---", "---:", "---:", "---:"], rows)


def versus_best_figure(scenarios: Sequence[ScenarioCells]) -> bytes:
    """README's picture of one workload, as PNG bytes: per scenario of each bench (:func:`read_decision`; a
    group of bars, named by the scenario and the settings that tell the benches apart), the median time to
    the accuracy target of the scenario's best baseline (grey, its name on the bar) and of every method that
    is not a baseline, each with its 95% bootstrap interval; a method that never reached the target has no
    bar and says so. The same cells and best baselines as :func:`decision_table`."""
    from matplotlib.figure import Figure

    from prague.metrics.report import BASELINE_METHODS, method_colours, png_bytes

    if not scenarios:
        raise ConfigError("prague report --plot needs the bench.json of one bench or more")
    groups: list[tuple[str, list[tuple[str, dict[str, Any]]]]] = []
    title, labels = _plot_labels(scenarios)
    for s, label in zip(scenarios, labels):
        best = next((c for c in s.cells if c["method"] == s.cells[0]["best_baseline"]), None)
        bars = [("best baseline", best)] if best is not None else []
        bars += [(c["method"], c) for c in s.cells if c["method"].split(":", 1)[0] not in BASELINE_METHODS]
        groups.append((label, bars))
    names = list(dict.fromkeys(name for _, bars in groups for name, _ in bars if name != "best baseline"))
    colours = {"best baseline": "0.6", **method_colours(names)}
    width = 0.8 / max(1, max(len(bars) for _, bars in groups))
    fig = Figure(figsize=(max(6.0, 1.2 + 2.2 * len(groups)), 4.5))
    ax = fig.add_subplot()
    top = max([c["time_to_target_s"]["median"] for _, bars in groups for _, c in bars
               if c["time_to_target_s"] and math.isfinite(c["time_to_target_s"]["median"])] or [1.0])
    labelled: set[str] = set()
    for x, (_, bars) in enumerate(groups):
        for i, (name, cell) in enumerate(bars):
            where = x + (i - (len(bars) - 1) / 2) * width
            spread = cell["time_to_target_s"]
            if not spread or not math.isfinite(spread["median"]):
                ax.text(where, 0.02 * top, f"{cell['method']}: never", rotation=90, ha="center", va="bottom",
                        fontsize="x-small")
                continue
            median = spread["median"]
            low = spread.get("ci_low", median)
            high = spread.get("ci_high", median)
            high = high if high is not None and math.isfinite(high) else 1.15 * top
            ax.bar(where, median, width=width, color=colours[name], label=None if name in labelled else name,
                   yerr=[[median - (low if low is not None else median)], [high - median]], capsize=3)
            labelled.add(name)
            if name == "best baseline":
                ax.text(where, 0.04 * top, cell["method"], rotation=90, ha="center", va="bottom",
                        fontsize="x-small")
    ax.set_xticks(range(len(groups)), [label for label, _ in groups], fontsize="small")
    targets = sorted({c["target_accuracy"] for _, bars in groups for _, c in bars})
    ax.set_ylabel(f"time to {' / '.join(f'{100 * t:g}%' for t in targets)} test accuracy (s),\n"
                  "median and 95% interval")
    ax.set_ylim(0, 1.2 * top)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(f"Against the best baseline of each scenario ({title})", fontsize="medium")
    return png_bytes(fig)


def _plot_labels(scenarios: Sequence[ScenarioCells]) -> tuple[str, list[str]]:
    """The picture's title and each scenario's label. What every bench shares (the workload, the cluster) goes
    in the title; what differs (another cluster, cross traffic, a flag) goes under its own bars, so that two
    benches of one scenario are told apart."""
    parts = [s.where.split(", ") for s in scenarios]
    shared = 0
    while all(len(p) > shared and p[shared] == parts[0][shared] for p in parts):
        shared += 1
    labels = ["\n".join([s.scenario, *own[shared:]]) + s.settings.replace("; ", "\n").replace("`", "")
              for s, own in zip(scenarios, parts)]
    return ", ".join(parts[0][:shared]), labels


def _decision_row(cluster: str, group: list[dict[str, Any]],
                  times: dict[tuple[str, str], list[float]]) -> list[str]:
    from prague.metrics.report import BASELINE_METHODS, bootstrap_ratio, percent_text, ratio_text, spread_text

    def median(cell: dict[str, Any]) -> float:
        spread = cell["time_to_target_s"]
        return float(spread["median"]) if spread else float("inf")

    def seconds(spread: dict[str, float] | None) -> str:
        return spread_text(spread, ".0f", " s") if spread and math.isfinite(spread["median"]) else "never"

    def job(cell: dict[str, Any]) -> str:
        return "-" if cell["job_s"] is None else f"{cell['job_s']['median']:.1f} s"

    counts = sorted({len(c["seeds"]) for c in group})
    seeds_text = str(counts[0]) if counts[0] == counts[-1] else f"{counts[0]}-{counts[-1]}"
    reached = [c for c in group if median(c) < float("inf")]
    if not reached:
        return [cluster, "none reached the target", "-", "-", "-", "-", seeds_text]
    fastest = min(reached, key=median)
    level = []
    for cell in reached:
        if cell is not fastest:
            slower = bootstrap_ratio(times[(cell["method"], cell["scenario"])],
                                     times[(fastest["method"], fastest["scenario"])])
            if slower is not None and slower.low <= 1.0:
                level.append(f"`{cell['method']}`")
    ours = min((c for c in group if c["method"].split(":", 1)[0] not in BASELINE_METHODS), key=median, default=None)
    best = next((c for c in group if c["method"] == fastest["best_baseline"]), None)
    versus = accuracy = jobs = "-"
    if ours is not None and best is not None:
        figure = ours["speedup_vs_best_baseline"]
        shown = ("never reached" if not math.isfinite(median(ours)) else "n/a" if figure is None else
                 ratio_text(figure))
        versus = f"`{ours['method']}` {shown} over `{best['method']}` ({seconds(best['time_to_target_s'])})"
        if math.isfinite(median(ours)) and not math.isfinite(median(best)):
            versus = f"`{ours['method']}` reached it, no baseline did (`{best['method']}` never)"
        accuracy = " / ".join(percent_text(c["test_accuracy"], interval=False) for c in (ours, best))
        jobs = f"{job(ours)} / {job(best)}"
    return [cluster, f"`{fastest['method']}` {seconds(fastest['time_to_target_s'])}",
            ", ".join(level) or "none", versus, accuracy, jobs, seeds_text]


def _network(command: str | None, records: Sequence[dict[str, Any]]) -> str:
    """The bench's workers and network in words, from its command line (the records do not say)."""
    nprocs = sorted({int(r["nproc"]) for r in records})
    workers = f"{'/'.join(map(str, nprocs))} workers"
    model = "/".join(sorted({f"{r.get('model')} on {r.get('data')}" for r in records}))
    targets = sorted({float(r["target_accuracy"]) for r in records if r.get("target_accuracy") is not None})
    if targets:
        model += f" to {'/'.join(f'{100 * t:g}%' for t in targets)}"
    flags = _flags(command)
    if "--hosts" not in flags:
        return f"{model}, {workers}, one machine"
    text = f"{model}, {workers} on {flags['--hosts']} hosts at {flags.get('--link-rate', '1gbit')}"
    return text + (f", cross-traffic {flags['--cross-traffic']}" if "--cross-traffic" in flags else "")


#: Flags a decision row does not repeat in its cluster: what the benches vary within themselves (methods,
#: scenarios, seeds), where they wrote, and what :func:`_network` says in words.
_SAID_ELSEWHERE = frozenset({"--algorithms", "--scenarios", "--repeat", "--seed", "--out", "--resume", "--quiet",
                             "--hosts", "--link-rate", "--cross-traffic", "--nproc", "--model", "--data",
                             "--data-dir", "--target-accuracy"})


def _flags(command: str | None) -> dict[str, str]:
    """A command line's ``--flag value`` pairs (``""`` for a flag without a value)."""
    words = shlex.split(command or "")
    return {word: words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else ""
            for i, word in enumerate(words) if word.startswith("--")}


def _differing(commands: Sequence[str | None]) -> list[str]:
    """For each bench, the settings that tell it from the others of its workload (``; `--sync-every-steps
    4```): the flags whose values differ between the commands with the same ``--model`` and ``--data``,
    outside :data:`_SAID_ELSEWHERE`; nothing for a workload of one bench (two workloads differ in their
    whole recipe: the model and data set name them)."""
    parsed = [_flags(c) for c in commands]

    def workload(flags: dict[str, str]) -> tuple[str | None, str | None]:
        return flags.get("--model"), flags.get("--data")

    out = []
    for flags in parsed:
        alike = [f for f in parsed if workload(f) == workload(flags)]
        names = sorted({n for f in alike for n in f} - _SAID_ELSEWHERE)
        varying = [n for n in names if len({f.get(n) for f in alike}) > 1]
        out.append("".join(f"; `{' '.join(filter(None, (n, flags[n])))}`" for n in varying if n in flags))
    return out


def _slowdowns(scenario: str) -> str:
    """A scenario in words, then as written (`paper:5`)."""
    from prague.hetero.spec import parse_scenario

    try:
        parsed = parse_scenario(scenario)
    except ConfigError:
        return f"`{scenario}`"
    words = [f"random {p.factor:g}x slowdowns" for p in parsed.paper]
    for s in parsed.stragglers:
        when = "throughout" if s.start == 0 and s.end is None else f"in steps {s.start}-{s.end}"
        words.append(f"rank {s.rank} {s.factor:g}x slower {when}")
    words += [f"rank {f.rank} {'crashes' if f.kind == 'crash' else 'hangs'} at step {f.step}" for f in parsed.faults]
    if parsed.rates:
        words += [f"crashes at {r.per_hour:g} per worker-hour" for r in parsed.rates]
    return f"{', '.join(words) or 'equal workers'} (`{scenario}`)"
