"""What the worker fork server imports once, so that forked workers do not (:mod:`prague.runtime.forkserver`).

Importing this module is its whole job. It must not start threads: the fork server forks from it. A
data set's own libraries (scikit-learn for digits) are preloaded only for jobs that use it, and what
only training needs (``torch._dynamo``, which every optimizer imports) only for jobs that train
(:func:`prague.runtime.forkserver.prestart`).
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed  # noqa: F401
import torch.nn.functional  # noqa: F401

import prague.cli  # noqa: F401
import prague.train.loop  # noqa: F401
from prague.algorithms.registry import METHODS

for _method in METHODS.values():  # each method's runtime modules (grpc for prague's service client)
    for _path in (_method.runtime, *_method.variant_runtimes.values()):
        importlib.import_module(_path.partition(":")[0])

torch.set_num_threads(1)  # the server itself computes nothing; a worker sets its own count
