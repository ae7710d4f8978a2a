"""Paced compute: a clock faithful to an accelerator, for workers that share this machine's cores.

Under ``--compute paced --compute-ms T`` every step's forward and backward pass is real (real model, real
data, real gradients), and its time is padded to the nominal time T times the step's slowdown factor f, so
that each worker behaves as if it had an accelerator of its own: background communication runs in the
padding instead of taking compute from the other workers.

Where the padding goes matters as much as how long it is. On an accelerator the backward pass is most of
the step, and DDP reduces each gradient bucket as soon as its gradients are ready, so its all-reduce
overlaps the rest of the backward pass (Li et al., "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training", VLDB 2020). So a paced step is split into a forward part and a backward part
(``--pace-split F:B``, 1:2 by default, the usual rule of thumb that a backward pass costs twice the
forward) and the backward part is spent layer by layer, in autograd's own order:

* the forward part ends when the model's forward pass returns (a forward hook on the model sleeps until
  ``t0 + f T F/(F+B)``, ``t0`` the step's start);
* the backward part starts there, and each gradient is ready when it would be on an accelerator: at
  ``t_b + f T B/(F+B) r_p``, where ``r_p`` is the share of the backward pass done once ``p``'s module has
  been differentiated. A method that sends gradients from inside backward (DDP's buckets) asks the pace's
  gate (:meth:`Pace.gate`, the method's ``gradient_gate``) before sending a group of them, and the gate
  holds it until the last of them is due; the real backward pass itself runs at full speed, so its
  arithmetic never piles up at a deadline (workers that share cores would otherwise all compute the first
  layer's gradient at once, right before the backward part ends). What other methods send, they send
  after backward, which ends at ``t_b + f T B/(F+B)`` (:meth:`Pace.pad_rest`);
* ``r_p`` comes from each module's arithmetic cost (:func:`module_cost`), measured from the shapes of
  the first forward pass: a module's backward runs after those of every module that ran after it in the
  forward pass, so ``r_p`` is the summed cost of ``p``'s module and of every later one, over the whole.

In the MNIST CNN, for example, ``fc1`` holds 95% of the parameters but 10% of the arithmetic: its
gradient is ready 10% into the backward part, and DDP's all-reduce of its bucket hides behind the
convolutions' backward, as on a GPU. A slowdown factor f scales both parts. What a step communicates after its backward
pass (a method's hook, a wait for others) comes after the nominal time, exposed, as on an accelerator.

The pace must be one this machine holds (:class:`Pace` judges it after a warm-up and refuses only a
sustained excess; ``--compute-ms auto`` probes it: :mod:`prague.train.probe`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from prague.errors import ConfigError
from prague.train.config import DEFAULT_SPLIT, forward_share

def module_cost(module: nn.Module, output: Any) -> float:
    """The arithmetic cost of one call of ``module`` that returned ``output``, in multiply-adds: a linear
    layer's ``outputs x in_features``; a convolution's ``outputs x in_channels / groups x kernel size``;
    another module with parameters of its own (attention projections held directly) ``output rows x its
    parameters`` for a matrix parameter, else the output's size; a module without parameters (activation,
    pooling, normalisation) the output's size. Only the proportions between modules matter."""
    out = output if isinstance(output, torch.Tensor) else next(
        (t for t in _tensors(output)), None)
    if out is None:
        return 0.0
    size = float(out.numel())
    if isinstance(module, nn.Linear):
        return size * module.in_features
    if isinstance(module, nn.modules.conv._ConvNd):
        return size * module.in_channels / module.groups * math.prod(module.kernel_size)
    own = [p for p in module.parameters(recurse=False) if p.dim() >= 2]
    if own and out.dim() >= 1 and out.shape[-1] > 0:
        return size / out.shape[-1] * sum(p.numel() for p in own)
    return size


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def ready_shares(order: list[nn.Module], costs: dict[nn.Module, float]) -> dict[torch.nn.Parameter, float]:
    """When each parameter's gradient is ready, as a share of the backward pass: ``order`` is the modules
    in the order their forward calls ended, ``costs`` their summed cost. A parameter of module k is ready
    once k and every module after it in ``order`` have been differentiated (autograd runs them in reverse)."""
    total = sum(costs[m] for m in order)
    shares: dict[torch.nn.Parameter, float] = {}
    if total <= 0:
        return shares
    after = 0.0
    for module in reversed(order):
        after += costs[module]
        for p in module.parameters(recurse=False):
            shares.setdefault(p, after / total)  # a shared parameter: at its first use in backward
    return shares


class Pace:
    """The accelerator-faithful clock of one rank (see the module docstring). The harness calls
    :meth:`begin` at a step's start; the model's forward hook (:meth:`attach`) pads the forward part; a
    method that sends gradients inside backward calls :meth:`gate` before sending them; the harness calls
    :meth:`pad_rest` when backward returns and :meth:`record`, which judges whether this machine holds the
    pace.

    The judgement ignores start-up: after :data:`WARMUP_STEPS` steps, each window of :data:`WINDOW`
    steps' median compute (the step's time to the end of its backward pass, less what the method
    communicated inside it) is compared with its nominal time; two windows in a row more than
    :data:`TOLERANCE` over it are a :class:`~prague.errors.ConfigError` that names the measured time."""

    WARMUP_STEPS = 10
    WINDOW = 20
    TOLERANCE = 0.10

    def __init__(self, pace_s: float, rank: int, split: str = DEFAULT_SPLIT,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.perf_counter) -> None:
        self.pace_s, self.rank = pace_s, rank
        self.forward_share = forward_share(split)
        self._sleep, self._clock = sleep, clock
        self._t0 = clock()
        self._factor = 1.0
        self._backward_t: float | None = None
        self._in_step = False
        self._shares: dict[int, float] = {}  # a parameter's data_ptr -> its ready share
        self._costs: dict[nn.Module, float] = {}
        self._order: list[nn.Module] = []
        self._handles: list[Any] = []
        self._cost_handles: list[Any] = []
        self._ratios: list[float] = []
        self._over_windows = 0
        self.steps = 0

    # -- the model's hooks

    def attach(self, model: nn.Module) -> None:
        """Hook ``model``: its forward pass ends at the forward part's end; the first forward pass measures
        the modules' costs. Outside a step (between :meth:`begin` and :meth:`pad_rest`) the hooks do
        nothing. They are closures, not bound methods, so a copy of the model (``copy.deepcopy``) does not
        copy this object; :meth:`detach` removes them."""
        self.detach()
        pace = self

        def count(module: nn.Module, args: Any, output: Any) -> None:
            if module not in pace._costs:
                pace._order.append(module)
                pace._costs[module] = 0.0
            pace._costs[module] += module_cost(module, output)

        def forward_done(module: nn.Module, args: Any, output: Any) -> None:
            pace._forward_done()

        self._handles.append(model.register_forward_hook(forward_done))
        for module in model.modules():
            has_own = any(True for _ in module.parameters(recurse=False))
            if has_own or not any(True for _ in module.children()):
                self._cost_handles.append(module.register_forward_hook(count))

    def detach(self) -> None:
        """Remove every hook :meth:`attach` placed."""
        for handle in self._handles + self._cost_handles:
            handle.remove()
        self._handles, self._cost_handles = [], []

    def _forward_done(self) -> None:
        if not self._in_step:
            return
        if self._cost_handles:  # the first forward pass measured the costs: fix the shares
            for handle in self._cost_handles:
                handle.remove()
            self._cost_handles = []
            self._shares = {p.data_ptr(): share for p, share in ready_shares(self._order, self._costs).items()}
        if self._backward_t is None:  # the step's first forward pass (a second one is real time only)
            self._sleep_until(self._t0 + self.pace_s * self._factor * self.forward_share)
            self._backward_t = self._clock()

    def due(self, params: Sequence[torch.Tensor]) -> float | None:
        """When the last gradient of ``params`` is ready in this step (``time.perf_counter`` s; a parameter
        the first forward pass did not see: at the backward part's end); None outside a step's backward."""
        start = self._backward_t
        if not self._in_step or start is None:
            return None
        share = max((self._shares.get(p.data_ptr(), 1.0) for p in params), default=1.0)
        return start + self.pace_s * self._factor * (1.0 - self.forward_share) * share

    def gate(self, params: Sequence[torch.Tensor]) -> None:
        """Return once the gradients of ``params`` would be ready on an accelerator (:meth:`due`): called by
        a method before it sends them from inside backward (the algorithm's ``gradient_gate``)."""
        deadline = self.due(params)
        if deadline is not None:
            self._sleep_until(deadline)

    def _sleep_until(self, deadline: float) -> None:
        rest = deadline - self._clock()
        if rest > 0:
            self._sleep(rest)

    # -- the step's boundaries (the harness)

    def begin(self, factor: float) -> None:
        """A step starts now, slowed by ``factor``."""
        self._t0, self._factor, self._backward_t = self._clock(), factor, None
        self._in_step = True

    def pad_rest(self) -> None:
        """Sleep until the step has taken its nominal time (nothing when its backward pass ended after);
        the step's hooks are done."""
        self._sleep_until(self._t0 + self.pace_s * self._factor)
        self._in_step = False

    def record(self, compute_s: float) -> None:
        """The step's compute (its start to the end of its backward pass, less what the method
        communicated inside it) took ``compute_s``; raise once the pace is not held (class docstring)."""
        self.steps += 1
        if self.steps <= self.WARMUP_STEPS:
            return
        self._ratios.append(compute_s / (self.pace_s * self._factor))
        if len(self._ratios) < self.WINDOW:
            return
        ratios, self._ratios = sorted(self._ratios), []
        median = ratios[len(ratios) // 2]
        self._over_windows = self._over_windows + 1 if median > 1 + self.TOLERANCE else 0
        if self._over_windows >= 2:
            measured = median * self.pace_s
            raise ConfigError(
                f"--compute paced: rank {self.rank}'s steps take {measured * 1e3:.1f} ms of compute (median of its last "
                f"{self.WINDOW} steps after {self.WARMUP_STEPS} of warm-up, in two windows running), more than the "
                f"pace of {self.pace_s * 1e3:g} ms; raise --compute-ms to at least {measured * 1.3e3:.0f}, give "
                "--compute-ms auto (the smallest pace this machine holds), or run fewer workers on this machine")
