"""Simulator benchmarks: the engine, the paper's setting, and scale. Prints tables, writes JSON.

    .venv/bin/python benchmarks/simulator.py --engine                 # heap loop vs SimPy (if installed)
    .venv/bin/python benchmarks/simulator.py --paper                  # 16 workers, 4 x 4, vs the paper
    .venv/bin/python benchmarks/simulator.py --scale --steps 200      # 16..1,024 workers, every generator
    .venv/bin/python benchmarks/simulator.py --timing                 # 1,024 workers x 1,000 steps, smart
    .venv/bin/python benchmarks/simulator.py --scale-timing           # prague at 1,024 x 1,000 .. 65,536 x 100
    .venv/bin/python benchmarks/simulator.py --consensus --sizes 1024x200,16384x200   # how well it mixes
    .venv/bin/python benchmarks/simulator.py --calls --sizes 1024x100,16384x20      # calls per worker-iteration
    .venv/bin/python benchmarks/simulator.py --all --out runs/bench_sim.json

``--paper`` runs every method on the ``paper`` cluster preset (:data:`prague.sim.cluster.PAPER`: 4 nodes x
4 GPUs, ResNet-18's 11,173,962 parameters, batch 128; its assumptions are in its comment) and prints each
method's throughput relative to homogeneous ``allreduce`` next to the Prague paper's figures (Luo et al.,
ASPLOS 2020: its 16-worker ResNet-18 figures), plus one row per sensitivity variant. ``--scale`` keeps 4 workers per
node and reports, per generator, throughput as a fraction of the no-wait limit under ``paper:5`` and the
Group Generator's load: the simulated GG thread's utilisation and the real policy code's CPU per request,
timed while simulating. ``--engine`` times the same workload (1,024 workers x 300 iterations of compute,
a pairwise rendezvous and a transfer) on this package's heap loop and on SimPy (``pip install simpy``);
SimPy is not a dependency, so that row is skipped without it.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import random
import sys
import time
from pathlib import Path
from typing import Any

from prague.hetero.spec import parse_scenario
from prague.metrics.record import host_facts
from prague.sim.cluster import PAPER
from prague.sim.engine import Engine, Process
from prague.simulate.run import SimConfig, simulate, simulate_charged

GENERATORS = ("static", "smart", "random", "ready")
PAPER_METHODS = ("allreduce", "ps:sync", "ps:async", "ps-eager", "adpsgd", "dssync", "prague:static",
                 "prague:smart", "prague:random", "prague:ready", "prague:smart/off", "prague:ready/off")
# "/off": the same method with --overlap off (every worker blocks on its group, as the paper's Prague did).
# Relative to homogeneous All-Reduce, as the Prague paper reports them (its 16-worker ResNet-18 figures; the
# paper's Prague blocked on its groups, so its figures stand beside the "/off" rows).
PAPER_FIGURES = {
    ("prague:smart/off", "homogeneous"): 1.1, ("adpsgd", "homogeneous"): 0.6, ("ps:sync", "homogeneous"): 0.2,
    ("allreduce", "paper:5"): 0.24, ("adpsgd", "paper:5"): 0.28, ("prague:smart/off", "paper:5"): 0.45,
}


# -- engine -------------------------------------------------------------------------------------------
def _engine_workload(n: int, k: int, seed: int = 1) -> list[list[float]]:
    rng = random.Random(seed)
    return [[0.1 * (0.5 + rng.random()) for _ in range(k)] for _ in range(n)]


def run_heap(compute: list[list[float]]) -> float:
    engine = Engine()
    meet: dict[tuple[int, int], Any] = {}

    def worker(w: int) -> Process:
        for k, c in enumerate(compute[w]):
            yield c
            key = (w >> 1, k)
            sig = meet.pop(key, None)
            if sig is None:
                meet[key] = sig = engine.signal()
                yield sig
            else:
                sig.fire()
            yield 0.01

    for w in range(len(compute)):
        engine.process(worker(w))
    return engine.run()


def run_simpy(compute: list[list[float]]) -> float:
    import simpy  # optional: not a dependency of prague

    env = simpy.Environment()
    meet: dict[tuple[int, int], Any] = {}

    def worker(w: int) -> Any:
        for k, c in enumerate(compute[w]):
            yield env.timeout(c)
            key = (w >> 1, k)
            ev = meet.pop(key, None)
            if ev is None:
                meet[key] = ev = env.event()
                yield ev
            else:
                ev.succeed()
            yield env.timeout(0.01)

    for w in range(len(compute)):
        env.process(worker(w))
    env.run()
    return float(env.now)


def bench_engine(n: int = 1024, k: int = 300, repeats: int = 3) -> list[dict[str, Any]]:
    compute = _engine_workload(n, k)
    rows = []
    for name, fn in (("heap loop (prague.sim.engine)", run_heap), ("SimPy", run_simpy)):
        try:
            best_wall = best_cpu = float("inf")
            end = 0.0
            for _ in range(repeats):
                t, c = time.perf_counter(), time.process_time()
                end = fn(compute)
                best_wall, best_cpu = min(best_wall, time.perf_counter() - t), min(best_cpu, time.process_time() - c)
        except ImportError:
            print(f"{name}: not installed, skipped")
            continue
        rows.append({"engine": name, "workers": n, "iterations": k, "wall_s": best_wall, "cpu_s": best_cpu,
                     "simulated_end_s": end})
    print("\n| engine | wall (s) | CPU (s) | simulated end (s) |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['engine']} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} | {r['simulated_end_s']:.3f} |")
    return rows


# -- the paper's setting ------------------------------------------------------------------------------
def _paper_config(algorithm: str, scenario: str, steps: int, **cluster: Any) -> SimConfig:
    algorithm, _, overlap = algorithm.partition("/")
    return SimConfig.of(algorithm=algorithm, scenario=scenario, nproc=16, nodes=4, steps=steps, batch_size=128,
                     model="resnet18", data="synthetic", cluster=PAPER.replace_fields(**cluster),
                     options={"overlap": overlap} if overlap else {})


def bench_paper(steps: int = 400) -> list[dict[str, Any]]:
    variants: dict[str, dict[str, Any]] = {
        "paper preset": {},
        "no link sharing": {"contention": False},
        "all-reduce not overlapped": {"backward_share": 0.0},
    }
    rows = []
    for variant, changes in variants.items():
        thr: dict[tuple[str, str], float] = {}
        for scenario in ("homogeneous", "paper:5"):
            methods = PAPER_METHODS if variant == "paper preset" else ("allreduce", "prague:smart", "prague:ready",
                                                                       "prague:smart/off", "prague:static", "adpsgd")
            for algorithm in methods:
                thr[(algorithm, scenario)] = simulate(_paper_config(algorithm, scenario, steps, **changes)).to_dict()[
                    "throughput_samples_per_s"]
        base = thr[("allreduce", "homogeneous")]
        for (algorithm, scenario), value in thr.items():
            paper = PAPER_FIGURES.get((algorithm, scenario))
            rel = value / base
            rows.append({"variant": variant, "method": algorithm, "scenario": scenario, "relative": rel,
                         "paper": paper, "within_15pct": None if paper is None else abs(rel / paper - 1) <= 0.15})
    print("\n| variant | method | scenario | simulated vs homogeneous allreduce | paper | within 15% |")
    print("|---|---|---|---:|---:|---|")
    for r in rows:
        figure = "-" if r["paper"] is None else f"{r['paper']:.2f}"
        ok = "-" if r["within_15pct"] is None else ("yes" if r["within_15pct"] else "no")
        print(f"| {r['variant']} | {r['method']} | {r['scenario']} | {r['relative']:.2f} | {figure} | {ok} |")
    return rows


# -- scale ---------------------------------------------------------------------------------------------
def bench_scale(steps: int = 200, sizes: tuple[int, ...] = (16, 64, 256, 1024)) -> list[dict[str, Any]]:
    rows = []
    for n in sizes:
        for generator, overlap in ((g, o) for g in GENERATORS for o in ("on", "off")):
            t, c = time.perf_counter(), time.process_time()
            r = simulate(SimConfig.of(algorithm=f"prague:{generator}", scenario="paper:5", nproc=n, nodes=n // 4,
                                   steps=steps, batch_size=128, model="resnet18", data="synthetic", cluster=PAPER,
                                   options={"overlap": overlap, "gg_shards": 1})).to_dict()  # one service
            stats = r["algorithm_stats"][0]
            rows.append({
                "workers": n, "generator": generator, "overlap": overlap,
                "fraction_of_limit": r["fraction_of_limit"],
                "mean_wait_ms": 1e3 * sum(r["mean_wait_s"]) / n,
                "gg_utilization": stats["gg_utilization"], "gg_mean_queue_ms": 1e3 * stats["gg_mean_queue_s"],
                "policy_us_per_call": stats["policy_us_per_call"], "policy_core_share": stats["policy_core_share"],
                "requests_per_s": stats["generator_stats"].get("requests", 0) / r["wall_s"] if r["wall_s"] else 0.0,
                "mean_group_size": stats["mean_group_size"], "local_step_share": stats.get("local_step_share", 0.0),
                "sim_wall_s": time.perf_counter() - t,
                "sim_cpu_s": time.process_time() - c,
            })
            print(f"  {n} workers, {generator}, overlap {overlap}: {rows[-1]['fraction_of_limit']:.2f} of the no-wait limit "
                  f"({rows[-1]['sim_cpu_s']:.1f} s CPU)", flush=True)
    print("\n| workers | generator | overlap | of no-wait limit | local steps | GG requests/s | GG thread busy | "
          "GG queue (ms) | policy CPU per request (us) | policy share of one core |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        remote = r["generator"] != "static"
        print(f"| {r['workers']} | {r['generator']} | {r['overlap']} | {100 * r['fraction_of_limit']:.0f}% | "
              f"{100 * r['local_step_share']:.0f}% | "
              f"{r['requests_per_s']:.0f} | {100 * r['gg_utilization']:.0f}% | "
              f"{r['gg_mean_queue_ms']:.2f} | {r['policy_us_per_call']:.1f} | "
              f"{100 * r['policy_core_share']:.1f}% |" if remote else
              f"| {r['workers']} | static | {r['overlap']} | {100 * r['fraction_of_limit']:.0f}% | "
              f"{100 * r['local_step_share']:.0f}% | (no GG) | - | - | "
              f"{r['policy_us_per_call']:.1f} | - |")
    return rows


#: The sizes of issue-scale timing: (workers, iterations), 8 workers per node, ``prague`` (the ``ready``
#: generator, its default shards), ``paper:5``, 100 ms steps.
SCALE_SIZES = ((1024, 1000), (16384, 1000), (65536, 100))


def parse_sizes(text: str) -> tuple[tuple[int, int], ...]:
    """``"1024x1000,16384x100"`` -> ((1024, 1000), (16384, 100))."""
    try:
        sizes = tuple((int(w), int(k)) for w, k in (part.split("x") for part in text.split(",")))
    except ValueError:
        raise SystemExit(f"--sizes {text!r}: write WORKERSxITERATIONS[,...], like 1024x1000,16384x100") from None
    if not sizes or any(w < 8 or w % 8 or k < 1 for w, k in sizes):
        raise SystemExit(f"--sizes {text!r}: workers must be a multiple of 8 (8 per node), iterations >= 1")
    return sizes


def _scale_config(workers: int, steps: int, algorithm: str = "prague", per_node: int = 8,
                  math: str = "none") -> SimConfig:
    """The scale-timing command's configuration: ``algorithm``, ``paper:5``, ResNet-18 at 100 ms steps, ``per_node``
    workers a node."""
    return SimConfig.of(algorithm=algorithm, scenario="paper:5", nproc=workers, nodes=workers // per_node, steps=steps,
                        batch_size=128, model="resnet18", data="synthetic", cluster=PAPER, compute="emulated",
                        compute_ms=100.0, math=math)


def bench_scale_timing(sizes: tuple[tuple[int, int], ...] = SCALE_SIZES, math: str = "none",
                       algorithm: str = "prague", per_node: int = 8) -> list[dict[str, Any]]:
    """How long ``prague simulate --algorithms ALGORITHM --scenarios paper:5 --nproc N --nodes N/PER_NODE --steps K
    --model resnet18 --compute emulated --compute-ms 100`` takes, per size: wall and CPU seconds, events, the
    cost per worker-iteration, and what the run reports of the Group Generator (shards, the busiest shard's
    utilisation), the share of local steps and, with ``math="mixing"``, the consensus distance at the last step."""
    rows = []
    for workers, steps in sizes:
        t, c = time.perf_counter(), time.process_time()
        r = simulate(_scale_config(workers, steps, algorithm=algorithm, per_node=per_node, math=math)).to_dict()
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        stats = r["algorithm_stats"][0]
        rows.append({"algorithm": algorithm, "workers": workers, "steps": steps, "math": math, "wall_s": wall, "cpu_s": cpu,
                     "engine_s": r["sim"]["run_s"], "events": r["sim"]["events"],
                     "us_per_worker_iteration": 1e6 * cpu / (workers * steps),
                     "gg_shards": stats.get("gg_shards"), "gg_utilization": stats.get("gg_utilization"),
                     "local_step_share": stats.get("local_step_share"),
                     # the spread at the last step: prague's final average over everyone (--final-average on)
                     # then removes it
                     "consensus_distance": (stats["final_average_distance"] if stats.get("final_average_distance")
                                            is not None else r.get("consensus_distance")),
                     "fraction_of_limit": r["fraction_of_limit"]})
        row = rows[-1]
        consensus = "" if row["consensus_distance"] is None else f", consensus distance {row['consensus_distance']:.2f}"
        print(f"  {algorithm}, {workers} x {steps}: {wall:.1f} s wall, {cpu:.1f} s CPU, {row['us_per_worker_iteration']:.1f} us "
              f"per worker-iteration, {row['gg_shards']} shard(s) at most {100 * (row['gg_utilization'] or 0):.0f}% "
              f"busy{consensus}", flush=True)
    return rows


def _calls_and_time(workers: int, steps: int) -> tuple[dict[str, int], int, float, float]:
    """One scale-timing run of ``workers`` x ``steps``: the Python calls of each function under
    :mod:`cProfile`, their total, then the same run's engine seconds and events without the profiler."""
    profiler = cProfile.Profile()
    profiler.enable()
    simulate(_scale_config(workers, steps))
    profiler.disable()
    stats = pstats.Stats(profiler)
    per_function = {f"{path.rsplit('/', 1)[-1]}:{name}": int(entry[1])  # primitive and recursive calls
                     for (path, _, name), entry in stats.stats.items()}  # type: ignore[attr-defined]
    gc.collect()
    r = simulate(_scale_config(workers, steps)).to_dict()
    return per_function, int(stats.total_calls), float(r["sim"]["run_s"]), float(r["sim"]["events"])  # type: ignore[attr-defined]


def bench_calls(sizes: tuple[tuple[int, int], ...], growth: float = 1.1) -> list[dict[str, Any]]:
    """Whether the simulator's work per worker-iteration depends on the number of workers: for each size
    ``N x K``, runs of ``K`` and ``3K`` iterations, and the difference between them divided by ``2K x N``
    (the world's build and the records cancel out): Python function calls per worker-iteration (by
    :mod:`cProfile`: a count of the work done, which the machine's caches do not change) and, without the
    profiler, engine microseconds per worker-iteration and per event. Calls that stay flat while the
    microseconds grow put the growth in the machine (memory), not in the code. Each row also lists the
    functions whose calls per worker-iteration grew by more than ``growth`` times against the first size."""
    from prague.native import state

    if state() != "pure":
        raise SystemExit("--calls counts Python calls, which compiled modules do not report: `make clean-compiled` first")
    simulate(_scale_config(8, 1))  # the one-time work (imports, caches) before the first counted run, not in it
    rows: list[dict[str, Any]] = []
    base: dict[str, float] | None = None
    for workers, steps in sizes:
        f1, c1, s1, e1 = _calls_and_time(workers, steps)
        f3, c3, s3, e3 = _calls_and_time(workers, 3 * steps)
        wi = workers * 2 * steps
        per = {name: (f3.get(name, 0) - f1.get(name, 0)) / wi for name in set(f1) | set(f3)}
        per = {name: v for name, v in per.items() if v > 1e-3}
        grown = {} if base is None else {
            name: [round(base.get(name, 0.0), 3), round(v, 3)] for name, v in per.items()
            if v > 0.01 and v > growth * base.get(name, 0.0)}
        base = per if base is None else base
        rows.append({"workers": workers, "steps": [steps, 3 * steps], "calls_per_worker_iteration": (c3 - c1) / wi,
                     "engine_us_per_worker_iteration": 1e6 * (s3 - s1) / wi,
                     "events_per_worker_iteration": (e3 - e1) / wi,
                     "engine_us_per_event": 1e6 * (s3 - s1) / (e3 - e1) if e3 > e1 else None,
                     "grown": dict(sorted(grown.items()))})
        row = rows[-1]
        print(f"  {workers} x {steps}..{3 * steps}: {row['calls_per_worker_iteration']:.1f} calls, "
              f"{row['engine_us_per_worker_iteration']:.1f} us, {row['events_per_worker_iteration']:.2f} events per "
              f"worker-iteration; grown: {row['grown'] or 'none'}", flush=True)
    return rows


#: Failure rates per worker-hour: the one large clusters report (Llama 3, Dubey et al. 2024: 419 unexpected
#: interruptions in 54 days on 16,384 GPUs, about 2e-5), and higher ones, where a job of 1,000 steps meets some.
FAILURE_RATES = (2e-5, 1e-3, 1e-2, 1e-1)


def bench_failures(workers: tuple[int, ...] = (1024,), steps: int = 1000, checkpoint_every: int = 100,
                   rates: tuple[float, ...] = FAILURE_RATES) -> list[dict[str, Any]]:
    """Time to finish ``steps`` iterations under each failure rate (``failures:P``), per method: ``prague``
    (the survivors go on) and ``allreduce`` (a restart from the last checkpoint, every ``checkpoint_every``
    steps, charged: :mod:`prague.sim.restarts`); 100 ms steps, ``paper:5``, 4 workers per node.

    A ``prague`` run under a rate at which no worker's failure time falls before the failure-free run's end
    is that run (no failure fires, and the slowdowns are the same draws): its row is the failure-free one's,
    marked ``reused``, not simulated again (at 16,384 workers a run takes a quarter of an hour). ``allreduce``
    runs once, without failures, and each rate's record is that run charged for the rate's failures
    (:func:`prague.simulate.run.simulate_charged`), its rows after the first marked ``reused``."""
    rows = []
    for n in workers:
        scenarios = ["paper:5" + (f"+failures:{rate:g}" if rate else "") for rate in (0.0, *rates)]

        def config(algorithm: str, scenario: str) -> SimConfig:
            return SimConfig.of(algorithm=algorithm, scenario=scenario, nproc=n, nodes=n // 4, steps=steps,
                                batch_size=128, model="resnet18", data="synthetic", cluster=PAPER,
                                checkpoint_every=checkpoint_every)

        def row(rate: float, algorithm: str, r: dict[str, Any], cpu_s: float, reused: str) -> None:
            rows.append({"workers": n, "rate_per_hour": rate, "method": algorithm, "job_s": r["job_s"],
                         "failures": len(r["failures"]), "restarts": r.get("restarts") or 0,
                         "sim_cpu_s": cpu_s, "reused": bool(reused)})
            print(f"  {n} workers, failures:{rate:g}, {algorithm}: {r['job_s']:.1f} s, {len(r['failures'])} "
                  f"failure(s){reused and f' ({reused})'}", flush=True)

        # prague's survivors go on: each rate whose first failure falls before the failure-free run's end is
        # a run of its own
        free: dict[str, Any] = {}
        for rate, scenario in zip((0.0, *rates), scenarios):
            first_failure_s = min(parse_scenario(scenario).failure_time_s(rank) for rank in range(n))
            if free and first_failure_s >= free["job_s"]:
                row(rate, "prague", free, 0.0, "the failure-free run")
                continue
            c = time.process_time()
            r = simulate(config("prague", scenario)).to_dict()
            row(rate, "prague", r, time.process_time() - c, "")
            free = free or r
        # allreduce restarts from its checkpoint: one run without failures, charged for each rate's
        c = time.process_time()
        records = simulate_charged(config("allreduce", scenarios[0]), scenarios)
        cpu_s = time.process_time() - c
        for i, (rate, record) in enumerate(zip((0.0, *rates), records)):
            row(rate, "allreduce", record.to_dict(), cpu_s if i == 0 else 0.0, "one run, charged" if i else "")
    print("\n| workers | failures per worker-hour | method | failures | restarts | time to 1,000 steps (s) |")
    print("|---:|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['workers']} | {r['rate_per_hour']:g} | {r['method']} | {r['failures']} | {r['restarts']} | "
              f"{r['job_s']:.1f} |")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", action="store_true")
    p.add_argument("--paper", action="store_true")
    p.add_argument("--scale", action="store_true")
    p.add_argument("--timing", action="store_true")
    p.add_argument("--failures", action="store_true", help="time to 1,000 steps under failure rates, per method")
    p.add_argument("--workers", default="1024", help="comma-separated worker counts for --failures")
    p.add_argument("--scale-timing", action="store_true",
                   help="time prague simulate at --sizes (default 1024x1000,16384x1000,65536x100)")
    p.add_argument("--consensus", action="store_true",
                   help="the consensus distance (--math mixing) at --sizes, for the sharded Group Generator")
    p.add_argument("--calls", action="store_true",
                   help="Python calls and engine time per worker-iteration at --sizes (N x K: runs of K and 3K)")
    p.add_argument("--sizes", default=None,
                   help="WORKERSxITERATIONS[,...] for --scale-timing, --consensus and --calls")
    p.add_argument("--all", action="store_true")
    p.add_argument("--steps", type=int, default=200, help="iterations per worker for --scale")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args()
    if not (args.engine or args.paper or args.scale or args.timing or args.failures or args.all
            or args.scale_timing or args.consensus or args.calls):
        p.error("choose at least one of --engine, --paper, --scale, --timing, --scale-timing, --consensus, "
                "--calls, --failures, --all")
    sizes = parse_sizes(args.sizes) if args.sizes else SCALE_SIZES
    results: dict[str, Any] = {"benchmark": "simulator", "command": "python benchmarks/simulator.py " + " ".join(sys.argv[1:]),
                               "machine": host_facts()}
    if args.engine or args.all:
        results["engine"] = bench_engine()
    if args.paper or args.all:
        results["paper"] = bench_paper()
    if args.scale or args.all:
        results["scale"] = bench_scale(args.steps)
    if args.timing or args.all:
        # the paper's generator at 1,024 workers x 1,000 iterations, 4 workers per node
        results["timing"] = bench_scale_timing(((1024, 1000),), algorithm="prague:smart", per_node=4)
    if args.scale_timing:
        results["scale_timing"] = bench_scale_timing(sizes)
    if args.consensus:
        results["consensus"] = bench_scale_timing(sizes, math="mixing")
    if args.calls:
        results["calls"] = bench_calls(sizes)
    if args.failures or args.all:
        results["failures"] = bench_failures(tuple(int(w) for w in args.workers.split(",")))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
