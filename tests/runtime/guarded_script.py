"""A user's own training loop (``prague.prepare``), for ``torchrun ... -m prague guard`` in
tests/runtime/test_torchrun_failure.py: ``python guarded_script.py ALGORITHM STEPS FAULT`` where FAULT is
``crash:R:S`` (an exception), ``kill:R:S`` (SIGKILL: gone at once), ``hang:R:S`` or ``none``; every rank that finishes prints ``rank R done STEPS``."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import prague


def main() -> int:
    algorithm, steps, fault = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    kind, rank, at = (fault.split(":") + ["", "-1", "-1"])[:3]
    prague.init()
    ctx = prague.context()
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 2))
    model, optimizer = prague.prepare(base, torch.optim.SGD(base.parameters(), lr=0.1), algorithm)
    gen = torch.Generator().manual_seed(ctx.rank)
    for step in range(steps):
        if ctx.rank == int(rank) and step == int(at):
            if kind == "crash":
                raise RuntimeError(f"the script of rank {ctx.rank} failed at step {step}")
            os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        x = torch.randn(16, 10, generator=gen)
        F.cross_entropy(model(x), (x[:, 0] > 0).long()).backward()
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(0.01)
    print(f"rank {ctx.rank} done {steps}", flush=True)
    prague.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
