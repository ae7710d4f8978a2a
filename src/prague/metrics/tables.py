"""Every table of the docs from the JSON a measurement wrote: ``prague report FILE``.

A ``bench.json`` (``prague bench``) gives its bench's tables (:func:`prague.metrics.report.report_markdown`);
the JSON of the other measurements says which it is in its ``benchmark`` field, and each kind has one
function here that turns it into the table the docs show:

* ``group_generator`` (``benchmarks/group_generator.py``): the service measured with real gRPC clients
  (``results``), or its latency curve simulated at scale (``simulated``);
* ``torchrun_faults`` (``benchmarks/torchrun_faults.py``): the fault matrix on two emulated machines;
* ``simulator`` (``benchmarks/simulator.py --failures``): time to finish under failure rates.

The docs hold each table between ``<!-- prague report FILE -->`` and ``<!-- end report -->``, and a test
checks that it is exactly what this module prints for FILE, so no table can drift from its data.
"""

from __future__ import annotations

import json
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
