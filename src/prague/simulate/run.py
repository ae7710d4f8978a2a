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
import dataclasses
import gc
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from prague import BUILD
from prague.algorithms.spec import Method
from prague.errors import ConfigError, unknown_choice
from prague.groups.api import Topology
from prague.hetero.spec import parse_scenario
from prague.metrics.record import RunRecord
from prague.metrics.summary import warmup_steps
from prague.net.hosts import DEFAULT_LINK_RATE, parse_rate
from prague.net.traffic import CrossTraffic, parse_cross_traffic
from prague.sim.cluster import PAPER, Cluster, Link
from prague.sim.math import MATH_MODES, MathConfig, make_math
from prague.sim.restarts import charge as restarts_charge
from prague.sim.world import World
from prague.simulate.memory import allocator
from prague.train.config import RunConfig
from prague.workload.budget import EqualShares, parse_budget
from prague.workload.catalog import dataset_info, epoch_steps, steps_per_epoch


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


#: The steps per worker of a simulation given neither --steps, --epochs nor --budget.
DEFAULT_STEPS = 200

@dataclass(frozen=True)
class SimConfig:
    """One simulated run: a run's job description (:class:`~prague.train.config.RunConfig`, the one
    ``prague run`` resolves and its workers read) plus the cluster it is simulated on.

    ``nodes`` splits ``run.nproc`` workers into equal nodes (``--hosts`` when given: then they must be
    equal); ``run.compute_ms``, when given, replaces the cluster's nominal compute time. ``math``:
    ``none`` times the run, ``real`` also trains the model. ``trace`` records every Group Generator call
    (tests). ``decisions``: a folder to write every simulated worker's decision log to (``rankR.jsonl``)
    and the services' traces, as a real run with ``--log-decisions`` does
    (:mod:`prague.metrics.decisions`). Emulated hosts (``run.hosts``): ``run.link_rate`` (default
    ``1gbit``) replaces the cluster's inter-node bandwidth, and ``run.cross_traffic`` loads every node's
    link with the runtime's seeded bursts (:mod:`prague.sim.traffic`, seeded by ``run.seed``).
    """

    run: RunConfig
    cluster: Cluster = PAPER
    nodes: int = 1
    math: str = "none"
    trace: bool = False
    decisions: Path | None = None

    @classmethod
    def of(cls, **settings: Any) -> SimConfig:
        """A simulation from flat settings: :class:`SimConfig`'s own fields, every other name a field of
        the run (``algorithm``, ``nproc``, ``steps``, ``options``...)."""
        sim = {f.name: settings.pop(f.name) for f in dataclasses.fields(cls) if f.name in settings and f.name != "run"}
        return cls(RunConfig(**settings), **sim)

    def __post_init__(self) -> None:
        run = self.run
        if run.budget is not None and parse_budget(run.budget).kind == "seconds":
            raise ConfigError(f"--budget {run.budget} is not modelled by the simulator; give epochs:E or "
                              "samples:N (a time budget stops lockstep methods by agreement, which it does "
                              "not model)")
        if self.nodes < 1 or run.nproc % self.nodes:
            raise ConfigError(f"--nproc {run.nproc} is not a multiple of --nodes {self.nodes}; "
                              f"use a divisor of {run.nproc}")
        if run.hosts is not None and run.hosts != self.nodes:
            raise ConfigError(f"--nodes {self.nodes} differs from --hosts {run.hosts}; with emulated hosts the nodes "
                              "are the hosts: drop --nodes")
        if self.math not in MATH_MODES:
            raise unknown_choice("math mode", self.math, MATH_MODES)
        if self.math == "real" and self.charged_restarts:
            raise ConfigError(f"{self.method.name} restarts from its last checkpoint after a failure, which the "
                              "simulator charges as time, not as a training curve: drop --math real, or the "
                              "failure terms")
        if self.math == "real":
            run.check_data_source()
        if parse_scenario(run.scenario).has_faults and self.method.survives_failures and \
                not self.method.sim_class(self.method.variant_of(self.options)).models_failures:
            from prague.algorithms.registry import METHODS

            modelled = sorted(m.name for m in METHODS.values() if m.sim_class().models_failures)
            raise ConfigError(f"scenario {run.scenario!r} crashes or freezes a worker: {self.method.name} goes on "
                              f"without it at run time, and the simulator plays that out for "
                              f"{', '.join(modelled)} only so far; drop the crash, hang and failures terms for "
                              f"{self.method.name}")
        self.method.check_job(self.options, run.nproc)

    @property
    def method(self) -> Method:
        return self.run.method

    @property
    def charged_restarts(self) -> bool:
        """Failures of a method that cannot go on without a worker: restarts from the last checkpoint,
        charged on the run without them (:mod:`prague.sim.restarts`)."""
        return parse_scenario(self.run.scenario).has_faults and not self.method.survives_failures

    @property
    def options(self) -> Any:
        """The method's options as the simulation runs them: the run's, seeds resolved, on ``nodes`` nodes
        (a method with a ``nodes`` option follows the simulated topology)."""
        options = self.run.seeded_options
        if any(o.name == "nodes" for o in self.method.option_infos):
            options = dataclasses.replace(options, nodes=self.nodes)
        return options

    @property
    def steps(self) -> int:
        """Each worker's steps: ``--steps``, ``--epochs`` passes over its shard, else DEFAULT_STEPS (under a
        job-wide budget, :meth:`shares` decides)."""
        run = self.run
        if run.steps is not None:
            return run.steps
        if run.epochs is None:
            return DEFAULT_STEPS
        per_epoch = steps_per_epoch(dataset_info(run.data).train_samples, run.nproc, run.batch_size)
        return epoch_steps(run.epochs, per_epoch)

    @property
    def topology(self) -> Topology:
        return Topology(self.nodes, self.run.nproc // self.nodes)

    @property
    def link_rate(self) -> str | None:
        """The emulated hosts' link rate (``--link-rate``, default 1gbit), None without ``--hosts``."""
        return None if self.run.hosts is None else self.run.link_rate or DEFAULT_LINK_RATE

    def shares(self, options: Any) -> tuple[str | None, int, int | None]:
        """(shares, steps, claimed) under the job-wide budget: ``equal`` with each worker's
        ``total // nproc`` steps for a method that needs every rank in every step, ``claimed`` with the
        budget's batches for the others (``steps``: the compute-time draws made at once, about one
        worker's share); without a budget (None, ``steps``, None)."""
        run = self.run
        if run.budget is None:
            return None, self.steps, None
        total = parse_budget(run.budget).total_batches(dataset_info(run.data).train_samples, run.batch_size)
        assert total is not None  # epochs or samples: a time budget is refused above
        if options.equal_shares():
            steps = EqualShares(0, run.nproc, total).steps
            assert steps is not None
            return "equal", steps, None
        return "claimed", -(-total // run.nproc), total

    @property
    def effective_cluster(self) -> Cluster:
        """The cluster with ``run.compute_ms`` and the emulated hosts' link rate (inter-node bandwidth, bits
        per second / 8) applied; the intra-node link stays the cluster's (a host's loopback)."""
        inter = None
        if self.link_rate is not None:
            inter = Link(self.cluster.inter.latency_s, parse_rate(self.link_rate) / 8.0)
        compute_s = None if self.run.compute_ms is None else self.run.compute_ms / 1e3
        return self.cluster.replace_fields(compute_s=compute_s, inter=inter)

    @property
    def traffic(self) -> CrossTraffic | None:
        return None if self.run.cross_traffic is None else parse_cross_traffic(self.run.cross_traffic)


def build(config: SimConfig, trace: list[tuple[Any, ...]] | None = None) -> tuple[World, Any]:
    """The world and the method object of ``config``, ready to :meth:`~prague.sim.method.SimMethod.start`;
    the caller closes the world (:meth:`~prague.sim.world.World.close`) if it logs decisions."""
    run, options = config.run, config.options
    cluster = config.effective_cluster
    _, state_bytes = model_size(run.model, run.data)
    shares, steps, claimed = config.shares(options)
    math = make_math(config.math, run.nproc, steps, MathConfig(
        model=run.model, data=run.data, data_dir=run.data_dir, batch_size=run.batch_size, lr=run.lr,
        momentum=run.momentum, seed=run.seed, eval_every_s=run.eval_every_s, target_accuracy=run.target_accuracy,
        target_loss=run.target_loss,
    ))
    scenario = parse_scenario(run.scenario, seed=run.seed)
    if config.charged_restarts:  # run without its failures; they are charged afterwards (restarts.charge)
        scenario = scenario.without_failures()
    world = World(cluster=cluster, topology=config.topology, scenario=scenario, steps=steps,
                  state_bytes=state_bytes, seed=run.seed, math=math, trace=trace, decisions=config.decisions,
                  cross_traffic=config.traffic, gradient_bytes=gradient_sizes(run.model, run.data),
                  claimed=claimed, lease_s=run.lease_s)
    if shares == "equal":  # rank r's k-th batch is r + k n, as the runtime's EqualShares
        math.use_global_batches(lambda w, k: w + k * run.nproc)
    elif shares == "claimed":
        math.use_global_batches(lambda w, k: world.batch_index[w][k])
    try:
        return world, config.method.sim_class(config.method.variant_of(options))(world, options)
    except BaseException:
        world.close()
        raise


@contextlib.contextmanager
def _no_collection() -> Iterator[None]:
    """The cycle collector off while a run is built, runs and is recorded. A run makes millions of short-lived
    containers and few cycles, while its live ones (a generator, a deque, a log per worker) grow with the number
    of workers: each collection of the oldest generation walks them all, so with the collector on, an
    iteration's cost grew with the job's size (measured: 16,384 workers spent a fifth of their time there), and
    building a 65,536-worker world, which allocates them, took 3.7 s with it on and 2.0 s off (compiled). Whatever
    cycles the run left are collected once it is back on."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def simulate(config: SimConfig) -> RunRecord:
    """Simulate ``config`` to the end; return its record (the runtime's summary fields, simulated)."""
    return simulate_charged(config, [config.run.scenario])[0]


def simulate_charged(config: SimConfig, scenarios: list[str]) -> list[RunRecord]:
    """``config`` under each of ``scenarios``, which differ from its own in failure terms only (``crash``,
    ``hang``, ``failures``), for a method that restarts from a checkpoint after a failure: such a method is
    simulated without its failures and charged for them afterwards (:mod:`prague.sim.restarts`), so one run
    serves every scenario, each record charged for its own failures (what ``simulate`` of each would
    return, but for ``run_s``). ConfigError when a scenario differs otherwise, or when the method goes on
    after a failure (its run differs with them: simulate each)."""
    configs = [dataclasses.replace(config, run=dataclasses.replace(config.run, scenario=s)) for s in scenarios]
    if len(configs) > 1:
        # what a restarting method's run depends on: each scenario less its failure terms, and its text
        plain = {dataclasses.replace(parse_scenario(s).without_failures(), text="") for s in scenarios}
        if len(plain) > 1:
            raise ConfigError(f"scenarios {scenarios!r} differ in more than their crash, hang and failures terms; "
                              "one run serves only scenarios that share their slowdowns: simulate each")
        if config.method.survives_failures:
            raise ConfigError(f"{config.method.name} goes on after a failure, so each failure scenario is a run of "
                              "its own: simulate each")
    started = time.perf_counter()
    trace: list[tuple[Any, ...]] | None = [] if config.trace else None
    threads = torch.get_num_threads()
    if config.math == "real":
        # Thousands of tiny tensor operations, one worker at a time: intra-op threads only add
        # synchronisation (measured 20x slower with 2 threads on a busy 2-core machine).
        torch.set_num_threads(1)
    try:
        with _no_collection():  # building a large job's world and reading its logs make few cycles, too
            world, method = build(configs[0], trace)
            with contextlib.closing(world):
                method.start()
                world.engine.run()
                method.check_done()
            run_s = time.perf_counter() - started
            return [_record(c, world, method, run_s, trace) for c in configs]
    finally:
        torch.set_num_threads(threads)


def slowest_ends(ends_by_rank: list[Any], steps: int) -> list[float]:
    """At each of ``steps`` steps, the latest end among the ranks that ran it (the slowest rank's), taken in C: a
    large simulation logs millions of steps."""
    table = np.full((len(ends_by_rank), steps), -np.inf)
    for row, ends in zip(table, ends_by_rank):
        row[:len(ends)] = ends
    return [float(end) for end in table.max(axis=0)] if len(ends_by_rank) else []


def _record(config: SimConfig, world: World, method: Any, run_s: float,
            trace: list[tuple[Any, ...]] | None) -> RunRecord:
    run = config.run
    scenario = parse_scenario(run.scenario, seed=run.seed)  # the world's, with any failures it was run without
    ran = max((len(ends) for ends in world.end_s), default=0)  # under a budget: the most any worker ran
    failures = [f.summary() for f in world.declared.values()]
    restarts, extra_s = None, 0.0
    if config.charged_restarts:
        ends = slowest_ends(world.end_s, ran)
        charged = restarts_charge(ends, scenario, run.nproc, world.cluster.restart_s, run.lease_s,
                                  run.checkpoint_every)
        failures, restarts, extra_s = [f.summary() for f in charged.failures], charged.restarts, charged.extra_s
    warmup = warmup_steps(ran, run.warmup_steps)
    parameters, state_bytes = model_size(run.model, run.data)
    results = world.math.results()
    cluster = world.cluster
    worker_samples = [len(ends) * run.batch_size for ends in world.end_s]
    spec = config.method
    stats = method.stats()
    sim: dict[str, Any] = {
        "nodes": config.nodes,
        "workers_per_node": run.nproc // config.nodes,
        "state_bytes": state_bytes,
        "cluster": cluster.describe(),
        "math": config.math,
        "events": world.engine.events,
        "run_s": run_s,
        "build": BUILD,  # what ran the simulation (``run_s`` depends on it, the records do not)
        "allocator": allocator(),  # likewise (prague.simulate.memory)
        "groups": world.groups_run,  # ring all-reduces and P-Reduces run (all members at once)
        "max_link_sharing": world.fabric.max_share_denominator,
        "link_rate": config.link_rate,
        "cross_traffic": None if world.bursts is None else world.bursts.report(),
    }
    if trace is not None:
        sim["trace"] = trace
    return RunRecord.from_timings(
        world.timings(), batch_size=run.batch_size, warmup=warmup,
        algorithm=spec.name, variant=spec.variant_of(method.options), nproc=run.nproc,
        compute_mode="real" if config.math == "real" else "emulated", compute_ms=cluster.compute_s * 1e3,
        scenario=scenario.text, model=run.model, parameters=parameters, data=run.data,
        steps=ran, seed=run.seed, backend="sim", lr=run.lr, optimizer=run.optimizer,
        budget=None if run.budget is None else parse_budget(run.budget).text,
        shares=config.shares(method.options)[0],
        wall_s=max((e[-1] for e in world.end_s if e), default=0.0) + extra_s,
        job_s=max((e[-1] for e in world.end_s if e), default=0.0) + extra_s,  # the clock starts at 0 for every worker
        samples=sum(worker_samples), worker_samples=worker_samples,
        target_accuracy=run.target_accuracy, target_loss=run.target_loss, **results,
        algorithm_stats=[stats], simulated=True, sim=sim,
        failures=failures, restarts=restarts,
        completed_steps=[len(ends) for ends in world.end_s],
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
