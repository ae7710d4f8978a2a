"""Checkpoints and resume (issue: reliability): atomic per-rank files, only complete checkpoints resumed,
a resumed run equal to one never interrupted, and a launcher killed with SIGKILL leaving no process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from prague.errors import ConfigError
from prague.train import checkpoint
from prague_testing import run_cli, wait_gone

pytestmark = pytest.mark.timeout(300)


def _state(step: int, value: float = 1.0) -> checkpoint.WorkerState:
    return checkpoint.WorkerState(step=step, model={"w": torch.full((3,), value)}, optimizer=None,
                                  trainer={"steps_done": step, "ema_s": None}, records=[], snapshots=[],
                                  wall_s=float(step), rng=checkpoint.rng_state())


def test_a_checkpoint_is_complete_only_once_every_rank_wrote_it(tmp_path: Path) -> None:
    assert checkpoint.latest_complete(tmp_path, 3) is None
    assert not checkpoint.write(tmp_path, 0, 3, _state(10))
    assert not checkpoint.write(tmp_path, 2, 3, _state(10))
    assert checkpoint.latest_complete(tmp_path, 3) is None
    assert checkpoint.write(tmp_path, 1, 3, _state(10))  # the last rank completes it
    assert checkpoint.latest_complete(tmp_path, 3) == 10
    assert (checkpoint.step_dir(tmp_path, 10) / checkpoint.COMPLETE).is_file()
    for rank in (0, 1):  # step 20 half written: step 10 stays the one to resume
        checkpoint.write(tmp_path, rank, 3, _state(20, value=2.0))
    assert checkpoint.resume_step(tmp_path, 3) == 10
    assert torch.equal(checkpoint.read(tmp_path, 10, 1).model["w"], torch.ones(3))
    with pytest.raises(ConfigError, match="no complete checkpoint of 4 workers"):
        checkpoint.resume_step(tmp_path, 4)


def test_older_checkpoints_are_removed_but_the_one_before_the_newest(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        for rank in range(2):
            checkpoint.write(tmp_path, rank, 2, _state(step))
    kept = sorted(p.name for p in (tmp_path / checkpoint.CHECKPOINTS_DIR).iterdir())
    assert kept == ["step-00000020", "step-00000030"]


def test_a_write_cut_short_leaves_no_file_and_a_corrupt_one_is_named(tmp_path: Path, monkeypatch) -> None:
    def dies(*args: object) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", dies)  # killed between writing the temporary file and the rename
    with pytest.raises(OSError):
        checkpoint.write(tmp_path, 0, 1, _state(5))
    monkeypatch.undo()
    assert list(checkpoint.step_dir(tmp_path, 5).iterdir()) == []  # neither the file nor its temporary
    assert checkpoint.latest_complete(tmp_path, 1) is None
    bad = checkpoint.step_dir(tmp_path, 6) / "rank0.pt"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="rank0.pt"):
        checkpoint.read(tmp_path, 6, 0)


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


@pytest.mark.slow
def test_a_resumed_run_ends_where_the_uninterrupted_one_does(tmp_path: Path) -> None:
    """allreduce on real data: resuming from step 20 of 40 gives the very same model (data order, RNG,
    optimizer momentum all restored) and a summary covering all 40 steps."""
    common = ["--algorithm", "allreduce", "--nproc", "2", "--steps", "40", "--batch-size", "16", "--quiet",
              "--checkpoint-every", "20", "--save-model"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    for out in (whole, resumed):  # the same run twice; the second is then resumed from its checkpoint
        assert run_cli("run", *common, "--out", str(out), timeout_s=120).returncode == 0
    assert checkpoint.latest_complete(resumed, 2) == 20  # the last step writes none: the summary is there
    (resumed / "model.pt").unlink()
    res = run_cli("run", "--resume", str(resumed), timeout_s=120)
    assert res.returncode == 0, res.stderr
    assert "from its checkpoint at step 20" in res.stdout
    a, b = torch.load(whole / "model.pt"), torch.load(resumed / "model.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    s = _summary(resumed)
    assert s["completed_steps"] == [40, 40] and s["test_accuracy"] == _summary(whole)["test_accuracy"]
    assert len((resumed / "metrics" / "rank0.jsonl").read_text().splitlines()) == 40


@pytest.mark.slow
def test_sigkill_to_the_launcher_leaves_no_process_and_resume_finishes(tmp_path: Path) -> None:
    """prague (with its Group Generator service) killed mid-run with SIGKILL: every worker and the
    service are gone within 10 s, and ``--resume`` trains from the last complete checkpoint to the end."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "prague", "run", "--algorithm", "prague", "--nproc", "3", "--steps", "120",
           "--compute", "emulated", "--compute-ms", "40", "--checkpoint-every", "10", "--out", str(out), "--quiet"]
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while (checkpoint.latest_complete(out, 3) or 0) < 20:
            assert launcher.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, "no complete checkpoint at step 20 within 90 s"
            time.sleep(0.05)
        assert any("gg.address" in " ".join(_cmdline(pid)) for pid in _mentioning(str(out)))  # the service runs
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        assert wait_gone(str(out), within_s=10.0) == []
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    step = checkpoint.latest_complete(out, 3)
    assert step is not None and step >= 20 and not (out / "summary.json").exists()
    res = run_cli("run", "--resume", str(out), timeout_s=120)
    assert res.returncode == 0, res.stderr
    s = _summary(out)
    assert s["completed_steps"] == [120, 120, 120] and s["failures"] == []
    assert wait_gone(str(out), within_s=10.0) == []


def _mentioning(marker: str) -> list[int]:
    from prague_testing import processes_mentioning

    return processes_mentioning(marker)


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


@pytest.mark.parametrize(("args", "expected"), [
    (["--steps", "5"], ["--resume", "--steps", "drop"]),
    (["--algorithm", "prague"], ["--algorithm", "drop"]),
])
def test_resume_with_other_settings_is_refused(tmp_path: Path, args: list[str], expected: list[str]) -> None:
    res = run_cli("run", "--resume", str(tmp_path), *args, timeout_s=60)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    assert all(word in res.stderr for word in expected), res.stderr


def test_resume_of_a_folder_without_a_run_or_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    res = run_cli("run", "--resume", str(tmp_path), timeout_s=60)
    assert res.returncode == 2 and "run.json" in res.stderr and "Traceback" not in res.stderr
    out = tmp_path / "done"
    assert run_cli("run", "--nproc", "1", "--steps", "3", "--out", str(out), "--quiet", timeout_s=60).returncode == 0
    res = run_cli("run", "--resume", str(out), timeout_s=60)
    assert res.returncode == 2 and "no complete checkpoint" in res.stderr and "--checkpoint-every" in res.stderr
