"""Group Generator service benchmark: latency at 64 concurrent clients, sustained requests/s at 256.

    PYTHONPATH=src .venv/bin/python benchmarks/group_generator.py --out runs/bench_gg.json
    PYTHONPATH=src .venv/bin/python benchmarks/group_generator.py --api unary --clients 64,256   # the old path

For each API (``stream``: one ``GroupStream`` per worker, what the client uses by default; ``unary``: one
``GetGroup`` call per request) and each client count C, it starts the service (smart policy, nproc = C)
in its own process on 127.0.0.1, as ``prague gg serve`` runs it (port chosen by the OS, address read
from a ready file). C emulated workers (worker id = index) are spread over ``--client-procs`` client
processes, each an asyncio event loop with its own ``grpc.aio`` channel, so the clients are real gRPC
clients outside the server's process and not serialised by one interpreter lock. Each worker first makes
a few untimed calls (connection and stream set-up); then, from a common start, it sends back-to-back
requests for ``--seconds`` (closed loop: C requests in flight at all times; latency then reads as C /
throughput, Little's law), and with ``--paced-ms`` also a second run where each worker asks once per
that period (an iteration time; open loop, the latency a worker sees when the service is not saturated).
Workers do not execute the groups (no P-Reduce), so this measures the service: an RPC round trip plus
the policy's decision under the service lock. The server's CPU time over the timed window (its
``/proc/PID/stat``) divided by the requests served is its cost per request, the number the simulator's
``gg_service_s`` uses; it does not depend on how busy the client processes keep the machine.

On a machine with few cores the clients compete with the server for CPU: req/s is then a lower bound of
the service's capacity, which is about 1 / (server CPU per request) when it has a core of its own.
Prints a table and writes JSON to --out (``headline``: p50/p99 at 64 clients and req/s at 256 clients,
closed loop, for each API).

``--shards 1,4`` measures the Group Generator in shards too (``--generator ready``, as ``prague run
--gg-shards N`` starts it): N services, each ``--shard s --shards N``, the C workers on C / 4 nodes of 4, and
each worker sending each request to the shard :class:`~prague.groups.shards.ShardPlan` names for it at
that iteration (``--epoch-steps``), over a stream per shard, as :class:`~prague.algorithms.prague.source.ShardedSource`
does. The latency is then a group's formation as a worker sees it (its partners must ask too), and the
server CPU per request is summed over the shards' processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

import prague.groups
from prague.groups import Topology
from prague.groups import gg_pb2 as pb
from prague.groups import gg_pb2_grpc as pb_grpc
from prague.groups.shards import ShardPlan
from prague.io import atomic_write_json
from prague.metrics.record import host_facts

TOKEN = "bench-token"
APIS = ("stream", "unary")


def start_service(nproc: int, generator: str, workdir: Path, shard: tuple[int, int] = (0, 1),
                  nodes: int = 1) -> tuple[subprocess.Popen[bytes], str]:
    """The service in its own process, as ``prague gg serve`` runs it (``shard``: shard s of n, on
    ``nodes`` nodes); returns (process, address)."""
    ready_file = workdir / f"gg-{nproc}-{shard[0]}-{time.monotonic_ns()}.addr"
    src = str(Path(prague.groups.__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}
    sharded = ["--shard", str(shard[0]), "--shards", str(shard[1]), "--window-s", "0"] if shard[1] > 1 else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "prague.groups.service", "--host", "127.0.0.1", "--port", "0",
         "--nproc", str(nproc), "--nodes", str(nodes), "--generator", generator, "--token", TOKEN,
         "--ready-file", str(ready_file), *sharded],
        env=env,
    )
    deadline = time.monotonic() + 60.0
    while not ready_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the group generator did not start (exit code {proc.poll()})")
        time.sleep(0.05)
    return proc, ready_file.read_text().strip()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- one client process ---------------------------------------------------------------------------------
async def _workers(addresses: list[str], api: str, workers: list[int], warmup: int, start_at: float,
                   seconds: float, paced_s: float, plan: ShardPlan | None = None) -> tuple[int, list[float]]:
    """Run ``workers`` until ``start_at + seconds`` (``time.time()``); (requests in the window, latencies).
    With several ``addresses`` (shards), each request goes to the shard ``plan`` names."""
    latencies: list[float] = []
    counted = 0
    channels = [grpc.aio.insecure_channel(address) for address in addresses]
    try:
        stubs = [pb_grpc.GroupGeneratorStub(channel) for channel in channels]  # type: ignore[no-untyped-call]

        async def worker(w: int) -> None:
            nonlocal counted
            calls = [stub.GroupStream(wait_for_ready=True) for stub in stubs] if api == "stream" else None
            opened: set[int] = set()

            async def ask(it: int) -> None:
                shard = 0 if plan is None else plan.shard_of(w, it)
                if calls is not None:
                    call = calls[shard]
                    await call.write(pb.GroupRequest(token=TOKEN if shard not in opened else "", worker=w,
                                                     iteration=it))
                    opened.add(shard)
                    reply = await call.read()
                    if reply is grpc.aio.EOF:
                        raise RuntimeError(f"worker {w}: the stream ended: {await call.code()}")
                else:
                    await stubs[shard].GetGroup(pb.GroupRequest(token=TOKEN, worker=w, iteration=it),
                                                wait_for_ready=True)

            for it in range(warmup):
                await ask(it)
            await asyncio.sleep(max(0.0, start_at - time.time()))
            end = start_at + seconds
            it = warmup
            next_at = time.perf_counter() + (paced_s * (w % 97) / 97 if paced_s else 0.0)  # spread the phases
            while time.time() < end:
                if paced_s:
                    await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
                    next_at += paced_s
                t0 = time.perf_counter()
                await ask(it)
                t1 = time.perf_counter()
                it += 1
                if time.time() <= end:
                    latencies.append(t1 - t0)
                    counted += 1
            for call in calls or ():
                await call.done_writing()

        await asyncio.gather(*(worker(w) for w in workers))
    finally:
        for channel in channels:
            await channel.close()
    return counted, latencies


def _client_process(addresses: list[str], api: str, workers: list[int], warmup: int, start_at: float,
                    seconds: float, paced_s: float, plan: ShardPlan | None, out: Any) -> None:
    try:
        out.put(asyncio.run(_workers(addresses, api, workers, warmup, start_at, seconds, paced_s, plan)))
    except BaseException as error:  # noqa: BLE001 - reported by the parent
        out.put(error)


def run_clients(addresses: list[str], server_pids: list[int], api: str, clients: int, procs: int, seconds: float,
                warmup: int, paced_s: float, plan: ShardPlan | None = None) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = max(1, min(procs, clients))
    start_at = time.time() + 3.0 + 0.02 * clients  # time for every process to start and warm up
    children = [
        ctx.Process(target=_client_process, daemon=True,
                    args=(addresses, api, list(range(i, clients, procs)), warmup, start_at, seconds, paced_s, plan,
                          out))
        for i in range(procs)
    ]
    for child in children:
        child.start()
    time.sleep(max(0.0, start_at - time.time()))
    cpu0 = sum(cpu_seconds(pid) for pid in server_pids)
    results = [out.get(timeout=start_at - time.time() + seconds + 120.0) for _ in children]
    cpu1 = sum(cpu_seconds(pid) for pid in server_pids)  # after the window: slightly over (drain, done_writing)
    for child in children:
        child.join(timeout=30.0)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    requests = sum(r[0] for r in results)
    flat = sorted(x for r in results for x in r[1])
    q = statistics.quantiles(flat, n=100, method="inclusive")
    return {
        "api": api,
        "shards": 1 if plan is None else plan.shards,
        "clients": clients,
        "client_procs": procs,
        "mode": f"paced {paced_s * 1e3:g} ms" if paced_s else "closed",
        "requests": requests,
        "seconds": seconds,
        "requests_per_s": requests / seconds,
        "p50_ms": q[49] * 1e3,
        "p99_ms": q[98] * 1e3,
        "mean_ms": statistics.fmean(flat) * 1e3,
        "server_cpu_us_per_request": (cpu1 - cpu0) / requests * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", default="1,8,64,256", help="comma-separated client counts")
    parser.add_argument("--api", default="stream,unary", help="comma-separated: stream, unary")
    parser.add_argument("--client-procs", type=int, default=4, help="client processes per run")
    parser.add_argument("--seconds", type=float, default=4.0, help="timed window per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per worker first")
    parser.add_argument("--paced-ms", type=float, default=0.0,
                        help="also run every client count with each worker asking once per this period")
    parser.add_argument("--generator", default="smart")
    parser.add_argument("--shards", default="1",
                        help="comma-separated shard counts (above 1: the ready generator in that many services)")
    parser.add_argument("--epoch-steps", type=int, default=10, help="with shards: the parts are drawn again every "
                        "this many requests of a worker")
    parser.add_argument("--simulate", default="", help="comma-separated worker counts to simulate instead (one "
                        "service and the default shards; e.g. 1024,4096,16384,65536)")
    parser.add_argument("--sim-steps", type=int, default=30, help="iterations per simulated worker")
    parser.add_argument("--service-us", type=float, default=None,
                        help="with --simulate: the service's CPU per request, us (default: the simulator's)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_gg.json"))
    parser.add_argument("--plot", nargs=3, type=Path, metavar=("MEASURED", "SIMULATED", "PNG"),
                        help="draw the latency curve of a measured JSON and a --simulate JSON into PNG, and stop")
    args = parser.parse_args()
    if args.plot:
        plot_curve(*args.plot)
        print(f"wrote {args.plot[2]}")
        return
    if args.simulate:
        rows = simulate_curve([int(n) for n in args.simulate.split(",")], args.sim_steps, args.service_us)
        print("| workers | shards | p50 (ms) | p99 (ms) | busiest shard | local steps |")
        print("|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['workers']} | {r['shards']} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
                  f"{100 * r['busiest_shard']:.0f}% | {100 * r['local_step_share']:.1f}% |")
        atomic_write_json(args.out, {"benchmark": "group_generator", "command": _command(), "machine": host_facts(),
                                     "simulated": rows})
        print(f"wrote {args.out}")
        return
    apis = args.api.split(",")
    for api in apis:
        if api not in APIS:
            raise SystemExit(f"unknown --api {api!r}; valid: {', '.join(APIS)}")

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for api in apis:
            for shards in (int(c) for c in args.shards.split(",")):
                for clients in (int(c) for c in args.clients.split(",")):
                    for paced_s in (0.0, args.paced_ms / 1e3) if args.paced_ms else (0.0,):
                        rows.append(_one(args, api, shards, clients, paced_s, Path(tmp)))

    print(f"Group Generator service, {args.generator} policy, server in its own process, 127.0.0.1, "
          f"{os.cpu_count()} CPUs, clients in {args.client_procs} processes, {args.seconds:g} s per run")
    print(f"{'api':>6} {'shards':>6} {'clients':>7} {'mode':>12} {'requests':>9} {'req/s':>8} {'p50 ms':>8} "
          f"{'p99 ms':>8} {'srv us/req':>10}")
    for r in rows:
        print(f"{r['api']:>6} {r['shards']:>6} {r['clients']:>7} {r['mode']:>12} {r['requests']:>9} "
              f"{r['requests_per_s']:>8.0f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
              f"{r['server_cpu_us_per_request']:>10.1f}")
    headline: dict[str, Any] = {}
    for api in apis:
        closed = {r["clients"]: r for r in rows if r["api"] == api and r["mode"] == "closed" and r["shards"] == 1}
        h: dict[str, float] = {}
        if 64 in closed:
            h.update(p50_ms_at_64=closed[64]["p50_ms"], p99_ms_at_64=closed[64]["p99_ms"])
        if 256 in closed:
            h["requests_per_s_at_256"] = closed[256]["requests_per_s"]
        if closed:
            h["server_cpu_us_per_request"] = statistics.median(
                r["server_cpu_us_per_request"] for r in closed.values())
        headline[api] = h
        print(f"{api}: " + ", ".join(f"{k} {v:.1f}" for k, v in h.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": "group_generator",
        "command": _command(),
        "generator": args.generator,
        "server": "subprocess",
        "host": "127.0.0.1",
        "machine": host_facts(),
        "load_average": os.getloadavg(),
        "client_procs": args.client_procs,
        "seconds": args.seconds,
        "grpc": grpc.__version__,
        "headline": headline,
        "results": rows,
    }
    atomic_write_json(args.out, record)
    print(f"wrote {args.out}")


def plot_curve(measured: Path, simulated: Path, out: Path) -> None:
    """One picture of the Group Generator's latency against the number of workers: the rows measured with
    real gRPC clients (``measured``, paced mode: a worker asks once per step) and the simulated curve
    (``simulated``, from ``--simulate``), p50 and p99, one service against shards."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    real = [r for r in json.loads(measured.read_text())["results"] if r["mode"] != "closed"]
    sim = json.loads(simulated.read_text())["simulated"]
    fig = Figure(figsize=(7.5, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for sharded, color in ((False, "tab:red"), (True, "tab:blue")):
        label = "shards (one per 256 workers)" if sharded else "one service"
        rows = sorted((r for r in sim if (r["shards"] > 1) == sharded or r["workers"] <= 256 and sharded),
                      key=lambda r: r["workers"])
        for q, style in (("p50_ms", "-"), ("p99_ms", ":")):
            ax.plot([r["workers"] for r in rows], [r[q] for r in rows], style, color=color,
                    label=f"simulated, {label}, {q[:3]}")
        got = sorted((r for r in real if (r["shards"] > 1) == sharded), key=lambda r: r["clients"])
        for q, marker in (("p50_ms", "o"), ("p99_ms", "^")):
            ax.plot([r["clients"] for r in got], [r[q] for r in got], marker, color=color, linestyle="none",
                    label=f"measured (real gRPC), {'shards' if sharded else 'one service'}, {q[:3]}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("workers (each asking once per 100 ms step)")
    ax.set_ylabel("request to group formed (ms)")
    ax.set_title("Group Generator latency: measured on this machine, simulated beyond it")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def _command() -> str:
    """This run's command line, as the docs show it (``prague report`` prints it above the table)."""
    return "python benchmarks/group_generator.py " + " ".join(sys.argv[1:])


def simulate_curve(sizes: list[int], steps: int, service_us: float | None = None) -> list[dict[str, Any]]:
    """The curve beyond this machine: ``prague:ready`` (overlap on, ``paper:5``, 100 ms steps, 4 workers per
    node) simulated at each size with one service and with the default shards (one per 256 workers), the
    service's cost per request ``service_us`` (default: the simulator's, measured by this benchmark)."""
    from prague.groups.shards import auto_shards
    from prague.sim.cluster import PAPER
    from prague.simulate.run import SimConfig, simulate

    cluster = PAPER if service_us is None else PAPER.replace_fields(gg_service_s=service_us * 1e-6)
    rows = []
    for n in sizes:
        for shards in (1, 0) if auto_shards(n, n // 4) > 1 else (1,):
            t = time.process_time()
            r = simulate(SimConfig.of(algorithm="prague:ready", scenario="paper:5", nproc=n, nodes=n // 4, steps=steps,
                                      model="resnet18", data="synthetic", cluster=cluster,
                                      options={"gg_shards": shards})).to_dict()
            st = r["algorithm_stats"][0]
            rows.append({"workers": n, "shards": st["gg_shards"], "p50_ms": 1e3 * st["gg_latency_p50_s"],
                         "p99_ms": 1e3 * st["gg_latency_p99_s"], "busiest_shard": st["gg_utilization"],
                         "local_step_share": st["local_step_share"], "sim_cpu_s": time.process_time() - t})
            print(f"  simulated {n} workers, {st['gg_shards']} shard(s): p50 {rows[-1]['p50_ms']:.2f} ms, "
                  f"p99 {rows[-1]['p99_ms']:.2f} ms, busiest {100 * rows[-1]['busiest_shard']:.0f}%", file=sys.stderr)
    return rows


def _one(args: argparse.Namespace, api: str, shards: int, clients: int, paced_s: float, tmp: Path) -> dict[str, Any]:
    """One row: the service (or its shards) started, the clients run, the service stopped."""
    generator, nodes, plan = args.generator, 1, None
    if shards > 1:
        if clients % 4:
            raise SystemExit(f"--shards {shards} puts the workers on nodes of 4: use client counts divisible by 4")
        generator, nodes = "ready", clients // 4
        plan = ShardPlan(Topology(nodes, 4), shards, args.epoch_steps)
    started = [start_service(clients, generator, tmp, (s, shards), nodes) for s in range(shards)]
    try:
        row = run_clients([a for _, a in started], [p.pid for p, _ in started], api, clients, args.client_procs,
                          args.seconds, args.warmup, paced_s, plan)
    finally:
        for proc, _ in started:
            proc.terminate()
        for proc, _ in started:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    print(f"  {api} {shards} shard(s) {clients} clients {row['mode']}: {row['requests_per_s']:.0f} req/s, "
          f"p99 {row['p99_ms']:.2f} ms", file=sys.stderr)
    return row


if __name__ == "__main__":
    main()
