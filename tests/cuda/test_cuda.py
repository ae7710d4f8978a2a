"""The CUDA paths, on a machine with a CUDA device (``pytest -m cuda``; ``make gpu-check`` runs them first).

Without a device every test here skips with the reason. What they check could not be checked on the CPU:

* the background average runs on a side stream ordered by events: it reads a snapshot only after the
  snapshot's copy on the compute stream, and its result is complete once handed over; the compute
  stream never waits for it;
* a step is timed by an event on the compute stream: the clock waits for the compute stream's queued
  kernels and not for the side stream's;
* an evaluation snapshot of a CUDA model is kept in host memory;
* ``--device cuda``: several ranks share one GPU over gloo, under ``prague run`` (``allreduce`` through
  DDP with CUDA modules, ``prague``'s overlapped P-Reduce of CUDA tensors) and in a script through
  ``prague.prepare`` with float16 autocast and a ``GradScaler``.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from prague_testing import run_cli

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device: run `make gpu-check` on a machine with one"),
]

#: About 0.1-0.5 s of queued GPU time (torch.cuda._sleep spins this many clock cycles).
LONG_CYCLES = 500_000_000


def _device() -> torch.device:
    return torch.device("cuda", 0)


def test_the_side_stream_reads_a_snapshot_after_its_copy_and_hands_a_complete_result() -> None:
    from prague.comm.streams import CudaStreams

    dev = _device()
    streams = CudaStreams(dev)
    values = torch.zeros(1 << 22, device=dev)
    snapshot = torch.empty_like(values)
    torch.cuda._sleep(LONG_CYCLES)  # the step's kernels, still queued on the compute stream
    values.fill_(3.0)
    snapshot.copy_(values)  # on the compute stream, after the step
    copied = streams.mark()
    with streams.side():
        streams.wait(copied)  # without it the side stream would read the snapshot before the copy
        result = snapshot * 2.0
        done = streams.mark()
    streams.finish(done)  # what the averager does before handing the correction over
    assert done.query()
    assert bool((result == 6.0).all())


def test_the_step_clock_waits_for_the_compute_stream_and_not_for_the_side_stream() -> None:
    from prague.comm.streams import CudaStreams
    from prague.train.trainer import step_clock

    dev = _device()
    streams = CudaStreams(dev)
    clock = step_clock(dev, streams)
    with streams.side():  # a background average, long
        torch.cuda._sleep(8 * LONG_CYCLES)
        side_done = streams.mark()
    torch.cuda._sleep(LONG_CYCLES)  # this step's queued kernels
    clock()
    assert torch.cuda.current_stream(dev).query(), "the clock read the time before the step's kernels ran"
    assert not side_done.query(), "the clock waited for the side stream's average"
    side_done.synchronize()


def test_an_evaluation_snapshot_of_a_cuda_model_is_kept_on_the_host() -> None:
    from prague.train.evaluation import SnapshotLog, host_state

    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2)).to(_device())
    state = host_state(model)
    assert state.device.type == "cpu"
    expected = torch.cat([p.detach().flatten().cpu() for p in model.parameters()])
    assert torch.equal(state[:expected.numel()], expected)
    log = SnapshotLog(every_s=0.5)
    log.observe(model, 0.0)
    log.observe(model, 1.2)
    assert log.entries and all(t.device.type == "cpu" for t in log.entries.values())


@pytest.mark.parametrize("algorithm", ["allreduce", "prague"])
def test_ranks_share_one_gpu_over_gloo_under_prague_run(tmp_path: Path, algorithm: str) -> None:
    out = tmp_path / algorithm
    res = run_cli("run", "--algorithm", algorithm, "--nproc", "2", "--device", "cuda", "--backend", "gloo",
                  "--model", "cnn", "--data", "digits", "--epochs", "3", "--lr", "0.05", "--out", str(out),
                  "--quiet", timeout_s=240)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["device"] == "cuda" and summary["backend"] == "gloo", summary
    assert summary["test_accuracy"] > 0.8, summary["test_accuracy"]
    assert summary["worst_replica_accuracy"] > 0.7, summary["worst_replica_accuracy"]


AMP_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch, torch.nn.functional as F
    import prague

    algorithm, result = sys.argv[1], sys.argv[2]
    ctx = prague.init(device="cuda")
    assert ctx.device.type == "cuda" and ctx.backend == "gloo", (ctx.device, ctx.backend)
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(ctx.device)
    model, opt = prague.prepare(base, torch.optim.SGD(base.parameters(), lr=0.05, momentum=0.9), algorithm)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 24)  # large: the first steps overflow and are skipped
    gen = torch.Generator(device="cpu").manual_seed(ctx.rank)
    teacher = torch.Generator(device="cpu").manual_seed(99)
    w = torch.randn(32, 4, generator=teacher)
    losses, scales = [], []
    for step in range(120):
        x = torch.randn(64, 32, generator=gen)
        y = (x @ w).argmax(1)
        x, y = x.to(ctx.device), y.to(ctx.device)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(float(loss))
        scales.append(scaler.get_scale())
    final = model.averaged_model()
    flat = torch.cat([p.detach().flatten().cpu() for p in final.parameters()])
    own = torch.cat([p.detach().flatten().cpu() for p in model.module.parameters()])
    with open(f"{result}.{ctx.rank}", "w") as f:
        json.dump({"first": sum(losses[:10]) / 10, "last": sum(losses[-10:]) / 10, "scales": scales,
                   "averaged": flat.tolist()[:64], "own": own.tolist()[:64],
                   "finite": bool(torch.isfinite(own).all())}, f)
    prague.shutdown()
""")


@pytest.mark.parametrize("algorithm", ["allreduce", "prague"])
def test_float16_autocast_with_a_grad_scaler_through_prepare_on_a_shared_gpu(tmp_path: Path, algorithm: str) -> None:
    script, result = tmp_path / "amp.py", tmp_path / "amp"
    script.write_text(AMP_SCRIPT)
    res = run_cli("launch", "--nproc", "2", str(script), algorithm, str(result), timeout_s=240)
    assert res.returncode == 0, res.stderr[-3000:]
    seen = [json.loads(Path(f"{result}.{rank}").read_text()) for rank in range(2)]
    for rank in seen:
        assert rank["finite"]
        assert rank["scales"][0] < 2.0 ** 24, "the scaler found no overflow at a scale of 2^24"
        assert rank["last"] < 0.6 * rank["first"], (rank["first"], rank["last"])
    # skipped steps are skipped alike: the ranks' scales move together, and the averaged model is one model
    assert seen[0]["scales"] == seen[1]["scales"] or algorithm != "allreduce"
    assert seen[0]["averaged"] == pytest.approx(seen[1]["averaged"], abs=1e-6)
    if algorithm == "allreduce":  # DDP's replicas stay identical
        assert seen[0]["own"] == pytest.approx(seen[1]["own"], abs=1e-6)
