"""The interface every synchronisation method implements.

The worker loop (:class:`prague.train.trainer.DistributedTrainer`) is short and linear and never
branches on the method's name: it calls these hooks in this order on every rank, every iteration::

    module = algorithm.setup(model, optimizer)        # once
    loss = closure(module); loss.backward()           # compute (a method may communicate inside backward)
    algorithm.after_backward(step, times)             # e.g. push gradients
    algorithm.apply_update(optimizer, step)           # local optimizer step unless the method owns it
    algorithm.after_step(step, times)                 # e.g. average parameters with a group
    ...
    algorithm.close()                                 # once, on every rank, even after a failure

Adding a method means one module under ``prague.algorithms`` with a subclass of :class:`Algorithm`, plus
one line in :mod:`prague.algorithms.registry`.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from prague.runtime.context import DistContext
from prague.runtime.launcher import ServiceSpec


@dataclass
class StepTimes:
    """Per-iteration time accounting that hooks add to.

    ``inner_comm_s``: communication that happened inside ``backward`` (overlapped methods such as DDP
    report the part that was not hidden behind compute). ``wait_s``: the part of hook time spent waiting
    for other workers rather than moving data, when a method can tell the two apart.
    """

    inner_comm_s: float = 0.0
    wait_s: float = 0.0


@dataclass(frozen=True)
class JobResources:
    """What a method needs from the launcher besides the workers: service processes to start before
    them, and environment variables for every process of the job."""

    services: tuple[ServiceSpec, ...] = ()
    env: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class NoOptions:
    """Options of a method that has none."""


class Algorithm:
    """Base class of a synchronisation method; the defaults do a plain local SGD step.

    Subclasses set ``name``, optionally an ``Options`` frozen dataclass whose fields are read from the
    CLI namespace or keyword arguments of the same names, and ``variant_field``: the option that
    ``NAME:VARIANT`` in ``prague bench --algorithms`` sets.
    """

    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    variant_field: ClassVar[str | None] = None

    def __init__(self, ctx: DistContext, options: Any) -> None:
        self.ctx = ctx
        self.options = options

    @classmethod
    def options_from(cls, values: dict[str, Any] | argparse.Namespace) -> Any:
        """Build this method's options from a mapping, taking only the fields it declares."""
        mapping = vars(values) if isinstance(values, argparse.Namespace) else dict(values)
        names = {f.name for f in dataclasses.fields(cls.Options)}
        return cls.Options(**{k: v for k, v in mapping.items() if k in names and v is not None})

    @classmethod
    def job_resources(cls, options: Any, nproc: int, out_dir: Path, seed: int) -> JobResources:
        """Services and environment the launcher provides for this method (none by default). Under
        torchrun there is no launcher: a method that needs a service starts it from rank 0 instead."""
        return JobResources()

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> nn.Module:
        """Prepare the method for ``model`` (already on the context's device); return the module to run
        forward through. Called once on every rank, before the first step."""
        return model

    def after_backward(self, step: int, times: StepTimes) -> None:
        """Called after ``loss.backward()``, before the optimizer step."""

    def apply_update(self, optimizer: torch.optim.Optimizer | None, step: int) -> None:
        """Apply the local update. Methods whose update happens elsewhere (a parameter server) override."""
        if optimizer is not None:
            optimizer.step()

    def after_step(self, step: int, times: StepTimes) -> None:
        """Called after the optimizer step; decentralised methods average parameters here."""

    def close(self) -> None:
        """Stop background threads and services; called once on every rank, also after a failure."""

    def stats(self) -> dict[str, Any]:
        """Method-specific counters for the run summary (JSON-serialisable)."""
        return {}

    @property
    def variant(self) -> str | None:
        if self.variant_field is None:
            return None
        return str(getattr(self.options, self.variant_field))
