"""Optional real arithmetic (``--math real``): every simulated worker holds real parameters.

The simulator decides *when* things happen; this module does *what* they do to the models, called by
the simulated methods in event order: a local SGD step at the end of a worker's compute, a group
average when a P-Reduce completes, a server update when a push arrives, and so on. So accuracy comes
out against simulated wall-clock time, for hundreds of workers, on one CPU.

All replicas live in one tensor ``X`` of shape ``(n + 1, P)`` (row ``n`` is a parameter server's copy,
unused by decentralised methods). Every update is :class:`prague.optim.SGDRule`, the step of
``torch.optim.SGD`` that ``prague run``'s optimizer and the parameter-server shards take: a worker's
local step uses the run's rule (:attr:`RealMath.optimizer`) with its row's momentum buffer; a server
step takes the rule and momentum buffer its method names (:meth:`RealMath.server_step`). Gradients
come from ``torch.func.functional_call`` of the real model (:func:`prague.workload.models.build_model`) on
a flat parameter vector. Data: each worker's batches come from :class:`prague.workload.data.ShardLoader`
(its shard of the training set, by global step) when every shard holds at least one batch; with more
workers than that (digits has 1,437 training images) each worker instead draws its batch uniformly from
the whole training set, seeded by (seed, rank, step). Models with buffers (BatchNorm) are not
supported: buffers would be shared by all simulated workers.

Evaluation is on the common clock, as in ``prague run`` (:mod:`prague.train.evaluation`): at every kept
point ``j * every_s`` of the simulated clock (``--eval-every-s``; :func:`~prague.metrics.grid.kept` with
:data:`~prague.metrics.grid.MAX_POINTS` dense points, the runtime's grid for a small model) the mean of the
workers' rows is kept, i.e. what a user stopping the job then would get; after the run the same points are
scored (accuracy and mean cross-entropy loss) by the runtime's time-order scan
(:func:`~prague.metrics.grid.scan`: the times to the targets, the smoothed one too), plus the final mean.
Every worker's final row is scored on its own too (``best_replica_accuracy``, ``worst_replica_accuracy``,
``worst_replica_loss``): one pass over the test set per simulated worker.

:class:`NoMath` has the same methods and does nothing, so a method's code never branches on the mode.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.func import functional_call

from prague.errors import ConfigError, unknown_choice
from prague.hetero.spec import uniform
from prague.metrics.grid import DEFAULT_EVAL_EVERY_S, MAX_POINTS, Score, next_kept, scan
from prague.optim import SGDRule
from prague.workload.data import Dataset, GlobalBatches, ShardLoader, load_dataset
from prague.workload.models import build_model

MATH_MODES = ("none", "real", "mixing")
_DATA_STREAM = 11  # stream of hetero.spec.uniform used for batch draws (the paper slowdowns use 1)


@dataclass(frozen=True)
class MathConfig:
    model: str = "mlp"
    data: str = "digits"
    data_dir: Path | None = None  # the data set's files (mnist)
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    seed: int = 0
    eval_every_s: float | None = None
    target_accuracy: float | None = None
    target_loss: float | None = None


@lru_cache(maxsize=4)
def _dataset(name: str, seed: int, data_dir: Path | None = None) -> Dataset:
    """Loaded once per process: tensors are only read."""
    return load_dataset(name, data_dir, seed=seed)


def group_mean(rows: torch.Tensor, members: Sequence[int], weights: Mapping[int, float] | None) -> torch.Tensor:
    """The mean of ``rows`` (one per member, in ``members``' order): equal, or weighted by ``weights``
    (by member), as the runtime's P-Reduce computes it (:func:`prague.comm.preduce.preduce_weighted`)."""
    if weights is None:
        return rows.mean(dim=0)
    w = torch.as_tensor([weights[m] for m in members], dtype=rows.dtype)
    return (rows * w.view(-1, *([1] * (rows.dim() - 1)))).sum(dim=0) / w.sum()


class NoMath:
    """Timing only: every hook is a no-op and there is nothing to report."""

    enabled = False
    optimizer: SGDRule | None = None  # the run's optimizer rule (None: no arithmetic)
    share_momentum = False  # prague --share-momentum on: momentum buffers are averaged with the rows

    def snapshot(self, w: int) -> None: ...

    def local_step(self, w: int, step: int, scale: float = 1.0) -> None: ...

    def gradient(self, w: int, step: int, at_snapshot: bool = False, lookahead: bool = False) -> Any:
        return None

    def apply(self, w: int, grad: Any, scale: float = 1.0) -> None: ...

    def average(self, members: Sequence[int], weights: Mapping[int, float] | None = None) -> None: ...

    def spread(self, members: Sequence[int]) -> float | None:
        """The mean distance of ``members``' rows from their mean (None: no arithmetic)."""
        return None

    def allreduce_step(self, members: Sequence[int], step: int, scale: float = 1.0) -> None: ...

    def values(self, w: int) -> Any:
        """A copy of x_w as it is now (a snapshot handed to a background average)."""
        return None

    def corrections(self, snapshots: dict[int, Any], weights: Mapping[int, float] | None = None) -> dict[int, Any]:
        """The delayed-averaging corrections of one group: ``avg - s_w`` for each member's snapshot (as
        caught up on the corrections it lacked: :class:`prague.algorithms.prague.overlap.Backlog`); ``avg``
        weighted by ``weights`` (by member) when given (``prague --average-by samples``)."""
        return {}

    def add(self, w: int, delta: Any) -> None: ...

    def server_step(self, grads: Sequence[Any], rule: SGDRule | None, key: Any, scale: float = 1.0) -> None: ...

    def own_step(self, w: int, grad: Any, rule: SGDRule | None, scale: float = 1.0) -> None: ...

    def server_values(self) -> Any:
        return None

    def install(self, w: int, values: Any) -> None: ...

    def reached(self, w: int, step: int, now_s: float) -> None: ...

    def attach(self, engine: Any, finished: Callable[[], bool]) -> None:
        """Keep the replicas' mean at the grid points of ``engine``'s clock until ``finished()``."""

    def use_global_batches(self, index_of: Callable[[int, int], int]) -> None: ...

    def results(self) -> dict[str, Any]:
        """The record's evaluation fields (none without arithmetic)."""
        return {"test_accuracy": None, "eval_history": [], "consensus_distance": None}


class RealMath(NoMath):
    """Real parameters for ``nproc`` simulated workers (and one server row); see the module docstring."""

    enabled = True

    def __init__(self, nproc: int, steps: int, config: MathConfig, dataset: Dataset | None = None) -> None:
        self.n = nproc
        self.config = config
        self.data = dataset if dataset is not None else _dataset(config.data, config.seed, config.data_dir)
        torch.manual_seed(config.seed)
        self.model = build_model(config.model, self.data.input_shape, self.data.num_classes)
        if any(True for _ in self.model.buffers()):
            raise ConfigError(
                f"--math real supports models without buffers (mlp, cnn), got {config.model!r}; "
                "simulate its timing with --math none"
            )
        self.model.train()
        self._names = [name for name, _ in self.model.named_parameters()]
        self._shapes = [p.shape for _, p in self.model.named_parameters()]
        self._sizes = [p.numel() for _, p in self.model.named_parameters()]
        flat0 = torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])
        self.X = flat0.repeat(nproc + 1, 1)
        self._rule = SGDRule(config.lr, config.momentum)
        self.optimizer = self._rule
        self._bufs: dict[Any, torch.Tensor | None] = {}  # momentum buffers, by row or by the key a method names
        self._snap: dict[int, torch.Tensor] = {}
        n_train = int(self.data.train_y.shape[0])
        self._loaders: list[ShardLoader] | None = None
        if n_train // nproc >= config.batch_size:
            self._loaders = [ShardLoader(self.data.train_x, self.data.train_y, w, nproc, config.batch_size,
                                         config.seed) for w in range(nproc)]
        self._n_train = n_train
        self._index_of: Callable[[int, int], int] | None = None
        self._global: GlobalBatches | None = None
        self.every_s = config.eval_every_s or DEFAULT_EVAL_EVERY_S
        self.steps = steps
        self.entries: dict[int, torch.Tensor] = {}  # kept grid index -> the workers' mean at that point
        self.end_s = 0.0  # the last iteration's end: the job's time

    # -- data and gradients -------------------------------------------------------------------------
    def use_global_batches(self, index_of: Callable[[int, int], int]) -> None:
        """Under a job-wide budget: worker w's batch at step k is the job-wide batch ``index_of(w, k)``
        (:class:`~prague.workload.data.GlobalBatches`, every sample once per epoch), as in the runtime."""
        self._global = GlobalBatches(self.data.train_x, self.data.train_y, self.config.batch_size, self.config.seed)
        self._index_of = index_of

    def _batch(self, w: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._index_of is not None:
            assert self._global is not None
            return self._global.batch(self._index_of(w, step))
        if self._loaders is not None:
            return self._loaders[w].batch(step)
        gen = torch.Generator().manual_seed(int(uniform(self.config.seed, w, step, _DATA_STREAM) * 2**53))
        rows = torch.randint(0, self._n_train, (self.config.batch_size,), generator=gen)
        return self.data.train_x[rows], self.data.train_y[rows]

    def _params(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out, offset = {}, 0
        for name, shape, size in zip(self._names, self._shapes, self._sizes):
            out[name] = flat[offset : offset + size].view(shape)
            offset += size
        return out

    def _grad(self, flat: torch.Tensor, w: int, step: int) -> torch.Tensor:
        x, y = self._batch(w, step)
        p = flat.detach().clone().requires_grad_(True)
        loss = F.cross_entropy(functional_call(self.model, self._params(p), (x,)), y)
        (g,) = torch.autograd.grad(loss, p)
        return g

    # -- hooks the simulated methods call ------------------------------------------------------------
    def snapshot(self, w: int) -> None:
        """Remember x_w as it is now: the gradient of this iteration is taken there (asynchronous methods)."""
        self._snap[w] = self.X[w].clone()

    def gradient(self, w: int, step: int, at_snapshot: bool = False, lookahead: bool = False) -> torch.Tensor:
        """Worker ``w``'s gradient of ``step``: at its values (its snapshot with ``at_snapshot``), or with
        ``lookahead`` at its values shifted by the momentum part of its next update, -lr m v (eager-sgd's
        ``--lookahead on``)."""
        flat = self._snap.pop(w) if at_snapshot and w in self._snap else self.X[w]
        buf = self._bufs.get(w)
        if lookahead and buf is not None and self._rule.momentum:
            flat = flat - self._rule.lr * self._rule.momentum * buf
        return self._grad(flat, w, step)

    def _step(self, row: int, grad: torch.Tensor, rule: SGDRule, key: Any, scale: float = 1.0) -> None:
        self._bufs[key] = rule.step(self.X[row], grad, self._bufs.get(key), scale)

    def apply(self, w: int, grad: torch.Tensor, scale: float = 1.0) -> None:
        """Worker ``w``'s optimizer step with ``grad`` (its own momentum buffer)."""
        self._step(w, grad, self._rule, w, scale)

    def own_step(self, w: int, grad: torch.Tensor, rule: SGDRule | None, scale: float = 1.0) -> None:
        """Worker ``w`` takes a step of a server's ``rule`` on its own copy (``ps-eager``'s read-my-writes),
        with a momentum buffer of that step's own."""
        self._step(w, grad, rule or self._rule, ("own", w), scale)

    def local_step(self, w: int, step: int, scale: float = 1.0) -> None:
        self.apply(w, self.gradient(w, step), scale)

    def _momentum(self, w: int) -> torch.Tensor:
        """Worker ``w``'s momentum buffer, zeros before its first step (what SGD's first step overwrites)."""
        buf = self._bufs.get(w)
        if buf is None:
            buf = self._bufs[w] = torch.zeros_like(self.X[w])
        return buf

    def average(self, members: Sequence[int], weights: Mapping[int, float] | None = None) -> None:
        idx = torch.as_tensor(list(members))
        self.X[idx] = group_mean(self.X[idx], members, weights)
        if self.share_momentum:
            mean = group_mean(torch.stack([self._momentum(w) for w in members]), members, weights)
            for w in members:
                self._bufs[w] = mean.clone()

    def spread(self, members: Sequence[int]) -> float:
        return rows_spread(self.X, members)

    def values(self, w: int) -> torch.Tensor:
        if self.share_momentum:
            return torch.cat([self.X[w], self._momentum(w)])
        return self.X[w].clone()

    def corrections(self, snapshots: dict[int, torch.Tensor],
                    weights: Mapping[int, float] | None = None) -> dict[int, torch.Tensor]:
        mean = group_mean(torch.stack(list(snapshots.values())), list(snapshots), weights)
        return {w: mean - snap for w, snap in snapshots.items()}

    def add(self, w: int, delta: torch.Tensor | None) -> None:
        if delta is None:
            return
        n = self.X.shape[1]
        self.X[w].add_(delta[:n])
        if self.share_momentum:
            self._momentum(w).add_(delta[n:])

    def allreduce_step(self, members: Sequence[int], step: int, scale: float = 1.0) -> None:
        grad = torch.stack([self._grad(self.X[w], w, step) for w in members]).mean(dim=0)
        for w in members:
            self.apply(w, grad, scale)

    def server_step(self, grads: Sequence[torch.Tensor], rule: SGDRule | None, key: Any, scale: float = 1.0) -> None:
        """The server's values take one step of ``rule`` (default: the run's optimizer) with the mean of
        ``grads`` (summed in the order given), momentum buffer ``key``, learning rate scaled by ``scale``."""
        if grads:
            grad = grads[0] if len(grads) == 1 else torch.stack(list(grads)).mean(dim=0)
            self._step(self.n, grad, rule or self._rule, ("server", key), scale)

    def server_values(self) -> torch.Tensor:
        """A copy of the server's values now (what a pull answered now carries)."""
        return self.X[self.n].clone()

    def install(self, w: int, values: torch.Tensor) -> None:
        """Worker ``w`` takes pulled ``values`` as its parameters."""
        self.X[w].copy_(values)

    # -- evaluation -----------------------------------------------------------------------------------
    def reached(self, w: int, step: int, now_s: float) -> None:
        """Worker ``w`` finished ``step`` at ``now_s``: the job lasts at least until then."""
        self.end_s = max(self.end_s, now_s)

    def attach(self, engine: Any, finished: Callable[[], bool]) -> None:
        def tick(j: int) -> None:
            # past the job's end (the final state stands for it), or nothing else will ever happen (a
            # deadlock, which the method reports): no more points
            if finished() or not engine.pending:
                return
            self.entries[j] = self.X[: self.n].mean(dim=0)
            following = next_kept(j, MAX_POINTS)
            engine.at(following * self.every_s, tick, following)

        engine.at(0.0, tick, 0)

    @torch.no_grad()
    def evaluate(self, flat: torch.Tensor) -> Score:
        """(test accuracy, mean test cross-entropy loss) of the parameters ``flat``."""
        out = functional_call(self.model, self._params(flat), (self.data.test_x,))
        accuracy = float((out.argmax(dim=1) == self.data.test_y).float().mean())
        return accuracy, float(F.cross_entropy(out.double(), self.data.test_y))

    def results(self) -> dict[str, Any]:
        workers = self.X[: self.n]
        mean = workers.mean(dim=0)
        consensus = rows_spread(self.X, range(self.n))
        points = sorted(j for j in self.entries if j * self.every_s < self.end_s)
        states = [self.entries[j] for j in points] + [mean]
        times = [j * self.every_s for j in points] + [self.end_s]
        found = scan(lambda i: self.evaluate(states[i]), times, self.config.target_accuracy, self.config.target_loss)
        replicas = [self.evaluate(row) for row in workers]
        worst_loss = max(loss for _, loss in replicas)
        return {
            "test_accuracy": found.scores[len(states) - 1][0],
            "eval_history": [{"wall_s": times[i], "accuracy": accuracy, "loss": loss if math.isfinite(loss) else None}
                             for i, (accuracy, loss) in sorted(found.scores.items())],
            "consensus_distance": consensus if math.isfinite(consensus) else None,
            "time_to_target_s": None if found.accuracy_hit is None else times[found.accuracy_hit],
            "time_to_target_smoothed_s": found.smoothed_s,
            "time_to_target_loss_s": None if found.loss_hit is None else times[found.loss_hit],
            "best_replica_accuracy": max(accuracy for accuracy, _ in replicas),
            "worst_replica_accuracy": min(accuracy for accuracy, _ in replicas),
            "worst_replica_loss": worst_loss if math.isfinite(worst_loss) else None,
        }


def rows_spread(X: torch.Tensor, members: Sequence[int]) -> float:
    """The mean over ``members`` of ``||X[m] - mean||``, the mean of their rows: the consensus distance."""
    rows = X[list(members)]
    return float(torch.linalg.vector_norm(rows - rows.mean(dim=0), dim=1).mean())


class MixingMath(NoMath):
    """How well a method's averaging mixes the replicas, at any scale: each worker holds a vector of
    :data:`MIXING_DIM` numbers, all equal at the start; each local step adds independent unit Gaussian noise to
    it (the replicas' drift apart), each average pulls the members together, by the method's own groups and
    corrections. The run's ``consensus_distance`` is the mean distance of the workers' vectors from their
    mean at the end: the noise it has not yet averaged away. A random walk spreads the replicas by about
    sqrt(steps) each; a method that mixes well keeps them within a few steps' noise of each other, whatever
    the number of workers (a mixing time that grows slowly with it). Seeded by (seed, rank, step)."""

    enabled = True

    def __init__(self, nproc: int, seed: int) -> None:
        self.n, self.seed = nproc, seed
        self.X = torch.zeros(nproc, MIXING_DIM, dtype=torch.float64)
        self._gen = torch.Generator().manual_seed(seed)

    def local_step(self, w: int, step: int, scale: float = 1.0) -> None:
        self.X[w] += torch.randn(MIXING_DIM, generator=self._gen, dtype=torch.float64) * scale

    def average(self, members: Sequence[int], weights: Mapping[int, float] | None = None) -> None:
        rows = list(members)
        self.X[rows] = group_mean(self.X[rows], rows, weights)

    def spread(self, members: Sequence[int]) -> float:
        return rows_spread(self.X, members)

    def values(self, w: int) -> torch.Tensor:
        return self.X[w].clone()

    def corrections(self, snapshots: dict[int, torch.Tensor],
                    weights: Mapping[int, float] | None = None) -> dict[int, torch.Tensor]:
        mean = group_mean(torch.stack(list(snapshots.values())), list(snapshots), weights)
        return {w: mean - s for w, s in snapshots.items()}

    def add(self, w: int, delta: torch.Tensor | None) -> None:
        if delta is not None:
            self.X[w] += delta

    def results(self) -> dict[str, Any]:
        consensus = rows_spread(self.X, range(self.n))
        return {"test_accuracy": None, "eval_history": [], "consensus_distance": consensus}


#: The length of each worker's vector under ``--math mixing``.
MIXING_DIM = 8


def make_math(mode: str, nproc: int, steps: int, config: MathConfig) -> NoMath:
    """``none`` (timing only), ``real`` (real parameters) or ``mixing`` (a noise vector per worker: how well
    the averaging mixes, at any scale); an unknown mode lists the valid ones."""
    if mode == "none":
        return NoMath()
    if mode == "real":
        return RealMath(nproc, steps, config)
    if mode == "mixing":
        return MixingMath(nproc, config.seed)
    raise unknown_choice("math mode", mode, MATH_MODES)
