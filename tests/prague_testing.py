"""Shared helpers: run the real CLI in a subprocess under a hard timeout, and find leftover processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MNIST_DIR = REPO.parent / "shared" / "datasets" / "mnist"


def processes_mentioning(marker: str) -> list[int]:
    """PIDs (other than ours) whose command line contains ``marker``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            pids.append(int(entry.name))
    return pids


def run_cli(*args: str, timeout_s: float = 180.0, cwd: Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m prague ARGS``; kill its whole process group if it outlives ``timeout_s``."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "prague", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=cwd, env={**os.environ, **(env or {})}, start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"prague {' '.join(args)} did not finish in {timeout_s} s\nstdout:\n{out}\nstderr:\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture
def mnist_dir() -> Path:
    if not MNIST_DIR.is_dir():
        pytest.skip(f"MNIST not found at {MNIST_DIR}")
    return MNIST_DIR
