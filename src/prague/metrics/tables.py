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
                    [f"{r['failures']}" + (f" ({r['restarts']})" if r["restarts"] else ""), f"{r['job_s']:,.1f}"])
        rows.append(row)
    return _command(document) + _table(header, ["---:"] * len(header), rows)


RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "group_generator": group_generator,
    "torchrun_faults": torchrun_faults,
    "simulator": simulator,
}


# --------------------------------------------------------------------------------------------------
# Which method to pick: several benches side by side


def decision_table(paths: Sequence[Path]) -> str:
    """README's "which method to pick" from the ``bench.json`` of several benches: one row per scenario
    of each bench (the cluster in words: workers, network, slowdowns), with

    * the fastest method: the lowest median time to the accuracy target, with its 95% interval;
    * the methods *level* with it: those whose slowdown against it, the bootstrap ratio of the two
      cells' median times (:func:`~prague.metrics.report.bootstrap_ratio`), has an interval reaching 1;
    * the fastest method that is not a baseline against the scenario's best baseline (the fastest of
      :data:`~prague.metrics.report.BASELINE_METHODS` with any variant), the ratio of the medians and its
      interval, as the bench's own table gives it;
    * the final accuracy of those two (median over seeds), and the seeds.

    ConfigError naming the file for one that is not a bench.json with a ``--target-accuracy``."""
    from prague.metrics.report import BASELINE_METHODS, bootstrap_ratio, cells, read_bench, times_to_target

    if not paths:
        raise ConfigError("prague report --decide needs the bench.json of one bench or more")
    rows = []
    benches = [read_bench(path) for path in paths]
    for path, bench, settings in zip(paths, benches, _differing([b.command for b in benches])):
        table = cells(bench.records)
        times = times_to_target(bench.records)
        if not times:
            raise ConfigError(f"{path} has no time to a target (its bench ran without --target-accuracy): it "
                              "cannot say which method to pick; pass a bench run with --target-accuracy")
        where = _network(bench.command, bench.records) + settings
        for scenario in dict.fromkeys(c["scenario"] for c in table):
            group = [c for c in table if c["scenario"] == scenario and (c["method"], scenario) in times]
            rows.append(_decision_row(f"{where}; {_slowdowns(scenario)}", group, times, BASELINE_METHODS,
                                      bootstrap_ratio))
    header = ["cluster", "fastest", "level with it", "fastest other than a baseline, against the best baseline",
              "final accuracy: those two", "seeds"]
    return _table(header, ["---", "---", "---", "---", "---:", "---:"], rows)


def _decision_row(cluster: str, group: list[dict[str, Any]], times: dict[tuple[str, str], list[float]],
                  baselines: frozenset[str], ratio: Callable[..., Any]) -> list[str]:
    def median(cell: dict[str, Any]) -> float:
        spread = cell["time_to_target_s"]
        return float(spread["median"]) if spread else float("inf")

    def key(cell: dict[str, Any]) -> list[float]:
        return times[(cell["method"], cell["scenario"])]

    def base(method: str) -> str:
        return method.split(":", 1)[0]

    seeds = sorted({len(c["seeds"]) for c in group})
    seeds_text = "-".join(str(n) for n in (seeds[0], seeds[-1]) if n) if seeds[0] != seeds[-1] else str(seeds[0])
    reached = [c for c in group if median(c) < float("inf")]
    if not reached:
        return [cluster, "none reached the target", "-", "-", "-", seeds_text]
    fastest = min(reached, key=median)
    level = []
    for cell in reached:
        if cell is not fastest:
            slower = ratio(key(cell), key(fastest))
            if slower is not None and slower.low <= 1.0:
                level.append(f"`{cell['method']}`")
    ours = min((c for c in group if base(c["method"]) not in baselines), key=median, default=None)
    best = next((c for c in group if c["method"] == fastest["best_baseline"]), None)
    versus, accuracy = "-", "-"
    if ours is not None and best is not None:
        figure = ours["speedup_vs_best_baseline"]
        spread = best["time_to_target_s"]
        shown = ("never reached" if not math.isfinite(median(ours)) else "n/a" if figure is None else
                 _interval(figure["ratio"], figure["ci_low"], figure["ci_high"], "x"))
        versus = f"`{ours['method']}` {shown} over `{best['method']}` ({_seconds_text(spread)})"
        accuracy = f"{_percent(ours['test_accuracy'])} / {_percent(best['test_accuracy'])}"
    return [cluster, f"`{fastest['method']}` {_seconds_text(fastest['time_to_target_s'])}",
            ", ".join(level) or "none", versus, accuracy, seeds_text]


def _interval(value: float, low: float | None, high: float | None, unit: str) -> str:
    bound = (lambda v: f"{v:.2f}" if v is not None and math.isfinite(v) else "-")
    return f"{bound(value)}{unit} [{bound(low)}, {bound(high)}]"


def _seconds_text(spread: dict[str, float] | None) -> str:
    if not spread or not math.isfinite(spread["median"]):
        return "never"
    low, high = spread.get("ci_low"), spread.get("ci_high")
    bound = (lambda v: f"{v:.0f}" if v is not None and math.isfinite(v) else "-")
    return f"{spread['median']:.0f} s" + (f" [{bound(low)}, {bound(high)}]" if low is not None else "")


def _percent(spread: dict[str, float] | None) -> str:
    return "-" if not spread else f"{100 * spread['median']:.2f}%"


def _network(command: str | None, records: Sequence[dict[str, Any]]) -> str:
    """The bench's workers and network in words, from its command line (the records do not say)."""
    nprocs = sorted({int(r["nproc"]) for r in records})
    workers = f"{'/'.join(map(str, nprocs))} workers"
    model = "/".join(sorted({f"{r.get('model')} on {r.get('data')}" for r in records}))
    flags = _flags(command)
    if "--hosts" not in flags:
        return f"{model}, {workers}, one machine"
    text = f"{model}, {workers} on {flags['--hosts']} hosts at {flags.get('--link-rate', '1gbit')}"
    return text + (f", cross-traffic {flags['--cross-traffic']}" if "--cross-traffic" in flags else "")


#: Flags a decision row does not repeat in its cluster: what the benches vary within themselves (methods,
#: scenarios, seeds), where they wrote, and what :func:`_network` says in words.
_SAID_ELSEWHERE = frozenset({"--algorithms", "--scenarios", "--repeat", "--seed", "--out", "--resume", "--quiet",
                             "--hosts", "--link-rate", "--cross-traffic", "--nproc", "--model", "--data",
                             "--data-dir"})


def _flags(command: str | None) -> dict[str, str]:
    """A command line's ``--flag value`` pairs (``""`` for a flag without a value)."""
    words = shlex.split(command or "")
    return {word: words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else ""
            for i, word in enumerate(words) if word.startswith("--")}


def _differing(commands: Sequence[str | None]) -> list[str]:
    """For each bench, the settings that tell it from the others (``; `--sync-every-steps 4```): the
    flags whose values differ between the commands, outside :data:`_SAID_ELSEWHERE`; nothing for one bench."""
    parsed = [_flags(c) for c in commands]
    names = sorted({n for flags in parsed for n in flags} - _SAID_ELSEWHERE)
    varying = [n for n in names if len({flags.get(n) for flags in parsed}) > 1]
    return ["".join(f"; `{' '.join(filter(None, (n, flags[n])))}`" for n in varying if n in flags)
            for flags in parsed]


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
