"""The launcher: success, a failing worker, Ctrl-C, torchrun, and no process left behind.

Bounds on how long stopping takes are hard timeouts here; the times themselves are measured by
benchmarks/failure_detection.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prague_testing import REPO, SHORT_RUN, run_cli, wait_gone

pytestmark = pytest.mark.timeout(240)


def test_run_writes_summary_and_metrics(allreduce_run: Path) -> None:
    """On the session's shared ``allreduce`` run (tests/prague_testing.py, ``SHORT_RUN``)."""
    nproc, steps, batch = SHORT_RUN.nproc, SHORT_RUN.steps, SHORT_RUN.batch_size
    summary = json.loads((allreduce_run / "summary.json").read_text())
    assert summary["algorithm"] == "allreduce" and summary["nproc"] == nproc and summary["steps"] == steps
    assert summary["compute_mode"] == "real" and summary["scenario"] == "homogeneous"
    assert 0.0 < summary["test_accuracy"] <= 1.0
    assert summary["consensus_distance"] == pytest.approx(0.0, abs=1e-6)  # DDP replicas stay identical
    records = []
    for rank in range(nproc):
        lines = (allreduce_run / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()
        assert len(lines) == steps
        records.append([json.loads(line) for line in lines])
        assert {"compute_s", "comm_s", "wait_s", "loss", "step"} <= records[-1][-1].keys()
        assert [r["step"] for r in records[-1]] == list(range(steps))
    # The summary's rates are those of the per-step records, after the default warm-up of min(5, steps // 5)
    # steps: the steps that ended in the common window (every worker warm, none finished) over its length,
    # and batch over the median step compute time for every worker (the no-wait limit; no slowdowns here).
    warmup = min(5, steps // 5)
    start = max(r[warmup - 1]["t_end_s"] for r in records)
    end = min(r[-1]["t_end_s"] for r in records)
    inside = sum(1 for r in records for x in r if start < x["t_end_s"] <= end)
    rate = inside * batch / (end - start)
    base = statistics.median(x["compute_s"] for r in records for x in r[warmup:])
    limit = nproc * batch / base
    assert summary["throughput_samples_per_s"] == pytest.approx(rate, rel=1e-9) and rate > 0
    assert summary["no_wait_limit_samples_per_s"] == pytest.approx(limit, rel=1e-9)
    assert summary["fraction_of_limit"] == pytest.approx(rate / limit, rel=1e-9) and summary["warmup_steps"] == warmup


def test_failing_worker_stops_the_job_with_its_traceback(tmp_path: Path) -> None:
    out = tmp_path / "crash"
    # Bounded by the hard timeout: the other ranks must be stopped, not waited for (100000 steps).
    res = run_cli("run", "--nproc", "3", "--steps", "100000", "--slowdown", "crash:1:3", "--data", "synthetic",
                  "--out", str(out), "--quiet", timeout_s=120)
    assert res.returncode == 1
    assert "worker rank 1 failed" in res.stderr
    assert "InjectedCrash" in res.stderr and "Traceback" in res.stderr
    assert wait_gone(str(out), within_s=10.0) == []


def test_launch_script_that_raises_while_peer_blocks(tmp_path: Path) -> None:
    script = tmp_path / "raises.py"
    script.write_text(
        "import prague, torch, torch.distributed as dist\n"
        "ctx = prague.init()\n"
        "if ctx.rank == 1:\n"
        "    raise ValueError('boom from rank one')\n"
        "dist.barrier()  # rank 0 would wait here forever\n"
    )
    res = run_cli("launch", "--nproc", "2", str(script), timeout_s=120)
    assert res.returncode == 1
    assert "worker rank 1 failed" in res.stderr and "boom from rank one" in res.stderr
    assert wait_gone(str(script), within_s=10.0) == []


def test_ctrl_c_stops_every_worker(tmp_path: Path) -> None:
    out = tmp_path / "interrupted"
    # The launcher must start with SIGINT at its default, as under a terminal, even when this process
    # ignores it (pytest started in the background, e.g. under nohup): an ignored signal stays ignored
    # across exec, and Python then never turns SIGINT into KeyboardInterrupt. A handled one is reset.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prague", "run", "--nproc", "2", "--steps", "1000000", "--data", "synthetic",
             "--out", str(out), "--quiet"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        deadline = time.monotonic() + 90
        while not (out / "metrics" / "rank1.jsonl").exists() or not (out / "metrics" / "rank0.jsonl").stat().st_size:
            assert time.monotonic() < deadline, "workers never started"
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130
    assert "interrupted" in err
    assert wait_gone(str(out), within_s=10.0) == []


def _torchrun() -> str:
    exe = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("torchrun not installed beside this Python")
    return exe


def test_worker_entry_point_under_torchrun(tmp_path: Path) -> None:
    out = tmp_path / "torchrun"
    cmd = [_torchrun(), "--standalone", "--nproc-per-node", "2", "-m", "prague", "worker",
           "--algorithm", "allreduce", "--steps", "8", "--data", "synthetic", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["nproc"] == 2 and summary["steps"] == 8


@pytest.mark.parametrize("algorithm,launcher", [("prague", "launch"), ("allreduce", "torchrun")])
def test_the_minimal_loop_example_runs_unchanged_under_both_launchers(tmp_path: Path, algorithm: str,
                                                                        launcher: str) -> None:
    example = str(REPO / "examples" / "custom_loop.py")
    args = [example, "--algorithm", algorithm, "--steps", "60", "--save", str(tmp_path / "a.pt")]
    res = _run_example(launcher, args)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "final test accuracy" in res.stdout and (tmp_path / "a.pt").exists()


@pytest.mark.parametrize("algorithm,launcher", [("allreduce", "launch"), ("prague", "torchrun")])
def test_the_transformer_example_trains_under_both_launchers(algorithm: str, launcher: str) -> None:
    """A few steps of the small language model (AdamW, warm-up and cosine, bf16 autocast on a CPU that has
    bfloat16 and float32 on one that does not, clipping, two micro-batches accumulated) with each method,
    each launcher."""
    example = str(REPO / "examples" / "transformer_lm.py")
    args = [example, "--algorithm", algorithm, "--steps", "4", "--batch-size", "2", "--context", "32",
            "--layers", "2", "--width", "64", "--warmup", "2"]
    res = _run_example(launcher, args)
    assert res.returncode == 0, res.stderr[-3000:]
    losses = [float(m) for m in re.findall(r"held-out loss of the averaged model ([0-9.]+)", res.stdout)]
    assert losses and all(0 < x < 6.0 for x in losses), res.stdout  # ln 256 = 5.55 at the start
    assert f"method {algorithm}" in res.stdout
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    native = bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    assert f"precision {'bfloat16' if native else 'float32'} on cpu" in res.stdout, res.stdout


def _run_example(launcher: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    if launcher == "launch":
        return run_cli("launch", "--nproc", "2", *args)
    cmd = [_torchrun(), "--standalone", "--nproc-per-node", "2", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})

QUIET_SCRIPT = """
import time
import torch, torch.nn.functional as F
import prague

ctx = prague.init()
torch.manual_seed(0)
base = torch.nn.Linear(8, 2)
model, opt = prague.prepare(base, torch.optim.SGD(base.parameters(), lr=0.1), "prague:smart", group_size=2)
for step in range(30):
    if ctx.rank == 0 and step == 10:
        time.sleep(3.0)  # rank 0 evaluates: the others wait for it in their groups, past every 1 s slice
    x = torch.randn(16, 8)
    loss = F.cross_entropy(model(x), (x[:, 0] > 0).long())
    loss.backward()
    opt.step()
    opt.zero_grad()
    prague.log_metrics({"loss": loss.item(), "lr": 0.1})
final = model.averaged_model()
print(f"rank {ctx.rank} finished", flush=True)
prague.shutdown()
"""


def test_a_healthy_job_whose_leader_pauses_prints_no_store_timeouts_and_records_its_steps(tmp_path: Path) -> None:
    """No c10d "waitForInput ... timed out" lines (waits on the store look, they never time out) and no
    traceback at exit, in a prague:smart job whose rank 0 pauses three seconds mid-run; the script's steps
    and its prague.log_metrics() are recorded in --log-dir's metrics/, as prague run's workers record
    theirs."""
    script, logs = tmp_path / "quiet.py", tmp_path / "logs"
    script.write_text(QUIET_SCRIPT)
    res = run_cli("launch", "--nproc", "3", "--echo-all", "--log-dir", str(logs), "--report-to", "csv", "--timeline",
                  str(script), timeout_s=150)
    assert res.returncode == 0, res.stderr[-3000:]
    assert all(f"rank {r} finished" in res.stdout for r in range(3)), res.stdout
    console = res.stdout + res.stderr
    assert "waitForInput" not in console and "timed out" not in console, console[-3000:]
    assert "Traceback" not in console, console[-3000:]
    for rank in range(3):
        steps = [json.loads(line) for line in (logs / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()]
        assert [s["step"] for s in steps] == list(range(30)) and {s["rank"] for s in steps} == {rank}
        assert all(s["compute_s"] >= 0 and s["comm_s"] >= 0 for s in steps)
        assert max(s["t_end_s"] for s in steps) > 3.0 or rank != 0  # rank 0's pause is in its clock
        user = [json.loads(line) for line in (logs / "metrics" / f"user-rank{rank}.jsonl").read_text().splitlines()]
        assert [u["step"] for u in user] == list(range(1, 31)) and all(u["lr"] == 0.1 and u["loss"] > 0 for u in user)
        rows = (logs / "metrics" / f"rank{rank}.csv").read_text().splitlines()  # --report-to csv: the same numbers
        assert sum(",time/compute_s," in r for r in rows) == 30 and sum(",user/loss," in r for r in rows) == 30
    # --timeline: every rank's steps, and the background averages prague:smart ran, in one Chrome trace
    trace = json.loads((logs / "timeline.json").read_text())
    names = {(e.get("pid"), e.get("name")) for e in trace["traceEvents"]}
    assert {pid for pid, _ in names if pid is not None} >= {0, 1, 2}, sorted(names)[:20]
    assert list((logs / "metrics" / "background").glob("rank*.jsonl")), "no background spans were written"
