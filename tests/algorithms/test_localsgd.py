"""``localsgd`` and ``diloco``: H local steps, then an average over all workers (and DiLoCo's outer step).

Real runs on two workers: ``localsgd`` with H = 1 and plain SGD ends where ``allreduce`` does; ``diloco``
with outer learning rate 1 and no momentum ends where ``localsgd`` does with the same H; the replicas are
equal after the last round; both train on digits under a job-wide budget, run under torchrun and in the
simulator. The replicas drifting apart inside a round and meeting at its end, through the user's own loop,
is tests/train/prepared_checks.py's ``rounds`` check.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prague.algorithms.diloco import DiLoCoOptions
from prague.algorithms.diloco.outer import outer_rule, outer_step
from prague.algorithms.localsgd import LocalSGDOptions
from prague.algorithms.registry import get_method
from prague.cli import main
from prague.errors import ConfigError
from prague_testing import bench_records, run_cli

pytestmark = pytest.mark.timeout(240)

#: Two workers, plain SGD (no momentum: Local SGD with H = 1 is then allreduce's update), 10 steps.
PLAIN = ["--nproc", "2", "--batch-size", "16", "--lr", "0.1", "--momentum", "0", "--seed", "5",
         "--model", "mlp", "--data", "digits", "--save-model", "--quiet"]
TEN_STEPS = ("--steps", "10")
#: The same ten steps as a job-wide budget: 2 workers x 10 steps x 16 samples.
TEN_STEPS_BUDGET = ("--budget", "samples:320")


def _run(out: Path, algorithm: str, *args: str, length: tuple[str, str] = TEN_STEPS) -> dict[str, torch.Tensor]:
    res = run_cli("run", "--algorithm", algorithm, *PLAIN, *length, *args, "--out", str(out), timeout_s=120)
    assert res.returncode == 0, res.stderr[-3000:]
    model: dict[str, torch.Tensor] = torch.load(out / "model.pt")
    return model


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=0)
    # training really moved the parameters, so the comparison means something
    assert max(float((a[n] - start[n]).abs().max()) for n in a) > 1e-3


def _initial_model() -> dict[str, torch.Tensor]:
    from prague.workload.data import load_dataset
    from prague.workload.models import build_model

    data = load_dataset("digits", seed=5)
    torch.manual_seed(5)
    return build_model("mlp", data.input_shape, data.num_classes).state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("length", [TEN_STEPS_BUDGET], ids=["budget"])  # per-worker steps: through prepare below
def test_localsgd_averaging_every_step_is_allreduce(tmp_path: Path, length: tuple[str, str]) -> None:
    reference = _run(tmp_path / "allreduce", "allreduce", length=length)
    local = _run(tmp_path / "localsgd", "localsgd", "--sync-every-steps", "1", length=length)
    _assert_same(local, reference, _initial_model())


@pytest.mark.slow
def test_diloco_with_a_plain_outer_step_is_localsgd_and_replicas_end_equal(tmp_path: Path) -> None:
    # 10 steps with H = 3: three rounds and a last one of one step (the finish)
    local = _run(tmp_path / "localsgd", "localsgd", "--sync-every-steps", "3")
    diloco = _run(tmp_path / "diloco", "diloco", "--sync-every-steps", "3", "--outer-lr", "1", "--outer-momentum", "0")
    _assert_same(diloco, local, _initial_model())
    for name in ("localsgd", "diloco"):
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["consensus_distance"] == 0.0  # the last round's average left one model
        assert summary["best_replica_accuracy"] == summary["worst_replica_accuracy"]
        for stats in summary["algorithm_stats"]:
            assert stats["sync_every_steps"] == 3 and stats["averages"] == 4
            assert stats["local_step_share"] == pytest.approx(7 / 10)


def test_the_outer_step_is_torch_sgd_with_nesterov_momentum() -> None:
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(50, generator=gen)
    param = torch.nn.Parameter(start.clone())
    reference = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True)
    rule, momentum = outer_rule(0.7, 0.9), None
    for _ in range(4):
        mean = start + 0.1 * torch.randn(50, generator=gen)  # where the replicas' round ended, on average
        param.grad = param.detach() - mean
        reference.step()
        momentum = outer_step(start, mean, momentum, rule)
        torch.testing.assert_close(start, param.detach(), atol=0, rtol=0)
    # learning rate 1 without momentum: the round's start becomes the mean, Local SGD's average
    mean = torch.randn(50, generator=gen)
    assert outer_step(start, mean, None, outer_rule(1.0, 0.0)) is None
    torch.testing.assert_close(start, mean)


@pytest.mark.parametrize("options,match", [
    (dict(sync_every_steps=0), "--sync-every-steps must be a whole number of steps >= 1, got 0"),
    (dict(sync_every_steps=2.5), "got 2.5"),
    (dict(outer_lr=0.0), "--outer-lr must be a finite number > 0, got 0.0; the paper's is 0.7"),
    (dict(outer_lr=float("inf")), "--outer-lr must be"),
    (dict(outer_momentum=1.0), r"--outer-momentum must be a number in \[0, 1\), got 1.0"),
    (dict(outer_momentum=-0.1), "--outer-momentum must be"),
])
def test_bad_option_values_are_config_errors_that_name_the_value(options: dict[str, float], match: str) -> None:
    method = get_method("diloco")
    with pytest.raises(ConfigError, match=match):
        method.make_options(options)
    if "sync_every_steps" in options:
        with pytest.raises(ConfigError, match=match):
            get_method("localsgd").make_options(options)


def test_defaults_and_lockstep() -> None:
    local, diloco = LocalSGDOptions(), DiLoCoOptions()
    assert local.sync_every_steps == diloco.sync_every_steps == 8
    assert (diloco.outer_lr, diloco.outer_momentum) == (0.7, 0.9)  # the paper's
    assert local.equal_shares() and diloco.equal_shares()
    assert not get_method("localsgd").survives_failures and not get_method("diloco").survives_failures


def test_a_bad_value_on_the_command_line_is_one_line_and_exit_2(tmp_path: Path) -> None:
    res = run_cli("run", "--algorithm", "diloco", "--outer-momentum", "1.5", "--nproc", "2", "--steps", "2",
                  "--out", str(tmp_path / "bad"), timeout_s=60)
    assert res.returncode == 2, res.stderr
    assert "--outer-momentum must be a number in [0, 1), got 1.5" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["localsgd", "diloco"])
def test_a_paced_epoch_on_digits_trains(tmp_path: Path, algorithm: str) -> None:
    out = tmp_path / algorithm
    res = run_cli("run", "--algorithm", algorithm, "--nproc", "2", "--compute", "paced", "--compute-ms", "20",
                  "--model", "mlp", "--data", "digits", "--budget", "epochs:1", "--out", str(out), "--quiet",
                  timeout_s=120)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["test_accuracy"] > 0.6, summary["test_accuracy"]  # about 0.8 after one epoch; chance is 0.1
    assert summary["shares"] == "equal" and len(set(summary["completed_steps"])) == 1


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["diloco", "allreduce:balanced", "allreduce:drop"])  # diloco: localsgd's rounds
def test_the_baselines_under_torchrun(tmp_path: Path, algorithm: str) -> None:
    """The practitioners' baselines in the built-in loop under torchrun (prague worker), as under prague
    run: Local SGD and DiLoCo average every --sync-every-steps, balanced batches rebalance every
    --rebalance-every steps, drop watches every --drop-window steps (no straggler here: nobody leaves)."""
    exe = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("torchrun not installed beside this Python")
    out = tmp_path / "torchrun"
    knobs = {"diloco": ["--sync-every-steps", "3"], "localsgd": ["--sync-every-steps", "3"],
             "allreduce:balanced": ["--rebalance-every", "3"], "allreduce:drop": ["--drop-window", "3"]}[algorithm]
    cmd = [exe, "--standalone", "--nproc-per-node", "2", "-m", "prague", "worker", "--algorithm", algorithm,
           *knobs, "--steps", "8", "--data", "synthetic", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["nproc"] == 2 and summary["completed_steps"] == [8, 8]
    stats = summary["algorithm_stats"]
    if algorithm in ("diloco", "localsgd"):
        assert [s["averages"] for s in stats] == [3, 3]  # after steps 3 and 6, then the last two
    elif algorithm == "allreduce:balanced":
        assert all(s["rebalances"] == 2 for s in stats), stats  # after steps 3 and 6
    else:
        assert all(s["left"] == {} for s in stats) and summary["ranks"] == [0, 1], stats


def test_the_simulator_runs_both_with_real_arithmetic(tmp_path: Path) -> None:
    out = tmp_path / "sim"
    assert main(["simulate", "--algorithms", "allreduce,localsgd,diloco", "--scenarios", "homogeneous",
                 "--nproc", "4", "--steps", "24", "--model", "mlp", "--data", "digits", "--math", "real",
                 "--sync-every-steps", "4", "--out", str(out)]) == 0
    records = {r["algorithm"]: r for r in bench_records(out)}
    for name in ("localsgd", "diloco"):
        record = records[name]
        stats = record["algorithm_stats"][0]
        assert stats["averages"] == 4 * 24 // 4  # every worker, every fourth step (summed over workers)
        assert stats["local_step_share"] == pytest.approx(3 / 4)
        assert record["test_accuracy"] > 0.3
        # one all-reduce every four steps against one every step
        assert sum(record["mean_comm_s"]) < sum(records["allreduce"]["mean_comm_s"])


EQUIVALENCE_SCRIPT = """
import json, sys
import torch
from torch import nn
import prague

out = sys.argv[1]
ctx = prague.init()
finals = {}
for name, opts in (("allreduce", {}), ("localsgd", {"sync_every_steps": 1}),
                   ("localsgd:3", {"sync_every_steps": 3}),
                   ("diloco:3", {"sync_every_steps": 3, "outer_lr": 1.0, "outer_momentum": 0.0})):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    method = name.split(":")[0]
    model, opt = prague.prepare(base, torch.optim.SGD(base.parameters(), lr=0.2), method, **opts)
    for step in range(10):
        g = torch.Generator().manual_seed(1000 * step + ctx.rank)
        x = torch.randn(16, 6, generator=g)
        loss = nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long() + (x[:, 1] > 0).long())
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.close()  # diloco's and localsgd's last round ends here
    finals[name] = torch.cat([p.detach().view(-1) for p in base.parameters()]).tolist()
json.dump(finals, open(f"{out}.rank{ctx.rank}", "w"))
prague.shutdown()
"""


@pytest.mark.slow
def test_the_equivalences_hold_through_prague_prepare(tmp_path: Path) -> None:
    """In a script's own loop (prague.prepare, plain SGD): Local SGD averaging every step ends where
    allreduce does, and DiLoCo with an outer step of lr 1 and no momentum where Local SGD does, on every
    rank."""
    script, out = tmp_path / "equivalence.py", tmp_path / "result"
    script.write_text(EQUIVALENCE_SCRIPT)
    res = run_cli("launch", "--nproc", "2", str(script), str(out), timeout_s=150)
    assert res.returncode == 0, res.stderr[-3000:]
    for rank in range(2):
        finals = {k: torch.tensor(v) for k, v in json.loads(Path(f"{out}.rank{rank}").read_text()).items()}
        torch.testing.assert_close(finals["localsgd"], finals["allreduce"], rtol=0, atol=1e-5)
        torch.testing.assert_close(finals["diloco:3"], finals["localsgd:3"], rtol=0, atol=1e-5)
        assert not torch.allclose(finals["localsgd:3"], finals["allreduce"], atol=1e-4)  # H = 3 is another run
