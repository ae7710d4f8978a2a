"""The built-in worker: what every process of ``prague run`` (or of torchrun) executes.

One short, linear function (:func:`train`) over the public :class:`DistributedTrainer` API; it never
branches on the method's name. Each rank writes ``metrics/rankR.jsonl`` (and, with ``--log-decisions``,
``decisions/rankR.jsonl``: :mod:`prague.metrics.decisions`); rank 0 writes ``summary.json`` at the end.
"""

from __future__ import annotations

import copy
import json
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from prague.comm.flat import flatten, state_tensors, unflatten_into
from prague.hetero.spec import parse_scenario
from prague.io import atomic_write_json
from prague.metrics.decisions import DECISIONS_DIR, DecisionLog
from prague.metrics.record import RunRecord
from prague.metrics.summary import WorkerTiming, warmup_steps
from prague.metrics.timeline import write_timeline
from prague.runtime.context import DistContext
from prague.runtime.liveness import PROGRESS_KEY
from prague.train import checkpoint
from prague.train.closing import Closing, closing_ranks
from prague.train.config import RunConfig
from prague.train.trainer import DistributedTrainer, StepRecord
from prague.workload.catalog import dataset_info, epoch_steps, steps_per_epoch
from prague.workload.data import Dataset, ShardLoader, load_dataset
from prague.workload.emulate import EmulatedCompute
from prague.workload.models import build_model, parameter_count



class TrainClock:
    """Wall time since the start of training (plus ``offset_s``, the time a resumed run had already
    trained), paused while the averaged model is evaluated."""

    def __init__(self, offset_s: float = 0.0) -> None:
        self._start = time.perf_counter() - offset_s
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


class SnapshotLog:
    """Copies of this rank's model state at evaluation points, evaluated after training.

    Evaluating the average of all replicas mid-run would need a collective that every rank reaches at
    the same step, which decentralised methods (whose ranks drift apart by design) cannot offer without
    stalling or deadlocking. Instead each rank keeps its state at step k with its own training-clock
    time; afterwards the states are averaged rank-wise and scored, and step k's wall time is the latest
    rank's time to reach it.
    """

    def __init__(self) -> None:
        self.entries: list[tuple[int, float, torch.Tensor]] = []

    def take(self, model: nn.Module, step: int, wall_s: float) -> None:
        # Kept on the host: a CUDA model's snapshots would otherwise hold device memory until the end.
        self.entries.append((step, wall_s, flatten(state_tensors(model)).to("cpu", copy=True)))

    def evaluate(self, model: nn.Module, data: Dataset, closing: Closing) -> list[dict[str, float]]:
        """Score the rank-wise average of every snapshot (over the closing ranks) taken by every
        closing rank. Collective."""
        history: list[dict[str, float]] = []
        probe = copy.deepcopy(model)
        for step, wall_s, snapshot in self.entries:  # every closing rank ran every step: the same snapshots
            flat = snapshot.to(closing.ctx.device)  # the backend's device (NCCL: the GPU)
            closing.all_reduce(flat)
            flat /= closing.size
            unflatten_into(flat, state_tensors(probe))
            history.append({"wall_s": max(closing.all_gather_floats(wall_s)), "step": step,
                            "accuracy": evaluate(probe, data, closing)})
        self.entries.clear()
        return history


@torch.no_grad()
def evaluate(model: nn.Module, data: Dataset, closing: Closing, batch_size: int = 1000) -> float:
    """Test accuracy of ``model`` (the same on every closing rank); each scores a slice, counts are summed.
    Collective."""
    model.eval()
    ctx = closing.ctx
    n = len(data.test_y)
    index, size = closing.ranks.index(ctx.rank), closing.size
    lo, hi = n * index // size, n * (index + 1) // size
    correct = 0
    for i in range(lo, hi, batch_size):
        x = data.test_x[i : min(i + batch_size, hi)].to(ctx.device)
        y = data.test_y[i : min(i + batch_size, hi)].to(ctx.device)
        correct += int((model(x).argmax(dim=1) == y).sum())
    counts = torch.tensor([correct], dtype=torch.float64, device=ctx.device)
    closing.all_reduce(counts)
    return float(counts.item()) / n


def total_steps(cfg: RunConfig, per_epoch: int) -> int:
    if cfg.steps is not None:
        return cfg.steps
    return epoch_steps(cfg.epochs or 1.0, per_epoch)


def build(cfg: RunConfig, input_shape: tuple[int, int, int], num_classes: int,
          ctx: DistContext) -> tuple[nn.Module, torch.optim.Optimizer | None, int]:
    """The model (identical on every rank), its optimizer (None under emulated compute) and its size."""
    torch.manual_seed(cfg.seed)  # identical initial replicas on every rank
    model: nn.Module = build_model(cfg.model, input_shape, num_classes)
    n_params = parameter_count(model)
    torch.manual_seed(cfg.seed * 1000 + ctx.rank + 1)  # independent dropout per rank
    if cfg.emulated:
        return EmulatedCompute(model, cfg.compute_ms), None, n_params
    return model, torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum), n_params


@dataclass
class Training:
    """What the steps of one rank left behind."""

    records: list[StepRecord]
    snapshots: SnapshotLog
    wall_s: float


def save_checkpoint(cfg: RunConfig, ctx: DistContext, trainer: DistributedTrainer, training: Training,
                    wall_s: float) -> None:
    """Write this rank's file of the checkpoint at ``trainer.steps_done`` (:mod:`prague.train.checkpoint`)."""
    state = checkpoint.WorkerState(
        step=trainer.steps_done, model=trainer.model.state_dict(),
        optimizer=trainer.optimizer.state_dict() if trainer.optimizer is not None else None,
        trainer=trainer.state_dict(), records=[r.as_dict() for r in training.records],
        snapshots=list(training.snapshots.entries), wall_s=wall_s, rng=checkpoint.rng_state(),
    )
    checkpoint.write(Path(cfg.out), ctx.rank, ctx.world_size, state)


def run_steps(cfg: RunConfig, ctx: DistContext, trainer: DistributedTrainer, loader: ShardLoader | None,
              steps: int, resumed: checkpoint.WorkerState | None = None) -> Training:
    """Run this rank's ``steps`` iterations (those after the ``resumed`` checkpoint's step), logging each
    to ``OUT/metrics/rankR.jsonl``, publishing progress and writing a checkpoint every
    ``--checkpoint-every`` steps; then close the method (draining its pending group operations, so the
    collectives that follow cannot interleave with them; after a failure only releasing)."""
    metrics_dir = Path(cfg.out) / "metrics"
    metrics_dir.mkdir(parents=True, exist_ok=True)
    eval_every = cfg.eval_every or (max(1, steps // 10) if cfg.target_accuracy is not None else None)
    training = Training([], SnapshotLog(), 0.0)
    clock = TrainClock(resumed.wall_s if resumed else 0.0)
    if resumed is not None:
        training.records = [StepRecord(**r) for r in resumed.records]
        training.snapshots.entries = list(resumed.snapshots)
    with trainer, open(metrics_dir / f"rank{ctx.rank}.jsonl", "w", buffering=1) as log:
        for rec in training.records:
            log.write(json.dumps(rec.as_dict()) + "\n")
        for step in range(trainer.steps_done, steps):
            if loader is None:  # emulated compute: no data
                rec = trainer.step(lambda m: m())
            else:
                x, y = loader.batch(step)
                x, y = x.to(ctx.device), y.to(ctx.device)
                rec = trainer.step(lambda m: F.cross_entropy(m(x), y))
            rec.t_end_s = clock.now()
            training.records.append(rec)
            log.write(json.dumps(rec.as_dict()) + "\n")
            ctx.store.set(f"{PROGRESS_KEY}{ctx.rank}", f"{step + 1},{steps},{rec.loss if rec.loss is not None else ''}")
            if not cfg.emulated and eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
                with clock.paused():
                    training.snapshots.take(trainer.model, step + 1, clock.now())
            if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 and step + 1 < steps:
                save_checkpoint(cfg, ctx, trainer, training, clock.now())
        training.wall_s = clock.now()
    return training


def evaluate_run(cfg: RunConfig, closing: Closing, trainer: DistributedTrainer, data: Dataset | None,
                 training: Training, steps: int) -> tuple[float | None, list[dict[str, float]], float | None]:
    """(final test accuracy, evaluation history, time to target) of the model averaged over the closing
    ranks; all None/empty under emulated compute (``data`` None). Collective."""
    if data is None:
        return None, [], None
    history = training.snapshots.evaluate(trainer.model, data, closing)
    final = trainer.averaged_model(closing.group)
    accuracy = evaluate(final, data, closing)
    history.append({"wall_s": max(closing.all_gather_floats(training.wall_s)), "step": steps, "accuracy": accuracy})
    if cfg.save_model and closing.is_main:
        torch.save(final.state_dict(), Path(cfg.out) / "model.pt")
    time_to_target = next(
        (h["wall_s"] for h in history if cfg.target_accuracy is not None and h["accuracy"] >= cfg.target_accuracy),
        None,
    )
    return accuracy, history, time_to_target


def train(cfg: RunConfig, ctx: DistContext) -> RunRecord | None:
    """Train ``cfg`` on this rank. Every rank calls it; rank 0 writes ``summary.json`` and returns its record."""
    data: Dataset | None = None
    loader: ShardLoader | None = None
    if cfg.emulated:  # only the data set's shape and size matter: no loading (the launcher checked the files)
        info = dataset_info(cfg.data)
        shape, classes = info.input_shape, info.num_classes
        per_epoch = steps_per_epoch(info.train_samples, ctx.world_size, cfg.batch_size)
    else:
        data = load_dataset(cfg.data, cfg.data_dir, seed=cfg.seed)
        loader = ShardLoader(data.train_x, data.train_y, ctx.rank, ctx.world_size, cfg.batch_size, cfg.seed)
        shape, classes, per_epoch = data.input_shape, data.num_classes, loader.steps_per_epoch
    steps = total_steps(cfg, per_epoch)
    scenario = parse_scenario(cfg.scenario, seed=cfg.seed)
    model, optimizer, n_params = build(cfg, shape, classes, ctx)
    resumed = None
    if cfg.resume:  # before the method's setup, which may publish rank 0's model (DDP, parameter servers)
        resumed = checkpoint.read(Path(cfg.out), checkpoint.resume_step(Path(cfg.out), ctx.world_size), ctx.rank)
        model.load_state_dict(resumed.model)
        if optimizer is not None and resumed.optimizer is not None:
            optimizer.load_state_dict(resumed.optimizer)
    decisions = DecisionLog(Path(cfg.out) / DECISIONS_DIR, ctx.rank) if cfg.log_decisions else None
    try:
        trainer = DistributedTrainer(model, optimizer, cfg.algorithm, scenario=scenario, ctx=ctx, seed=cfg.seed,
                                     decisions=decisions, stall_warn_s=cfg.stall_warn_s, **cfg.options)
        if resumed is not None:
            trainer.load_state_dict(resumed.trainer)
            checkpoint.set_rng_state(resumed.rng)
        training = run_steps(cfg, ctx, trainer, loader, steps, resumed)  # closes the method: its last groups are logged
    finally:
        if decisions is not None:
            decisions.close()
    closing = closing_ranks(ctx)
    try:
        return close_run(cfg, closing, trainer, data, training, steps, scenario.text, n_params)
    finally:
        closing.close()


def close_run(cfg: RunConfig, closing: Closing, trainer: DistributedTrainer, data: Dataset | None,
              training: Training, steps: int, scenario: str, n_params: int) -> RunRecord | None:
    """Evaluate, gather and (on the closing ranks' first) write ``summary.json``. Collective over the
    closing ranks."""
    ctx = closing.ctx
    accuracy, history, time_to_target = evaluate_run(cfg, closing, trainer, data, training, steps)
    consensus = trainer.consensus_distance(closing.group)

    mine = WorkerTiming(
        end_s=[r.t_end_s for r in training.records], compute_s=[r.compute_s for r in training.records],
        comm_s=[r.comm_s for r in training.records], wait_s=[r.wait_s for r in training.records],
        slowdown=[r.slowdown for r in training.records],
    )
    gathered = closing.all_gather_object({"timing": asdict(mine), "stats": trainer.stats(), "wall_s": training.wall_s,
                                          "steps": len(training.records)})
    if not closing.is_main:
        return None
    completed = [0] * ctx.world_size
    for rank, g in zip(closing.ranks, gathered):
        completed[rank] = g["steps"]
    for rank, failure in closing.failures.items():
        completed[rank] = failure.step
    record = RunRecord.from_timings(
        [WorkerTiming(**g["timing"]) for g in gathered], batch_size=cfg.batch_size,
        warmup=warmup_steps(steps, cfg.warmup_steps),
        algorithm=trainer.method.name, variant=trainer.variant, nproc=ctx.world_size, compute_mode=cfg.compute,
        compute_ms=cfg.compute_ms if cfg.emulated else None, scenario=scenario, model=cfg.model,
        parameters=n_params, data=cfg.data, steps=steps, seed=cfg.seed, backend=ctx.backend,
        wall_s=max(g["wall_s"] for g in gathered), test_accuracy=accuracy, target_accuracy=cfg.target_accuracy,
        time_to_target_s=time_to_target, eval_history=history, consensus_distance=consensus,
        algorithm_stats=[g["stats"] for g in gathered], simulated=False,
        failures=[f.summary() for _, f in sorted(closing.failures.items())], completed_steps=completed,
        ranks=list(closing.ranks),
    )
    atomic_write_json(Path(cfg.out) / "summary.json", record.to_dict())
    if cfg.timeline:  # every rank's step records are complete: all closed their runs
        write_timeline(Path(cfg.out))
    return record
