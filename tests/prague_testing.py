"""Shared helpers: run the real CLI in a subprocess under a hard timeout, find leftover processes, and
run code in threads whose failures reach the test."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
MNIST_DIR = REPO.parent / "shared" / "datasets" / "mnist"


def _other_processes() -> Iterator[tuple[Path, str]]:
    """(``/proc/PID``, command line) of every live process but ours that we may read."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone, or not ours to read
            continue
        yield entry, cmdline


def _still_there(look: Callable[[], list[Any]], within_s: float) -> list[Any]:
    """Call ``look`` until it returns nothing or ``within_s`` has passed; its last answer."""
    deadline = time.monotonic() + within_s
    left = look()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = look()
    return left


def processes_mentioning(marker: str) -> list[int]:
    """PIDs (other than ours) whose command line contains ``marker``."""
    return [int(entry.name) for entry, cmdline in _other_processes() if marker in cmdline]


def _session_processes(token: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live process but ours whose environment carries ``token``."""
    needle = token.encode()
    out = []
    for entry, cmdline in _other_processes():
        cmdline = cmdline.strip()
        if not cmdline:  # a zombie has none: it is already dead
            continue
        if "from multiprocessing." in cmdline and _parent(entry) == os.getpid():
            continue  # this interpreter's own multiprocessing helpers (resource tracker, forkserver): they end with it
        try:
            if needle in (entry / "environ").read_bytes():
                out.append((int(entry.name), cmdline))
        except OSError:
            continue
    return out


def _parent(proc_dir: Path) -> int:
    try:
        return int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def processes_of_session(token: str, within_s: float = 15.0, kill: bool = False) -> list[tuple[int, str]]:
    """Processes carrying ``token`` in their environment still alive after ``within_s`` (killed with
    SIGKILL when ``kill``); empty when all ended in time."""
    left: list[tuple[int, str]] = _still_there(lambda: _session_processes(token), within_s)
    if kill:
        for pid, _ in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    return left


def wait_gone(marker: str, within_s: float = 15.0) -> list[int]:
    """Wait until no process mentions ``marker``; return those still there after ``within_s``."""
    pids: list[int] = _still_there(lambda: processes_mentioning(marker), within_s)
    return pids


def run_command(argv: Sequence[str], timeout_s: float = 180.0, cwd: Path | None = None,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in a session of its own; kill its whole process group if it outlives ``timeout_s``."""
    proc = subprocess.Popen(
        list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=cwd, env={**os.environ, **(env or {})}, start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(argv)} did not finish in {timeout_s} s\nstdout:\n{out}\nstderr:\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_cli(*args: str, timeout_s: float = 180.0, cwd: Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m prague ARGS``; kill its whole process group if it outlives ``timeout_s``."""
    return run_command([sys.executable, "-m", "prague", *args], timeout_s=timeout_s, cwd=cwd, env=env)


def wait_training(proc: subprocess.Popen[Any], out: Path, nproc: int, within_s: float = 90.0) -> None:
    """Wait until every rank of the run writing to ``out`` has logged a step; fail if ``proc`` ends first
    or ``within_s`` passes."""
    deadline = time.monotonic() + within_s
    metrics = [out / "metrics" / f"rank{rank}.jsonl" for rank in range(nproc)]
    while not all(m.exists() and m.stat().st_size for m in metrics):
        assert proc.poll() is None, f"the run ended (code {proc.returncode}) before every rank trained"
        assert time.monotonic() < deadline, f"the workers logged no step within {within_s} s"
        time.sleep(0.1)


@pytest.fixture
def mnist_dir() -> Path:
    if not MNIST_DIR.is_dir():
        pytest.skip(f"MNIST not found at {MNIST_DIR}")
    return MNIST_DIR


@dataclass(frozen=True)
class ShortRun:
    """A short real training run of the MLP on digits that saves the averaged model (``OUT/model.pt``)."""

    nproc: int = 4
    steps: int = 10
    batch_size: int = 16
    lr: float = 0.05
    momentum: float = 0.9
    seed: int = 3

    def args(self) -> list[str]:
        return ["--nproc", str(self.nproc), "--steps", str(self.steps), "--batch-size", str(self.batch_size),
                "--lr", str(self.lr), "--momentum", str(self.momentum), "--seed", str(self.seed),
                "--model", "mlp", "--data", "digits", "--save-model"]


SHORT_RUN = ShortRun()


@pytest.fixture(scope="session")
def allreduce_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output folder of ``allreduce`` over :data:`SHORT_RUN`, run once per session and shared: compared
    with one process by tests/algorithms/test_allreduce.py and with the synchronous parameter server by
    tests/algorithms/test_ps.py; its summary and metric files are checked by tests/runtime/test_launcher.py."""
    out = tmp_path_factory.mktemp("allreduce") / "run"
    res = run_cli("run", "--algorithm", "allreduce", *SHORT_RUN.args(), "--out", str(out), "--quiet")
    assert res.returncode == 0, res.stderr
    return out


class CheckedThread(threading.Thread):
    """A thread whose failure reaches the test: whatever ``target(*args)`` raises (a failed assert,
    ``pytest.fail``, ``pytest.raises`` not satisfied, any error) is re-raised by :meth:`join` in the
    test's thread, and a thread still running when ``join``'s timeout expires fails the test. Its
    return value is :attr:`result`. A daemon, so a hung thread cannot keep pytest from exiting."""

    def __init__(self, target: Callable[..., Any], *args: Any, name: str | None = None) -> None:
        super().__init__(name=name, daemon=True)
        self._call = target, args
        self.result: Any = None
        self.error: BaseException | None = None
        self.failed_at = float("inf")

    def run(self) -> None:
        target, args = self._call
        try:
            self.result = target(*args)
        except BaseException as error:  # noqa: BLE001 - re-raised by join() in the test's thread
            self.error, self.failed_at = error, time.monotonic()

    def join(self, timeout: float | None = None) -> None:
        join_all([self], timeout)


def start_thread(target: Callable[..., Any], *args: Any, name: str | None = None) -> CheckedThread:
    """Start ``target(*args)`` in a :class:`CheckedThread`; the test must ``join()`` it."""
    thread = CheckedThread(target, *args, name=name)
    thread.start()
    return thread


def join_all(threads: Sequence[CheckedThread], timeout_s: float | None) -> None:
    """Wait for every thread (``timeout_s`` for all of them together), then re-raise the error that was
    raised first (later ones are often its consequences: a peer's broken barrier), or fail naming the
    threads still running."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for thread in threads:
        threading.Thread.join(thread, None if deadline is None else max(0.0, deadline - time.monotonic()))
    errors = [(t.failed_at, error) for t in threads if (error := t.error) is not None]
    if errors:
        raise min(errors, key=lambda e: e[0])[1]
    hung = [t.name for t in threads if t.is_alive()]
    if hung:
        pytest.fail(f"threads {hung} still running after {timeout_s} s", pytrace=False)


def bench_records(folder: Path) -> list[dict[str, Any]]:
    """The run records in ``folder/bench.json`` (``prague bench`` or ``prague simulate``)."""
    import json

    return list(json.loads((Path(folder) / "bench.json").read_text())["records"])


#: The file whose lock :func:`netns_lock` holds (empty; one per machine, kept).
NETNS_LOCK = Path(tempfile.gettempdir()) / "prague-tests-netns.lock"


@pytest.fixture
def netns_lock() -> Iterator[None]:
    """Held by every test that builds network namespaces, from its set-up to its tear-down, so that under
    ``make test``'s two pytest workers such tests run one at a time: each counts the namespaces and cleans up
    the leftovers of dead owners, which another test's emulated hosts built beside it would upset. Tests of
    any other kind run beside them. The lock is the machine's, so two test runs at once keep apart too."""
    fd = os.open(NETNS_LOCK, os.O_RDONLY | os.O_CREAT, 0o666)  # read-only: another user's file locks as well
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # bounded by the test's pytest-timeout
        yield
    finally:
        os.close(fd)  # releases the lock
