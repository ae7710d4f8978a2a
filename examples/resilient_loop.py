"""A newcomer's training script, as a DDP user writes it, that goes on when a worker dies.

Everything a real script has: a DataLoader with a DistributedSampler, AdamW with a one-cycle schedule,
bfloat16 autocast where the CPU computes it natively (float32 elsewhere; float16 with a GradScaler on
CUDA), gradient clipping, accumulation over micro-batches (``model.no_sync()``), an evaluation of the
average model at every epoch's end (``model.averaged_model()``), the leader's checkpoint, and metrics
for TensorBoard or CSV (``prague.log_metrics``). Under a method that survives failures (``prague``,
``adpsgd``, ``dssync``, ``eager-sgd``), killing a worker, even the leader, leaves the others training:
prague's own collectives run over the living ranks and the next rank leads.

    prague launch --nproc 4 --log-dir runs/resilient examples/resilient_loop.py --algorithm prague
    torchrun --standalone --nproc-per-node 4 -m prague guard --out runs/resilient examples/resilient_loop.py

(then ``kill -9`` one of the workers: ``ps`` names each ``prague rank R/4 ...``).
"""

import argparse
import contextlib
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import prague
from prague.workload.data import load_dataset

parser = argparse.ArgumentParser()
parser.add_argument("--algorithm", default="prague", help="any name `prague methods` lists")
parser.add_argument("--epochs", type=int, default=6)
parser.add_argument("--batch-size", type=int, default=16, help="samples per micro-batch")
parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of the one-cycle schedule")
parser.add_argument("--checkpoints", type=Path, default=Path("runs/resilient/checkpoints"))
args = parser.parse_args()


def cpu_has_bfloat16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16, AMX, Arm BF16: Linux's flags)."""
    try:
        return bool(set(Path("/proc/cpuinfo").read_text().split()) & {"avx512_bf16", "amx_bf16", "bf16"})
    except OSError:
        return False


ctx = prague.init()
device = ctx.device
digits = load_dataset("digits")  # scikit-learn's bundled digits: nothing to download
train_set = TensorDataset(digits.train_x, digits.train_y)
sampler = DistributedSampler(train_set, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=0)
loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)

torch.manual_seed(0)  # the same initial model on every rank
model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 10)).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
model, optimizer = prague.prepare(model, optimizer, algorithm=args.algorithm)
steps_per_epoch = len(loader) // args.accumulate
scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.epochs * steps_per_epoch)
cuda = device.type == "cuda"
dtype = torch.float16 if cuda else torch.bfloat16 if cpu_has_bfloat16() else torch.float32
scaler = torch.amp.GradScaler("cuda", enabled=cuda)
args.checkpoints.mkdir(parents=True, exist_ok=True)
if prague.is_leader():
    print(f"{ctx.world_size} workers, method {args.algorithm}, precision {str(dtype).removeprefix('torch.')}",
          flush=True)

for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    model.train()
    batches = iter(loader)
    seen = torch.zeros(2)  # summed loss, micro-batches
    for _ in range(steps_per_epoch):
        for micro in range(args.accumulate):
            x, y = (t.to(device) for t in next(batches))
            last = micro == args.accumulate - 1  # its forward runs outside no_sync: the step takes it
            with contextlib.nullcontext() if last else model.no_sync():
                with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                    loss = F.cross_entropy(model(x).float(), y) / args.accumulate
                scaler.scale(loss).backward()
            seen += torch.tensor([loss.item() * args.accumulate, 1.0])
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        scheduler.step()
    # the epoch's end, on the ranks still alive: the mean training loss, the average model's accuracy
    mean_loss = prague.all_reduce(seen[:1] / seen[1], op="mean").item()
    final = model.averaged_model()
    final.eval()
    with torch.no_grad():
        accuracy = (final(digits.test_x.to(device)).argmax(1).cpu() == digits.test_y).float().mean().item()
    prague.log_metrics({"loss": mean_loss, "accuracy": accuracy, "lr": scheduler.get_last_lr()[0]})
    if prague.is_leader():  # the lowest living rank: it moves when the leader dies
        torch.save({"epoch": epoch, "model": final.state_dict()}, args.checkpoints / f"epoch{epoch}.pt")
        print(f"epoch {epoch}: loss {mean_loss:.3f}, accuracy of the average model {accuracy:.4f}, "
              f"leader rank {ctx.rank}, living ranks {prague.live_ranks()}", flush=True)
print(f"rank {ctx.rank} done", flush=True)
prague.shutdown()
