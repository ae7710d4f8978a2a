"""A worker that fails under torchrun: torchrun stops the job in bounded time, exits non-zero naming the
rank, and no process (worker, or the Group Generator that rank 0 started) is left behind.

Runs torchrun as ``python -m torch.distributed.run`` with this interpreter; what prague owes here is that
the failing rank's error reaches torchrun and that rank 0's service dies with rank 0."""

from __future__ import annotations

import json
import os
import re
import sys
import uuid
from pathlib import Path

import pytest

from prague_testing import processes_of_session, run_command

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]


def test_a_crashing_worker_under_torchrun_fails_the_job_naming_its_rank(tmp_path: Path) -> None:
    out, case = tmp_path / "crash", uuid.uuid4().hex  # every process of this job carries ``case``
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "prague", "worker", "--algorithm", "prague", "--steps", "100000", "--slowdown", "crash:1:5",
           "--compute", "emulated", "--compute-ms", "10", "--data", "synthetic", "--out", str(out)]
    # Bounded by the hard timeout: rank 0 must be stopped, not waited for (100000 steps).
    res = run_command(cmd, timeout_s=150, env={"OMP_NUM_THREADS": "1", "PRAGUE_TEST_CASE": case})
    assert res.returncode != 0
    assert "InjectedCrash" in res.stderr and "[rank 1] Traceback" in res.stderr, res.stderr[-3000:]
    # torchrun's report blames rank 1 as the first failure.
    root = res.stderr[res.stderr.index("Root Cause"):]
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", root), res.stderr[-3000:]
    assert processes_of_session(case, within_s=10.0, kill=True) == []
    assert not (out / "summary.json").exists()


@pytest.mark.parametrize("algorithm", ["allreduce", "ps:sync", "ps-eager"])
def test_torchrun_restarts_a_method_that_needs_every_rank_from_its_last_checkpoint(tmp_path: Path,
                                                                                   algorithm: str) -> None:
    # The crash fires once per job: the restarted attempt resumes at step 20, where it fired, and goes on.
    out, case = tmp_path / "restart", uuid.uuid4().hex
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
           "-m", "prague", "worker", "--algorithm", algorithm, "--steps", "40", "--checkpoint-every", "10",
           "--slowdown", "crash:1:20", "--compute", "emulated", "--compute-ms", "10", "--quiet", "--out", str(out)]
    res = run_command(cmd, timeout_s=150, env={"OMP_NUM_THREADS": "1", "PRAGUE_TEST_CASE": case})
    assert res.returncode == 0, res.stderr[-4000:]
    assert res.stderr.count("InjectedCrash: injected crash of rank 1 at step 20") == 1, res.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["completed_steps"] == [40, 40] and summary["failures"] == []
    steps = [json.loads(line)["step"] for line in (out / "metrics" / "rank1.jsonl").read_text().splitlines()]
    assert steps == list(range(40))  # the checkpoint's 20 steps, then the resumed attempt's 20
    assert processes_of_session(case, within_s=10.0, kill=True) == []
