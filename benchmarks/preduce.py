"""P-Reduce benchmark: averaging one buffer over a group of S ranks three ways, and building a group.

    .venv/bin/python benchmarks/preduce.py --out runs/bench_preduce.json
    .venv/bin/python benchmarks/preduce.py --backend nccl --nproc 8   # one process per GPU

It starts --nproc ranks (8) on this machine, joined as `prague launch` joins them (a TCPStore hosted here,
port from the OS; each rank has OMP_NUM_THREADS=1). For each buffer size (45 MB: ResNet-18's 11.2M float32
parameters; 4 MB) and each group size S (2, 4, 8; the group is ranks 0..S-1, the others wait at a barrier)
it times, after --warmup untimed rounds, --reps rounds of:

  preduce     prague.comm.preduce.preduce with a cached communicator (its store handshake included)
  all_reduce  dist.all_reduce on a dist.new_group of the same ranks, built once beforehand, then / S
  ring        a hand-written ring all-reduce over the default group: reduce-scatter then all-gather,
              each step one isend/irecv pair (batched, so the same code is safe on NCCL), then / S

and get() on a cached set alone (the handshake inside preduce); the methods take turns in each round.
Then the cost of a communicator for a member set its GroupCommunicators has never seen (a fresh
instance each time): get() plus a first 1-float all-reduce, so that NCCL's lazy set-up is counted too.
Every call starts after a tiny all-reduce over the group, so that members start together, and is timed
on rank 0. The table shows medians (min, max and samples in the JSON).
Loopback gloo on a shared 2-core machine is noisy: compare columns of one run, not runs.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import prague
from prague.comm.preduce import GroupCommunicators, preduce
from prague.io import atomic_write_json
from prague.metrics.record import host_facts

SIZES = {"45 MB": 11_200_000, "4 MB": 1_000_000}  # float32 elements


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=8)
    p.add_argument("--group-sizes", default="2,4,8")
    p.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, from {list(SIZES)}")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--create-reps", type=int, default=7)
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--out", type=Path, default=Path("runs/bench_preduce.json"))
    args = p.parse_args()
    args.group_sizes = [int(s) for s in args.group_sizes.split(",")]
    args.sizes = [s.strip() for s in args.sizes.split(",")]
    if any(s not in SIZES for s in args.sizes) or any(not 2 <= s <= args.nproc for s in args.group_sizes):
        p.error(f"--sizes must be among {list(SIZES)} and --group-sizes within 2..--nproc ({args.nproc})")
    return args


# ---- what the ranks run ----------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ring_allreduce(buf: torch.Tensor, members: list[int], rank: int) -> None:
    """Sum ``buf`` over ``members`` in place (global ranks, default group), then divide by their number."""
    n, i = len(members), members.index(rank)
    right, left = members[(i + 1) % n], members[(i - 1) % n]
    chunks = list(buf.tensor_split(n))
    scratch = torch.empty_like(chunks[0])

    def exchange(send: torch.Tensor, recv: torch.Tensor) -> None:
        ops = [dist.P2POp(dist.isend, send, right), dist.P2POp(dist.irecv, recv, left)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    for step in range(n - 1):  # reduce-scatter: afterwards chunk (i + 1) % n holds the full sum here
        recv_idx = (i - step - 1) % n
        incoming = scratch[: chunks[recv_idx].numel()]
        exchange(chunks[(i - step) % n], incoming)
        chunks[recv_idx].add_(incoming)
    for step in range(n - 1):  # all-gather: pass the summed chunks around the ring
        exchange(chunks[(i + 1 - step) % n], chunks[(i - step) % n])
    buf.div_(n)


def timed(fns: dict[str, Callable[[], object]], start_together: Callable[[], object], device: torch.device,
          warmup: int, reps: int) -> dict[str, list[float]]:
    """Seconds per call of each of ``fns``, taking turns each round so that load drifting on a shared
    machine hits every method alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(warmup + reps):
        for name, fn in fns.items():
            start_together()
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def rank_main(rank: int, args: argparse.Namespace, port: int, results: "mp.Queue[tuple[str, object]]") -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nproc), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    try:
        ctx = prague.init(backend=args.backend, timeout_s=args.timeout_s)
        device = ctx.device
        # dist.new_group needs every rank, members or not, in the same order.
        subgroups = {s: dist.new_group(list(range(s))) for s in args.group_sizes}
        comms = GroupCommunicators(ctx, capacity=len(args.group_sizes), namespace="bench/kept")
        tiny = torch.zeros(1, device=device)
        rows = []
        for size in args.sizes:
            buf = torch.randn(SIZES[size], device=device)
            for s in args.group_sizes:
                members, sub = tuple(range(s)), subgroups[s]
                # Every rank builds the same GroupCommunicators instances, members or not, each under
                # a store-key namespace of its own.
                fresh = [GroupCommunicators(ctx, capacity=1, namespace=f"bench/{size}/{s}/{i}")
                         for i in range(args.create_reps)]
                if rank in members:
                    start = lambda: dist.all_reduce(tiny, group=sub)  # noqa: E731

                    def all_reduce() -> None:
                        dist.all_reduce(buf, group=sub)
                        buf.div_(s)

                    def create(c: GroupCommunicators) -> None:
                        c.get(members).allreduce([tiny]).wait()

                    methods: dict[str, Callable[[], object]] = {
                        "preduce": lambda: preduce(buf, members, comms),
                        "all_reduce": all_reduce,
                        "ring": lambda: ring_allreduce(buf, list(members), rank),
                        "get_cached": lambda: comms.get(members),
                    }
                    row = {"size": size, "size_bytes": buf.numel() * buf.element_size(), "group_size": s,
                           **timed(methods, start, device, args.warmup, args.reps),
                           "create": [timed({"create": lambda: create(c)}, start, device, 0, 1)["create"][0]
                                      for c in fresh]}
                    rows.append(row)
                for c in fresh:
                    c.close()
                dist.barrier()  # the idle ranks wait here
        comms.close()
        if rank == 0:
            results.put(("rows", rows))
        prague.shutdown()
    except BaseException:
        results.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        raise


# ---- the driver ------------------------------------------------------------------------------------


def ms(xs: list[float]) -> dict[str, Any]:
    return {"median_ms": 1e3 * statistics.median(xs), "min_ms": 1e3 * min(xs), "max_ms": 1e3 * max(xs), "n": len(xs),
            "samples_ms": [round(1e3 * x, 3) for x in xs]}


def main() -> None:
    args = parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the ranks: n processes share the cores
    store = dist.TCPStore("127.0.0.1", 0, args.nproc, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=args.timeout_s))
    spawn = mp.get_context("spawn")
    results = spawn.Queue()
    procs = [spawn.Process(target=rank_main, args=(r, args, store.port, results)) for r in range(args.nproc)]
    t0 = time.time()
    for p in procs:
        p.start()
    rows = None
    try:
        while rows is None:
            try:
                kind, payload = results.get(timeout=1.0)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    sys.exit(f"a rank died: exit codes {[p.exitcode for p in procs]}")
                if time.time() - t0 > args.timeout_s * 2:
                    sys.exit("benchmark did not finish in time")
                continue
            if kind == "error":
                sys.exit(payload)
            rows = payload
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()

    table = []
    for row in rows:
        stats = {k: ms(row[k]) for k in ("preduce", "all_reduce", "ring", "get_cached", "create")}
        table.append({"size": row["size"], "size_bytes": row["size_bytes"], "group_size": row["group_size"], **stats})
    med = lambda r, k: r[k]["median_ms"]  # noqa: E731
    print(f"\nP-Reduce, {args.backend}, {args.nproc} ranks on {os.cpu_count()} cores; medians of {args.reps} "
          f"(create: of {args.create_reps}); ms\n")
    print("| buffer | S | preduce | all_reduce (new_group) | ring (isend/irecv) | ring / all_reduce "
          "| preduce / all_reduce | get, cached | create |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['size']} | {r['group_size']} | {med(r, 'preduce'):.1f} | {med(r, 'all_reduce'):.1f} "
              f"| {med(r, 'ring'):.1f} | {med(r, 'ring') / med(r, 'all_reduce'):.2f} "
              f"| {med(r, 'preduce') / med(r, 'all_reduce'):.2f} | {med(r, 'get_cached'):.2f} "
              f"| {med(r, 'create'):.1f} |")
    report = {
        "benchmark": "preduce",
        "config": {"backend": args.backend, "nproc": args.nproc, "group_sizes": args.group_sizes,
                   "sizes": {s: SIZES[s] for s in args.sizes}, "reps": args.reps, "warmup": args.warmup,
                   "create_reps": args.create_reps, "omp_num_threads": 1},
        "machine": host_facts(),
        "wall_s": time.time() - t0,
        "rows": table,
    }
    atomic_write_json(args.out, report)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
