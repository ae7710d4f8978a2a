"""The built-in worker: what every process of ``prague run`` (or of torchrun) executes.

One short, linear function (:func:`train`) over the public :class:`DistributedTrainer` API; it never
branches on the method's name. The experiment's injected faults, slowdowns and paced compute are its
:class:`~prague.train.harness.Harness`, hooked into the trainer's steps. Each rank writes ``metrics/rankR.jsonl`` (and, with ``--log-decisions``,
``decisions/rankR.jsonl``: :mod:`prague.metrics.decisions`); rank 0 writes ``summary.json`` at the end.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from prague.comm.flat import flatten, state_tensors
from prague.errors import ConfigError
from prague.hetero.spec import parse_scenario
from prague.io import atomic_write_json
from prague.metrics.decisions import DECISIONS_DIR, DecisionLog
from prague.metrics.record import RunRecord, host_facts
from prague.metrics.summary import WorkerTiming, warmup_steps
from prague.metrics.timeline import BACKGROUND_DIR, write_background, write_timeline
from prague.metrics.writers import Writers, parse_report_to
from prague.runtime.background import Span, spans_since
from prague.runtime.context import DistContext
from prague.runtime.liveness import PROGRESS_KEY, mark_left, progress_text, read_progress
from prague.train import checkpoint
from prague.workload.budget import EqualShares, SharedBatches, StopAgreement, parse_budget
from prague.train.closing import Closing, closing_ranks
from prague.train.config import RunConfig
from prague.train.divergence import DivergenceFlag, LossWatch, divergence_line
from prague.train.evaluator import StateFiles, stop_point, stop_requested
from prague.train.evaluation import (
    DEFAULT_EVAL_EVERY_S, MAX_POINTS, SNAPSHOT_BYTES, SnapshotLog, TrainClock, accuracy_history, finite_or_none,
    replica_scores, start_together,
)
from prague.train.harness import Harness
from prague.train.trainer import DistributedTrainer, StepRecord
from prague.workload.catalog import dataset_info, epoch_steps, steps_per_epoch
from prague.workload.data import Dataset, GlobalBatches, ShardLoader, load_dataset
from prague.workload.emulate import EmulatedCompute
from prague.workload.models import build_model, build_optimizer, parameter_count


#: Where each rank records the injected faults it fired (:class:`~prague.train.harness.Harness`).
FAULTS_DIR = "faults"


def total_steps(cfg: RunConfig, per_epoch: int) -> int:
    if cfg.steps is not None:
        return cfg.steps
    return epoch_steps(cfg.epochs or 1.0, per_epoch)


def build(cfg: RunConfig, input_shape: tuple[int, ...], num_classes: int,
          ctx: DistContext) -> tuple[nn.Module, torch.optim.Optimizer | None, int]:
    """The model (identical on every rank), its optimizer (None under emulated compute) and its size."""
    torch.manual_seed(cfg.seed)  # identical initial replicas on every rank
    model: nn.Module = build_model(cfg.model, input_shape, num_classes)
    n_params = parameter_count(model)
    torch.manual_seed(cfg.seed * 1000 + ctx.rank + 1)  # independent dropout per rank
    if cfg.emulated:
        return EmulatedCompute(model, cfg.nominal_compute_ms or 0.0), None, n_params
    return model, build_optimizer(cfg.optimizer, model, cfg.lr, cfg.momentum), n_params


def measure_compute_ms(cfg: RunConfig, steps: int = 10) -> float:
    """The median time of a real step (forward, backward, optimizer) of ``cfg``'s model on ``cfg``'s data in
    this process, ms: the nominal compute that injected slowdowns multiply under ``--compute real`` when
    ``--compute-ms`` is not given, measured once by the launcher so every method faces the same seconds."""
    import time

    data = load_dataset(cfg.data, cfg.data_dir, seed=cfg.seed)
    torch.manual_seed(cfg.seed)
    # Where the workers compute: a GPU under --device cuda (timed after its queued kernels), else the CPU.
    device = torch.device("cuda", 0) if cfg.device == "cuda" else torch.device("cpu")
    model = build_model(cfg.model, data.input_shape, data.num_classes).to(device)
    optimizer = build_optimizer(cfg.optimizer, model, cfg.lr, cfg.momentum)
    x, y = data.train_x[:cfg.batch_size].to(device), data.train_y[:cfg.batch_size].to(device)
    times = []
    for _ in range(steps + 2):  # two warm-up steps
        t0 = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    times = sorted(times[2:])
    return 1e3 * times[len(times) // 2]


@dataclass
class Training:
    """What the steps of one rank left behind."""

    records: list[StepRecord]
    snapshots: SnapshotLog
    wall_s: float


@dataclass
class Work:
    """What one rank trains on and when it stops: ``plan.next()`` gives the index of its next batch
    (None: its share is done), ``loader`` the batch of an index (None under emulated compute);
    ``seconds`` a time budget on the common clock, ``agreement`` (lockstep methods under a time budget)
    makes every rank stop at the same step. ``expected`` is the steps shown in the progress bar.
    ``watch`` and ``divergence`` (real and paced compute): this rank's divergence rule and the job-wide
    report of a divergence (:mod:`prague.train.divergence`), which stops every rank."""

    plan: Any
    loader: ShardLoader | GlobalBatches | None
    expected: int
    seconds: float | None = None
    agreement: StopAgreement | None = None
    shares: str | None = None  # "claimed" or "equal" under a job-wide budget
    stop_signal: Callable[[], bool] | None = None  # --stop-at-target: the evaluator found the target reached
    watch: LossWatch | None = None
    divergence: DivergenceFlag | None = None
    stepping: tuple[int, ...] | None = None  # the ranks still taking steps, once some left (None: all)
    cursor: int | None = None  # batches of the method's sizes from this rank's shard: the next sample's position

    def stop_before(self, completed: int, now_s: float) -> bool:
        """Whether this rank stops before its next step, having completed ``completed``."""
        must = self.seconds is not None and now_s >= self.seconds
        must = must or (self.stop_signal is not None and self.stop_signal())
        if self.agreement is not None:  # a divergence elsewhere arrives as the agreed stop: no request of its own
            return self.agreement.stop_before(completed, must or (self.divergence is not None
                                                                  and self.divergence.reported))
        return must or (self.divergence is not None and self.divergence.seen())

    def batch(self, index: int, share: tuple[int, int] | None, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The inputs and labels of step ``index`` (the plan's): the loader's batch, or, with a ``share``
        (offset, count) of the step's samples from the method, those samples: within the step's batches of
        every rank under a job-wide budget, else next in this rank's own shard."""
        assert self.loader is not None
        if share is None:
            return self.loader.batch(index)
        offset, count = share
        if isinstance(self.loader, GlobalBatches):
            first = self.plan.window_start(index) if isinstance(self.plan, EqualShares) else index
            return self.loader.samples(first * batch_size + offset, count)
        if self.cursor is None:
            self.cursor = index * batch_size
        start, self.cursor = self.cursor, self.cursor + count
        return self.loader.samples(start, count)

    def regroup(self, completed: int, ranks: tuple[int, ...]) -> None:
        """From step ``completed`` on only ``ranks`` take steps (the others left the job): under a job-wide
        budget they share the batches not taken yet (:meth:`EqualShares.regroup`)."""
        self.stepping = ranks
        if isinstance(self.plan, EqualShares):
            self.plan.regroup(completed, ranks)
            if self.plan.steps is not None:
                self.expected = max(completed, self.plan.steps)

    def observe_loss(self, step: int, loss: float | None) -> None:
        """Apply the divergence rule to this rank's loss at ``step``; report a divergence it completes."""
        if self.watch is not None and self.divergence is not None:
            found = self.watch.observe(step, loss)
            if found is not None:
                self.divergence.report(found)


class FixedSteps:
    """Steps ``start..steps-1`` of a per-worker length (``--steps``/``--epochs``): the index is the step."""

    def __init__(self, start: int, steps: int) -> None:
        self._next, self.steps = start, steps

    def next(self) -> int | None:
        if self._next >= self.steps:
            return None
        self._next += 1
        return self._next - 1


def plan_work(cfg: RunConfig, ctx: DistContext, trainer: DistributedTrainer, data: Dataset | None,
              train_samples: int, per_epoch: int) -> Work:
    """This rank's :class:`Work`: its own steps over its shard (``--steps``/``--epochs``), or its share of
    the job-wide ``--budget`` (:mod:`prague.workload.budget`). A method that needs every rank in every step
    (``equal_shares``) stops on a step all ranks agree on when a time budget or ``--stop-at-target`` ends
    the job early."""
    lockstep = trainer.algorithm.options.equal_shares()
    budget = None if cfg.budget is None else parse_budget(cfg.budget)
    seconds = None if budget is None else budget.seconds
    signal = (lambda: stop_requested(Path(cfg.out))) if cfg.stop_at_target else None
    watched = data is not None  # a loss to watch: real or paced compute
    agreement = None
    if lockstep and ctx.world_size > 1 and (seconds is not None or signal is not None or watched):
        ranks = range(ctx.world_size)
        agreement = StopAgreement(ctx.store, lambda: read_progress(ctx.store, ranks).values())
    if budget is None:
        steps = total_steps(cfg, per_epoch)
        loader = None if data is None else ShardLoader(data.train_x, data.train_y, ctx.rank, ctx.world_size,
                                                       cfg.batch_size, cfg.seed)
        work = Work(FixedSteps(trainer.steps_done, steps), loader, steps, None, agreement, stop_signal=signal)
    else:
        total = budget.total_batches(train_samples, cfg.batch_size)
        global_batches = None if data is None else GlobalBatches(data.train_x, data.train_y, cfg.batch_size, cfg.seed)
        expected = 0 if total is None else -(-total // ctx.world_size)
        if lockstep:
            work = Work(EqualShares(ctx.rank, ctx.world_size, total), global_batches, expected, seconds, agreement,
                        "equal", signal)
        else:
            work = Work(SharedBatches(ctx.store, total, ctx.world_size), global_batches, expected, seconds,
                        shares="claimed", stop_signal=signal)
    if watched:
        work.watch = LossWatch(ctx.rank, cfg.divergence_factor, cfg.divergence_window)
        work.divergence = DivergenceFlag(ctx.store)
    return work


def save_checkpoint(cfg: RunConfig, ctx: DistContext, trainer: DistributedTrainer, harness: Harness,
                    training: Training, wall_s: float) -> None:
    """Write this rank's file of the checkpoint at ``trainer.steps_done`` (:mod:`prague.train.checkpoint`)."""
    state = checkpoint.WorkerState(
        step=trainer.steps_done, model=trainer.model.state_dict(),
        optimizer=trainer.optimizer.state_dict() if trainer.optimizer is not None else None,
        trainer={**trainer.state_dict(), **harness.state_dict()}, records=[r.as_dict() for r in training.records],
        snapshots=list(training.snapshots.entries.items()), wall_s=wall_s, rng=checkpoint.rng_state(),
    )
    checkpoint.write(Path(cfg.out), ctx.rank, ctx.world_size, state)


def run_steps(cfg: RunConfig, ctx: DistContext, trainer: DistributedTrainer, harness: Harness, work: Work,
              snapshots: SnapshotLog | None, resumed: checkpoint.WorkerState | None = None) -> Training:
    """Run this rank's steps (those after the ``resumed`` checkpoint's step) until its :class:`Work` is
    done, logging each to ``OUT/metrics/rankR.jsonl``, publishing progress, keeping the model's state at
    the common clock's grid points (``snapshots``, None: no evaluation) and writing a checkpoint every
    ``--checkpoint-every`` steps; then close the method (draining its pending group operations, so the
    collectives that follow cannot interleave with them; after a failure only releasing). Every rank
    starts its clock at one agreed instant (:func:`start_together`)."""
    metrics_dir = Path(cfg.out) / "metrics"
    metrics_dir.mkdir(parents=True, exist_ok=True)
    training = Training([], snapshots or SnapshotLog(math.inf), 0.0)
    if resumed is not None:
        training.records = [StepRecord(**r) for r in resumed.records]
        training.snapshots.restore(resumed.snapshots)
    progress = f"{PROGRESS_KEY}{ctx.rank}"
    ctx.store.set(progress, progress_text(trainer.steps_done, work.expected))
    start_together(ctx.store, ctx.rank, ctx.world_size)
    clock = TrainClock(resumed.wall_s if resumed else 0.0)
    harness.clock = clock.now  # a failure rate (failures:P) fires on the job's clock
    keep = snapshots is not None
    writers = Writers(Path(cfg.out), ctx.rank, parse_report_to(cfg.report_to))  # --report-to
    with trainer, writers, open(metrics_dir / f"rank{ctx.rank}.jsonl", "w", buffering=1) as log:
        for rec in training.records:
            log.write(json.dumps(rec.as_dict()) + "\n")
            work.observe_loss(rec.step, rec.loss)  # the checkpoint's steps set the starting loss
        while True:
            now = clock.now()
            if keep:
                training.snapshots.observe(trainer.model, now)
            if work.stop_before(trainer.steps_done, now):
                break
            index = work.plan.next()
            if index is None:
                break
            share = trainer.algorithm.batch_share()  # allreduce:balanced: this rank's samples of the step
            harness.fraction = 1.0 if share is None else share[1] / cfg.batch_size
            if work.loader is None:  # emulated compute: no data
                rec = trainer.step(lambda m: m())
            else:
                x, y = work.batch(index, share, cfg.batch_size)
                x, y = x.to(ctx.device), y.to(ctx.device)
                rec = trainer.step(lambda m: F.cross_entropy(m(x), y))
            stepping = trainer.algorithm.stepping
            if stepping is not None and stepping != work.stepping:  # ranks left: share their batches
                work.regroup(trainer.steps_done, stepping)
            harness.finish_step(rec)
            rec.t_end_s = clock.now()
            if cfg.budget is not None:
                rec.batch = index
            if share is not None:
                rec.samples = share[1]
            training.records.append(rec)
            log.write(json.dumps(rec.as_dict()) + "\n")
            writers.step(rec)
            work.observe_loss(rec.step, rec.loss)
            done = trainer.steps_done
            ctx.store.set(progress, progress_text(done, max(work.expected, done), rec.loss))
            if trainer.algorithm.left:  # this rank left the job: the others go on without it
                break
            if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < work.expected:
                now = clock.now()
                if keep:  # the points passed during this step, with the state before it, go in the checkpoint
                    training.snapshots.observe(trainer.model, now)
                save_checkpoint(cfg, ctx, trainer, harness, training, now)
        if keep:
            training.snapshots.observe(trainer.model, clock.now())
    training.wall_s = clock.now()  # the method's close included: the job ends when its last group is done
    # every background thread's stages since the run started: the method's and the process's others
    write_background(metrics_dir / BACKGROUND_DIR / f"rank{ctx.rank}.jsonl", spans_since(-clock.at(0.0)),
                     clock.at(0.0))
    return training


def agreed_stop_point(out: Path, closing: Closing) -> int | None:
    """The grid index at which ``--stop-at-target``'s evaluator found the target reached, the same on every
    closing rank (None: it did not). The evaluator may write its file while the ranks close (a job that
    ended on its budget while the evaluator, scoring behind, was reaching the target): ranks that read it at
    different instants would score different points and their collectives would not match, so each
    rank's reading is gathered and the latest, the only one a file written once can differ by, is kept.
    Collective."""
    mine = stop_point(out)
    seen = max(closing.all_gather_floats(-1.0 if mine is None else float(mine)))
    return None if seen < 0 else int(seen)


def evaluate_run(cfg: RunConfig, closing: Closing, trainer: DistributedTrainer, data: Dataset | None,
                 training: Training) -> dict[str, Any]:
    """The record's evaluation fields (``job_s``, ``test_accuracy``, ``eval_history``, the times to the
    targets, the best and worst replica): the model averaged over the closing ranks on the common clock
    (:func:`accuracy_history`), and each closing rank's own final replica scored by that rank
    (:func:`replica_scores`). Only the job's time under emulated compute (``data`` None): nothing is
    learnt. Collective."""
    if data is None:
        return {"job_s": max(closing.all_gather_floats(training.wall_s))}
    # --stop-at-target: the point at which the evaluator found the target reached is scored too, so a
    # crossing right before the stop is never missed
    stopped_at = agreed_stop_point(Path(cfg.out), closing) if cfg.stop_at_target else None
    found = accuracy_history(trainer.model, training.snapshots, training.wall_s, data, closing,
                             cfg.target_accuracy, cfg.target_loss,
                             known_points=() if stopped_at is None else (stopped_at,))
    accuracies, losses = replica_scores(trainer.model, data, closing)
    if cfg.save_model:
        final = trainer.averaged_model(closing.group)
        if closing.is_main:
            torch.save(final.state_dict(), Path(cfg.out) / "model.pt")
    return {
        "job_s": found.job_s, "test_accuracy": found.test_accuracy, "eval_history": found.history,
        "time_to_target_s": found.time_to_target_s, "time_to_target_smoothed_s": found.time_to_target_smoothed_s,
        "time_to_target_loss_s": found.time_to_target_loss_s, "best_replica_accuracy": max(accuracies),
        "worst_replica_accuracy": min(accuracies), "worst_replica_loss": finite_or_none(max(losses)),
    }


def snapshot_log(cfg: RunConfig, model: nn.Module, files: StateFiles | None) -> SnapshotLog | None:
    """The grid of model states this rank keeps for evaluation (None under emulated compute: nothing is
    learnt), each also written to ``files`` when given (``--stop-at-target``). The dense points' states
    take at most ``SNAPSHOT_BYTES`` (at least 8 points); the grid beyond them grows with the logarithm of
    the job's length (:mod:`prague.metrics.grid`)."""
    if cfg.emulated:
        return None
    state_bytes = sum(t.numel() * t.element_size() for t in state_tensors(model))
    most = max(8, min(MAX_POINTS, SNAPSHOT_BYTES // max(1, state_bytes)))
    return SnapshotLog(cfg.eval_every_s or DEFAULT_EVAL_EVERY_S, most, None if files is None else files.write)


def train(cfg: RunConfig, ctx: DistContext) -> RunRecord | None:
    """Train ``cfg`` on this rank. Every rank calls it; rank 0 writes ``summary.json`` and returns its record."""
    data: Dataset | None = None
    if cfg.emulated:  # only the data set's shape and size matter: no loading (the launcher checked the files)
        info = dataset_info(cfg.data)
        shape, classes, train_samples = info.input_shape, info.num_classes, info.train_samples
    else:
        data = load_dataset(cfg.data, cfg.data_dir, seed=cfg.seed)
        shape, classes, train_samples = data.input_shape, data.num_classes, len(data.train_y)
    per_epoch = steps_per_epoch(train_samples, ctx.world_size, cfg.batch_size)
    scenario = parse_scenario(cfg.scenario, seed=cfg.seed)
    model, optimizer, n_params = build(cfg, shape, classes, ctx)
    resumed = None
    restarts = ctx.job.attempt  # torchrun's restarts of the job (--max-restarts)
    # torchrun --max-restarts started this attempt again: it continues from the last complete checkpoint
    restarted = restarts > 0 and checkpoint.latest_complete(Path(cfg.out), ctx.world_size) is not None
    if cfg.resume or restarted:  # before the method's setup, which may publish rank 0's model (DDP, servers)
        resumed = checkpoint.read(Path(cfg.out), checkpoint.resume_step(Path(cfg.out), ctx.world_size), ctx.rank)
        model.load_state_dict(resumed.model)
        if optimizer is not None and resumed.optimizer is not None:
            optimizer.load_state_dict(resumed.optimizer)
    files = None
    if cfg.stop_at_target:
        if not ctx.job.under_launcher:
            raise ConfigError("--stop-at-target needs the evaluator `prague run` starts beside the workers, which "
                              "reads their states from this machine's disk; under torchrun drop it")
        files = StateFiles(Path(cfg.out), ctx.rank)
    nominal_s: float | None = getattr(model, "nominal_compute_s", None)  # emulated compute's own
    if nominal_s is None and cfg.nominal_compute_ms is not None:
        nominal_s = cfg.nominal_compute_ms / 1e3
    harness = Harness(scenario, ctx.rank, ctx.world_size, nominal_s, paced=cfg.compute == "paced",
                      fired=Path(cfg.out) / FAULTS_DIR / f"rank{ctx.rank}.json",
                      continued=cfg.resume or restarts > 0, split=cfg.pace_split)
    decisions = DecisionLog(Path(cfg.out) / DECISIONS_DIR, ctx.rank) if cfg.log_decisions else None
    try:
        trainer = DistributedTrainer(model, optimizer, cfg.options, ctx=ctx, seed=cfg.seed, decisions=decisions,
                                     stall_warn_s=cfg.stall_warn_s, hooks=harness)
        if resumed is not None:
            trainer.load_state_dict(resumed.trainer)
            harness.load_state_dict(resumed.trainer)
            checkpoint.set_rng_state(resumed.rng)
        harness.attach(model, trainer.algorithm)  # paced: gradients ready when they would be on an accelerator
        work = plan_work(cfg, ctx, trainer, data, train_samples, per_epoch)
        # closes the method: its last groups are logged
        try:
            training = run_steps(cfg, ctx, trainer, harness, work, snapshot_log(cfg, model, files), resumed)
        finally:
            harness.detach()  # evaluation's copies of the model run unpaced
        if files is not None:
            files.write_final(flatten(state_tensors(trainer.model)))
    finally:
        if decisions is not None:
            decisions.close()
    if trainer.algorithm.left:  # it left the job (allreduce:drop): the others close the run without it
        mark_left(ctx.store, ctx.rank, trainer.steps_done)
        return None
    closing = closing_ranks(ctx)
    try:
        return close_run(cfg, closing, trainer, data, training, work, scenario.text, n_params)
    finally:
        closing.close()


def close_run(cfg: RunConfig, closing: Closing, trainer: DistributedTrainer, data: Dataset | None,
              training: Training, work: Work, scenario: str, n_params: int) -> RunRecord | None:
    """Evaluate, gather and (on the closing ranks' first) write ``summary.json``. Collective over the
    closing ranks."""
    ctx = closing.ctx
    evaluation = evaluate_run(cfg, closing, trainer, data, training)
    consensus: float | None = trainer.consensus_distance(closing.group)
    if consensus is not None and not math.isfinite(consensus):  # a diverged run's replicas: JSON has no NaN
        consensus = None

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
    for rank, steps in closing.left.items():
        completed[rank] = steps
    steps = work.expected if cfg.budget is None else max(completed)
    diverged = work.divergence.read() if work.divergence is not None else None
    if diverged is not None and not ctx.job.under_launcher:  # torchrun: nobody else will say it
        name = trainer.method.name + (f":{trainer.variant}" if trainer.variant else "")
        print(f"prague worker: {divergence_line(name, diverged.as_dict())}", file=sys.stderr, flush=True)
    record = RunRecord.from_timings(
        [WorkerTiming(**g["timing"]) for g in gathered], batch_size=cfg.batch_size,
        warmup=warmup_steps(min(steps, max(completed)), cfg.warmup_steps),  # a run stopped early: its steps
        algorithm=trainer.method.name, variant=trainer.variant, nproc=ctx.world_size, compute_mode=cfg.compute,
        compute_ms=cfg.nominal_compute_ms, scenario=scenario, model=cfg.model, lr=cfg.lr, optimizer=cfg.optimizer,
        parameters=n_params, data=cfg.data, steps=steps, seed=cfg.seed, backend=ctx.backend,
        device=ctx.device.type,
        wall_s=max(g["wall_s"] for g in gathered), target_accuracy=cfg.target_accuracy, target_loss=cfg.target_loss,
        consensus_distance=consensus, **evaluation,
        algorithm_stats=[g["stats"] for g in gathered], simulated=False,
        failures=[f.summary() for _, f in sorted(closing.failures.items())], completed_steps=completed,
        ranks=list(closing.ranks), budget=cfg.budget, shares=work.shares,
        samples=sum(completed) * cfg.batch_size, worker_samples=[c * cfg.batch_size for c in completed],
        diverged=diverged.as_dict() if diverged is not None else None,
        restarts=ctx.job.restart_count, host=host_facts(),
    )
    atomic_write_json(Path(cfg.out) / "summary.json", record.to_dict())
    if cfg.report_to and record.eval_history:
        with Writers(Path(cfg.out), ctx.rank, parse_report_to(cfg.report_to)) as writers:
            writers.history(record.eval_history)
    if cfg.timeline:  # every rank's step records are complete: all closed their runs
        write_timeline(Path(cfg.out))
    return record
