"""Failure benchmark: how long ``prague run`` takes to stop every process after a failure or Ctrl-C.

    .venv/bin/python benchmarks/failure_detection.py --out runs/bench_failures.json
    .venv/bin/python benchmarks/failure_detection.py --repeats 5 --cases crash,dead-shard

The tests only bound these times with hard timeouts (tests/runtime/test_launcher.py,
tests/algorithms/test_ps.py); this script measures them. Each case runs the real CLI in its own
session, waits until every rank has logged a step (``OUT/metrics/rank*.jsonl`` non-empty), then:

  crash       ``--slowdown crash:1:3``, 3 ranks: rank 1 raises at its step 3, right as training starts;
              the launcher must stop ranks 0 and 2 and exit 1 with rank 1's traceback
  dead-shard  ``ps:async``, 2 ranks, 1 shard: SIGKILL the shard process; the workers must notice,
              and the run exit 1 naming the shard
  ctrl-c      ``allreduce``, 2 ranks: SIGINT to the launcher; it must stop the ranks and exit 130

and times from that moment (the event) to the launcher's exit, then checks that no process of the run
is left. Runs use synthetic data, an MLP and emulated compute (``--compute-ms 20``), with far more
steps than can finish, so only stopping ends them. Prints the median, min and max of --repeats runs
(seconds) and writes JSON. On a shared 2-core machine the numbers move with the load.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prague.io import atomic_write_json
from prague.metrics.record import host_facts

QUICK = ["--steps", "1000000", "--compute", "emulated", "--compute-ms", "20", "--model", "mlp", "--data", "synthetic",
         "--quiet"]
SHARD_MODULE = "prague.algorithms.ps.server"


@dataclass(frozen=True)
class Case:
    """A run, what to do once it trains, and the exit code that shows it stopped for that reason."""

    args: tuple[str, ...]
    event: str  # "none" (the run fails by itself), "kill-shard" or "sigint"
    exit_code: int


CASES = {
    "crash": Case(("--nproc", "3", "--slowdown", "crash:1:3"), "none", 1),
    "dead-shard": Case(("--algorithm", "ps", "--ps-mode", "async", "--nproc", "2"), "kill-shard", 1),
    "ctrl-c": Case(("--algorithm", "allreduce", "--nproc", "2"), "sigint", 130),
}


def cmdlines() -> dict[int, str]:
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
    return out


def training(out: Path) -> bool:
    logs = list((out / "metrics").glob("rank*.jsonl"))
    return bool(logs) and all(f.stat().st_size > 0 for f in logs)


def measure(case: Case, out: Path, timeout_s: float) -> dict[str, Any]:
    """One run of ``case``: seconds from start to training, and from the event to the launcher's exit."""
    t0 = time.monotonic()
    # SIGINT handled here while the run starts, so that the run starts with it at its default even when
    # this script ignores it (started in the background): an ignored signal would stay ignored across exec.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "prague", "run", *case.args, *QUICK, "--out", str(out)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        while not training(out):
            if proc.poll() is not None:
                raise SystemExit(f"{case} ended before every rank trained (exit {proc.returncode}):\n"
                                 f"{proc.stderr.read() if proc.stderr else ''}")
            if time.monotonic() - t0 > timeout_s:
                raise SystemExit(f"{case} did not start training within {timeout_s} s")
            time.sleep(0.02)
        t_event = time.monotonic()
        if case.event == "kill-shard":
            shards = [pid for pid, cmd in cmdlines().items() if SHARD_MODULE in cmd and str(out) in cmd]
            if not shards:
                raise SystemExit(f"no shard process of {out} to kill")
            os.kill(shards[0], signal.SIGKILL)
        elif case.event == "sigint":
            proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=timeout_s)
        t_exit = time.monotonic()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.returncode != case.exit_code:
        raise SystemExit(f"{case}: exit code {proc.returncode}, expected {case.exit_code}:\n{err[-3000:]}")
    time.sleep(1.0)  # children reaped by the launcher may take a moment to leave /proc
    left = [pid for pid, cmd in cmdlines().items() if str(out) in cmd]
    return {"to_training_s": t_event - t0, "event_to_exit_s": t_exit - t_event, "left_behind": len(left)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {list(CASES)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout-s", type=float, default=180.0, help="per run; a run still going is killed")
    p.add_argument("--out", type=Path, default=Path("runs/bench_failures.json"))
    args = p.parse_args()
    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    if not names or any(c not in CASES for c in names) or args.repeats < 1:
        p.error(f"--cases must be among {list(CASES)} and --repeats >= 1")

    t0 = time.time()
    rows = []
    with tempfile.TemporaryDirectory(prefix="prague-bench-failures-") as tmp:
        for name in names:
            runs = [measure(CASES[name], Path(tmp) / f"{name}-{i}", args.timeout_s) for i in range(args.repeats)]
            stop = [r["event_to_exit_s"] for r in runs]
            rows.append({"case": name, "median_s": statistics.median(stop), "min_s": min(stop), "max_s": max(stop),
                         "median_to_training_s": statistics.median(r["to_training_s"] for r in runs),
                         "left_behind": max(r["left_behind"] for r in runs), "runs": runs})
            print(f"{name}: {[round(s, 2) for s in stop]}", flush=True)

    print(f"\nFrom the event to the launcher's exit, {args.repeats} runs each, {os.cpu_count()} cores; seconds\n")
    print("| case | median | min | max | start to training (median) | processes left |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['median_s']:.2f} | {r['min_s']:.2f} | {r['max_s']:.2f} "
              f"| {r['median_to_training_s']:.2f} | {r['left_behind']} |")
    atomic_write_json(args.out, {
        "benchmark": "failure_detection",
        "config": {"cases": {n: CASES[n].args for n in names}, "common": QUICK, "repeats": args.repeats},
        "machine": host_facts(),
        "wall_s": time.time() - t0,
        "rows": rows,
    })
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
