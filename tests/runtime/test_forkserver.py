"""Workers forked from the preloaded fork server: the same training as fresh interpreters, without the imports."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prague.errors import ConfigError
from prague.jobenv import JobEnv
from prague.algorithms.registry import parse_method
from prague.cli import worker_imports
from prague.runtime.forkserver import (
    TRAINING_PRELOAD, PRELOAD, ForkedWorker, _exit_code, forkable, preload_modules, running, server_pid, server_running, start_mode,
    stop,
)
from prague.train.config import RunConfig
from prague.workload.catalog import digits_split_file
from prague_testing import run_cli

pytestmark = pytest.mark.timeout(240)

RUN = ["run", "--algorithm", "prague:static", "--nproc", "2", "--steps", "12", "--batch-size", "16",
       "--model", "mlp", "--data", "digits", "--seed", "5", "--quiet"]


def test_start_mode_and_what_can_be_forked() -> None:
    assert start_mode(JobEnv.read({"PRAGUE_WORKER_START": "exec"})) == "exec"
    assert start_mode(JobEnv()) == ("fork" if sys.platform.startswith("linux") else "exec")
    with pytest.raises(ConfigError, match="PRAGUE_WORKER_START must be one of fork, exec"):
        start_mode(JobEnv.read({"PRAGUE_WORKER_START": "spawn"}))
    assert forkable([sys.executable, "-m", "prague", "worker", "--algorithm", "allreduce"])
    assert not forkable([sys.executable, "no-such-script.py"])  # not a file: exec'd, and it says so itself
    assert forkable([sys.executable, str(SCRIPT), "--flag"])  # prague launch's ranks
    assert not forkable([sys.executable, "-u", str(SCRIPT)])  # interpreter options: exec'd
    assert not forkable(["/other/python", "-m", "prague", "worker"])
    assert not forkable(["/other/python", str(SCRIPT)])


def test_exit_codes_as_the_interpreter_makes_them(capsys: pytest.CaptureFixture[str]) -> None:
    assert [_exit_code(c) for c in (None, 0, 3, 256, -1)] == [0, 0, 3, 0, 255]
    assert _exit_code("bye") == 1 and capsys.readouterr().err == "bye\n"


def test_a_worker_whose_fork_server_died_says_its_exit_was_lost(tmp_path: Path) -> None:
    """The fork server killed under a running worker, a plain script that never joins prague's context: the
    script dies with the server (parent-death signal), ``multiprocessing`` reports 255 for it (its exit can no
    longer be reported), and the worker's account of that code says the server had exited."""
    script = tmp_path / "sleeper.py"
    script.write_text("import time\ntime.sleep(60)\n")
    worker = ForkedWorker([sys.executable, str(script)], dict(os.environ))
    try:
        assert server_running() is True and worker.poll() is None and worker.lost_exit() is None
        pid = server_pid()
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while worker.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.poll() == 255 and server_running() is False
        assert "fork server had exited" in (worker.lost_exit() or "")
        while running(worker.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running(worker.pid)  # it would have slept 60 s
    finally:
        try:
            os.kill(worker.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        stop()
    assert server_running() is None  # stopped and forgotten: the next fork starts a new server


# A launched script that shows what it ran as: its name, arguments, folder on sys.path, exit handlers and code.
SCRIPT_TEXT = """
import atexit, json, os, sys
from pathlib import Path
rank = int(os.environ["RANK"])
out = Path(sys.argv[1])
atexit.register(lambda: (out / f"exit{rank}").write_text("ran"))
(out / f"rank{rank}.json").write_text(json.dumps({"name": __name__, "argv": sys.argv[1:], "file": __file__,
                                                 "first": sys.path[0] == os.path.dirname(os.path.abspath(__file__))}))
if rank == 1 and len(sys.argv) > 2:
    sys.exit(int(sys.argv[2]))
"""
SCRIPT = Path(__file__)  # any existing .py file can stand for a script


@pytest.mark.parametrize("start", ["fork", "exec"])
def test_a_launched_script_runs_as_a_fresh_interpreter_runs_it(tmp_path: Path, start: str) -> None:
    """``prague launch``'s ranks are forked from the preloaded server (or exec'd): either way the script is
    ``__main__`` with its own arguments and folder, its exit handlers run, and its exit code is the rank's."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT_TEXT)
    for code in (None, 3):
        out = tmp_path / f"{start}-{code}"
        out.mkdir()
        args = [str(out)] + ([] if code is None else [str(code)])
        res = run_cli("launch", "--nproc", "2", str(script), *args, env={"PRAGUE_WORKER_START": start})
        assert (res.returncode == 0) == (code is None), res.stderr
        for rank in range(2):
            seen = json.loads((out / f"rank{rank}.json").read_text())
            assert seen == {"name": "__main__", "argv": args, "file": str(script), "first": True}
            assert (out / f"exit{rank}").read_text() == "ran"
        if code is not None:
            assert "worker rank 1 failed (exit code 3)" in res.stderr, res.stderr


def _losses(out: Path) -> list[list[float]]:
    return [[json.loads(line)["loss"] for line in (out / "metrics" / f"rank{r}.jsonl").read_text().splitlines()]
            for r in range(2)]


def test_forked_workers_train_exactly_like_fresh_interpreters(tmp_path: Path) -> None:
    forked, execd = tmp_path / "fork", tmp_path / "exec"
    res = run_cli(*RUN, "--out", str(forked), env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert res.returncode == 0, res.stderr
    res = run_cli(*RUN, "--out", str(execd), env={"PRAGUE_WORKER_START": "exec"})
    assert res.returncode == 0, res.stderr
    assert _losses(forked) == _losses(execd)
    a, b = (json.loads((d / "summary.json").read_text()) for d in (forked, execd))
    assert a["test_accuracy"] == b["test_accuracy"] is not None
    # The forked workers imported neither torch nor scikit-learn themselves: the fork server had.
    for r in range(2):
        imported = re.findall(r"import time:.*\|\s+(\S+)$", (forked / "logs" / f"rank{r}.log").read_text(), re.M)
        assert "prague.runtime.worker" in imported  # the profile reached the worker's log
        assert not {"torch", "torch._dynamo", "sklearn"} & set(imported), imported


def test_the_fork_server_preloads_neither_the_simulator_nor_plotting_nor_scikit_learn() -> None:
    """What every forked worker inherits: the runtime, not the simulator; scikit-learn only for digits jobs,
    ``torch._dynamo`` (which every optimizer imports) only for jobs that train."""
    code = f"import json, sys, {PRELOAD}; print(json.dumps(sorted(sys.modules)))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr
    imported = set(json.loads(res.stdout))
    assert {"torch", "prague.train.loop", "prague.algorithms.prague.runtime",
            "prague.algorithms.allreduce.backup"} <= imported  # the variants' runtimes too
    assert "torch._dynamo" not in imported  # emulated compute trains nothing: no optimizer, no dynamo
    assert not {m for m in imported if m.split(".")[0] in ("sklearn", "matplotlib")}
    assert not {m for m in imported if m.startswith(("prague.sim", "prague.simulate"))}
    assert TRAINING_PRELOAD == ("torch._dynamo",)


def test_the_server_preloads_what_the_jobs_workers_would_import_each(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Emulated compute: prague's runtime only, plus DDP's torch._dynamo for allreduce; training: the
    optimizers' torch._dynamo and the data set's loader, scikit-learn for digits until its split is kept."""
    monkeypatch.setenv("HOME", str(tmp_path))

    def job(algorithm: str, compute: str, data: str = "digits") -> list[str]:
        cfg = RunConfig(algorithm, "homogeneous", 2, str(tmp_path / "out"), compute=compute, data=data, seed=11)
        return preload_modules(not cfg.emulated, worker_imports(cfg))

    sklearn = ["sklearn.datasets", "sklearn.model_selection"]
    assert parse_method("allreduce:drop")[0].worker_imports == ("torch._dynamo",)
    assert job("prague", "emulated") == [PRELOAD]
    assert job("allreduce:backup", "emulated") == [PRELOAD, "torch._dynamo"]
    assert job("prague", "real") == [PRELOAD, "torch._dynamo", *sklearn]
    assert job("allreduce", "paced", "synthetic") == [PRELOAD, "torch._dynamo"]  # once
    (tmp_path / ".cache" / "prague").mkdir(parents=True)
    split = digits_split_file(11)
    assert split is not None
    split.write_bytes(b"")  # kept (whether it reads is the loader's business)
    assert job("prague", "real") == [PRELOAD, "torch._dynamo"]
