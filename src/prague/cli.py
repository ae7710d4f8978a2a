"""The ``prague`` command line: parse -> config -> run.

    prague run    --algorithm NAME --nproc N [--epochs E | --steps S] [--out DIR] ...
    prague bench  --algorithms a,b:VARIANT --scenarios homogeneous,paper:5 --nproc N ...
    prague launch --nproc N script.py [script args]     (any script using the prague API)
    prague worker ...                                   (one rank; what torchrun runs)
    prague simulate --algorithms ... --nproc N --nodes M (the same methods in simulated time)
    prague gg serve --nproc N --token T                 (a Group Generator service)

Bad input exits with code 2 and a one-line message naming the bad value and the valid choices.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from prague.errors import ConfigError, PragueError, WorkerFailed

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors on one line, without the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _add_run_arguments(p: argparse.ArgumentParser, *, with_nproc: bool = True) -> None:
    from prague.algorithms.registry import ALGORITHMS
    from prague.train.config import COMPUTE_MODES, DATASET_NAMES, MODEL_NAMES

    g = p.add_argument_group("training")
    if with_nproc:
        g.add_argument("--nproc", type=int, default=4, help="number of worker processes (default 4)")
    length = g.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=float, help="passes over each worker's shard (default 1)")
    length.add_argument("--steps", type=int, help="iterations per worker")
    g.add_argument("--batch-size", type=int, default=32, help="per-worker batch size (default 32)")
    g.add_argument("--lr", type=float, default=0.05)
    g.add_argument("--momentum", type=float, default=0.9)
    g.add_argument("--model", default="mlp", metavar="{" + ",".join(MODEL_NAMES) + "}")
    g.add_argument("--data", default="digits", metavar="{" + ",".join(DATASET_NAMES) + "}")
    g.add_argument("--data-dir", type=Path, help="directory of the data set's files (mnist)")
    g.add_argument("--compute", default="real", metavar="{" + ",".join(COMPUTE_MODES) + "}")
    g.add_argument("--compute-ms", type=float, default=100.0, help="emulated compute time per iteration")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--out", type=Path, help="output directory (default runs/<method>-<time>)")
    g.add_argument("--target-accuracy", type=float, help="record the time to reach this test accuracy")
    g.add_argument("--eval-every", type=int, help="evaluate the averaged model every K steps")
    g.add_argument("--warmup-steps", type=int, help="steps left out of the throughput window")
    g.add_argument("--timeout-s", type=float, default=300.0, help="collective/rendezvous timeout")
    g.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    g.add_argument("--save-model", action="store_true", help="rank 0 saves the averaged model to OUT/model.pt")

    seen: set[str] = set()
    a = p.add_argument_group("method options")
    for cls in ALGORITHMS.values():
        for f in dataclasses.fields(cls.Options):
            if f.name in seen:
                continue
            seen.add(f.name)
            kind = type(f.default) if f.default is not dataclasses.MISSING else str
            a.add_argument(
                "--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=None,
                help=f"[{cls.name}] {f.metadata.get('help', '')} (default {f.default})".strip(),
            )


def _option_names() -> set[str]:
    from prague.algorithms.registry import ALGORITHMS

    return {f.name for cls in ALGORITHMS.values() for f in dataclasses.fields(cls.Options)}


def config_from_args(args: argparse.Namespace, algorithm: str, scenario: str, nproc: int) -> Any:
    """Build and validate a RunConfig from parsed flags."""
    from prague.algorithms.registry import split_variant
    from prague.hetero.spec import parse_scenario
    from prague.train.config import RunConfig

    split_variant(algorithm)
    parse_scenario(scenario).check_world(nproc)
    options = {k: getattr(args, k) for k in _option_names() if getattr(args, k, None) is not None}
    out = args.out or Path("runs") / f"{algorithm.replace(':', '-')}-{time.strftime('%Y%m%d-%H%M%S')}"
    cfg = RunConfig(
        algorithm=algorithm, nproc=nproc, epochs=args.epochs, steps=args.steps, batch_size=args.batch_size,
        lr=args.lr, momentum=args.momentum, model=args.model, data=args.data, data_dir=args.data_dir,
        compute=args.compute, compute_ms=args.compute_ms, scenario=scenario, seed=args.seed, out=out,
        target_accuracy=args.target_accuracy, eval_every=args.eval_every, warmup_steps=args.warmup_steps,
        timeout_s=args.timeout_s, backend=args.backend, save_model=args.save_model, options=options,
    )
    method_resources(cfg)  # validates the method's own options before anything starts
    return cfg


def worker_argv(cfg: Any) -> list[str]:
    """The ``prague worker`` command line that reproduces ``cfg`` in a worker process."""
    argv = [sys.executable, "-m", "prague", "worker", "--algorithm", cfg.algorithm, "--slowdown", cfg.scenario]
    plain = {
        "batch_size": cfg.batch_size, "lr": cfg.lr, "momentum": cfg.momentum, "model": cfg.model,
        "data": cfg.data, "compute": cfg.compute, "compute_ms": cfg.compute_ms, "seed": cfg.seed,
        "out": cfg.out, "timeout_s": cfg.timeout_s, "backend": cfg.backend, "steps": cfg.steps,
        "epochs": cfg.epochs, "data_dir": cfg.data_dir, "target_accuracy": cfg.target_accuracy,
        "eval_every": cfg.eval_every, "warmup_steps": cfg.warmup_steps, **cfg.options,
    }
    for name, value in plain.items():
        if value is not None:
            argv += ["--" + name.replace("_", "-"), str(value)]
    if cfg.save_model:
        argv.append("--save-model")
    return argv


def check_data(cfg: Any) -> None:
    """Load the data set once in the launcher, so a bad file is a clear error before any worker starts."""
    from prague.train.data import load_dataset

    load_dataset(cfg.data, cfg.data_dir, seed=cfg.seed)


def method_resources(cfg: Any) -> Any:
    """The services and environment the method of ``cfg`` needs; validates its options."""
    from prague.algorithms.registry import get_algorithm, split_variant

    name, variant = split_variant(cfg.algorithm)
    cls = get_algorithm(name)
    options = dict(cfg.options)
    if variant is not None and cls.variant_field is not None:
        options[cls.variant_field] = variant
    return cls.job_resources(cls.options_from(options), cfg.nproc, Path(cfg.out), cfg.seed)


def _progress_printer(total_ranks: int) -> tuple[Any, Any]:
    from tqdm import tqdm

    bar = tqdm(total=0, unit="step", dynamic_ncols=True, disable=None, leave=False)

    def tick(job: Any) -> None:
        prog = job.progress()
        if not prog:
            return
        done, total, losses = [], 0, []
        for rank in range(total_ranks):
            step, steps, loss = (prog.get(rank, "0,0,").split(",") + ["", "", ""])[:3]
            done.append(int(step or 0))
            total += int(steps or 0)
            if loss:
                losses.append(float(loss))
        bar.total = max(total, bar.total or 0)
        bar.n = sum(done)
        post = f"steps {done}" + (f" loss {sum(losses) / len(losses):.4f}" if losses else "")
        bar.set_postfix_str(post, refresh=False)
        bar.refresh()

    return bar, tick


def run_config(cfg: Any, *, quiet: bool = False) -> dict[str, Any]:
    """Launch ``cfg.nproc`` workers for ``cfg`` on this machine; return rank 0's summary.

    Raises WorkerFailed if a worker fails (after stopping every process)."""
    from prague.runtime.launcher import LaunchSpec, launch

    check_data(cfg)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").unlink(missing_ok=True)
    resources = method_resources(cfg)
    spec = LaunchSpec(argv=worker_argv(cfg), nproc=cfg.nproc, log_dir=out / "logs", services=resources.services,
                      env=resources.env)
    bar, tick = _progress_printer(cfg.nproc) if not quiet else (None, None)
    try:
        launch(spec, on_tick=tick)
    finally:
        if bar is not None:
            bar.close()
    summary_path = out / "summary.json"
    if not summary_path.exists():
        raise WorkerFailed(0, 0, f"rank 0 exited without writing {summary_path}")
    return json.loads(summary_path.read_text())


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _summary_line(s: dict[str, Any]) -> str:
    name = s["algorithm"] + (f":{s['variant']}" if s.get("variant") else "")
    acc = "-" if s["test_accuracy"] is None else f"{100 * s['test_accuracy']:.2f}%"
    return (
        f"{name} [{s['scenario']}, {s['compute_mode']}] nproc={s['nproc']}: "
        f"{s['throughput_samples_per_s']:.1f} samples/s ({100 * (s['fraction_of_limit'] or 0):.0f}% of no-wait limit), "
        f"test accuracy {acc}, time to target {_fmt(s['time_to_target_s'], '.1f')} s, wall {s['wall_s']:.1f} s"
    )


def cmd_run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args, args.algorithm, args.slowdown, args.nproc)
    summary = run_config(cfg, quiet=args.quiet)
    print(_summary_line(summary))
    print(f"wrote {Path(cfg.out) / 'summary.json'}")
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from prague.runtime.worker import run_worker
    from prague.train.loop import train

    def body(ctx: Any) -> None:
        cfg = config_from_args(args, args.algorithm, args.slowdown, ctx.world_size)
        if args.out is None:
            cfg = replace(cfg, out=Path("runs") / "torchrun")
        train(cfg, ctx)

    run_worker(body, backend=args.backend, timeout_s=args.timeout_s)
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from prague.runtime.launcher import LaunchSpec, launch

    if not args.script:
        raise ConfigError("prague launch needs a script: prague launch --nproc N script.py [args]")
    script = Path(args.script[0])
    if not script.is_file():
        raise ConfigError(f"script {str(script)!r} does not exist; pass the path of a Python file")
    spec = LaunchSpec(
        argv=[sys.executable, str(script), *args.script[1:]], nproc=args.nproc,
        log_dir=args.log_dir, echo_ranks=frozenset(range(args.nproc)) if args.echo_all else frozenset({0}),
    )
    launch(spec)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from prague.metrics.report import bench_table, write_bench

    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if not algorithms or not scenarios:
        raise ConfigError("--algorithms and --scenarios each need at least one entry, e.g. allreduce and homogeneous")
    out = args.out or Path("runs") / f"bench-{time.strftime('%Y%m%d-%H%M%S')}"
    configs = [
        config_from_args(argparse.Namespace(**{**vars(args), "out": out / "runs" / f"{a.replace(':', '-')}_{s.replace(':', '-')}"}), a, s, args.nproc)
        for s in scenarios for a in algorithms
    ]  # validate every pair before running any
    records: list[dict[str, Any]] = []
    failures: list[str] = []
    command = "prague " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    for cfg in configs:
        print(f"== {cfg.algorithm} / {cfg.scenario}", flush=True)
        try:
            records.append(run_config(cfg, quiet=args.quiet))
            print(_summary_line(records[-1]), flush=True)
        except WorkerFailed as exc:
            failures.append(f"{cfg.algorithm} / {cfg.scenario}: {exc}")
            print(f"FAILED {cfg.algorithm} / {cfg.scenario}: {exc}", file=sys.stderr, flush=True)
        if records:
            write_bench(out, records, command=command)
    if records:
        print()
        print(bench_table(records))
        print(f"\nwrote {out / 'bench.json'}, {out / 'bench.md'} and plots")
    if failures:
        print(f"{len(failures)} run(s) failed", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="prague", description="Data-parallel PyTorch training that stays fast when workers are unequal.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    for name, helptext in (("run", "train one method with N local worker processes"),
                           ("worker", "one worker process (what torchrun runs)")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--algorithm", default="allreduce", help="method, optionally NAME:VARIANT (default allreduce)")
        p.add_argument("--slowdown", default="homogeneous",
                       help="heterogeneity: homogeneous | paper:X | straggler:RANK:X | crash:RANK:STEP, joined with +")
        _add_run_arguments(p, with_nproc=(name == "run"))
        p.add_argument("--quiet", action="store_true", help="no progress bar")

    b = sub.add_parser("bench", help="run every (method, scenario) pair and write a comparison")
    b.add_argument("--algorithms", default="allreduce", help="comma-separated methods, NAME or NAME:VARIANT")
    b.add_argument("--scenarios", default="homogeneous,paper:5", help="comma-separated scenarios")
    _add_run_arguments(b)
    b.add_argument("--quiet", action="store_true")

    gg = sub.add_parser("gg", help="the Group Generator service")
    gg_sub = gg.add_subparsers(dest="gg_command", required=True, parser_class=_Parser)
    serve = gg_sub.add_parser("serve", help="run a Group Generator for a job (prague gg serve --help)", add_help=False)
    serve.add_argument("rest", nargs=argparse.REMAINDER)

    la = sub.add_parser("launch", help="run a script using the prague API on N local processes")
    la.add_argument("--nproc", type=int, default=2)
    la.add_argument("--log-dir", type=Path, help="write each rank's output to DIR/rankR.log")
    la.add_argument("--echo-all", action="store_true", help="print every rank's output (default: rank 0)")
    la.add_argument("script", nargs=argparse.REMAINDER, help="script.py [args]")

    from prague.sim.cli import add_simulate_parser

    add_simulate_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    if argv is None:
        argv = sys.argv[1:]
    if argv[:2] == ["gg", "serve"]:  # the service parses its own flags
        from prague.groups.service import main as serve_main

        return serve_main(argv[2:], prog="prague gg serve")
    args = parser.parse_args(argv)
    from prague.sim.cli import cmd_simulate

    handlers = {"run": cmd_run, "worker": cmd_worker, "launch": cmd_launch, "bench": cmd_bench,
                "simulate": cmd_simulate}
    try:
        return handlers[args.command](args)
    except ConfigError as exc:
        print(f"prague {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except WorkerFailed as exc:
        where = f"worker rank {exc.rank}" if exc.rank >= 0 else "a service process"
        print(f"prague {args.command}: {where} failed (exit code {exc.exitcode}):\n{exc.detail}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"prague {args.command}: interrupted; all worker processes stopped", file=sys.stderr)
        return 130
    except PragueError as exc:
        print(f"prague {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
