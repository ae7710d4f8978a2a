"""Run one simulated job, or a benchmark of many, and describe it with the runtime's record fields.

:func:`simulate` is the simulated ``prague run``: it builds a :class:`~prague.sim.world.World`, starts
the method's worker processes, runs the engine to the end and returns the run record (:class:`~prague.metrics.record.RunRecord`) with the fields of the
runtime's ``summary.json`` (:func:`prague.train.loop.train`), computed by the same functions
(:mod:`prague.metrics.summary`), plus ``"simulated": true`` and a ``"sim"`` block (cluster, event count,
simulator run time). :func:`simulate_bench` is the simulated ``prague bench``: every (method, scenario)
pair, then :func:`prague.metrics.report.write_bench`, so the files are the same as a real benchmark's.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from prague.algorithms.registry import parse_method
from prague.errors import ConfigError, unknown_choice
from prague.groups.api import Topology
from prague.hetero.spec import parse_scenario
from prague.metrics.record import RunRecord
from prague.metrics.summary import warmup_steps
from prague.net.hosts import parse_rate
from prague.net.traffic import CrossTraffic, parse_cross_traffic
from prague.sim.cluster import PAPER, Cluster, Link
from prague.sim.math import MATH_MODES, MathConfig, make_math
from prague.sim.world import World
from prague.workload.budget import EqualShares, parse_budget
from prague.workload.catalog import dataset_info


def model_size(model: str, data: str) -> tuple[int, int]:
    """``(parameters, bytes of the flat state P-Reduce moves)`` of ``model`` on ``data`` (cached)."""
    parameters, state_bytes, _ = _model_facts(model, data)
    return parameters, state_bytes


def gradient_sizes(model: str, data: str) -> tuple[int, ...]:
    """The bytes of ``model``'s gradients on ``data`` in the order backward produces them (the reverse of
    ``parameters()``, as DDP's buckets are filled), cached."""
    return _model_facts(model, data)[2]


@lru_cache(maxsize=None)
def _model_facts(model: str, data: str) -> tuple[int, int, tuple[int, ...]]:
    from prague.workload.models import build_model, parameter_count, state_elements

    info = dataset_info(data)
    module = build_model(model, info.input_shape, info.num_classes)
    gradients = tuple(4 * p.numel() for p in reversed(list(module.parameters())) if p.requires_grad)
    return parameter_count(module), 4 * state_elements(module), gradients


@dataclass(frozen=True)
class SimConfig:
    """One simulated run: what ``prague simulate`` reads from its flags for one (method, scenario).

    ``algorithm`` may carry a variant (``prague:smart``); ``options`` holds method options by their
    runtime names (``group_size``, ``window_ms``...). ``nodes`` splits ``nproc`` workers into equal
    nodes. ``compute_s`` overrides the cluster's nominal compute time when given. ``trace`` records
    every Group Generator call (tests). ``decisions``: a folder to write every simulated worker's
    decision log to (``rankR.jsonl``) and the services' traces, as a real run with ``--log-decisions``
    does (:mod:`prague.metrics.decisions`). Emulated hosts (``prague simulate --hosts H``, with ``nodes``
    = H): ``link_rate`` (``--link-rate``, like ``1gbit``) replaces the cluster's inter-node bandwidth,
    and ``cross_traffic`` (``--cross-traffic bursts:P:MB``) loads every node's link with the runtime's
    seeded bursts (:mod:`prague.sim.traffic`, seeded by ``seed``).
    """

    algorithm: str = "allreduce"
    scenario: str = "homogeneous"
    nproc: int = 16
    nodes: int = 1
    steps: int = 200
    batch_size: int = 32
    model: str = "resnet18"
    data: str = "digits"
    data_dir: Path | None = None
    seed: int = 0
    warmup_steps: int | None = None
    cluster: Cluster = PAPER
    compute_s: float | None = None
    options: dict[str, Any] = field(default_factory=dict)
    math: str = "none"
    lr: float = 0.05
    momentum: float = 0.9
    eval_every_s: float | None = None
    target_accuracy: float | None = None
    trace: bool = False
    decisions: Path | None = None
    link_rate: str | None = None
    cross_traffic: str | None = None
    budget: str | None = None

    def __post_init__(self) -> None:
        method, variant = parse_method(self.algorithm)
        method.check_job(method.make_options(self.options, variant), self.nproc)
        if self.budget is not None:
            kind = parse_budget(self.budget).kind
            if kind == "seconds":
                raise ConfigError(f"--budget {self.budget} is not modelled by the simulator; give epochs:E or "
                                  "samples:N (a time budget stops lockstep methods by agreement, which it does "
                                  "not model)")
        if self.nproc < 1:
            raise ConfigError(f"--nproc must be >= 1, got {self.nproc}")
        if self.nodes < 1 or self.nproc % self.nodes:
            raise ConfigError(f"--nproc {self.nproc} is not a multiple of --nodes {self.nodes}; "
                              f"use a divisor of {self.nproc}")
        if self.steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {self.steps}")
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.math not in MATH_MODES:
            raise unknown_choice("math mode", self.math, MATH_MODES)
        if self.compute_s is not None and not self.compute_s >= 0:
            raise ConfigError(f"--compute-ms must be >= 0, got {self.compute_s * 1e3}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ConfigError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if self.link_rate is not None:
            parse_rate(self.link_rate)
        if self.cross_traffic is not None:
            parse_cross_traffic(self.cross_traffic)
        scenario = parse_scenario(self.scenario)
        scenario.check_world(self.nproc)
        if scenario.faults:
            raise ConfigError(f"scenario {self.scenario!r} crashes or freezes a worker; the simulator models slowdowns "
                              "only (homogeneous, paper:X, straggler:RANK:X): drop the crash and hang terms")

    @property
    def topology(self) -> Topology:
        return Topology(self.nodes, self.nproc // self.nodes)

    def shares(self, options: Any) -> tuple[str | None, int, int | None]:
        """(shares, steps, claimed) under the job-wide budget: ``equal`` with each worker's
        ``total // nproc`` steps for a method that needs every rank in every step, ``claimed`` with the
        budget's batches for the others (``steps``: the compute-time draws made at once, about one
        worker's share); without a budget (None, ``steps``, None)."""
        if self.budget is None:
            return None, self.steps, None
        total = parse_budget(self.budget).total_batches(dataset_info(self.data).train_samples, self.batch_size)
        assert total is not None  # epochs or samples: a time budget is refused above
        if options.equal_shares():
            steps = EqualShares(0, self.nproc, total).steps
            assert steps is not None
            return "equal", steps, None
        return "claimed", -(-total // self.nproc), total

    @property
    def effective_cluster(self) -> Cluster:
        """The cluster with ``compute_s`` and the emulated hosts' ``link_rate`` (inter-node bandwidth, bits
        per second / 8) applied; the intra-node link stays the cluster's (a host's loopback)."""
        inter = None
        if self.link_rate is not None:
            inter = Link(self.cluster.inter.latency_s, parse_rate(self.link_rate) / 8.0)
        return self.cluster.replace_fields(compute_s=self.compute_s, inter=inter)

    @property
    def traffic(self) -> CrossTraffic | None:
        return None if self.cross_traffic is None else parse_cross_traffic(self.cross_traffic)


def build(config: SimConfig, trace: list[tuple[Any, ...]] | None = None) -> tuple[World, Any]:
    """The world and the method object of ``config``, ready to :meth:`~prague.sim.method.SimMethod.start`;
    the caller closes the world (:meth:`~prague.sim.world.World.close`) if it logs decisions."""
    method, variant = parse_method(config.algorithm)
    options = method.make_options({**config.options, "nodes": config.nodes}, variant, seed=config.seed)
    cluster = config.effective_cluster
    _, state_bytes = model_size(config.model, config.data)
    shares, steps, claimed = config.shares(options)
    math = make_math(config.math, config.nproc, steps, MathConfig(
        model=config.model, data=config.data, data_dir=config.data_dir, batch_size=config.batch_size, lr=config.lr,
        momentum=config.momentum, seed=config.seed, eval_every_s=config.eval_every_s,
        target_accuracy=config.target_accuracy,
    ))
    world = World(cluster=cluster, topology=config.topology,
                  scenario=parse_scenario(config.scenario, seed=config.seed), steps=steps,
                  state_bytes=state_bytes, seed=config.seed, math=math, trace=trace, decisions=config.decisions,
                  cross_traffic=config.traffic, gradient_bytes=gradient_sizes(config.model, config.data),
                  claimed=claimed)
    if shares == "equal":  # rank r's k-th batch is r + k n, as the runtime's EqualShares
        math.use_global_batches(lambda w, k: w + k * config.nproc)
    elif shares == "claimed":
        math.use_global_batches(lambda w, k: world.batch_index[w][k])
    try:
        return world, method.sim_class()(world, options)
    except BaseException:
        world.close()
        raise


def simulate(config: SimConfig) -> RunRecord:
    """Simulate ``config`` to the end; return its record (the runtime's summary fields, simulated)."""
    started = time.perf_counter()
    trace: list[tuple[Any, ...]] | None = [] if config.trace else None
    threads = torch.get_num_threads()
    if config.math == "real":
        # Thousands of tiny tensor operations, one worker at a time: intra-op threads only add
        # synchronisation (measured 20x slower with 2 threads on a busy 2-core machine).
        torch.set_num_threads(1)
    try:
        world, method = build(config, trace)
        with contextlib.closing(world):
            method.start()
            world.engine.run()
            method.check_done()
        run_s = time.perf_counter() - started
        return _record(config, world, method, run_s, trace)
    finally:
        torch.set_num_threads(threads)


def _record(config: SimConfig, world: World, method: Any, run_s: float,
            trace: list[tuple[Any, ...]] | None) -> RunRecord:
    ran = max((len(ends) for ends in world.end_s), default=0)  # under a budget: the most any worker ran
    warmup = warmup_steps(ran, config.warmup_steps)
    parameters, state_bytes = model_size(config.model, config.data)
    results = world.math.results()
    cluster = world.cluster
    worker_samples = [len(ends) * config.batch_size for ends in world.end_s]
    spec, _ = parse_method(config.algorithm)
    stats = method.stats()
    sim: dict[str, Any] = {
        "nodes": config.nodes,
        "workers_per_node": config.nproc // config.nodes,
        "state_bytes": state_bytes,
        "cluster": cluster.describe(),
        "math": config.math,
        "events": world.engine.events,
        "run_s": run_s,
        "groups": world.groups_run,  # ring all-reduces and P-Reduces run (all members at once)
        "max_link_sharing": world.fabric.max_share_denominator,
        "link_rate": config.link_rate,
        "cross_traffic": None if world.bursts is None else world.bursts.report(),
    }
    if trace is not None:
        sim["trace"] = trace
    return RunRecord.from_timings(
        world.timings(), batch_size=config.batch_size, warmup=warmup,
        algorithm=spec.name, variant=spec.variant_of(method.options), nproc=config.nproc,
        compute_mode="real" if world.math.enabled else "emulated", compute_ms=cluster.compute_s * 1e3,
        scenario=world.scenario.text, model=config.model, parameters=parameters, data=config.data,
        steps=ran, seed=config.seed, backend="sim",
        budget=None if config.budget is None else parse_budget(config.budget).text,
        shares=config.shares(method.options)[0],
        wall_s=max((e[-1] for e in world.end_s if e), default=0.0),
        job_s=max((e[-1] for e in world.end_s if e), default=0.0),  # the clock starts at 0 for every worker
        samples=sum(worker_samples), worker_samples=worker_samples,
        test_accuracy=results["test_accuracy"], target_accuracy=config.target_accuracy,
        time_to_target_s=results["time_to_target_s"], eval_history=results["eval_history"],
        consensus_distance=results["consensus_distance"], algorithm_stats=[stats], simulated=True, sim=sim,
    )


def simulate_bench(configs: list[SimConfig], out: Path | None = None, *, command: str | None = None,
                   echo: Any = None) -> list[RunRecord]:
    """Simulate every config (the CLI builds one per (method, scenario)); write the bench files to ``out``."""
    from prague.metrics.report import write_bench

    records = []
    for config in configs:
        record = simulate(config)
        records.append(record)
        if echo is not None:
            echo(record)
    if out is not None and records:
        write_bench(Path(out), records, command=command)
    return records
