"""Fault matrix on several machines: each method under torchrun across emulated machines, with a failed worker.

    .venv/bin/python benchmarks/torchrun_faults.py --out runs/torchrun_faults.json
    .venv/bin/python benchmarks/torchrun_faults.py --cases prague:smart,allreduce --faults crash:2:20

Two network namespaces as machines (``EmulatedHosts``), each running its own torchrun with two workers
(``--nnodes 2 --rdzv-backend c10d``), ``--steps 60``, emulated compute of 10 ms. For every method that
goes on without a failed worker (each of prague's generators, dssync, adpsgd, eager-sgd) and every
fault (``crash:2:20``, ``hang:2:20``: rank 2 is the first worker of the second machine), the job must
exit 0 on both machines, name rank 2 in ``failures`` and bring the other ranks to step 60. ``prague``
also faces ``crash:0:20``: the worker of the rank whose guard hosts the Group Generator, on the machine
that holds the rendezvous store. ``allreduce``, which needs every rank, must survive ``crash:2:20`` by
restarting (``--max-restarts 1 --checkpoint-every 10``) and end at step 60 with ``restarts`` 1.

The test suite runs a few of these cases (``tests/net/test_torchrun_nodes.py``); this script runs the
whole matrix. Prints a table (outcome and job seconds per case) and writes JSON. Needs root (or
CAP_NET_ADMIN and CAP_SYS_ADMIN).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from prague.io import atomic_write_json
from prague.metrics.record import host_facts
from prague.net.hosts import EmulatedHosts, missing_privileges, parse_rate

NODES, PER_NODE, STEPS, STEP = 2, 2, 60, 20
SURVIVORS = ["prague:static", "prague:smart", "prague:random", "prague:ready", "dssync", "adpsgd", "eager-sgd"]
FAULTS = [f"crash:2:{STEP}", f"hang:2:{STEP}"]
COMMON = ["--steps", str(STEPS), "--compute", "emulated", "--compute-ms", "10", "--data", "synthetic", "--quiet"]


def cases(methods: list[str], faults: list[str]) -> list[tuple[str, str]]:
    """(method, fault) pairs: every survivor with every fault, prague's Group Generator host, allreduce."""
    out = [(m, f) for m in methods if m != "allreduce" for f in faults]
    if any(m.startswith("prague") for m in methods):
        out.append(("prague", f"crash:0:{STEP}"))
    if "allreduce" in methods:
        out.append(("allreduce", f"crash:2:{STEP}"))
    return out


def run_case(net: EmulatedHosts, algorithm: str, fault: str, index: int, folder: Path) -> dict[str, Any]:
    out = folder / f"{index}-{algorithm.replace(':', '-')}-{fault.replace(':', '-')}"
    restart = algorithm == "allreduce"
    args = ["--algorithm", algorithm, "--slowdown", fault, "--lease-s", "2", "--out", str(out), *COMMON]
    if restart:
        args += ["--checkpoint-every", "10"]
    started = time.perf_counter()
    results = net.torchrun(args, per_host=PER_NODE, job=f"faults-{index}", port=29450 + index % 40,
                           torchrun_args=["--max-restarts", "1"] if restart else [], env={"OMP_NUM_THREADS": "1"})
    seconds = time.perf_counter() - started
    codes = [code for code, _ in results]
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    kind, rank, step = fault.split(":")
    world = NODES * PER_NODE
    if restart:
        expected_steps = [STEPS] * world
        ok = codes == [0] * NODES and summary.get("restarts") == 1 and summary.get("completed_steps") == expected_steps
    else:
        expected_steps = [int(step) if r == int(rank) else STEPS for r in range(world)]
        ok = (codes == [0] * NODES and summary.get("completed_steps") == expected_steps
              and summary.get("failures") == [{"rank": int(rank), "step": int(step), "kind": kind}])
    row = {"method": algorithm, "fault": fault, "ok": ok, "exit_codes": codes, "seconds": round(seconds, 1),
           "failures": summary.get("failures"), "completed_steps": summary.get("completed_steps"),
           "restarts": summary.get("restarts"), "job_s": summary.get("job_s")}
    if not ok:
        row["output_tail"] = [text[-3000:] for _, text in results]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join([*SURVIVORS, "allreduce"]),
                        help="methods, comma-separated (default: every survivor and allreduce)")
    parser.add_argument("--faults", default=",".join(FAULTS), help="faults of the survivors, comma-separated")
    parser.add_argument("--out", type=Path, default=Path("runs/torchrun_faults.json"))
    args = parser.parse_args()
    reason = missing_privileges()
    if reason is not None:
        print(f"emulated machines unavailable: {reason}", file=sys.stderr)
        return 2
    matrix = cases([m for m in args.cases.split(",") if m], [f for f in args.faults.split(",") if f])
    rows = []
    with tempfile.TemporaryDirectory(prefix="prague-faults-") as tmp, EmulatedHosts(NODES, parse_rate("10gbit")) as net:
        for i, (method, fault) in enumerate(matrix):
            row = run_case(net, method, fault, i, Path(tmp))
            rows.append(row)
            print(f"{method:15} {fault:12} {'ok' if row['ok'] else 'FAILED':6} exit {row['exit_codes']} "
                  f"{row['seconds']:6.1f} s  failures {row['failures']}  steps {row['completed_steps']}"
                  + (f"  restarts {row['restarts']}" if row["restarts"] else ""), flush=True)
    atomic_write_json(args.out, {"benchmark": "torchrun_faults", "machine": host_facts(), "nodes": NODES, "per_node": PER_NODE, "steps": STEPS,
                                 "command": "python benchmarks/torchrun_faults.py " + " ".join(sys.argv[1:]), "cases": rows})
    passed = sum(r["ok"] for r in rows)
    print(f"\n{passed} of {len(rows)} cases as expected; wrote {args.out}")
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
