"""prague: data-parallel PyTorch training that stays fast when workers are unequal.

Public API::

    prague.init()                      # join the job (prague launch / torchrun environment)
    model, optimizer = prague.prepare(model, optimizer, algorithm="prague")   # your own loop:
    loss.backward(); optimizer.step(); optimizer.zero_grad()                 # the method runs in step()
    model.averaged_model()             # mean of all replicas (collective)
    if prague.is_leader(): ...         # the lowest living rank: print, evaluate, save
    prague.log_metrics({"loss": x})    # beside the steps in prague launch --log-dir's metrics/
    prague.barrier(); prague.all_reduce(t); prague.broadcast(t)   # over the living ranks
    prague.shutdown()
    # or the closure form:
    trainer = prague.wrap(model, optimizer, algorithm="allreduce")
    trainer.step(closure)              # one iteration
    trainer.averaged_model()           # mean of all replicas (collective)
    trainer.close(); prague.shutdown()

The names are loaded on first use, so ``prague --help``, ``prague methods`` and the simulator's
driver do not import torch.distributed unless they need it.
"""

from __future__ import annotations

import importlib
from typing import Any

from prague import native

__version__ = "0.1.0"

#: ``"pure"`` or ``"compiled (N modules)"`` (``make compiled``); a compiled module older than its source is
#: refused here, with the fix, rather than run in place of the code that was edited.
BUILD = native.state()

_EXPORTS = {
    "DistContext": "prague.runtime.context",
    "context": "prague.runtime.context",
    "init": "prague.runtime.context",
    "shutdown": "prague.runtime.context",
    "DistributedTrainer": "prague.train.trainer",
    "StepRecord": "prague.train.trainer",
    "StepHooks": "prague.train.trainer",
    "wrap": "prague.train.trainer",
    "prepare": "prague.train.prepared",
    "log_metrics": "prague.train.prepared",
    "live_ranks": "prague.comm.collectives",
    "leader": "prague.comm.collectives",
    "is_leader": "prague.comm.collectives",
    "barrier": "prague.comm.collectives",
    "all_reduce": "prague.comm.collectives",
    "broadcast": "prague.comm.collectives",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'prague' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
