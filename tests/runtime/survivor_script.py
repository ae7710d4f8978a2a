"""A newcomer's script that keeps its per-epoch work going when a worker dies: ``python survivor_script.py
ALGORITHM VICTIM WHERE OUT`` (under ``prague launch`` or torchrun's ``prague guard``). Rank VICTIM is killed
(SIGKILL) in epoch 1 right before WHERE: ``averaged`` (the others are in ``model.averaged_model()``),
``barrier`` (in ``prague.barrier()``) or ``checkpoint`` (before the leader's checkpoint: kill the leader).
Every epoch ends with a metric averaged by ``prague.all_reduce`` and the leader's checkpoint in OUT; every
rank that finishes prints ``rank R done``."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import prague

EPOCHS, STEPS = 3, 8


def main() -> int:
    algorithm, victim, where, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    ctx = prague.init()
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 2))
    model, optimizer = prague.prepare(base, torch.optim.SGD(base.parameters(), lr=0.1), algorithm)
    gen = torch.Generator().manual_seed(ctx.rank)
    for epoch in range(EPOCHS):
        total = torch.zeros(1)
        for _ in range(STEPS):
            x = torch.randn(16, 10, generator=gen)
            loss = F.cross_entropy(model(x), (x[:, 0] > 0).long())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            total += loss.detach()
        if epoch == 1 and ctx.rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        if where == "averaged":
            final = model.averaged_model()
            assert isinstance(final, nn.Sequential)
        elif where == "barrier":
            prague.barrier()
        mean = prague.all_reduce(total / STEPS, op="mean")
        live = prague.live_ranks()
        if prague.is_leader():
            torch.save({"epoch": epoch, "model": base.state_dict()}, out / f"epoch{epoch}.pt")
            print(f"leader {ctx.rank} epoch {epoch} loss {mean.item():.3f} live {live}", flush=True)
    print(f"rank {ctx.rank} done", flush=True)
    prague.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
