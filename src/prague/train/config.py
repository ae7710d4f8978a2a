"""The settings of one run, validated when built, and the one place a run flag is declared.

Every field of :class:`RunConfig` declared with :func:`setting` is a flag of ``prague run``, ``prague
worker``, ``prague bench`` and ``prague simulate`` (:func:`add_run_arguments`), is read back from the
parsed flags (:func:`config_from_args`) and is forwarded to every worker process
(:func:`worker_argv`). Adding a run flag is adding one field here (and using it). Method options are
declared by each method (:mod:`prague.algorithms.spec`) and handled the same way.

This module imports neither torch nor any method's code.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import threading
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from prague.algorithms.spec import Method, check_nproc, check_seconds
from prague.errors import ConfigError, unknown_choice
from prague.hetero.spec import parse_scenario
from prague.net.hosts import DEFAULT_LINK_RATE, check_layout, parse_rate
from prague.net.traffic import parse_cross_traffic
from prague.train.divergence import DEFAULT_FACTOR, DEFAULT_WINDOW, REFERENCE_STEPS, check_rule
from prague.metrics.writers import parse_report_to
from prague.workload.catalog import COMPUTE_MODES, DATASETS, MODELS, OPTIMIZERS, check_pairing, check_seed

#: The nominal step time of paced and emulated compute when --compute-ms is not given.
DEFAULT_COMPUTE_MS = 100.0
#: ``--compute-ms auto``: the smallest pace this machine holds, probed by ``prague run`` and ``prague bench``.
AUTO = "auto"
#: The default split of a paced step into its forward and backward part (``--pace-split``).
DEFAULT_SPLIT = "1:2"


def forward_share(split: str) -> float:
    """The forward part's share of a paced step from ``--pace-split F:B`` (``"1:2"``: 1/3); ConfigError
    naming the value otherwise."""
    parts = str(split).split(":")
    try:
        forward, backward = (float(p) for p in parts)
    except ValueError:
        raise ConfigError(f"--pace-split takes F:B, the forward and backward parts of a paced step (like 1:2), "
                          f"got {split!r}") from None
    if not (math.isfinite(forward) and math.isfinite(backward) and forward >= 0 and backward > 0):
        raise ConfigError(f"--pace-split {split!r}: the forward part must be >= 0 and the backward part > 0, "
                          "both finite (like 1:2)")
    return forward / (forward + backward)


def pace_value(text: str) -> float | str:
    """``--compute-ms``'s value: a number of ms, or ``auto``."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a number of ms or {AUTO}, got {text!r}") from None


def setting(default: Any, help: str, *, choices: tuple[str, ...] | None = None, exclusive: str | None = None,
            parse: Any = None) -> Any:
    """Declare a run flag: its default, help text, valid names (if any), the group of flags it
    excludes (``--steps`` and ``--epochs``) and, where the field's type is not enough, the function that
    reads its text (``--compute-ms auto``)."""
    return field(default=default, metadata={"help": help, "choices": choices, "exclusive": exclusive,
                                            "parse": parse})


@dataclass(frozen=True)
class RunConfig:
    """One run of one method, resolved once: the job description every worker reads.

    The first five fields are given per command (``--algorithm``/``--algorithms``, ``--slowdown``/
    ``--scenarios``, ``--nproc``, ``--out``, the method's options); every field after them is a flag
    (see the module docstring). ``algorithm`` may carry a variant (``prague:smart``). ``steps`` is per
    worker; when it is None the run lasts ``epochs`` (default 1) passes over each worker's shard.

    ``options`` may be given as option values by name (or None: every default); once built it is the
    method's typed options (its :class:`~prague.algorithms.spec.Options` dataclass), checked against the
    job, and ``method`` is the method's description. Its seed options stay as given (0: the run's
    ``seed``, so a bench's ``--repeat`` replaces one field); :attr:`seeded_options` resolves them. ``prague run`` writes the description to ``OUT/run.json`` (:func:`write_job`); its
    workers, a guard's child under torchrun and ``prague run --resume`` read it back (:func:`read_job`).
    """

    algorithm: str = "allreduce"
    scenario: str = "homogeneous"
    nproc: int = 1
    out: Path = Path("runs/latest")
    options: Any = None
    method: Method = field(init=False, repr=False, compare=False)

    epochs: float | None = setting(None, "passes over each worker's shard (default 1)", exclusive="length")
    steps: int | None = setting(None, "iterations per worker", exclusive="length")
    budget: str | None = setting(None, "work of the whole job: epochs:E (every sample E times across all workers), "
                                       "samples:N or seconds:T; fast workers take more batches where the method "
                                       "allows (summary.json's `shares` says which way a run went)",
                                 exclusive="length")
    batch_size: int = setting(32, "per-worker batch size")
    lr: float = setting(0.05, "learning rate of the optimizer")
    optimizer: str = setting("sgd", "the workers' optimizer: sgd (with --momentum) or adamw (torch.optim.AdamW's "
                                    "defaults: betas 0.9 and 0.999, weight decay 0.01; for transformers, at an lr "
                                    "near 0.001)", choices=OPTIMIZERS)
    momentum: float = setting(0.9, "momentum of SGD (--optimizer sgd)")
    model: str = setting("mlp", "model to train", choices=MODELS)
    data: str = setting("digits", "data set", choices=tuple(DATASETS))
    data_dir: Path | None = setting(None, "directory of the data set's files (mnist)")
    compute: str = setting("real", "real: train the model; paced: train it, each step padded to --compute-ms "
                                   "(times its slowdown), as if every worker had an accelerator of its own; "
                                   "emulated: a --compute-ms wait instead of the arithmetic (nothing is learnt)",
                           choices=COMPUTE_MODES)
    compute_ms: float | None = setting(None, "nominal compute time per iteration, ms: what paced and emulated steps "
                                             "take and what injected slowdowns multiply in every mode (paced, "
                                             "emulated: default 100; real: one step measured by the launcher); "
                                             "auto (paced, prague run and bench): the smallest pace this machine "
                                             "holds for the workers and model, probed once", parse=pace_value)
    pace_split: str = setting(DEFAULT_SPLIT, "paced compute: the forward and backward parts of a step, F:B; the "
                                             "backward part is spent layer by layer in autograd's order, so "
                                             "gradients are ready when they would be on an accelerator")
    seed: int = setting(0, "seed of the model, the data order and every scenario draw")
    target_accuracy: float | None = setting(None, "record the time to reach this test accuracy")
    target_loss: float | None = setting(None, "record the time to reach this mean test cross-entropy loss (of the "
                                              "average of the replicas), or lower")
    stop_at_target: bool = setting(False, "end the job once the average of the replicas reaches --target-accuracy "
                                          "(scored while training by a process beside the workers: one machine)")
    eval_every: int | None = setting(None, "gone: runs and simulations evaluate on the common clock (--eval-every-s)")
    eval_every_s: float | None = setting(None, "evaluate the average of the replicas' states every S seconds of the "
                                               "common clock (default 1; beyond the first 64 points the interval "
                                               "doubles each time the elapsed time doubles, the same instants "
                                               "for every job)")
    warmup_steps: int | None = setting(None, "steps left out of the throughput window")
    divergence_factor: float = setting(DEFAULT_FACTOR, "a run whose loss stays above this many times its starting "
                                                       f"loss (the median of its first {REFERENCE_STEPS}) for "
                                                       "--divergence-window steps has diverged and stops, as does "
                                                       "one with a NaN or infinite loss (0: only those)")
    divergence_window: int = setting(DEFAULT_WINDOW, "steps the loss must stay above --divergence-factor times its "
                                                     "starting loss")
    timeout_s: float = setting(300.0, "collective and rendezvous timeout, in s")
    lease_s: float = setting(10.0, "a worker whose heartbeat stops this long has hung: methods that survive "
                                   "failures go on without it, the others stop, naming it (s)")
    backend: str = setting("auto", "torch.distributed backend", choices=("auto", "gloo", "nccl"))
    device: str = setting("auto", "where each rank computes: auto (its own GPU under nccl, the CPU under gloo), cpu, "
                                  "or cuda (the GPUs under gloo too: ranks share them, local rank modulo their "
                                  "number; real GPU compute with more ranks than GPUs)",
                          choices=("auto", "cpu", "cuda"))
    save_model: bool = setting(False, "rank 0 saves the averaged model to OUT/model.pt")
    stall_warn_s: float | None = setting(None, "warn when a worker has waited this long (s) for others in one "
                                               "step, naming them (default: 10x the median step time, at "
                                               "least 1 s)")
    checkpoint_every: int | None = setting(None, "every K steps each worker writes its state to "
                                                 "OUT/checkpoints; `prague run --resume OUT` continues from "
                                                 "the last complete one")
    log_decisions: bool = setting(False, "write each worker's decisions (groups, partners, pushes) to "
                                         "decisions/rankR.jsonl in the run's folder, the services' traces "
                                         "beside them")
    hosts: int | None = setting(None, "place the workers on H emulated hosts: Linux network namespaces linked to "
                                      "a bridge through shaped links (needs root; simulate: H simulated nodes); "
                                      "--nodes follows")
    link_rate: str | None = setting(None, "with --hosts: each host's link rate each way, like 1gbit or 100mbit "
                                          "(default 1gbit)")
    cross_traffic: str | None = setting(None, "with --hosts: congestion on every link, bursts:P:MB (every 100 ms "
                                              "each link carries MB megabytes each way with probability P, "
                                              "seeded by --seed)")
    timeline: bool = setting(False, "write OUT/timeline.json, a Chrome trace of every worker's steps (open it in "
                                    "Perfetto); `prague timeline OUT` prints where the time went")
    report_to: str | None = setting(None, "also write each rank's step times and loss, and the evaluation, to "
                                          "tensorboard (OUT/tensorboard/rankR) and/or csv (OUT/metrics/rankR.csv), "
                                          "comma-separated")
    resume: bool = False  # continue from the last complete checkpoint in ``out`` (prague run --resume OUT)

    def __post_init__(self) -> None:
        check_nproc(self.nproc)
        check_seed(self.seed)
        self._resolve_method()
        parse_scenario(self.scenario).check_world(self.nproc)
        check_seconds("--lease-s", self.lease_s)
        if self.steps is not None and self.steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {self.steps}")
        if self.epochs is not None and not 0 < self.epochs < math.inf:
            raise ConfigError(f"--epochs must be a finite number > 0, got {self.epochs}")
        given = [flag for flag, v in (("--steps", self.steps), ("--epochs", self.epochs), ("--budget", self.budget))
                 if v is not None]
        if len(given) > 1:
            raise ConfigError(f"give one of --steps, --epochs and --budget, not {' and '.join(given)}")
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1, got {self.batch_size}")
        if not 0 < self.lr < math.inf:
            raise ConfigError(f"--lr must be a finite number > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"--momentum must be in [0, 1), got {self.momentum}")
        for f in flag_fields():
            choices = f.metadata["choices"]
            if choices is not None and getattr(self, f.name) not in choices:
                raise unknown_choice(_what(f.name), getattr(self, f.name), choices)
        check_pairing(self.model, self.data)
        if self.compute_ms == AUTO:
            raise ConfigError("--compute-ms auto is probed by prague run and prague bench before the workers start; "
                              "here give a number of ms")
        if self.compute_ms is not None and not 0 <= self.compute_ms / 1e3 <= threading.TIMEOUT_MAX:
            raise ConfigError(f"--compute-ms must be a number of ms in 0..{threading.TIMEOUT_MAX * 1000:.3g}, "
                              f"got {self.compute_ms}")
        forward_share(self.pace_split)
        if self.compute == "paced" and self.compute_ms == 0:
            raise ConfigError("--compute paced needs a pace: give --compute-ms above 0 (the nominal step time)")
        if self.budget is not None:
            from prague.workload.budget import parse_budget

            parse_budget(self.budget)
            if self.checkpoint_every is not None:
                raise ConfigError("--checkpoint-every with --budget: a job-wide budget's shared batch counter "
                                  "is not checkpointed yet; use --steps or --epochs to checkpoint")
        if self.stop_at_target and (self.target_accuracy is None or self.emulated):
            raise ConfigError("--stop-at-target stops at --target-accuracy, which needs real or paced compute: give "
                              "--target-accuracy and drop --compute emulated, or drop --stop-at-target")
        if self.eval_every_s is not None and not 0 < self.eval_every_s <= 1e6:
            raise ConfigError(f"--eval-every-s must be a number of seconds in (0, 1e6], got {self.eval_every_s}")
        check_out_folder(Path(self.out))
        if self.data_dir is not None and not Path(self.data_dir).is_dir():
            raise ConfigError(f"--data-dir {str(self.data_dir)!r} is not a directory; pass the folder holding the data files")
        if self.target_accuracy is not None and not 0 < self.target_accuracy <= 1:
            raise ConfigError(f"--target-accuracy must be in (0, 1], got {self.target_accuracy}")
        if self.target_loss is not None and not 0 < self.target_loss < math.inf:
            raise ConfigError(f"--target-loss must be a finite loss > 0 (mean cross-entropy, nats), got "
                              f"{self.target_loss}")
        if self.eval_every is not None:
            raise ConfigError("--eval-every counted steps; runs and simulations now evaluate on the common clock: "
                              "give --eval-every-s SECONDS")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ConfigError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        check_seconds("--timeout-s", self.timeout_s)
        check_rule(self.divergence_factor, self.divergence_window)
        if self.stall_warn_s is not None:
            check_seconds("--stall-warn-s", self.stall_warn_s)
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ConfigError(f"--checkpoint-every must be >= 1 step, got {self.checkpoint_every}")
        if self.hosts is not None:
            check_layout(self.nproc, self.hosts)
            parse_rate(self.link_rate or DEFAULT_LINK_RATE)
        elif self.link_rate is not None or self.cross_traffic is not None:
            flag = "--link-rate" if self.link_rate is not None else "--cross-traffic"
            raise ConfigError(f"{flag} acts on the links of emulated hosts; give --hosts H too, or drop it")
        if self.cross_traffic is not None:
            parse_cross_traffic(self.cross_traffic)
        parse_report_to(self.report_to)

    def _resolve_method(self) -> None:
        """Set ``method`` from ``algorithm`` and make ``options`` the method's typed, checked options."""
        from prague.algorithms.registry import parse_method

        method, variant = parse_method(self.algorithm)
        options = self.options
        if isinstance(options, method.options):
            chosen = None if method.variant_option is None else getattr(options, method.variant_option)
            if variant is not None and chosen != variant:
                raise ConfigError(f"--algorithm {self.algorithm} and the options' {method.variant_option} "
                                  f"{chosen!r} disagree; give one of them")
        elif options is None or isinstance(options, Mapping):
            options = method.make_options(_typed_values(method, dict(options or {})), variant)
        else:
            raise ConfigError(f"the options of {method.name} must be its {method.options.__name__} or option "
                              f"values by name, got {type(options).__name__}")
        method.check_job(options, self.nproc)
        if method.sgd_only and self.optimizer != "sgd":
            raise ConfigError(f"--optimizer {self.optimizer}: {method.name} applies SGD's update rule on its servers; "
                              "use --optimizer sgd with it")
        object.__setattr__(self, "method", method)
        object.__setattr__(self, "options", options)

    @property
    def seeded_options(self) -> Any:
        """The options the method runs with: seed options left at 0 set to ``seed``."""
        return self.method.seeded(self.options, self.seed)

    @property
    def label(self) -> str:
        """``NAME`` or ``NAME:VARIANT``, from the resolved options (``prague --generator smart`` is
        ``prague:smart``)."""
        return self.method.label(self.options)

    @property
    def link_bits(self) -> int:
        """The emulated hosts' link rate, in bits per second."""
        return parse_rate(self.link_rate or DEFAULT_LINK_RATE)

    @property
    def emulated(self) -> bool:
        return self.compute == "emulated"

    @property
    def nominal_compute_ms(self) -> float | None:
        """The nominal compute time per step, ms: ``--compute-ms``, 100 by default when paced or emulated,
        None under real compute without it (each worker then scales slowdowns by its measured average)."""
        if self.compute_ms is not None:
            return self.compute_ms
        return None if self.compute == "real" else DEFAULT_COMPUTE_MS

    def check_data_source(self) -> None:
        """Raise unless the data set can be loaded from what was given (MNIST needs ``--data-dir``).
        Checked before a real run starts; a simulation that only times needs no data."""
        if self.data == "mnist" and self.data_dir is None:
            raise ConfigError("--data mnist needs --data-dir pointing at a directory of MNIST IDX files")


def check_out_folder(out: Path) -> None:
    """Raise ConfigError unless ``out`` (``--out``) is a folder this process can write in, or one it can
    create: so a run does not fail on its first write, after its workers started."""
    try:
        existing = next(p for p in (out, *out.parents) if p.exists())  # "." or "/" at the latest
        if not existing.is_dir():
            where = "is a file" if existing == out else f"is below the file {str(existing)!r}"
            raise ConfigError(f"--out {str(out)!r} {where}; pass a folder (created if missing)")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(f"--out {str(out)!r}: {str(existing)!r} is not writable; pass a folder you can write to")
    except OSError as exc:  # a name too long, a loop of links...
        raise ConfigError(f"--out {str(out)!r} is not a usable folder ({exc.strerror or exc}); pass another") from None


def _what(name: str) -> str:
    return {"model": "model", "data": "data set", "compute": "compute mode"}.get(name, "--" + name.replace("_", "-"))


@cache
def flag_fields() -> tuple[dataclasses.Field[Any], ...]:
    """The fields of :class:`RunConfig` that are flags."""
    return tuple(f for f in dataclasses.fields(RunConfig) if "help" in f.metadata)


@cache
def _flag_types() -> dict[str, type]:
    hints = typing.get_type_hints(RunConfig)
    out = {}
    for f in flag_fields():
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        out[f.name] = args[0] if args else hint
    return out


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_run_arguments(parser: argparse.ArgumentParser, *, defaults: Mapping[str, Any] | None = None) -> None:
    """Add every run flag and every method option to ``parser``.

    ``defaults`` overrides a flag's default for this command (``prague simulate`` trains resnet18 by
    default). Unset flags parse as None, so the dataclass defaults apply."""
    from prague.algorithms.registry import all_options

    defaults = dict(defaults or {})
    group = parser.add_argument_group("training")
    exclusive: dict[str, Any] = {}
    types = _flag_types()
    for f in flag_fields():
        default = defaults.get(f.name, f.default)
        where = group
        if f.metadata["exclusive"]:
            if f.metadata["exclusive"] not in exclusive:  # one group per name: an empty extra one breaks --help
                exclusive[f.metadata["exclusive"]] = group.add_mutually_exclusive_group()
            where = exclusive[f.metadata["exclusive"]]
        helptext = f.metadata["help"] + ("" if default is None or types[f.name] is bool else f" (default {default})")
        if helptext.startswith("gone:"):  # still parsed, to say what replaced it; not offered in --help
            helptext = argparse.SUPPRESS
        if types[f.name] is bool:
            where.add_argument(_flag(f.name), dest=f.name, action="store_true", default=None, help=helptext)
            continue
        choices = f.metadata["choices"]
        where.add_argument(_flag(f.name), dest=f.name, type=f.metadata["parse"] or types[f.name], default=None,
                           help=helptext,
                           metavar="{" + ",".join(choices) + "}" if choices else None)
    if defaults:
        parser.set_defaults(**{k: v for k, v in defaults.items() if k in types})

    options = parser.add_argument_group("method options (each applies to the methods named in brackets)")
    for name, declared in all_options().items():
        _, info = declared[0]
        methods = ",".join(m.name for m, _ in declared)
        shown = {str(i.default) for _, i in declared}
        default = shown.pop() if len(shown) == 1 else "per method"
        choices = f"; one of {', '.join(info.choices)}" if info.choices else ""
        if info.type is bool:
            options.add_argument(info.flag, dest=name, type=parse_on_off, default=None, metavar="{on,off}",
                                 help=f"[{methods}] {info.help} (default {'on' if info.default else 'off'})")
            continue
        options.add_argument(info.flag, dest=name, type=info.type, default=None,
                             help=f"[{methods}] {info.help}{choices} (default {default})")


def parse_on_off(text: str) -> bool:
    """A yes/no method option's value on the command line: on/off (true/false, yes/no, 1/0 too)."""
    value = {"on": True, "true": True, "yes": True, "1": True, "off": False, "false": False, "no": False,
             "0": False}.get(text.strip().lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return value


def option_values(args: argparse.Namespace) -> dict[str, Any]:
    """The method options given on the command line (by option name)."""
    from prague.algorithms.registry import all_options

    return {k: getattr(args, k) for k in all_options() if getattr(args, k, None) is not None}


def config_from_args(args: argparse.Namespace, *, algorithm: str, scenario: str, nproc: int,
                     out: Path) -> RunConfig:
    """Build and validate a RunConfig from parsed flags: the method resolved, the options it declares
    typed (those given for other methods of a bench left out) and checked against the job."""
    from prague.algorithms.registry import parse_method

    method = parse_method(algorithm)[0]
    values = option_values(args)
    hosts = getattr(args, "hosts", None)
    if hosts is not None:  # --nodes follows --hosts
        values = follow_hosts(method, values, hosts)
    declared = {o.name for o in method.option_infos}
    options = {k: v for k, v in values.items() if k in declared}
    flags = {f.name: getattr(args, f.name) for f in flag_fields() if getattr(args, f.name, None) is not None}
    return RunConfig(algorithm=algorithm, scenario=scenario, nproc=nproc, out=out, options=options, **flags)


def follow_hosts(method: Any, values: dict[str, Any], hosts: int) -> dict[str, Any]:
    """A method with a ``nodes`` option runs with ``--nodes`` = ``--hosts`` unless told otherwise; told
    something else is an error."""
    if "nodes" not in {o.name for o in method.option_infos}:
        return values
    return {**values, "nodes": hosts_nodes(values.get("nodes"), hosts)}


def hosts_nodes(given: int | None, hosts: int) -> int:
    """The nodes of a job on ``hosts`` emulated hosts: the hosts; a ``--nodes`` that says otherwise
    (``given``) is an error. Serves runs (:func:`follow_hosts`) and the simulated topology alike."""
    if given is not None and given != hosts:
        raise ConfigError(f"--nodes {given} differs from --hosts {hosts}; with emulated hosts the nodes are the "
                          "hosts: drop --nodes")
    return hosts


def check_options_apply(args: argparse.Namespace, algorithms: list[str], topology: tuple[str, ...] = ()) -> None:
    """Raise unless every method option given applies to at least one of ``algorithms`` (options named
    in ``topology`` apply to every method: the simulator's ``--nodes``)."""
    from prague.algorithms.registry import parse_method

    methods = [parse_method(a)[0] for a in algorithms]
    for name in option_values(args):
        if name in topology:
            continue
        if not any(name in {o.name for o in m.option_infos} for m in methods):
            flag = _flag(name)
            raise ConfigError(f"{flag} is not an option of {', '.join(m.name for m in methods)}; drop it "
                              f"(`prague methods` lists each method's options)")


def run_folder(out: Path, algorithm: str, scenario: str) -> Path:
    """The folder of one (method, scenario) run inside a bench's output folder ``out``:
    ``out/runs/<method>_<scenario>`` (``:`` written as ``-``). ``prague simulate`` writes a run's
    decision logs there too."""
    return Path(out) / "runs" / f"{algorithm.replace(':', '-')}_{scenario.replace(':', '-')}"


RUN_FILE = "run.json"


def job_file(out: Path) -> Path:
    """Where a run's job description lives: ``OUT/run.json``."""
    return Path(out) / RUN_FILE


def write_job(cfg: RunConfig, path: Path | None = None) -> Path:
    """Write the job description ``cfg`` (every setting, the method's typed options in full) to ``path``
    (default ``OUT/run.json``), atomically; return the path. Workers and ``prague run --resume`` read it
    back with :func:`read_job`."""
    from prague.io import atomic_write_json

    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(RunConfig) if f.init and f.name != "resume"}
    fields["options"] = dataclasses.asdict(cfg.options)
    path = job_file(cfg.out) if path is None else Path(path)
    atomic_write_json(path, {k: str(v) if isinstance(v, Path) else v for k, v in fields.items()})
    return path


def read_job(path: Path, *, flag: str = "--job", out: Path | None = None, resume: bool = False) -> RunConfig:
    """The job description :func:`write_job` wrote at ``path``, validated as when it was built;
    ConfigError naming ``flag`` and the file when it is missing or not one. ``out`` replaces the saved
    output folder (a resumed run's folder may have moved)."""
    import json

    path = Path(path)
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{flag}: no job description at {str(path)!r}; pass the {RUN_FILE} of a "
                          "`prague run` (in its --out folder)") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{flag}: cannot read {str(path)!r}: {exc}") from None
    known = {f.name for f in dataclasses.fields(RunConfig) if f.init} - {"resume"}
    if not isinstance(saved, dict) or not set(saved) <= known:
        raise ConfigError(f"{flag}: {str(path)!r} is not a job description written by this version of prague; "
                          "start a new run instead")
    hints = typing.get_type_hints(RunConfig)
    fields: dict[str, Any] = {name: _from_json(name, value, hints[name], path, flag)
                              for name, value in saved.items() if name != "options"}
    options = saved.get("options")
    if options is not None and not isinstance(options, dict):
        raise ConfigError(f"{flag}: {str(path)!r} holds options = {options!r}, not option values by name; it was "
                          "not written by `prague run`, start a new run instead")
    fields["options"] = options
    if out is not None:
        fields["out"] = Path(out)
    try:
        return RunConfig(**fields, resume=resume)
    except ConfigError as exc:
        raise ConfigError(f"{flag}: {str(path)!r} does not hold a valid job description: {exc}") from None


def _typed_values(method: Method, values: dict[str, Any]) -> dict[str, Any]:
    """Option values by name for ``method``, each of its declared type (an int where a float is declared
    becomes one); ConfigError naming an unknown option or a value of the wrong type."""
    infos = {o.name: o for o in method.option_infos}
    unknown = sorted(set(values) - set(infos))
    if unknown:
        flags = ", ".join("--" + n.replace("_", "-") for n in unknown)
        raise ConfigError(f"{flags} is not an option of {method.name}; drop it (`prague methods` lists each "
                          "method's options)")
    out: dict[str, Any] = {}
    for name, v in values.items():
        kind = infos[name].type
        ok = v is None or (isinstance(v, bool) == (kind is bool)
                           and (isinstance(v, kind) or (kind is float and isinstance(v, int))))
        if not ok:
            raise ConfigError(f"option {name} = {v!r} is not a {kind.__name__} (--{name.replace('_', '-')})")
        out[name] = float(v) if kind is float and v is not None else v
    return out


def load_config(out: Path) -> RunConfig:
    """The job ``prague run --resume OUT`` continues: ``OUT/run.json``, its folder ``out``."""
    return read_job(job_file(out), flag="--resume", out=Path(out), resume=True)


def _from_json(name: str, value: object, hint: Any, path: Path, flag: str) -> Any:
    """Field ``name`` of a saved configuration as its annotated type (a path from its string); ConfigError
    naming the file if ``value`` is not one."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None
        if value is None:
            return None
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    kind = typing.get_origin(hint) or hint
    if isinstance(value, bool):
        ok = kind is bool
    elif kind is float:
        ok = isinstance(value, (int, float))
    elif kind is Path:
        ok = isinstance(value, str)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise ConfigError(f"{flag}: {str(path)!r} holds {name} = {value!r}, not a {kind.__name__}; it was not "
                          "written by `prague run`, start a new run instead")
    return Path(value) if kind is Path else value  # type: ignore[arg-type]


def worker_argv(job: Path, *, resume: bool = False) -> list[str]:
    """The ``prague worker`` command line of a worker that reads the job description at ``job``."""
    return [sys.executable, "-m", "prague", "worker", "--job", str(job), *(["--resume"] if resume else [])]
