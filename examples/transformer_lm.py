"""A realistic loop: a small transformer language model, trained with prague like any PyTorch script.

A character-level GPT-style model (about 3.3 million parameters with the defaults) learns the text of
Python's own standard library (its source files ship with every Python). Everything a real training
script has is here: AdamW, linear warm-up then cosine decay, mixed precision (float16 with a GradScaler on
CUDA; bfloat16 autocast on a CPU that computes bfloat16 natively, float32 on one that would only emulate it,
many times slower), gradient clipping, and gradient accumulation over micro-batches
(``model.no_sync()``, as with DDP). The synchronisation method is one argument.

    prague launch --nproc 4 examples/transformer_lm.py --algorithm prague --steps 300
    torchrun --standalone --nproc-per-node 4 examples/transformer_lm.py --algorithm allreduce --steps 300

Each rank reads its own windows of the text; at the end every rank reports the loss of the average of
the replicas on held-out text (the last tenth), and rank 0 prints a few generated characters.
"""

import argparse
import contextlib
import math
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import prague

parser = argparse.ArgumentParser()
parser.add_argument("--algorithm", default="allreduce", help="any name `prague methods` lists")
parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
parser.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch")
parser.add_argument("--context", type=int, default=128, help="characters per sequence")
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--width", type=int, default=256)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--warmup", type=int, default=30, help="warm-up steps, then cosine decay to 10%")
parser.add_argument("--precision", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="on the CPU: auto takes bfloat16 where the CPU has it natively, else float32")
args = parser.parse_args()


def cpu_has_bfloat16() -> bool:
    """Whether this CPU computes bfloat16 natively: AVX512-BF16 or AMX on x86, BF16 on Arm (Linux's flags)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def corpus(limit: int = 2_000_000) -> torch.Tensor:
    """The bytes of the standard library's source files, in a fixed order (the same on every rank)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_bytes()
        chunks.append(text)
        size += len(text)
        if size >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


class TinyGPT(nn.Module):
    """Byte embeddings, learned positions, causal self-attention blocks, a tied output layer."""

    def __init__(self, layers: int, width: int, context: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        nn.init.normal_(self.embed.weight, std=0.02)  # small logits at the start: a loss near ln 256
        self.position = nn.Parameter(torch.zeros(context, width))
        block = nn.TransformerEncoderLayer(width, nhead=max(1, width // 64), dim_feedforward=4 * width,
                                           dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        h = self.embed(tokens) + self.position[:n]
        h = self.blocks(h, mask=self.mask[:n, :n], is_causal=True)
        return self.norm(h) @ self.embed.weight.T  # logits over the 256 byte values


def windows(text: torch.Tensor, count: int, context: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(text) - context - 1, (count,), generator=gen)
    rows = torch.stack([text[s:s + context + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def schedule(step: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < args.warmup:
        return (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


ctx = prague.init()
device = ctx.device
text = corpus()
split = len(text) * 9 // 10
train_text, held_out = text[:split], text[split:]
torch.manual_seed(0)  # the same initial model on every rank
model = TinyGPT(args.layers, args.width, args.context).to(device)
if ctx.rank == 0:
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {len(text) / 1e6:.1f}M characters, "
          f"{ctx.world_size} workers, method {args.algorithm}")
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
model, optimizer = prague.prepare(model, optimizer, algorithm=args.algorithm)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
cuda = device.type == "cuda"
if cuda:
    dtype = torch.float16
elif args.precision == "bfloat16" or (args.precision == "auto" and cpu_has_bfloat16()):
    dtype = torch.bfloat16
else:
    dtype = torch.float32  # autocast off: float32 throughout
if ctx.rank == 0:
    print(f"precision {str(dtype).removeprefix('torch.')} on {device.type}")
scaler = torch.amp.GradScaler("cuda", enabled=cuda)  # float16 needs a scaler; bfloat16 does not
gen = torch.Generator().manual_seed(1000 + ctx.rank)  # each rank its own windows

for step in range(args.steps):
    for micro in range(args.accumulate):
        x, y = (t.to(device) for t in windows(train_text, args.batch_size, args.context, gen))
        last = micro == args.accumulate - 1  # its forward runs outside no_sync: its backward synchronises
        with contextlib.nullcontext() if last else model.no_sync():
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()) / args.accumulate
            scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)  # the method's iteration
    scaler.update()
    optimizer.zero_grad()
    scheduler.step()
    if ctx.rank == 0 and (step % 50 == 0 or step == args.steps - 1):
        print(f"step {step} loss {loss.item() * args.accumulate:.3f} lr {scheduler.get_last_lr()[0]:.2e}")

final = model.averaged_model()  # collective: the mean of the replicas
final.eval()
with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
    x, y = (t.to(device) for t in windows(held_out, 32, args.context, torch.Generator().manual_seed(7)))
    held_loss = F.cross_entropy(final(x).flatten(0, 1).float(), y.flatten()).item()
print(f"rank {ctx.rank}: held-out loss of the averaged model {held_loss:.3f} ({held_loss / math.log(2):.2f} bits/char)")
if ctx.rank == 0:
    tokens = x[:1, : args.context // 2]
    with torch.no_grad():
        for _ in range(40):
            logits = final(tokens[:, -args.context:])[:, -1]
            tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
    print("sample:", bytes(tokens[0, args.context // 2:].tolist()).decode("utf-8", errors="replace"))
prague.shutdown()
