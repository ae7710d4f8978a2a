"""The record of one run: one dataclass for a real run and a simulated one alike.

``summary.json`` is one record; ``bench.json`` a list of them; ``bench.md`` and the plots are rendered
from them (:mod:`prague.metrics.report`); ``prague simulate --calibrate`` reads them back. The real
worker loop (:mod:`prague.train.loop`) and the simulator (:mod:`prague.simulate.run`) both build it
with :meth:`RunRecord.from_timings`, so throughput, the no-wait limit and the per-worker means are
computed by one piece of code (:mod:`prague.metrics.summary`).

``schema_version`` is :data:`SCHEMA_VERSION`; files written before it existed (no version field) read
as version 1, whose fields are the same. The fields are documented in README.md (a test checks that
the README's table is :func:`fields_markdown`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prague.errors import ConfigError
from prague.metrics.summary import (
    WorkerTiming, base_compute_s, mean_after, mean_slowdowns, no_wait_limit, nominal_compute_s, throughput,
    worker_rate,
)

SCHEMA_VERSION = 5

#: The CPU features a record's ``host`` names when present: those that change how fast a CPU trains (wide
#: vectors, bfloat16 arithmetic and matrix tiles), so that two benches on machines of one kind can be told apart.
CPU_FEATURES: tuple[str, ...] = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def host_facts(cpuinfo: str | None = None) -> dict[str, Any]:
    """What a record says of the machine that ran it: the CPU's model name, the logical CPUs this process may
    use, which of :data:`CPU_FEATURES` the CPU has, and the Python and torch versions. ``cpuinfo``: the
    text of ``/proc/cpuinfo`` (read here when None; where there is none, the model is
    :func:`platform.processor` and the features are left empty)."""
    import torch  # here: reading and rendering records needs no torch

    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
                cpuinfo = fh.read()
        except OSError:
            cpuinfo = ""
    model, flags = "", set[str]()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    affinity = getattr(os, "sched_getaffinity", None)
    cpus = len(affinity(0)) if affinity is not None else (os.cpu_count() or 0)
    return {"cpu": model or platform.processor() or "unknown", "logical_cpus": cpus,
            "cpu_features": [f for f in CPU_FEATURES if f in flags], "python": platform.python_version(),
            "torch": torch.__version__.split("+")[0]}


def _doc(text: str, default: Any = None) -> Any:
    return field(default=default, metadata={"doc": text})


def _doc_list(text: str) -> Any:
    return field(default_factory=list, metadata={"doc": text})


def method_label_of(algorithm: str, variant: str | None) -> str:
    """A run's method as tables and messages name it: ``allreduce``, or ``prague:smart`` with a variant."""
    return f"{algorithm}:{variant}" if variant else algorithm


#: Values a record's JSON form holds that are immutable: shared, not copied, by :func:`_json_copy`.
_IMMUTABLE = (str, int, float, bool, type(None))


def _json_copy(value: Any) -> Any:
    """``value`` as :func:`dataclasses.asdict` copies a field: lists, tuples and dicts copied (their keys and
    immutable items shared), dataclasses made dicts, anything else deep-copied. ``asdict`` deep-copies each
    number too, which at 65,536 workers' lists of a simulated record took seconds per copy."""
    kind = type(value)
    if kind in _IMMUTABLE:
        return value
    if kind is list:
        return [v if type(v) in _IMMUTABLE else _json_copy(v) for v in value]
    if kind is dict:
        return {k if type(k) in _IMMUTABLE else copy.deepcopy(k): v if type(v) in _IMMUTABLE else _json_copy(v)
                for k, v in value.items()}
    if kind is tuple:
        return tuple(v if type(v) in _IMMUTABLE else _json_copy(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _json_copy(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return copy.deepcopy(value)


@dataclass
class RunRecord:
    """One run of one method in one scenario (see the module docstring)."""

    algorithm: str = _doc("method name (`prague`)", "")
    scenario: str = _doc("heterogeneity scenario (`paper:5`)", "")
    throughput_samples_per_s: float = _doc("samples per second of all workers together, after warm-up", 0.0)
    schema_version: int = _doc("version of this layout", SCHEMA_VERSION)
    variant: str | None = _doc("the method's variant (`ready`), or null")
    nproc: int | None = _doc("number of workers")
    compute_mode: str | None = _doc("`real`, `paced` or `emulated`")
    compute_ms: float | None = _doc("nominal compute time per iteration (paced, emulated, simulated, or given), ms")
    pace_probe: dict[str, Any] | None = _doc(
        "`--compute-ms auto`: what the probe found, `{ms, step_ms, workers, margin, probed}` (null: the pace was given)")
    model: str | None = _doc("model name")
    parameters: int | None = _doc("trainable parameters of the model")
    data: str | None = _doc("data set name")
    batch_size: int | None = _doc("per-worker batch size")
    lr: float | None = _doc("the learning rate it trained with (`--lr`; a bench given several picks one per cell "
                            "with its pilot)")
    optimizer: str | None = _doc("the workers' optimizer (`--optimizer`: `sgd` or `adamw`)")
    lr_pilot: list[dict[str, Any]] = _doc_list(
        "a bench's learning-rate pilot of this cell (`--lr` with several values): `{lr, seed, time_to_target_s, "
        "test_accuracy}` per value and pilot seed (`--pilot-seeds`, the bench's first seeds), each a run on "
        "`--pilot-budget`")
    steps: int | None = _doc("iterations per worker (under a `--budget`: the most any worker ran)")
    budget: str | None = _doc("the job-wide `--budget` (`epochs:3`), or null for per-worker `--steps`/`--epochs`")
    shares: str | None = _doc("under a budget: `claimed` (batches from a shared counter: fast workers take more) "
                              "or `equal` (the method runs every rank in every step)")
    job_s: float | None = _doc("job completion time: from the common start to the last worker's finish, s")
    samples: int | None = _doc("training samples processed by all workers together")
    worker_samples: list[int] = _doc_list("per rank: the training samples it processed")
    warmup_steps: int | None = _doc("iterations left out of the throughput window")
    seed: int | None = _doc("the run's seed")
    backend: str | None = _doc("`gloo`, `nccl`, or `sim`")
    device: str | None = _doc("where the ranks computed: `cpu` or `cuda` (`--device`; null when simulated)")
    no_wait_limit_samples_per_s: float | None = _doc("throughput if communication were free and nobody waited")
    fraction_of_limit: float | None = _doc("throughput / no-wait limit")
    base_compute_s: float | None = _doc("compute of one step without injected slowdown (median; the no-wait limit's step)")
    mean_slowdown: list[float] = _doc_list("per worker: mean injected slowdown factor after warm-up")
    wall_s: float | None = _doc("training time of the slowest worker (simulated time when simulated), s")
    test_accuracy: float | None = _doc("test accuracy of the average of all replicas (null without real compute)")
    target_accuracy: float | None = _doc("the `--target-accuracy`, or null")
    time_to_target_s: float | None = _doc("time on the common clock until the average of the replicas first "
                                          "reached the target (the first scored point at or above it)")
    time_to_target_smoothed_s: float | None = _doc(
        "the same on the smoothed curve: the first instant at which the mean of three consecutive coarse points' "
        "accuracies reaches the target, interpolated linearly between scored instants")
    target_loss: float | None = _doc("the `--target-loss`, or null")
    time_to_target_loss_s: float | None = _doc("time on the common clock until the mean test cross-entropy loss of "
                                               "the average of the replicas first fell to the `--target-loss`")
    eval_history: list[dict[str, float | None]] = _doc_list(
        "`{wall_s, accuracy, loss}` (loss: mean test cross-entropy, null if not finite) of the average of the "
        "replicas' states at `wall_s` on the common clock, the scored grid points and the job's end last")
    consensus_distance: float | None = _doc("mean distance of the replicas from their average at the end (null if not finite)")
    best_replica_accuracy: float | None = _doc("test accuracy of the best closing worker's own final replica")
    worst_replica_accuracy: float | None = _doc("test accuracy of the worst closing worker's own final replica")
    worst_replica_loss: float | None = _doc("the highest mean test cross-entropy loss of a closing worker's own "
                                            "final replica (null if not finite)")
    mean_compute_s: list[float] = _doc_list("per worker: mean compute time per iteration after warm-up, s")
    mean_comm_s: list[float] = _doc_list("per worker: mean communication time per iteration, s")
    mean_wait_s: list[float] = _doc_list("per worker: mean time per iteration waiting for others, s")
    worker_samples_per_s: list[float] = _doc_list("per worker: its own samples per second after warm-up")
    ranks: list[int] = _doc_list("the ranks the per-worker lists describe, in order (all of them, or the survivors)")
    algorithm_stats: list[dict[str, Any]] = _doc_list(
        "per worker (one entry when simulated): the method's own counters, as `prague methods` lists them")
    failures: list[dict[str, Any]] = _doc_list(
        "workers the run lost and went on without: `{rank, step, kind}` (kind `crash` or `hang`; step: the steps it "
        "had completed); the per-worker lists and the averaged model are then the survivors'")
    completed_steps: list[int] = _doc_list("per rank: the steps it completed (a failed rank's steps before it failed)")
    diverged: dict[str, Any] | None = _doc(
        "null, or where the run diverged and stopped: `{rank, step, loss, last_finite_loss, reason}` (loss null: "
        "not finite); its accuracy is that of the broken model, and benches count it as never reaching the target")
    host: dict[str, Any] | None = _doc(
        "the machine rank 0 ran on: `{cpu, logical_cpus, cpu_features, python, torch}` (cpu_features: which of "
        f"{', '.join(f'`{f}`' for f in CPU_FEATURES)} it has; null when simulated, or in records written before "
        "this field)")
    restarts: int | None = _doc("how many times torchrun (`--max-restarts`) restarted the job, each time from its last "
                                "complete checkpoint (null: not a torchrun run of the built-in worker)")
    simulated: bool = _doc("true for `prague simulate`", False)
    sim: dict[str, Any] | None = _doc("simulated runs: nodes, cluster, event count, simulator run time")

    def __post_init__(self) -> None:
        for key in ("algorithm", "scenario"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                raise ConfigError(f"a run record has {key}={getattr(self, key)!r}; it must be a non-empty string")
        thr = self.throughput_samples_per_s
        if isinstance(thr, bool) or not isinstance(thr, (int, float)) or not math.isfinite(thr):
            raise ConfigError(f"a run record has throughput_samples_per_s={thr!r}; it must be a number (and finite)")

    @property
    def label(self) -> str:
        """``NAME`` or ``NAME:VARIANT``."""
        return method_label_of(self.algorithm, self.variant)

    def to_dict(self) -> dict[str, Any]:
        """The record's JSON form: what :func:`dataclasses.asdict` returns, a copy that shares nothing mutable with
        the record, made without its deep copy of every number (:func:`_json_copy`)."""
        return {f.name: _json_copy(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: object, source: str = "run record") -> RunRecord:
        """Read a record from its JSON form; raises ConfigError naming ``source`` and the problem."""
        if isinstance(data, RunRecord):
            return data
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source} is a {type(data).__name__} ({data!r:.80}), not a JSON object")
        version = data.get("schema_version", 1)
        if not isinstance(version, int) or version > SCHEMA_VERSION:
            raise ConfigError(f"{source} has schema_version {version!r}; this prague reads versions 1 to "
                              f"{SCHEMA_VERSION}: upgrade prague or re-run the benchmark")
        missing = [k for k in REQUIRED_KEYS if k not in data]
        if missing:
            raise ConfigError(f"{source} lacks required key(s) {', '.join(repr(k) for k in missing)}; every "
                              f"record needs {', '.join(REQUIRED_KEYS)}")
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["schema_version"] = SCHEMA_VERSION
        try:
            return cls(**values)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None

    @classmethod
    def from_timings(cls, timings: Sequence[WorkerTiming], *, batch_size: int, warmup: int,
                     **fields: Any) -> RunRecord:
        """A record whose throughput, no-wait limit and per-worker means come from ``timings``
        (every worker's log); ``fields`` gives the rest."""
        thr = throughput(timings, batch_size, warmup)
        nominal = nominal_compute_s(fields.get("compute_mode"), fields.get("compute_ms"))
        base_s = base_compute_s(timings, warmup, nominal)
        limit = no_wait_limit(timings, batch_size, warmup, nominal, base_s)
        return cls(
            throughput_samples_per_s=thr, no_wait_limit_samples_per_s=limit,
            fraction_of_limit=thr / limit if limit > 0 else None, batch_size=batch_size, warmup_steps=warmup,
            base_compute_s=base_s, mean_slowdown=mean_slowdowns(timings, warmup),
            mean_compute_s=[mean_after(t.compute_s, warmup) for t in timings],
            mean_comm_s=[mean_after(t.comm_s, warmup) for t in timings],
            mean_wait_s=[mean_after(t.wait_s, warmup) for t in timings],
            worker_samples_per_s=[worker_rate(t, batch_size, warmup) for t in timings],
            **fields,
        )


#: Keys a record read from a file must carry; all others are optional.
REQUIRED_KEYS: tuple[str, ...] = ("algorithm", "scenario", "throughput_samples_per_s")


def fields_markdown() -> str:
    """The README's table of record fields."""
    rows = ["| field | meaning |", "| --- | --- |"]
    rows += [f"| `{f.name}` | {f.metadata['doc']} |" for f in dataclasses.fields(RunRecord)]
    return "\n".join(rows)
