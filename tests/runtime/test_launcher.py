"""The launcher: success, a failing worker, Ctrl-C, torchrun, and no process left behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prague_testing import REPO, processes_mentioning, run_cli

pytestmark = pytest.mark.timeout(240)


def _wait_gone(marker: str, within_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        left = processes_mentioning(marker)
        if not left:
            return []
        time.sleep(0.2)
    return processes_mentioning(marker)


def test_run_writes_summary_and_metrics(tmp_path: Path) -> None:
    out = tmp_path / "ok"
    res = run_cli("run", "--algorithm", "allreduce", "--nproc", "2", "--steps", "12", "--out", str(out), "--quiet")
    assert res.returncode == 0, res.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["algorithm"] == "allreduce" and summary["nproc"] == 2
    assert summary["compute_mode"] == "real" and summary["scenario"] == "homogeneous"
    assert summary["throughput_samples_per_s"] > 0
    assert summary["no_wait_limit_samples_per_s"] >= summary["throughput_samples_per_s"] * 0.5
    assert 0.0 < summary["test_accuracy"] <= 1.0
    assert summary["consensus_distance"] == pytest.approx(0.0, abs=1e-6)  # DDP replicas stay identical
    for rank in range(2):
        lines = (out / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()
        assert len(lines) == 12
        rec = json.loads(lines[-1])
        assert {"compute_s", "comm_s", "wait_s", "loss", "step"} <= rec.keys() and rec["step"] == 11


def test_failing_worker_stops_the_job_with_its_traceback(tmp_path: Path) -> None:
    out = tmp_path / "crash"
    t0 = time.monotonic()
    res = run_cli("run", "--nproc", "3", "--steps", "100000", "--slowdown", "crash:1:3", "--out", str(out), "--quiet")
    assert res.returncode == 1
    assert "worker rank 1 failed" in res.stderr
    assert "InjectedCrash" in res.stderr and "Traceback" in res.stderr
    assert time.monotonic() - t0 < 120  # bounded: the other ranks were stopped, not waited for
    assert _wait_gone(str(out)) == []


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
    assert _wait_gone(str(script)) == []


def test_ctrl_c_stops_every_worker(tmp_path: Path) -> None:
    out = tmp_path / "interrupted"
    proc = subprocess.Popen(
        [sys.executable, "-m", "prague", "run", "--nproc", "2", "--steps", "1000000", "--out", str(out), "--quiet"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
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
    assert _wait_gone(str(out)) == []


def _torchrun() -> str:
    exe = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("torchrun not installed beside this Python")
    return exe


def test_worker_entry_point_under_torchrun(tmp_path: Path) -> None:
    out = tmp_path / "torchrun"
    cmd = [_torchrun(), "--standalone", "--nproc-per-node", "2", "-m", "prague", "worker",
           "--algorithm", "allreduce", "--steps", "8", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["nproc"] == 2 and summary["steps"] == 8


def test_example_runs_under_launch_and_torchrun(tmp_path: Path) -> None:
    example = str(REPO / "examples" / "custom_loop.py")
    res = run_cli("launch", "--nproc", "2", example, "--steps", "60", "--save", str(tmp_path / "a.pt"))
    assert res.returncode == 0, res.stderr
    assert "final test accuracy" in res.stdout and (tmp_path / "a.pt").exists()
    cmd = [_torchrun(), "--standalone", "--nproc-per-node", "2", example, "--steps", "60", "--save", str(tmp_path / "b.pt")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / "b.pt").exists()
