"""``prague.prepare``: the user's own loop (backward, step, zero_grad) with every piece of a real training
script, on real worker processes. The checks themselves run inside the job (``prepared_checks.py``);
here they are started alone (a job of one) and under ``prague launch``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from prague_testing import run_cli, run_command

pytestmark = pytest.mark.timeout(240)

CHECKS = Path(__file__).with_name("prepared_checks.py")


def test_a_job_of_one_runs_every_check_with_allreduce() -> None:
    res = run_command([sys.executable, str(CHECKS), "order,accumulation,features,compiled", "allreduce"], timeout_s=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ok order,accumulation,features,compiled" in res.stdout


def test_a_job_of_one_compiles_the_prepared_model_without_a_graph_break() -> None:
    """adpsgd here (a method whose module is the user's; prague under prague launch, allreduce above): the
    prepared model's own path is the same for every such method."""
    res = run_command([sys.executable, str(CHECKS), "compiled", "adpsgd"], timeout_s=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ok compiled" in res.stdout


@pytest.mark.slow
@pytest.mark.parametrize("algorithm,checks", [
    ("allreduce", "order,accumulation,features,unused,ddp_options"),  # a gradient method: DDP inside backward
    ("prague", "order,features,unused,compiled"),  # an averaging method: a Group Generator and background averages
    ("eager-sgd", "order,scaler_refused"),  # a lockstep method whose gradients travel in the step
    ("ps-eager", "order"),  # a parameter server: rank 0 starts the shards, the model installs their values
    ("allreduce:backup", "order"),  # rounds of the first n - b gradients; a worker may be counted out of them
    ("allreduce:drop", "order"),  # DDP behind a front whose target changes when a rank leaves
    ("localsgd", "order,rounds"),  # a lockstep method that averages parameters every few steps
    ("diloco", "features,rounds"),  # the same rounds with an outer step, under the paper's inner AdamW
])
def test_two_workers_under_prague_launch(algorithm: str, checks: str) -> None:
    res = run_cli("launch", "--nproc", "2", str(CHECKS), checks, algorithm, timeout_s=200)
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-3000:])
    assert f"ok {checks}" in res.stdout


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["guard"])
def test_the_users_model_is_the_module_under_every_method(launcher: str, tmp_path: Path) -> None:
    """Every method and variant prepared in turn in one job of two workers (prepared_checks.py's
    module_everywhere), under torchrun's prague guard (prague launch prepares each method in the tests
    above): model.module is the user's model, its parameters once, it trains, and once each is closed
    prague.shutdown() leaves no process group behind. ("launch" runs it under prague launch.)"""
    args = [str(CHECKS), "module_everywhere", "allreduce"]
    if launcher == "launch":
        res = run_cli("launch", "--nproc", "2", *args, timeout_s=200)
    else:
        res = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "prague", "guard", "--out", str(tmp_path), *args], timeout_s=200,
                          env={"OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-3000:])
    assert "ok module_everywhere" in res.stdout


def test_prepare_before_init_says_to_call_init_first() -> None:
    """A script that prepares its model before ``prague.init()`` gets one line naming both calls, exit 2."""
    script = ("import torch, prague\n"
              "m = torch.nn.Linear(2, 2)\n"
              "prague.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1), 'prague')\n")
    res = run_command([sys.executable, "-c", script], timeout_s=60)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert lines == ["prague: error: prague.init() has not been called in this process; call it first, on every "
                     "rank, before prague.prepare() or prague.wrap()"], res.stderr[-2000:]
    other = run_command([sys.executable, "-c", "import prague.runtime.context\nraise RuntimeError('not ours')"],
                        timeout_s=60)
    assert other.returncode == 1 and "Traceback" in other.stderr and "RuntimeError: not ours" in other.stderr
