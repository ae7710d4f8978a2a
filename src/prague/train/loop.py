"""The built-in worker: what every process of ``prague run`` (or of torchrun) executes.

One short, linear function (:func:`train`) over the public :class:`DistributedTrainer` API; it never
branches on the method's name. Rank 0 writes ``summary.json`` at the end.
"""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from prague.hetero.spec import parse_scenario
from prague.metrics.io import atomic_write_json
from prague.metrics.summary import WorkerTiming, mean_after, no_wait_limit, throughput, warmup_steps
from prague.runtime.context import DistContext
from prague.train.config import RunConfig
from prague.train.data import Dataset, ShardLoader, load_dataset
from prague.train.emulate import EmulatedCompute
from prague.train.models import build_model, parameter_count
from prague.train.trainer import DistributedTrainer, StepRecord

PROGRESS_KEY = "prague/progress/"


class TrainClock:
    """Wall time since the start of training, paused while the averaged model is evaluated."""

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._paused = 0.0

    def now(self) -> float:
        return time.perf_counter() - self._start - self._paused

    @contextmanager
    def paused(self) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self._paused += time.perf_counter() - t


@torch.no_grad()
def evaluate(model: nn.Module, data: Dataset, ctx: DistContext, batch_size: int = 1000) -> float:
    """Test accuracy of ``model`` (the same on every rank); each rank scores a slice, counts are summed.
    Collective."""
    model.eval()
    n = len(data.test_y)
    lo, hi = n * ctx.rank // ctx.world_size, n * (ctx.rank + 1) // ctx.world_size
    correct = 0
    for i in range(lo, hi, batch_size):
        x = data.test_x[i : min(i + batch_size, hi)].to(ctx.device)
        y = data.test_y[i : min(i + batch_size, hi)].to(ctx.device)
        correct += int((model(x).argmax(dim=1) == y).sum())
    counts = torch.tensor([correct], dtype=torch.float64)
    dist.all_reduce(counts)
    return float(counts.item()) / n


def total_steps(cfg: RunConfig, loader: ShardLoader) -> int:
    if cfg.steps is not None:
        return cfg.steps
    return max(1, math.ceil((cfg.epochs or 1.0) * loader.steps_per_epoch))


def train(cfg: RunConfig, ctx: DistContext) -> dict[str, Any] | None:
    """Train ``cfg`` on this rank. Every rank calls it; rank 0 returns (and writes) the summary."""
    data = load_dataset(cfg.data, cfg.data_dir, seed=cfg.seed)
    loader = ShardLoader(data.train_x, data.train_y, ctx.rank, ctx.world_size, cfg.batch_size, cfg.seed)
    steps = total_steps(cfg, loader)
    scenario = parse_scenario(cfg.scenario, seed=cfg.seed)

    torch.manual_seed(cfg.seed)  # identical initial replicas on every rank
    model: nn.Module = build_model(cfg.model, data.input_shape, data.num_classes)
    n_params = parameter_count(model)
    torch.manual_seed(cfg.seed * 1000 + ctx.rank + 1)  # independent dropout per rank
    optimizer: torch.optim.Optimizer | None
    if cfg.emulated:
        model, optimizer = EmulatedCompute(model, cfg.compute_ms), None
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    trainer = DistributedTrainer(model, optimizer, cfg.algorithm, scenario=scenario, ctx=ctx, **cfg.options)

    metrics_dir = Path(cfg.out) / "metrics"
    metrics_dir.mkdir(parents=True, exist_ok=True)
    eval_every = cfg.eval_every or (max(1, steps // 10) if cfg.target_accuracy is not None else None)
    history: list[dict[str, float]] = []
    records: list[StepRecord] = []
    clock = TrainClock()
    time_to_target: float | None = None

    def eval_now(step: int) -> float:
        nonlocal time_to_target
        with clock.paused():
            acc = evaluate(trainer.averaged_model(), data, ctx)
        history.append({"wall_s": clock.now(), "step": step, "accuracy": acc})
        if cfg.target_accuracy is not None and time_to_target is None and acc >= cfg.target_accuracy:
            time_to_target = clock.now()
        return acc

    try:
        with open(metrics_dir / f"rank{ctx.rank}.jsonl", "w", buffering=1) as log:
            for step in range(steps):
                if cfg.emulated:
                    rec = trainer.step(lambda m: m())
                else:
                    x, y = loader.batch(step)
                    x, y = x.to(ctx.device), y.to(ctx.device)
                    rec = trainer.step(lambda m: F.cross_entropy(m(x), y))
                rec.t_end_s = clock.now()
                records.append(rec)
                log.write(json.dumps(rec.as_dict()) + "\n")
                ctx.store.set(f"{PROGRESS_KEY}{ctx.rank}", f"{step + 1},{steps},{rec.loss if rec.loss is not None else ''}")
                if not cfg.emulated and eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
                    eval_now(step + 1)
        wall_s = clock.now()
    finally:
        trainer.close()

    accuracy = None if cfg.emulated else eval_now(steps)
    consensus = trainer.consensus_distance()
    if cfg.save_model and not cfg.emulated:
        averaged = trainer.averaged_model()
        if ctx.is_main:
            torch.save(averaged.state_dict(), Path(cfg.out) / "model.pt")

    warmup = warmup_steps(steps, cfg.warmup_steps)
    mine = WorkerTiming(
        end_s=[r.t_end_s for r in records], compute_s=[r.compute_s for r in records],
        comm_s=[r.comm_s for r in records], wait_s=[r.wait_s for r in records],
    )
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, {"timing": asdict(mine), "stats": trainer.stats(), "wall_s": wall_s})
    if not ctx.is_main:
        return None

    timings = [WorkerTiming(**g["timing"]) for g in gathered]
    name, _, variant = cfg.algorithm.partition(":")
    variant = variant or trainer.algorithm.variant
    thr = throughput(timings, cfg.batch_size, warmup)
    limit = no_wait_limit(timings, cfg.batch_size, warmup)
    summary: dict[str, Any] = {
        "algorithm": name,
        "variant": variant,
        "nproc": ctx.world_size,
        "compute_mode": cfg.compute,
        "compute_ms": cfg.compute_ms if cfg.emulated else None,
        "scenario": scenario.text,
        "model": cfg.model,
        "parameters": n_params,
        "data": cfg.data,
        "batch_size": cfg.batch_size,
        "steps": steps,
        "warmup_steps": warmup,
        "seed": cfg.seed,
        "backend": ctx.backend,
        "throughput_samples_per_s": thr,
        "no_wait_limit_samples_per_s": limit,
        "fraction_of_limit": thr / limit if limit > 0 else None,
        "wall_s": max(g["wall_s"] for g in gathered),
        "test_accuracy": accuracy,
        "target_accuracy": cfg.target_accuracy,
        "time_to_target_s": time_to_target,
        "eval_history": history,
        "consensus_distance": consensus,
        "mean_compute_s": [mean_after(t.compute_s, warmup) for t in timings],
        "mean_comm_s": [mean_after(t.comm_s, warmup) for t in timings],
        "mean_wait_s": [mean_after(t.wait_s, warmup) for t in timings],
        "algorithm_stats": [g["stats"] for g in gathered],
        "simulated": False,
    }
    atomic_write_json(Path(cfg.out) / "summary.json", summary)
    return summary
