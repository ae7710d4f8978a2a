"""prague: data-parallel PyTorch training that stays fast when workers are unequal.

Public API::

    prague.init()                      # join the job (prague launch / torchrun environment)
    trainer = prague.wrap(model, optimizer, algorithm="allreduce")
    trainer.step(closure)              # one iteration
    trainer.averaged_model()           # mean of all replicas (collective)
    trainer.close(); prague.shutdown()
"""

from prague.runtime.context import DistContext, context, init, shutdown
from prague.train.trainer import DistributedTrainer, StepRecord, wrap

__version__ = "0.1.0"

__all__ = ["DistContext", "DistributedTrainer", "StepRecord", "context", "init", "shutdown", "wrap"]
