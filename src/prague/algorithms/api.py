"""The runtime interface every synchronisation method implements.

The worker loop (:class:`prague.train.trainer.DistributedTrainer`) is short and linear and never
branches on the method's name: it calls these hooks in this order on every rank, every iteration::

    module = algorithm.setup(model, optimizer)        # once
    loss = closure(module); loss.backward()           # compute (a method may communicate inside backward)
    algorithm.after_backward(step, times)             # e.g. push gradients
    algorithm.apply_update(optimizer, step)           # local optimizer step unless the method owns it
    algorithm.after_step(step, times)                 # e.g. average parameters with a group
    ...
    algorithm.close(failed=...)                       # once, on every rank, also after a failure

A method is one package under ``prague/algorithms/``: its description (name, options, variants,
reported fields; :mod:`prague.algorithms.spec`) in ``__init__.py``, a subclass of :class:`Algorithm`
in ``runtime.py``, its simulator model in ``sim.py``, and one line in
:mod:`prague.algorithms.registry`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from prague import jobenv
from prague.metrics.decisions import DecisionLog
from prague.runtime.background import BackgroundWork, Span
from prague.runtime.context import DistContext
from prague.runtime.services import ServiceSpec
from prague.runtime.stall import Phase

W = TypeVar("W", bound=BackgroundWork)


@dataclass
class StepTimes:
    """Per-iteration time accounting that hooks add to.

    ``inner_comm_s``: communication that happened inside ``backward`` (overlapped methods such as DDP
    report the part that was not hidden behind compute). ``wait_s``: the part of hook time spent waiting
    for other workers rather than moving data, when a method can tell the two apart. ``dropped``: the
    share of the gradient a method that drops data (``lossy``) left out of this iteration, else None.
    """

    inner_comm_s: float = 0.0
    wait_s: float = 0.0
    dropped: float | None = None


@dataclass(frozen=True)
class JobResources:
    """What a method needs from the launcher besides the workers: service processes to start before
    them, and environment variables for every process of the job."""

    services: tuple[ServiceSpec, ...] = ()
    env: dict[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.services:  # whoever starts them says so to every process of the job (one flag for all)
            object.__setattr__(self, "env", {jobenv.MANAGED_SERVICES: "1", **self.env})  # the caller's dict stays as it was


class BeforeForward(nn.Module):
    """Wraps ``module`` so that ``hook()`` runs before every forward pass.

    For methods that must touch the parameters right before compute (install fresh values, take a
    snapshot). The hook is a plain closure, so a deepcopy of the wrapped model (the averaged model)
    never drags the method object along."""

    def __init__(self, module: nn.Module, hook: Callable[[], None]) -> None:
        super().__init__()
        self.module = module
        self._hook = hook

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._hook()
        return self.module(*args, **kwargs)


class Algorithm:
    """Base class of a synchronisation method's runtime; the defaults do a plain local SGD step.

    Constructed on every rank with the job's context and the method's validated options (built by
    :meth:`prague.algorithms.spec.Method.make_options`). What :meth:`setup` acquires that must be
    released (threads, communicators, processes, temporary folders) it registers on
    :attr:`resources`, in order; :meth:`close` releases exactly that, in reverse order, so it never has
    to guess how far ``setup`` got.

    :attr:`decisions` is this worker's decision log (:mod:`prague.metrics.decisions`) when the run logs
    decisions, else None; set by whoever builds the method, before :meth:`setup`, and closed by them
    after :meth:`close`. A method writes one :class:`~prague.metrics.decisions.Decision` per decision
    it makes (only if the log is there) and has its services write their traces to ``decisions.folder``.
    """

    #: Whether this method's gradients leave the worker in the optimizer step (``after_backward`` /
    #: ``apply_update``: pushed to a server, summed in background rounds, reduced in chunks), rather than
    #: inside backward (DDP) or never (parameter averaging). A mixed-precision step the scaler skips must
    #: then not send them (:mod:`prague.train.prepared`).
    sends_gradients_in_step = False

    def __init__(self, ctx: DistContext, options: Any, namespace: str | None = None) -> None:
        self.ctx = ctx
        self.options = options
        #: Where this method's components key the job's store, each under a fixed child name of its own
        #: (``NAMESPACE/groups``...): given by whoever builds the method (:meth:`DistContext.namespace`,
        #: with :func:`prague.prepare`'s ``name``), else the job's next for this class.
        self.namespace = namespace if namespace is not None else ctx.namespace(type(self).__name__.lower())
        self.decisions: DecisionLog | None = None
        self.phase = Phase()  # the trainer's: a method whose communication starts inside backward says when
        self.background: list[BackgroundWork] = []  # the method's background communication (in_background)
        self.background_spans: list[tuple[str, Span]] = []  # after close: what the background threads did
        self.resources = contextlib.ExitStack()
        self.failed = False  # set by close(): releasing after a failure (kill rather than wait)
        self._closed = False
        #: Set by a harness that paces the backward pass (:mod:`prague.train.pacing`), else None. A method
        #: that sends gradients from inside backward (DDP's buckets) calls it with the gradients' parameters
        #: right before sending them; it returns once they would be ready on an accelerator.
        self.gradient_gate: Callable[[Sequence[torch.Tensor]], None] | None = None
        #: The ranks still taking steps, once a method has let others leave the job (``allreduce:drop``);
        #: None: every rank. Under a job-wide budget the loop shares the leavers' batches among them.
        self.stepping: tuple[int, ...] | None = None
        #: This rank has left the job: it takes no further steps that matter, and its replica is not the
        #: job's model (the run's closing is the others').
        self.left = False

    @classmethod
    def job_resources(cls, options: Any, nproc: int, out_dir: Path, host: str = "127.0.0.1") -> JobResources:
        """Services and environment the launcher provides for this method (none by default); a service
        that listens does so on ``host`` (the bridge's address with emulated hosts). Under torchrun
        there is no launcher: a method that needs a service starts it from rank 0 instead."""
        return JobResources()

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> nn.Module:
        """Prepare the method for ``model`` (already on the context's device); return the module to run
        forward through. Called once on every rank, before the first step."""
        return model

    def before_compute(self, step: int) -> None:
        """Called right before the forward pass of ``step`` (after the gradients were zeroed)."""

    def after_backward(self, step: int, times: StepTimes) -> None:
        """Called after ``loss.backward()``, before the optimizer step."""

    def apply_update(self, optimizer: torch.optim.Optimizer | None, step: int) -> None:
        """Apply the local update. Methods whose update happens elsewhere (a parameter server) override."""
        if optimizer is not None:
            optimizer.step()

    def after_step(self, step: int, times: StepTimes) -> None:
        """Called after the optimizer step; decentralised methods average parameters here."""

    def finish(self) -> None:
        """The orderly end, on every rank after its last step: drain pending work, say goodbye to peers
        and services. Not called after a failure. Collective where the method says so."""

    def close(self, failed: bool = False) -> None:
        """End the method on this rank; called once on every rank. Unless ``failed`` (an exception is
        propagating, so peers may be gone), first :meth:`finish`; then, in every case, release what
        :meth:`setup` registered on :attr:`resources`. A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self.failed = failed
        try:
            with self.resources:
                if not failed:
                    self.finish()
        finally:  # a work holds its communicators until dropped: keep only what it did, for the timeline
            self.background_spans = [(work.what, span) for work in self.background for span in work.spans]
            self.background = []

    def in_background(self, work: W) -> W:
        """Register a background communication thread started by :meth:`setup`: stall warnings watch its
        operations, the timeline shows them, and :meth:`close` (through :attr:`resources`, at this point
        of the order) stops and joins it (:meth:`~prague.runtime.background.BackgroundWork.shutdown`:
        after a failure without waiting for a collective with a dead peer)."""
        self.background.append(work)
        self.resources.callback(lambda: work.shutdown(self.failed, self.ctx.timeout_s))
        return work

    @contextlib.contextmanager
    def outside_steps(self) -> Iterator[None]:
        """Around a collective of the user's loop (the averaged model, the consensus distance), which a
        rank reaches at its own time: a method whose steps need other ranks' steps to go on
        (``allreduce:backup``'s rounds) counts this rank out of them meanwhile. Nothing by default."""
        yield

    def batch_share(self) -> tuple[int, int] | None:
        """The samples this rank takes in its next step, as (offset, count) within the step's samples of
        all ranks (n times the loop's batch), when the method sets them (``allreduce:balanced``); None: a
        batch of the loop's own size."""
        return None

    def replica_group(self) -> tuple[tuple[int, ...], Any]:
        """The ranks whose replicas are the job's model, and a communicator over them (None: the world's),
        for ``model.averaged_model()``. Every rank by default."""
        return tuple(range(self.ctx.world_size)), None

    def peers(self) -> Sequence[int] | None:
        """The ranks this worker's communication of the moment involves (a P-Reduce group, a partner),
        named by stall warnings (:mod:`prague.runtime.stall`); None: every rank. Called from another
        thread: read, never block."""
        return None

    def stats(self) -> dict[str, Any]:
        """Method-specific counters for the run summary (JSON-serialisable); the keys are those the
        method's description declares in ``reports``."""
        return {}
