"""``prague simulate``: every method on a simulated cluster, writing what ``prague bench`` writes.

    prague simulate --algorithms allreduce,prague:smart,prague:ready --scenarios homogeneous,paper:5 \\
        --nproc 16 --nodes 4 --model resnet18 --cluster paper --steps 300 --out runs/sim
    prague simulate --calibrate runs/bench/bench.json --out runs/cal        # fit, compare, write cluster.toml
    prague simulate --calibrate runs/bench/bench.json --check runs/bench2/bench.json --out runs/cal
    prague simulate --calibrate runs/bench/bench.json --algorithms prague:ready --nproc 256 --out runs/big
    prague simulate --algorithms prague:smart,allreduce --nproc 256 --math real --steps 400   # accuracy too
    prague simulate --algorithms allreduce,lossy --nproc 8 --hosts 4 --link-rate 1gbit --cross-traffic bursts:0.3:20

The run flags are ``prague bench``'s own (same names, same method options); cluster flags override
single values of ``--cluster`` (a preset: ``paper``, ``local``; or a TOML file, see
:mod:`prague.sim.cluster`). With ``--calibrate`` the cluster is fitted to that benchmark first
(:mod:`prague.simulate.calibrate`), the comparison, in-sample and out-of-sample (on the ``--check``
benchmark, or leave-one-scenario-out), is printed and written to ``OUT/calibration.{md,json}`` and the
fitted cluster to ``OUT/cluster.toml``; methods are simulated only if ``--algorithms`` is given.

Emulated hosts are modelled, with ``prague run``'s flags: ``--hosts H`` makes H nodes (ranks in
contiguous blocks; ``--nodes`` follows), ``--link-rate`` (default 1gbit) is the inter-node bandwidth
(the intra-node link stays the cluster's: a host's loopback), ``--cross-traffic bursts:P:MB`` loads
every node's link with the runtime's seeded bursts (:mod:`prague.sim.traffic`).

``--budget epochs:E | samples:N`` is the job-wide budget as in ``prague bench``: methods whose workers
may take unequal shares claim batches from one counter with the runtime's rule, the others take equal
shares; with ``--math real`` the batches are the job-wide ones, every sample once per epoch. ``--compute
paced --compute-ms T`` is accepted as what it emulates: every simulated worker computes T ms a step.
Accuracy (``--math real``) is measured on the common clock, every ``--eval-every-s`` simulated seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prague.metrics.record import RunRecord
    from prague.simulate.run import SimConfig

from prague.errors import ConfigError
from prague.sim.cluster import PRESETS, Cluster, Link, load_cluster
from prague.simulate.memory import AUTO_FROM_WORKERS, MODES, unsupported, wanted
from prague.train.config import (
    RunConfig, add_run_arguments, check_options_apply, check_out_folder, config_from_args, hosts_nodes, option_values,
    run_folder,
)

DEFAULT_ALGORITHMS = "allreduce,prague:smart"


def add_simulate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``simulate`` to the ``prague`` command's subparsers; its handler is :func:`cmd_simulate`."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "simulate", help="simulate methods on a cluster of any size, in simulated time")
    p.add_argument("--algorithms", default=None,
                   help=f"comma-separated methods, NAME or NAME:VARIANT (default {DEFAULT_ALGORITHMS})")
    p.add_argument("--scenarios", default="homogeneous,paper:5", help="comma-separated scenarios")
    p.add_argument("--calibrate", type=Path, metavar="BENCH_JSON",
                   help="fit the cluster to this real benchmark and compare simulated with measured throughput")
    p.add_argument("--check", type=Path, metavar="BENCH_JSON",
                   help="with --calibrate: the real benchmark the fitted cluster predicts (out-of-sample error); "
                        "without it, leave-one-scenario-out on the --calibrate benchmark")
    p.add_argument("--math", default="none",
                   help="none (default): timing only; real: every simulated worker trains real parameters "
                        "(accuracy against simulated time); mixing: a noise vector per worker, how well the "
                        "averaging keeps the replicas together at any scale (consensus_distance)")
    c = p.add_argument_group("cluster (override single values of --cluster)")
    c.add_argument("--cluster", default=None,
                   help=f"a preset ({', '.join(sorted(PRESETS))}) or a TOML file (default paper; the base "
                        "that --calibrate fits: local)")
    c.add_argument("--compute-cv", type=float, help="coefficient of variation of per-iteration compute")
    c.add_argument("--compute-dist", help="constant | uniform | normal | lognormal")
    c.add_argument("--intra-latency-us", type=float)
    c.add_argument("--intra-gbps", type=float, help="intra-node bandwidth, Gbit/s")
    c.add_argument("--inter-latency-us", type=float)
    c.add_argument("--inter-gbps", type=float, help="inter-node bandwidth, Gbit/s")
    c.add_argument("--backward-share", type=float,
                   help="share of the compute that is backward, which DDP's all-reduce overlaps with (0 to 1)")
    c.add_argument("--allreduce-ring-factor", type=float,
                   help="the all-reduce's time over the alpha-beta ring's (1: the ideal ring)")
    c.add_argument("--allreduce-exposed", type=float, help=argparse.SUPPRESS)  # removed: a clear error
    c.add_argument("--gg-rtt-us", type=float, help="Group Generator RPC round trip")
    c.add_argument("--gg-service-us", type=float, help="Group Generator time per request")
    c.add_argument("--no-contention", action="store_true", help="concurrent transfers do not share links")
    p.add_argument("--nproc", type=int, default=4, help="number of simulated workers (default 4)")
    p.add_argument("--out", type=Path, help="output directory (default runs/simulate-<time>)")
    add_run_arguments(p, defaults={"model": "resnet18"})
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--huge-pages", choices=MODES, default="auto",
                   help="run on glibc's malloc with transparent huge pages, which large simulations need to keep "
                        f"their memory's addresses cached: auto (default) from {AUTO_FROM_WORKERS:,} workers where "
                        "the machine allows it (Linux, glibc 2.35+, huge pages not off), on, or off; the command "
                        "starts itself again once to change allocator (docs/simulator.md)")
    return p


def cluster_from_args(args: argparse.Namespace, base: Cluster | None = None) -> Cluster:
    """``--cluster`` (or ``base``) with the single-value flags applied; ConfigError naming a bad flag."""
    cluster = base if base is not None else load_cluster(args.cluster or "paper")
    if isinstance(args.compute_ms, str):
        raise ConfigError("--compute-ms auto probes this machine for real runs (prague run, prague bench); the "
                          "simulator's nominal compute is a number of ms: give one")
    if getattr(args, "allreduce_exposed", None) is not None:
        raise ConfigError("--allreduce-exposed is gone: the simulator plays out DDP's buckets (--bucket-cap-mb) "
                          "against backward; set --backward-share (0: nothing hidden) and --allreduce-ring-factor")
    for name in ("compute_cv", "intra_latency_us", "intra_gbps", "inter_latency_us", "inter_gbps", "backward_share",
                 "allreduce_ring_factor", "gg_rtt_us", "gg_service_us"):
        value, zero = getattr(args, name), not name.endswith("gbps")  # a link needs some bandwidth
        if value is not None and not (math.isfinite(value) and (value >= 0 if zero else value > 0)):
            raise ConfigError(f"--{name.replace('_', '-')} must be a finite number {'>= 0' if zero else '> 0'}, "
                              f"got {value}")
    if args.backward_share is not None and args.backward_share > 1:
        raise ConfigError(f"--backward-share is backward's share of the compute, between 0 and 1, got "
                          f"{args.backward_share}")

    def link(old: Link, latency_us: float | None, gbps: float | None) -> Link | None:
        if latency_us is None and gbps is None:
            return None
        return Link.of(old.latency_s * 1e6 if latency_us is None else latency_us,
                       old.bandwidth_bytes_per_s * 8 / 1e9 if gbps is None else gbps)

    return cluster.replace_fields(
        compute_s=None if args.compute_ms is None else args.compute_ms / 1e3,
        compute_cv=args.compute_cv, compute_dist=args.compute_dist,
        intra=link(cluster.intra, args.intra_latency_us, args.intra_gbps),
        inter=link(cluster.inter, args.inter_latency_us, args.inter_gbps),
        backward_share=args.backward_share, allreduce_ring_factor=args.allreduce_ring_factor,
        gg_rtt_s=None if args.gg_rtt_us is None else args.gg_rtt_us * 1e-6,
        gg_service_s=None if args.gg_service_us is None else args.gg_service_us * 1e-6,
        contention=False if args.no_contention else None,
    )


def cluster_to_toml(cluster: Cluster) -> str:
    """``cluster`` in the TOML layout :func:`prague.sim.cluster.load_cluster` reads."""
    def link(name: str, value: Link) -> list[str]:
        return [f"[links.{name}]", f"latency_us = {value.latency_s * 1e6:.6g}",
                f"bandwidth_gbps = {value.bandwidth_bytes_per_s * 8 / 1e9:.6g}", ""]

    lines = [f"name = {json.dumps(cluster.name)}", "", "[compute]", f"time_ms = {cluster.compute_s * 1e3:.6g}",
             f"overhead_ms = {cluster.compute_overhead_s * 1e3:.6g}",
             f"distribution = {json.dumps(cluster.compute_dist)}", f"cv = {cluster.compute_cv:.6g}",
             f"backward_share = {cluster.backward_share:.6g}"]
    if cluster.speeds:
        lines.append(f"speeds = [{', '.join(f'{s:.6g}' for s in cluster.speeds)}]")
    lines.append("")
    lines += link("intra", cluster.intra) + link("inter", cluster.inter)
    lines += ["[allreduce]", f"ring_factor = {cluster.allreduce_ring_factor:.6g}", "",
              "[preduce]", f"setup_ms = {cluster.preduce_setup_s * 1e3:.6g}", "",
              "[gg]", f"rtt_us = {cluster.gg_rtt_s * 1e6:.6g}", f"service_us = {cluster.gg_service_s * 1e6:.6g}", "",
              "[ps]", f"apply_ms = {cluster.ps_apply_s * 1e3:.6g}",
              f"full_duplex = {'true' if cluster.ps_full_duplex else 'false'}"]
    if cluster.server is not None:
        lines += [f"server_latency_us = {cluster.server.latency_s * 1e6:.6g}",
                  f"server_bandwidth_gbps = {cluster.server.bandwidth_bytes_per_s * 8 / 1e9:.6g}"]
    lines += ["", "[network]", f"contention = {'true' if cluster.contention else 'false'}", ""]
    return "\n".join(lines)


def sim_config(run: RunConfig, *, cluster: Cluster, math_mode: str, nodes: int) -> SimConfig:
    """The simulated twin of one run: its job description on ``cluster``. ``run.out`` is the simulation's
    output folder: with ``--log-decisions`` the run's decisions go to
    ``OUT/runs/<method>_<scenario>/decisions/``, where ``prague bench`` puts a real run's."""
    from prague.metrics.decisions import DECISIONS_DIR
    from prague.simulate.run import SimConfig

    decisions = run_folder(run.out, run.algorithm, run.scenario) / DECISIONS_DIR if run.log_decisions else None
    return SimConfig(run, cluster=cluster, nodes=nodes, math=math_mode, decisions=decisions)


def _line(r: RunRecord) -> str:
    acc = "" if r.test_accuracy is None else f", test accuracy {100 * r.test_accuracy:.2f}%"
    sim = r.sim or {}
    return (f"{r.label} [{r.scenario}, simulated] nproc={r.nproc}: {r.throughput_samples_per_s:.1f} samples/s "
            f"({100 * (r.fraction_of_limit or 0):.0f}% of no-wait limit){acc}, simulated wall "
            f"{r.wall_s or 0:.1f} s, {sim.get('events')} events in {sim.get('run_s', 0):.1f} s")


def _run_configs(args: argparse.Namespace, out: Path) -> list[RunConfig]:
    """The validated run settings of every (method, scenario) pair to simulate."""
    algorithms = [a.strip() for a in (args.algorithms or DEFAULT_ALGORITHMS).split(",") if a.strip()]
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if not algorithms or not scenarios:
        raise ConfigError("--algorithms and --scenarios each need at least one entry, e.g. allreduce and homogeneous")
    check_options_apply(args, algorithms, topology=("nodes",))
    if getattr(args, "optimizer", None) not in (None, "sgd"):
        raise ConfigError(f"--optimizer {args.optimizer!r}: the simulator's arithmetic applies SGD's rule "
                          "(prague.sim.math); simulate with --optimizer sgd, or train with prague run or bench")
    if getattr(args, "hosts", None) is not None and args.inter_gbps is not None:
        raise ConfigError(f"--inter-gbps {args.inter_gbps} and --hosts both set the inter-node bandwidth; with "
                          "emulated hosts it is --link-rate (default 1gbit): drop --inter-gbps")
    sim_nodes(args)  # --nodes against --hosts, for every method (runs check it only for methods with --nodes)
    return [config_from_args(args, algorithm=a, scenario=s, nproc=args.nproc, out=out)
            for s in scenarios for a in algorithms]


def sim_nodes(args: argparse.Namespace) -> int:
    """The simulated topology's nodes, for every method: ``--hosts`` when given (a different ``--nodes``
    is an error), else ``--nodes`` (default 1)."""
    given = option_values(args).get("nodes")
    hosts = getattr(args, "hosts", None)
    if hosts is not None:
        return hosts_nodes(None if given is None else int(given), int(hosts))
    return 1 if given is None else int(given)


def cmd_simulate(args: argparse.Namespace) -> int:
    """Handler of ``prague simulate`` (see the module docstring). Bad input raises ConfigError."""
    from prague.io import atomic_write_json, atomic_write_text
    from prague.metrics.report import bench_table
    from prague.simulate.calibrate import calibrate, calibration_report, calibration_table
    from prague.simulate.run import simulate_bench

    if args.check is not None and args.calibrate is None:
        raise ConfigError(f"--check {str(args.check)!r} checks a calibration: add --calibrate FIT/bench.json, the "
                          "benchmark to fit on")
    wanted(args.huge_pages, args.nproc, unsupported())  # `on` where the machine cannot: the reason and the fix
    out = Path(args.out) if args.out else Path("runs") / f"simulate-{time.strftime('%Y%m%d-%H%M%S')}"
    check_out_folder(out)
    command = "prague " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    base = load_cluster(args.cluster or ("local" if args.calibrate is not None else "paper"))
    # Every flag is checked (ConfigError) before anything is calibrated or simulated: the methods' run
    # settings, the cluster flags (on the preset, until calibration replaces it), the simulations.
    calibrate_only = args.calibrate is not None and args.algorithms is None
    runs = [] if calibrate_only else _run_configs(args, out)
    nodes = sim_nodes(args)  # the simulated topology, for every method
    cluster = cluster_from_args(args, base)
    configs = [sim_config(run, cluster=cluster, math_mode=args.math, nodes=nodes) for run in runs]
    if args.calibrate is not None:
        cal = calibrate(args.calibrate, base, args.check)
        table = calibration_table(cal)
        print(table)
        atomic_write_text(out / "calibration.md", f"# prague simulate --calibrate\n\n```\n{command}\n```\n\n{table}")
        atomic_write_json(out / "calibration.json", calibration_report(cal, args.calibrate, args.check))
        atomic_write_text(out / "cluster.toml", cluster_to_toml(cal.cluster))
        print(f"wrote {out / 'calibration.md'}, {out / 'calibration.json'} and {out / 'cluster.toml'}")
        if calibrate_only:
            return 0
        cluster = cluster_from_args(args, cal.cluster)
        configs = [dataclasses.replace(c, cluster=cluster) for c in configs]
    echo = None if args.quiet else (lambda r: print(_line(r), flush=True))
    records = simulate_bench(configs, out, command=command, echo=echo)
    print()
    print(bench_table(records))
    print(f"wrote {out / 'bench.json'}, {out / 'bench.md'} and plots")
    if args.log_decisions:
        print(f"wrote the decision logs to {out / 'runs'}/<method>_<scenario>/decisions/")
    return 0
