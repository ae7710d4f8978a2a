"""The ``prague`` command line: parse -> config -> run.

    prague run    --algorithm NAME --nproc N [--epochs E | --steps S] [--out DIR] ...
    prague bench  --algorithms a,b:VARIANT --scenarios homogeneous,paper:5 --nproc N ...
    prague launch --nproc N script.py [script args]     (any script using the prague API)
    prague worker ...                                   (one rank; what torchrun runs)
    prague simulate --algorithms ... --nproc N --nodes M (the same methods in simulated time)
    prague methods [--json | --markdown]                (every method, its variants and options)
    prague gg serve --nproc N --token T                 (a Group Generator service)

Bad input exits with code 2 and a one-line message naming the bad value and the valid choices.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from prague import jobenv
from prague.errors import EXIT_DIVERGED, EXIT_USAGE, ConfigError, PragueError, WorkerFailed, one_line, usage_message
from prague.net.hosts import EmulatedHosts, check_privileges


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors on one line, without the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {one_line(message)}\n")

    def _get_values(self, action: argparse.Action, arg_strings: list[str]) -> Any:
        # Before Python 3.12 argparse drops the value of `--lr=--` (it takes '--' for the end of the
        # flags) and hands the flag an empty list instead of refusing it.
        if action.nargs is None and action.option_strings and arg_strings == ["--"]:
            self.error(f"argument {'/'.join(action.option_strings)}: expected one argument, got '--'")
        return super()._get_values(action, arg_strings)


def resolve_job(args: argparse.Namespace, *, nproc: int | None, algorithm: str = "", scenario: str = "",
                out: Path | None = None, saved: Path | None = None, saved_flag: str = "--job",
                here: bool = True) -> Any:
    """The job a command runs, worked out in this one place whatever the entry point (``prague run``,
    ``--resume``, each cell of ``prague bench``, ``prague worker`` under the launcher or under torchrun).

    From the description at ``saved`` (``prague run --resume OUT``: OUT/run.json, ``saved_flag``
    ``--resume``; ``prague worker --job FILE``), with no run flag beside it; else from the run flags,
    for ``nproc`` workers running ``algorithm`` under ``scenario`` into ``out``. A saved job must
    describe ``nproc`` workers (None: as many as it says). Checked before anything starts: the method's
    services can be declared (:func:`method_resources`); with ``here`` (the workers start on this
    machine) also the data files, the backend against this machine's GPUs and the privileges emulated
    hosts need, while the workers' fork server starts importing. ConfigError names what does not hold."""
    from prague.train.config import config_from_args, load_config, read_job

    if saved is not None:
        flags = _run_flags_given(args)
        resumed = saved_flag == "--resume"
        if flags:
            raise ConfigError(f"--resume continues the run as it was started (its settings are in OUT/run.json); "
                              f"drop {flags}" if resumed else f"{saved_flag} holds the whole job; drop {flags}")
        cfg = load_config(saved) if resumed else read_job(saved, flag=saved_flag, resume=bool(args.resume))
        if nproc is not None and cfg.nproc != nproc:
            raise ConfigError(f"{saved_flag} {str(saved)!r} describes {cfg.nproc} workers, but this job has {nproc}; "
                              "start it with as many (torchrun --nnodes x --nproc-per-node)")
    else:
        if nproc is None or out is None:
            raise ValueError("a job from the flags needs its number of workers and its folder")
        cfg = config_from_args(args, algorithm=algorithm, scenario=scenario, nproc=nproc, out=out)
        if not here and args.resume:  # torchrun running `prague worker --resume` with the flags
            cfg = dataclasses.replace(cfg, resume=True)
    if here:
        from prague.runtime.forkserver import prestart

        cfg.check_data_source()
        # The flags hold: the fork server imports while the rest is checked (the method's runtime, imported to
        # declare its services, is torch's import too: started first, the server's overlaps it).
        prestart(not cfg.emulated, worker_imports(cfg))
    method_resources(cfg)  # the method's services can be declared for this job, before anything starts
    if here:
        check_backend(cfg)
        if cfg.hosts is not None:
            check_privileges()
    return cfg


def check_backend(cfg: Any) -> None:
    """Raise ConfigError unless ``--backend`` and ``--device`` can run ``cfg.nproc`` ranks on this machine
    (nccl: a GPU each; cuda: a GPU at all)."""
    import torch

    from prague.runtime.context import device_for, pick_backend

    gpus = torch.cuda.device_count()
    device = getattr(cfg, "device", "auto")
    backend = pick_backend(cfg.backend, gpus, cfg.nproc, device)
    device_for(backend, 0, device, gpus)


def _default_out(name: str) -> Path:
    return Path("runs") / f"{name.replace(':', '-')}-{time.strftime('%Y%m%d-%H%M%S')}"


#: Data sets that come with the code or are generated: no file of the user's to check before the workers start.
NO_FILES = ("digits", "synthetic")


def check_data(cfg: Any) -> None:
    """Load a data set read from files once in the launcher, so a bad file is a clear error before any
    worker starts (one that comes with the code is not loaded: loading digits imports scikit-learn, a
    second and a half of every launch), and check the method's options against the model built for it
    (:meth:`Options.check_model`)."""
    from prague.workload.catalog import dataset_info
    from prague.workload.data import load_dataset
    from prague.workload.models import build_model, state_elements

    if cfg.data in NO_FILES:
        info = dataset_info(cfg.data)
        shape, classes = info.input_shape, info.num_classes
    else:
        dataset = load_dataset(cfg.data, cfg.data_dir, seed=cfg.seed)
        shape, classes = dataset.input_shape, dataset.num_classes
    cfg.options.check_model(lambda: state_elements(build_model(cfg.model, shape, classes)))


def method_resources(cfg: Any, host: str = "127.0.0.1") -> tuple[Any, bool]:
    """The services and environment the method of ``cfg`` needs (its services listening on ``host``),
    and whether it survives failed workers."""
    return (cfg.method.runtime_class(cfg.method.variant_of(cfg.seeded_options)).job_resources(cfg.seeded_options, cfg.nproc, Path(cfg.out), host=host),
            cfg.method.survives_failures)


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


def worker_imports(cfg: Any) -> tuple[str, ...]:
    """What ``cfg``'s workers import beyond prague's runtime: its method's modules, and its data set's loader
    if they train (emulated compute loads no data); the fork server preloads them."""
    from prague.workload.catalog import loader_imports

    return (*cfg.method.worker_imports, *(() if cfg.emulated else loader_imports(cfg.data, cfg.seed)))


def run_config(cfg: Any, *, quiet: bool = False) -> dict[str, Any]:
    """Launch ``cfg.nproc`` workers for ``cfg`` on this machine; return rank 0's summary.

    Raises WorkerFailed if a worker fails (after stopping every process)."""
    from prague.runtime.forkserver import prestart

    prestart(not cfg.emulated, worker_imports(cfg))  # the fork server imports torch meanwhile
    from prague.runtime.launcher import LaunchSpec, launch
    from prague.train.checkpoint import CHECKPOINTS_DIR, resume_step
    from prague.train.config import job_file, worker_argv, write_job

    check_data(cfg)
    out = Path(cfg.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create --out {str(out)!r} ({exc.strerror or exc}); pass a folder you can "
                          "write to") from None
    if cfg.resume:
        print(f"resuming {out} from its checkpoint at step {resume_step(out, cfg.nproc)}", flush=True)
    else:  # a new run in this folder: an older run's checkpoints must never be resumed as this one's
        shutil.rmtree(out / CHECKPOINTS_DIR, ignore_errors=True)
        write_job(cfg)
    (out / "summary.json").unlink(missing_ok=True)
    (out / "services.json").unlink(missing_ok=True)
    network = EmulatedHosts(cfg.hosts, cfg.link_bits).up() if cfg.hosts is not None else None
    bar = None
    try:
        resources, survivable = method_resources(cfg, network.bridge_address if network else "127.0.0.1")
        services = list(resources.services)
        if network is not None and cfg.cross_traffic is not None:
            services.append(_cross_traffic_service(cfg, network))
        if cfg.stop_at_target:
            services.append(_evaluator_service(cfg))
        spec = LaunchSpec(argv=worker_argv(job_file(out), resume=cfg.resume), nproc=cfg.nproc, log_dir=out / "logs",
                          services=services, env=resources.env, survivable=survivable, lease_s=cfg.lease_s,
                          services_file=out / "services.json" if services else None,
                          **(_network_launch(network, cfg.nproc) if network else {}))
        bar, tick = _progress_printer(cfg.nproc) if not quiet else (None, None)
        launch(spec, on_tick=tick)
    finally:
        if bar is not None:
            bar.close()
        if network is not None:
            network.down()
    summary_path = out / "summary.json"
    if not summary_path.exists():
        raise WorkerFailed(0, 0, f"rank 0 exited without writing {summary_path}")
    return json.loads(summary_path.read_text())


def _network_launch(network: Any, nproc: int) -> dict[str, Any]:
    """The launcher's settings for workers on emulated hosts: the store through the bridge, each rank in
    its host's namespace, services' gloo on the bridge."""
    return {"master_addr": network.bridge_address, "rank_env": [network.worker_env(r, nproc) for r in range(nproc)],
            "service_env": network.service_env()}


def _cross_traffic_service(cfg: Any, network: Any) -> Any:
    """The service that puts ``--cross-traffic`` bursts on every link of ``network``."""
    from prague.runtime.services import ServiceSpec

    hosts = range(network.hosts)
    argv = [sys.executable, "-m", "prague.net.traffic", "--namespaces", ",".join(map(network.namespace, hosts)),
            "--addresses", ",".join(map(network.address, hosts)), "--bridge", network.bridge_address,
            "--traffic", cfg.cross_traffic, "--seed", str(cfg.seed)]
    ready = Path(cfg.out) / "cross-traffic.ready"
    return ServiceSpec("cross-traffic", [*argv, "--ready-file", str(ready)], ready_file=ready)


def usage_error(exc: WorkerFailed) -> str | None:
    """The message of a worker that exited because its settings cannot work (a ConfigError, exit code
    2), or None for any other failure."""
    return usage_message(exc.detail) if exc.exitcode == EXIT_USAGE else None


def with_nominal_compute(cfg: Any, scenarios: list[str]) -> Any:
    """``cfg`` with the nominal step time its slowdowns multiply: as given, or under ``--compute real``
    with slowdowns in some scenario, measured once here (every method and scenario then faces the same
    injected seconds; without it each worker would scale by its own measured average)."""
    from prague.hetero.spec import parse_scenario

    if cfg.compute != "real" or cfg.compute_ms is not None or cfg.resume:
        return cfg
    if all(parse_scenario(s).is_homogeneous for s in scenarios):
        return cfg
    from prague.train.loop import measure_compute_ms

    nominal = round(measure_compute_ms(cfg), 3)
    print(f"nominal compute {nominal:g} ms per step (a real step of {cfg.model} measured here; slowdowns multiply "
          "it; --compute-ms sets it)", flush=True)
    return dataclasses.replace(cfg, compute_ms=nominal)


def resolve_pace(args: argparse.Namespace, nproc: int) -> Any:
    """``--compute-ms auto``: probe the smallest pace this machine holds for ``nproc`` workers of the
    run's model (:mod:`prague.train.probe`), print it and put it in ``args``; returns the probe (None when
    ``--compute-ms`` was not auto). Only paced compute has a pace to probe."""
    from prague.train.config import AUTO

    if getattr(args, "compute_ms", None) != AUTO:
        return None
    if args.compute != "paced":
        raise ConfigError("--compute-ms auto probes the pace of paced compute; give --compute paced, or a number "
                          "of ms")
    from prague.errors import unknown_choice
    from prague.train.probe import probe_pace
    from prague.workload.catalog import DATASETS, MODELS, OPTIMIZERS

    model, data, optimizer = args.model or "mlp", args.data or "digits", getattr(args, "optimizer", None) or "sgd"
    if model not in MODELS:
        raise unknown_choice("model", model, MODELS)
    if data not in DATASETS:
        raise unknown_choice("data set", data, tuple(DATASETS))
    if optimizer not in OPTIMIZERS:
        raise unknown_choice("optimizer", optimizer, OPTIMIZERS)
    probe = probe_pace(model, data, args.batch_size or 32, nproc, seed=args.seed or 0, optimizer=optimizer)
    print(probe.line(), flush=True)
    args.compute_ms = probe.ms
    return probe


def _evaluator_service(cfg: Any) -> Any:
    """The process that scores the average model while the workers train and stops them at the target
    (:mod:`prague.train.evaluator`)."""
    from prague.runtime.services import ServiceSpec
    from prague.train.evaluator import READY_FILE, eval_dir

    folder = eval_dir(Path(cfg.out))
    shutil.rmtree(folder, ignore_errors=True)  # an earlier run's states and STOP must not count
    argv = [sys.executable, "-m", "prague.train.evaluator", "--out", str(cfg.out), "--nproc", str(cfg.nproc),
            "--data", cfg.data, "--model", cfg.model, "--seed", str(cfg.seed), "--target", str(cfg.target_accuracy)]
    if cfg.data_dir is not None:
        argv += ["--data-dir", str(cfg.data_dir)]
    return ServiceSpec("evaluator", argv, ready_file=folder / READY_FILE)


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _method_name(s: dict[str, Any]) -> str:
    from prague.metrics.record import method_label_of

    return method_label_of(s["algorithm"], s.get("variant"))


def _divergence(s: dict[str, Any]) -> str:
    from prague.train.divergence import divergence_line

    return divergence_line(_method_name(s), s["diverged"])


def _summary_line(s: dict[str, Any]) -> str:
    name = _method_name(s)
    if s.get("diverged"):
        name = f"{name} DIVERGED (step {s['diverged']['step']}, rank {s['diverged']['rank']})"
    acc = "-" if s["test_accuracy"] is None else f"{100 * s['test_accuracy']:.2f}%"
    samples = f", {s['samples']} samples" if s.get("samples") is not None else ""
    return (
        f"{name} [{s['scenario']}, {s['compute_mode']}] nproc={s['nproc']}: "
        f"time to target {_fmt(s['time_to_target_s'], '.1f')} s, test accuracy {acc}, "
        f"job {_fmt(s.get('job_s', s['wall_s']), '.1f')} s{samples}; "
        f"{s['throughput_samples_per_s']:.1f} samples/s ({100 * (s['fraction_of_limit'] or 0):.0f}% of no-wait limit)"
    )


_RUN_DEFAULTS: dict[str, Any] = {"algorithm": "allreduce", "slowdown": "homogeneous", "nproc": 4, "out": None}


def _run_flags_given(args: argparse.Namespace) -> str:
    """The run flags given on the command line, as ``--a, --b`` (empty if none): what a command that
    reads a saved job (``--resume``, ``--job``) refuses beside it."""
    from prague.train.config import flag_fields, option_values

    given = [f.name for f in flag_fields() if getattr(args, f.name, None) is not None] + list(option_values(args))
    given += [k for k, default in _RUN_DEFAULTS.items() if getattr(args, k, default) != default]
    return ", ".join("--" + k.replace("_", "-") for k in given)


def cmd_run(args: argparse.Namespace) -> int:
    from prague.io import atomic_write_json
    from prague.train.config import check_options_apply

    probe = None
    if args.resume is None:
        check_options_apply(args, [args.algorithm])
        probe = resolve_pace(args, args.nproc)
    cfg = resolve_job(args, nproc=None if args.resume is not None else args.nproc, algorithm=args.algorithm,
                      scenario=args.slowdown, out=args.out or _default_out(args.algorithm), saved=args.resume,
                      saved_flag="--resume")
    cfg = with_nominal_compute(cfg, [cfg.scenario])
    summary = run_config(cfg, quiet=args.quiet)
    if probe is not None:
        summary["pace_probe"] = probe.as_dict()
        atomic_write_json(Path(cfg.out) / "summary.json", summary)
    print(_summary_line(summary))
    if args.resume is None and args.epochs is None and args.steps is None and args.budget is None:
        print("note: the run's length was the default, one pass over each worker's shard: a quick check, not a "
              "trained model; give --epochs E or --budget epochs:E to train to a result")
    if summary.get("worker_samples_per_s"):
        from prague.metrics.summary import speed_report

        print(speed_report(summary["ranks"], summary["worker_samples_per_s"], summary["mean_compute_s"],
                           summary["mean_comm_s"], summary["mean_wait_s"], summary["batch_size"]))
    print(f"wrote {Path(cfg.out) / 'summary.json'}")
    if summary.get("diverged"):
        print(f"prague run: {_divergence(summary)}", file=sys.stderr)
        return EXIT_DIVERGED
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from prague.runtime.worker import run_worker
    from prague.train.loop import train

    from prague.net.hosts import enter_from_env

    enter_from_env()  # an emulated host's namespace (prague run --hosts), before any socket
    from prague.runtime.guard import under_torchrun

    if under_torchrun():
        return _guarded_worker(args)
    job = _worker_job(args)

    def body(ctx: Any) -> None:
        train(job, ctx)

    run_worker(body, backend=job.backend, timeout_s=job.timeout_s, device=job.device)
    return 0


def _worker_job(args: argparse.Namespace) -> Any:
    """The job ``prague worker`` runs, resolved before it joins: the description ``--job FILE`` names
    (what ``prague run`` and a guard give their workers), or the flags (torchrun running ``prague
    worker`` directly), for as many workers as the environment's ``WORLD_SIZE``."""
    return resolve_job(args, nproc=jobenv.current().need("world_size"), algorithm=args.algorithm,
                       scenario=args.slowdown, out=args.out or Path("runs") / "torchrun", saved=args.job,
                       here=False)


def _guarded_worker(args: argparse.Namespace) -> int:
    """Under torchrun: guard a child that trains (:mod:`prague.runtime.guard`) and return the exit code.
    The job is resolved here, once, and written to ``OUT/run.json`` (unless given with ``--job``) for
    the child to read."""
    from prague.runtime.context import service_host
    from prague.runtime.guard import Guard
    from prague.train.config import worker_argv, write_job

    cfg = _worker_job(args)
    env = jobenv.current()  # the torchrun rank's environment, read once here
    rank0 = env.need("rank") == 0
    resources, survives = method_resources(cfg, host=service_host(env) if rank0 else "127.0.0.1")
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    job = args.job if args.job is not None else write_job(cfg)  # every local rank writes the same description
    guard = Guard(worker_argv(job, resume=cfg.resume), services=resources.services, env=resources.env,
                  survives=survives, lease_s=cfg.lease_s, out=Path(cfg.out), timeout_s=cfg.timeout_s)
    return guard.run()


def cmd_launch(args: argparse.Namespace) -> int:
    from prague.algorithms.spec import check_nproc
    from prague.runtime.launcher import LaunchSpec, launch

    from prague.metrics.writers import parse_report_to

    check_nproc(args.nproc)  # before --echo-all lists every rank
    reports = parse_report_to(args.report_to)
    if (reports or args.timeline) and args.log_dir is None:
        flag = "--report-to" if reports else "--timeline"
        raise ConfigError(f"{flag} writes beside the script's logs: give --log-dir DIR too")
    if not args.script:
        raise ConfigError("prague launch needs a script: prague launch --nproc N script.py [args]")
    script = Path(args.script[0])
    if not script.is_file():
        raise ConfigError(f"script {str(script)!r} does not exist; pass the path of a Python file")
    from prague.runtime.forkserver import prestart

    prestart()  # the ranks are forked from it (a .py script): it imports torch meanwhile
    spec = LaunchSpec(
        argv=[sys.executable, str(script), *args.script[1:]], nproc=args.nproc,
        log_dir=args.log_dir, echo_ranks=frozenset(range(args.nproc)) if args.echo_all else frozenset({0}),
        survivable=None,  # the script's method says, when it is set up
        # the services the script's method starts on its rank 0 are listed beside the logs
        env={jobenv.SERVICES_FILE: str((args.log_dir / "services.json").resolve()),
             jobenv.OUT: str(args.log_dir.resolve()),
             **({jobenv.REPORT_TO: ",".join(reports)} if reports else {})} if args.log_dir else {},
        summary_file=args.log_dir / "summary.json" if args.log_dir else None,
    )
    try:
        launch(spec)
    finally:
        if args.timeline:
            _script_timeline(args.log_dir)
    return 0


def _script_timeline(folder: Path) -> None:
    """``--timeline`` of a script's job: ``folder/timeline.json`` from the steps its ranks recorded there
    (said, not raised, when there are none: the job's own outcome is what the command reports)."""
    from prague.metrics.timeline import write_timeline

    if not any((folder / "metrics").glob("rank*.jsonl")):
        print(f"prague: no steps were recorded in {folder / 'metrics'}: no timeline written", file=sys.stderr)
        return
    print(f"wrote {write_timeline(folder)}", file=sys.stderr)


def cmd_bench(args: argparse.Namespace) -> int:
    from prague.metrics.report import bench_table, load_resume, write_bench
    from prague.train.config import run_folder

    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if not algorithms or not scenarios:
        raise ConfigError("--algorithms and --scenarios each need at least one entry, e.g. allreduce and homogeneous")
    if not 1 <= args.repeat <= 1000:
        raise ConfigError(f"--repeat must be a number of seeds in 1..1000, got {args.repeat}")
    from prague.train.config import check_options_apply, check_out_folder

    check_options_apply(args, algorithms)
    from prague.metrics.pilot import best, check_pilot_seeds, parse_lr_values

    lr_values = None if args.lr is None else parse_lr_values(args.lr)
    if lr_values is not None:
        args.lr = lr_values[0]  # the cells are checked with the first; a pilot picks each one's
    for flag, given in (("--pilot-budget", args.pilot_budget), ("--pilot-seeds", args.pilot_seeds)):
        if given is not None and (lr_values is None or len(lr_values) < 2):
            raise ConfigError(f"{flag} sets a learning-rate pilot, which needs --lr with several values "
                              "(0.025,0.05,0.1,0.2): give them or drop the flag")
    if args.pilot_seeds is not None:
        check_pilot_seeds(args.pilot_seeds)
    if lr_values is not None and len(lr_values) > 1:  # checked before anything is measured or run; read by _lr_pilot
        from prague.metrics.pilot import DEFAULT_PILOT_BUDGET
        from prague.workload.budget import parse_budget

        args.pilot_budget = parse_budget(args.pilot_budget or DEFAULT_PILOT_BUDGET, "--pilot-budget").text
    if args.resume and args.out is None:
        raise ConfigError("--resume goes on with the bench in --out; pass the --out of the unfinished bench")
    out = args.out or _default_out("bench")
    check_out_folder(out)
    argv = [a for a in sys.argv[1:] if a not in ("--resume", "--quiet")]
    records: list[dict[str, Any]] = []
    runs: list[str] = []  # the run folder of each record, relative to out (what --resume skips)
    if args.resume:
        records, runs = load_resume(out, argv)
        if records:
            print(f"resuming {out}: {len(records)} runs done", flush=True)
    pace_probe = _bench_pace(args, records)
    cells = [resolve_job(args, nproc=args.nproc, algorithm=a, scenario=s, out=run_folder(out, a, s))
             for s in scenarios for a in algorithms]
    # every pair validated before any runs; one nominal step time for all (the same injected seconds)
    nominal = with_nominal_compute(cells[0], scenarios).compute_ms
    link_line = link_ratio_line(cells[0], nominal)
    if link_line:
        print(link_line, flush=True)

    def folder(cfg: Any, seed: int) -> Path:
        return cfg.out if args.repeat == 1 else cfg.out.with_name(f"{cfg.out.name}_seed{seed}")

    pilot: dict[tuple[str, str], list[dict[str, Any]]] = {}
    if lr_values is not None and len(lr_values) > 1:
        pilot = _lr_pilot(args, out, cells, lr_values, nominal)
        cells = [dataclasses.replace(c, lr=best(pilot[(c.algorithm, c.scenario)])) for c in cells]
    configs = [dataclasses.replace(c, seed=seed, out=folder(c, seed), compute_ms=nominal)
               for seed in range(cells[0].seed, cells[0].seed + args.repeat) for c in cells]
    # the seeds one after another, so the machine's noise spreads over every cell
    failures: list[str] = []
    command = "prague " + " ".join(shlex.quote(a) for a in argv)  # without --resume and --quiet: the same runs
    for cfg in configs:
        run = cfg.out.relative_to(out).as_posix()
        if run in runs:
            continue
        if args.resume and cfg.out.exists():  # a run the interrupted bench had begun: start it afresh
            shutil.rmtree(cfg.out)
        print(f"== {cfg.algorithm} / {cfg.scenario}" + (f" / seed {cfg.seed}" if args.repeat > 1 else ""), flush=True)
        try:
            records.append(run_config(cfg, quiet=args.quiet))
            if pace_probe is not None:
                records[-1]["pace_probe"] = pace_probe
            if pilot:
                records[-1]["lr_pilot"] = pilot[(cfg.algorithm, cfg.scenario)]
            runs.append(run)
            print(_summary_line(records[-1]), flush=True)
            if records[-1].get("diverged"):  # a result, not a failure: the tables say so, the bench goes on
                print(_divergence(records[-1]), file=sys.stderr, flush=True)
        except WorkerFailed as exc:
            if usage_error(exc) is not None:  # the settings every cell shares cannot work (the pace...)
                raise
            failures.append(f"{cfg.algorithm} / {cfg.scenario} / seed {cfg.seed}: {exc}")
            print(f"FAILED {cfg.algorithm} / {cfg.scenario} / seed {cfg.seed}: {exc}", file=sys.stderr, flush=True)
        if records:
            write_bench(out, records, command=command, resume={"argv": argv, "runs": runs})
    if records:
        print()
        print(bench_table(records))
        print(f"\nwrote {out / 'bench.json'}, {out / 'bench.md'} and plots")
    if failures:
        print(f"{len(failures)} run(s) failed", file=sys.stderr)
        return 1
    return 0


def _lr_list_flag(parser: argparse.ArgumentParser) -> None:
    """``prague bench --lr`` takes one learning rate or several (a pilot picks one per cell)."""
    for action in parser._actions:
        if action.dest == "lr":
            action.type = str
            action.metavar = "LR[,LR...]"
            action.help = ("learning rate of the optimizer (default 0.05); several, comma-separated "
                           "(0.025,0.05,0.1,0.2): every cell is first run at each on --pilot-budget and the full bench runs each cell "
                           "at its best (soonest to --target-accuracy)")


def _lr_pilot(args: argparse.Namespace, out: Path, cells: list[Any], values: tuple[float, ...],
              nominal: float | None) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Run the learning-rate pilot of every cell (:mod:`prague.metrics.pilot`); each cell's results."""
    from prague.metrics.pilot import pilot_lines, run_pilot

    budget: str = args.pilot_budget  # checked, and its default set, by cmd_bench
    by_cell = {(c.algorithm, c.scenario): c for c in cells}

    def run(algorithm: str, scenario: str, lr: float, seed: int, folder: Path) -> dict[str, Any]:
        cfg = dataclasses.replace(by_cell[(algorithm, scenario)], lr=lr, budget=budget, steps=None, epochs=None,
                                  out=folder, compute_ms=nominal, seed=seed)
        if cfg.out.exists():  # an interrupted pilot run: start it afresh
            shutil.rmtree(cfg.out)
        try:
            return run_config(cfg, quiet=args.quiet)
        except WorkerFailed as exc:
            if usage_error(exc) is not None:
                raise
            print(f"FAILED pilot {algorithm} / {scenario} / lr {lr:g}: {exc}", file=sys.stderr, flush=True)
            return {}

    first = cells[0].seed
    results = run_pilot(out, list(by_cell), values, list(range(first, first + (args.pilot_seeds or 1))), run)
    print("\n".join(["learning rates chosen by the pilot:", *pilot_lines(results)]), flush=True)
    return results


def link_ratio_line(cfg: Any, pace_ms: float | None) -> str | None:
    """For paced workers on emulated hosts: how long one all-reduce of the model's gradients takes on the
    hosts' links against the backward part of a step (the regime a bench measures: below 1 the all-reduce
    can hide behind the backward pass, above it cannot), from the simulator's ring all-reduce cost. None
    otherwise."""
    if cfg.hosts is None or cfg.compute != "paced" or not pace_ms:
        return None
    from prague.sim.cluster import Link
    from prague.sim.costs import BYTES_PER_FLOAT32, ring_allreduce_s
    from prague.simulate.run import model_size
    from prague.train.config import forward_share

    parameters, _ = model_size(cfg.model, cfg.data)
    size = parameters * BYTES_PER_FLOAT32
    allreduce_s = ring_allreduce_s(cfg.nproc, size, Link(0.0, cfg.link_bits / 8))
    backward_s = pace_ms / 1e3 * (1.0 - forward_share(cfg.pace_split))
    return (f"one all-reduce of {cfg.model}'s gradients ({size / 1e6:.2f} MB, {cfg.nproc} workers on {cfg.hosts} hosts "
            f"at {cfg.link_rate or '1gbit'}): about {allreduce_s * 1e3:.0f} ms, {allreduce_s / backward_s:.2f}x the "
            f"backward part of a step ({backward_s * 1e3:.0f} ms)")


def _bench_pace(args: argparse.Namespace, done: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The bench's ``--compute-ms auto``: probed once, before its first run; a resumed bench keeps the pace
    its first runs had (every run of a bench at one pace). The probe's figures, for the records (None
    when the pace was given)."""
    from prague.train.config import AUTO

    if getattr(args, "compute_ms", None) != AUTO:
        return None
    earlier = next((r for r in done if r.get("pace_probe")), None)
    if earlier is not None:
        args.compute_ms = float(earlier["pace_probe"]["ms"])
        print(f"pace {args.compute_ms:g} ms per step (probed when this bench began)", flush=True)
        return dict(earlier["pace_probe"])
    probe = resolve_pace(args, args.nproc)
    return None if probe is None else probe.as_dict()


def cmd_methods(args: argparse.Namespace) -> int:
    from prague.algorithms.registry import METHODS
    from prague.algorithms.table import methods_markdown, methods_text

    if args.json:
        print(json.dumps([m.describe() for m in METHODS.values()], indent=2))
    elif args.markdown:
        print(methods_markdown())
    else:
        print(methods_text())
    return 0


def _add_run_parser(sub: Any, name: str, helptext: str) -> None:
    from prague.train.config import add_run_arguments

    p = sub.add_parser(name, help=helptext)
    p.add_argument("--algorithm", default=_RUN_DEFAULTS["algorithm"], help="method, optionally NAME:VARIANT (default allreduce; "
                                                            "see prague methods)")
    p.add_argument("--slowdown", default=_RUN_DEFAULTS["slowdown"],
                   help="heterogeneity: homogeneous | paper:X | straggler:RANK:X | crash:RANK:STEP | hang:RANK:STEP, joined with +")
    if name == "run":
        p.add_argument("--nproc", type=int, default=_RUN_DEFAULTS["nproc"],
                       help=f"number of worker processes (default {_RUN_DEFAULTS['nproc']})")
        p.add_argument("--resume", type=Path, metavar="OUT",
                       help="continue the run in OUT from its last complete checkpoint, as it was started "
                            "(--checkpoint-every), to the same final step count")
    else:
        p.add_argument("--resume", action="store_true",
                       help="continue from the last complete checkpoint in --out (what `prague run --resume` starts)")
        p.add_argument("--job", type=Path, metavar="FILE",
                       help="run the job described in FILE (the run.json `prague run` writes in its --out folder) "
                            "instead of the flags")
    p.add_argument("--out", type=Path, help="output directory (default runs/<method>-<time>)")
    add_run_arguments(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``prague`` parser; with ``only``, just that command (``prague worker`` builds no other, so a
    worker process imports nothing it does not run, the simulator least of all)."""
    from prague.train.config import add_run_arguments

    parser = _Parser(prog="prague", description="Data-parallel PyTorch training that stays fast when workers are unequal.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    if only == "worker":
        _add_run_parser(sub, "worker", "one worker process (what torchrun runs)")
        return parser

    _add_run_parser(sub, "run", "train one method with N local worker processes")
    _add_run_parser(sub, "worker", "one worker process (what torchrun runs)")

    b = sub.add_parser("bench", help="run every (method, scenario) pair and write a comparison")
    b.add_argument("--algorithms", default="allreduce", help="comma-separated methods, NAME or NAME:VARIANT")
    b.add_argument("--scenarios", default="homogeneous,paper:5", help="comma-separated scenarios")
    b.add_argument("--nproc", type=int, default=4, help="number of worker processes (default 4)")
    b.add_argument("--out", type=Path, help="output directory (default runs/bench-<time>)")
    b.add_argument("--repeat", type=int, default=1, help="run every (method, scenario) cell with K seeds: --seed, "
                                                         "--seed + 1, ...; the tables give the median and the range "
                                                         "(default 1)")
    b.add_argument("--resume", action="store_true", help="go on with the bench in --out: keep its finished runs, "
                   "run the rest; with the same arguments, or with more --algorithms, --scenarios or --repeat "
                   "seeds (the bench grows, every other setting the same)")
    add_run_arguments(b)
    _lr_list_flag(b)
    b.add_argument("--pilot-budget", default=None,
                   help="with several --lr values: the budget of each pilot run (default epochs:1)")
    b.add_argument("--pilot-seeds", type=int, default=None, metavar="K",
                   help="with several --lr values: run each value's pilot on the bench's first K seeds and keep "
                        "the one that reached the target on the most, then the soonest by the median (default 1)")
    b.add_argument("--quiet", action="store_true")

    m = sub.add_parser("methods", help="list every method, its variants and options")
    fmt = m.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="machine-readable: name, variants, options with defaults")
    fmt.add_argument("--markdown", action="store_true", help="the README's method table")

    gg = sub.add_parser("gg", help="the Group Generator service")
    gg_sub = gg.add_subparsers(dest="gg_command", required=True, parser_class=_Parser)
    serve = gg_sub.add_parser("serve", help="run a Group Generator for a job (prague gg serve --help)", add_help=False)
    serve.add_argument("rest", nargs=argparse.REMAINDER)

    tl = sub.add_parser("timeline", help="where a run's time went, per worker (from OUT/timeline.json or its "
                                         "step records)")
    tl.add_argument("out", type=Path, help="the run's output folder")
    tl.add_argument("--slowest", type=int, default=5, help="how many of the longest steps to list (default 5)")

    rp = sub.add_parser("report", help="print a bench's tables from its bench.json (what bench.md holds), or the "
                        "table of another benchmark's JSON (benchmarks/*.py)")
    rp.add_argument("bench", type=Path, metavar="BENCH_JSON", nargs="+",
                    help="the bench.json a `prague bench` or `prague simulate` wrote (or the folder holding it), or "
                         "the JSON of benchmarks/group_generator.py, torchrun_faults.py or simulator.py --failures; "
                         "several bench.json with --decide")
    rp_fmt = rp.add_mutually_exclusive_group()
    rp_fmt.add_argument("--markdown", action="store_true", help="the tables, as bench.md holds them (the default)")
    rp_fmt.add_argument("--json", action="store_true", help="per (method, scenario): medians, ranges, bootstrap "
                                                            "intervals and speed-ups; each scenario's best baseline")
    rp_fmt.add_argument("--tta", action="store_true", help="the time-to-accuracy table only, without the throughput "
                                                           "of every run (what README shows)")
    rp_fmt.add_argument("--decide", action="store_true", help="which method to pick, from one bench or several: per "
                        "scenario the fastest method, those level with it, and the best baseline (README's table)")

    rp.add_argument("--plot", type=Path, metavar="PNG", help="with --decide: also draw each scenario's time to "
                    "target of the best baseline and of every method that is not one, with intervals (README's "
                    "picture of a workload), into PNG")

    la = sub.add_parser("launch", help="run a script using the prague API on N local processes")
    la.add_argument("--nproc", type=int, default=2)
    la.add_argument("--log-dir", type=Path, help="write each rank's output to DIR/rankR.log, list the services "
                                                 "the script's method starts in DIR/services.json, and its steps "
                                                 "and prague.log_metrics() in DIR/metrics/")
    la.add_argument("--echo-all", action="store_true", help="print every rank's output (default: rank 0)")
    la.add_argument("--timeline", action="store_true", help="with --log-dir: write DIR/timeline.json at the end, a "
                    "Chrome trace of every rank's steps (open it in Perfetto); `prague timeline DIR` prints where the "
                    "time went")
    la.add_argument("--report-to", metavar="{tensorboard,csv}", help="with --log-dir: also write the script's step "
                    "times and prague.log_metrics() to tensorboard (DIR/tensorboard/rankR) and/or csv "
                    "(DIR/metrics/rankR.csv), comma-separated")
    la.add_argument("script", nargs=argparse.REMAINDER, help="script.py [args]")

    gu = sub.add_parser("guard", help="under torchrun: run a script using the prague API so that the job goes on "
                                      "without a crashed or hung worker (torchrun ... -m prague guard train.py)")
    gu.add_argument("--lease-s", type=float, default=10.0,
                    help="a worker whose heartbeat stops this long has hung: it is declared failed and killed "
                         "(default 10)")
    gu.add_argument("--timeout-s", type=float, default=300.0,
                    help="how long the guards wait for the others at the start and the end (default 300)")
    gu.add_argument("--out", type=Path, default=Path("."), help="where services.json, the script's steps and its "
                                                                "prague.log_metrics() (metrics/) go, and rank 0's "
                                                                "summary.json of how the job ended (default .)")
    gu.add_argument("--timeline", action="store_true", help="rank 0's guard writes OUT/timeline.json at the end, a "
                    "Chrome trace of the steps of the ranks that record in OUT (open it in Perfetto)")
    gu.add_argument("--report-to", metavar="{tensorboard,csv}", help="also write the script's step times and "
                    "prague.log_metrics() to tensorboard (OUT/tensorboard/rankR) and/or csv (OUT/metrics/rankR.csv), "
                    "comma-separated")
    gu.add_argument("script", nargs=argparse.REMAINDER, help="script.py [args]")

    from prague.simulate.cli import add_simulate_parser

    add_simulate_parser(sub)
    return parser


def _simulate(args: argparse.Namespace) -> int:
    from prague.simulate.cli import cmd_simulate

    return cmd_simulate(args)


def cmd_timeline(args: argparse.Namespace) -> int:
    from prague.metrics.timeline import load_trace, summarize

    if not args.out.is_dir():
        raise ConfigError(f"{str(args.out)!r} is not a folder; pass a `prague run` output folder")
    if not 0 <= args.slowest <= 10_000:
        raise ConfigError(f"--slowest must be in 0..10000, got {args.slowest}")
    print(summarize(load_trace(args.out), args.slowest))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from prague.metrics.report import read_bench, report_json
    from prague.metrics.tables import decision_table, read_decision, report_file

    if args.plot is not None and not args.decide:
        raise ConfigError("--plot draws the decision table's benches: add --decide")
    if args.decide:
        scenarios = read_decision(args.bench)
        if args.plot is not None:
            from prague.io import atomic_write_bytes
            from prague.metrics.tables import versus_best_figure

            atomic_write_bytes(args.plot, versus_best_figure(scenarios))
        sys.stdout.write(decision_table(scenarios))
        return 0
    if len(args.bench) > 1:
        raise ConfigError(f"prague report reads one file, got {len(args.bench)}; pass one, or add --decide to "
                          "compare several benches")
    if args.json:
        bench = read_bench(args.bench[0])
        print(json.dumps(report_json(bench.records, bench.command), indent=2))
    else:
        sys.stdout.write(report_file(args.bench[0], tta_only=args.tta))
    return 0


def cmd_guard(args: argparse.Namespace) -> int:
    from prague.runtime.guard import Guard, under_torchrun
    from prague.train.config import check_seconds

    if not args.script:
        raise ConfigError("prague guard needs a script: torchrun ... -m prague guard script.py [args]")
    script = Path(args.script[0])
    if not script.is_file():
        raise ConfigError(f"script {str(script)!r} does not exist; pass the path of a Python file")
    check_seconds("--lease-s", args.lease_s)
    check_seconds("--timeout-s", args.timeout_s)
    if not under_torchrun():
        raise ConfigError("prague guard runs under torchrun, one per rank (torchrun --nproc-per-node N -m prague "
                          "guard script.py); on one machine use prague launch, whose launcher guards every worker")
    from prague.metrics.writers import parse_report_to

    reports = parse_report_to(args.report_to)
    guard = Guard([sys.executable, str(script), *args.script[1:]], services=(), env={}, survives=None,
                  lease_s=args.lease_s, out=args.out, timeout_s=args.timeout_s, summary_file=args.out / "summary.json",
                  child_env={jobenv.REPORT_TO: ",".join(reports)} if reports else {})
    code = guard.run()
    if args.timeline and guard.rank == 0:
        _script_timeline(args.out)
    return code


HANDLERS = {"run": cmd_run, "worker": cmd_worker, "launch": cmd_launch, "bench": cmd_bench, "simulate": _simulate,
            "methods": cmd_methods, "timeline": cmd_timeline, "guard": cmd_guard, "report": cmd_report}


def main(argv: list[str] | None = None) -> int:
    as_command = argv is None  # the `prague` command itself, not a call from inside a program
    if argv is None:
        argv = sys.argv[1:]
    if argv[:2] == ["gg", "serve"]:  # the service parses its own flags
        from prague.groups.service import main as serve_main

        return serve_main(argv[2:], prog="prague gg serve")
    parser = build_parser(only="worker" if argv[:1] == ["worker"] else None)
    args = parser.parse_args(argv)
    try:
        if as_command and args.command == "simulate":  # a large job starts again on huge pages (its allocator)
            from prague.simulate.memory import restart

            restart(args.huge_pages, args.nproc)
        return HANDLERS[args.command](args)
    except ConfigError as exc:
        print(f"prague {args.command}: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except WorkerFailed as exc:
        where = f"worker rank {exc.rank}" if exc.rank >= 0 else "a service process"
        usage = usage_error(exc)
        if usage is not None:  # the worker found its settings cannot work: one line, as for bad flags
            print(f"prague {args.command}: error: {where}: {one_line(usage)}", file=sys.stderr)
            return EXIT_USAGE
        print(f"prague {args.command}: {where} failed (exit code {exc.exitcode}):\n{exc.detail}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"prague {args.command}: interrupted; all worker processes stopped", file=sys.stderr)
        return 130
    except PragueError as exc:
        print(f"prague {args.command}: error: {one_line(exc)}", file=sys.stderr)
        return 1
    finally:
        if args.command in ("run", "bench", "launch"):  # return only once every process started has exited
            from prague.runtime.forkserver import stop

            stop()
        if as_command and args.command == "simulate":
            # The process ends now, its files written and closed: the collections of the interpreter's exit would
            # only walk what the run left (0.6 s at 1,024 workers x 1,000 iterations, 0.1 s once frozen).
            gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
