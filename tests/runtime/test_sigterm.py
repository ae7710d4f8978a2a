"""SIGTERM to the launcher of ``prague run`` (what ``kill PID``, systemd or a batch scheduler sends):
the same as Ctrl-C (tests/runtime/test_launcher.py): every worker and service stopped, exit 130."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from prague_testing import processes_of_session, wait_training

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]


def test_sigterm_to_the_launcher_stops_every_worker_and_service(tmp_path: Path) -> None:
    out, case = tmp_path / "terminated", uuid.uuid4().hex  # every process of this run carries ``case``
    launcher = subprocess.Popen(
        [sys.executable, "-m", "prague", "run", "--algorithm", "prague", "--nproc", "2", "--steps", "1000000",
         "--compute", "emulated", "--compute-ms", "20", "--data", "synthetic", "--out", str(out), "--quiet"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "PRAGUE_TEST_CASE": case},
    )
    try:
        wait_training(launcher, out, nproc=2)
        services = json.loads((out / "services.json").read_text())["services"]
        assert [s["name"] for s in services] == ["group-generator"]
        os.kill(services[0]["pid"], 0)  # the Group Generator runs: it must be stopped too
        assert len(processes_of_session(case, within_s=0)) >= 4  # launcher, fork server, 2 workers, service
        launcher.send_signal(signal.SIGTERM)  # to the launcher alone, not its process group
        sent = time.monotonic()
        _, err = launcher.communicate(timeout=60)
        took_s = time.monotonic() - sent
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.communicate()
    assert launcher.returncode == 130, err
    assert "interrupted; all worker processes stopped" in err
    assert took_s < 15, f"the launcher took {took_s:.1f} s to stop after SIGTERM"  # grace period 5 s, then SIGKILL
    assert processes_of_session(case, within_s=10.0, kill=True) == []
    # Nothing half-written: no summary (the run did not finish), no atomic write's temporary file left.
    assert not (out / "summary.json").exists()
    assert [p.name for p in out.rglob(".*.json.*")] == []
    json.loads((out / "services.json").read_text())
