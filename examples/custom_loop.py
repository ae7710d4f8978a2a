"""The minimal loop: your own training loop, synchronised by prague.

Run on one machine with prague's launcher, or with torchrun (same script, no change):

    prague launch --nproc 4 examples/custom_loop.py --algorithm prague --steps 200
    torchrun --standalone --nproc-per-node 4 examples/custom_loop.py --algorithm allreduce --steps 200

Each rank trains a small MLP on its own shard of scikit-learn's digits; at the end rank 0 evaluates
and saves the average of all replicas.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import prague
from prague.workload.data import ShardLoader, load_dataset

parser = argparse.ArgumentParser()
parser.add_argument("--algorithm", default="allreduce", help="any name `prague methods` lists")
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--save", default=None, help="where rank 0 saves the averaged model")
args = parser.parse_args()

ctx = prague.init()
data = load_dataset("digits")
loader = ShardLoader(data.train_x, data.train_y, ctx.rank, ctx.world_size, batch_size=32, seed=0)

torch.manual_seed(0)  # the same initial model on every rank
model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
model, optimizer = prague.prepare(model, optimizer, algorithm=args.algorithm)

for step in range(args.steps):
    x, y = loader.batch(step)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()  # the method's iteration
    optimizer.zero_grad()
    if ctx.rank == 0 and step % 50 == 0:
        print(f"step {step} loss {loss.item():.4f}")

final = model.averaged_model()  # collective: every rank calls it
if ctx.rank == 0:
    with torch.no_grad():
        accuracy = (final(data.test_x).argmax(1) == data.test_y).float().mean().item()
    print(f"final test accuracy {accuracy:.4f}")
    if args.save:
        torch.save(final.state_dict(), args.save)
prague.shutdown()
