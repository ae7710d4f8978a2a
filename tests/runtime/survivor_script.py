"""A newcomer's script that keeps its per-epoch work going while workers die: ``python survivor_script.py
ALGORITHM OUT`` (under ``prague launch`` or torchrun's ``prague guard``, 4 workers). Three workers are
killed (SIGKILL), one in each of epochs 1-3, each at another point of the epoch's end (:data:`KILLS`):
rank 3 right before ``model.averaged_model()`` (the others are in it), rank 1 right before
``prague.barrier()`` (the others are in it), and the leader, rank 0, after the barrier, before the epoch's
metric and its checkpoint (the others are in ``prague.all_reduce``, then the next rank saves). Every
epoch ends with a metric averaged by ``prague.all_reduce``, a ``prague.broadcast`` from the leader (every
survivor checks it got the leader's values), the epoch's loss given to ``prague.log_metrics`` and the
leader's checkpoint in OUT; every rank that finishes prints ``rank R done``."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import prague

EPOCHS, STEPS = 4, 8
#: (epoch, rank, the point it is killed right before)
KILLS = ((1, 3, "averaged"), (2, 1, "barrier"), (3, 0, "checkpoint"))


def main() -> int:
    algorithm, out = sys.argv[1], Path(sys.argv[2])
    ctx = prague.init()
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 2))
    model, optimizer = prague.prepare(base, torch.optim.SGD(base.parameters(), lr=0.1), algorithm)
    gen = torch.Generator().manual_seed(ctx.rank)

    def killed_before(epoch: int, where: str) -> None:
        if (epoch, ctx.rank, where) in KILLS:
            os.kill(os.getpid(), signal.SIGKILL)

    for epoch in range(EPOCHS):
        total = torch.zeros(1)
        for _ in range(STEPS):
            x = torch.randn(16, 10, generator=gen)
            loss = F.cross_entropy(model(x), (x[:, 0] > 0).long())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            total += loss.detach()
        killed_before(epoch, "averaged")
        final = model.averaged_model()
        assert isinstance(final, nn.Sequential)
        killed_before(epoch, "barrier")
        prague.barrier()
        killed_before(epoch, "checkpoint")  # the leader: the others learn of it in the all-reduce below
        mean = prague.all_reduce(total / STEPS, op="mean")
        live = prague.live_ranks()
        sent = prague.broadcast(torch.tensor([float(ctx.rank), 7.0 * epoch]))  # from the leader, whoever it is
        assert sent.tolist() == [float(prague.leader()), 7.0 * epoch], (sent, prague.leader())
        prague.log_metrics({"epoch_loss": mean.item()}, step=epoch)
        if prague.is_leader():
            torch.save({"epoch": epoch, "model": base.state_dict()}, out / f"epoch{epoch}.pt")
            print(f"leader {ctx.rank} epoch {epoch} loss {mean.item():.3f} live {live}", flush=True)
    print(f"rank {ctx.rank} done", flush=True)
    prague.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
