"""Group Generator service benchmark: requests/s and latency with 1, 8, 64 and 256 concurrent clients.

    PYTHONPATH=src .venv/bin/python benchmarks/group_generator.py --out runs/bench_gg.json

For each client count C it starts the service (smart policy, nproc = C) in its own process on 127.0.0.1
(port chosen by the OS, address read from a ready file), then runs C client threads. Each thread emulates
one worker: its own channel, worker id = thread index, a few untimed warm-up calls (connection set-up),
then, after a common start barrier, back-to-back GetGroup calls for its share of a fixed total number of
requests, then Finish. Workers do not execute the groups (no P-Reduce), so this measures the service
alone: an RPC round trip plus the policy's decision under the service lock. Clients are threads of one
Python process, so at 256 clients the client side (GIL, 2 cores here) is part of what is measured.
Prints a table and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import prague.groups
from prague.groups.client import GroupGeneratorClient

TOKEN = "bench-token"


def start_service(nproc: int, generator: str, workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """The service in its own process, as ``prague gg serve`` runs it; returns (process, address)."""
    ready_file = workdir / f"gg-{nproc}.addr"
    src = str(Path(prague.groups.__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "prague.groups.service", "--host", "127.0.0.1", "--port", "0",
         "--nproc", str(nproc), "--generator", generator, "--token", TOKEN, "--ready-file", str(ready_file)],
        env=env,
    )
    deadline = time.monotonic() + 60.0
    while not ready_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the group generator did not start (exit code {proc.poll()})")
        time.sleep(0.05)
    return proc, ready_file.read_text().strip()


def run_clients(address: str, clients: int, requests: int, warmup: int) -> dict[str, float | int]:
    per_client = max(1, requests // clients)
    latencies: list[list[float]] = [[] for _ in range(clients)]
    errors: list[BaseException] = []
    start = threading.Barrier(clients + 1)
    done = threading.Barrier(clients + 1)

    def worker(w: int) -> None:
        try:
            with GroupGeneratorClient(address, TOKEN, timeout_s=120.0) as client:
                for it in range(warmup):
                    client.get_group(w, it)
                start.wait()
                mine = latencies[w]
                for it in range(warmup, warmup + per_client):
                    t0 = time.perf_counter()
                    client.get_group(w, it)
                    mine.append(time.perf_counter() - t0)
                done.wait()
                client.finish(w)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)
            start.abort()
            done.abort()

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    done.wait()
    elapsed = time.perf_counter() - t0
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    flat = sorted(x for xs in latencies for x in xs)
    q = statistics.quantiles(flat, n=100, method="inclusive")
    return {
        "clients": clients,
        "requests": len(flat),
        "seconds": elapsed,
        "requests_per_s": len(flat) / elapsed,
        "p50_ms": q[49] * 1e3,
        "p99_ms": q[98] * 1e3,
        "mean_ms": statistics.fmean(flat) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", default="1,8,64,256", help="comma-separated client counts")
    parser.add_argument("--requests", type=int, default=6400, help="timed GetGroup calls per client count")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per client first")
    parser.add_argument("--generator", default="smart")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_gg.json"))
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for clients in (int(c) for c in args.clients.split(",")):
            proc, address = start_service(clients, args.generator, Path(tmp))
            try:
                row = run_clients(address, clients, args.requests, args.warmup)
                with GroupGeneratorClient(address, TOKEN, timeout_s=30.0) as client:
                    stats = client.stats()
                    client.shutdown()
                proc.wait(timeout=30)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            row["mean_group_size"] = stats["mean_group_size"]
            rows.append(row)
            print(f"  {clients} clients done", file=sys.stderr)

    print(f"Group Generator service, {args.generator} policy, server in its own process, 127.0.0.1, "
          f"{os.cpu_count()} CPUs")
    print(f"{'clients':>8} {'requests':>9} {'seconds':>8} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for r in rows:
        print(f"{r['clients']:>8} {r['requests']:>9} {r['seconds']:>8.2f} {r['requests_per_s']:>9.0f} "
              f"{r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": "group_generator",
        "generator": args.generator,
        "server": "subprocess",
        "host": "127.0.0.1",
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "results": rows,
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
