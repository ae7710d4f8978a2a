"""``allreduce`` (DDP) with 4 workers equals one process training on the concatenated batches.

The distributed run is the session's shared ``allreduce_run`` (tests/prague_testing.py), which
test_ps.py compares with the synchronous parameter server.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from prague.algorithms.allreduce.scaling import linear_scaling
from prague_testing import SHORT_RUN, run_cli
from prague.workload.data import ShardLoader, load_dataset
from prague.workload.models import build_model

pytestmark = pytest.mark.timeout(240)


def test_four_workers_match_one_process_on_concatenated_batches(allreduce_run: Path) -> None:
    _match_one_process(torch.load(allreduce_run / "model.pt"))


def test_the_linear_scaling_rule_warms_the_learning_rate_up_to_n_times(tmp_path: Path) -> None:
    """Goyal et al.'s rule: the one-worker rate times 1, 1.75, 2.5, 3.25, then 4 (four workers, four steps
    of warm-up), on top of the optimizer's rate: one process with that schedule ends where the job does."""
    assert [linear_scaling(4, k, 4) for k in range(6)] == [1.75, 2.5, 3.25, 4.0, 4.0, 4.0]
    assert linear_scaling(4, 0, 0) == 4.0
    out = tmp_path / "scaled"
    res = run_cli("run", "--algorithm", "allreduce", "--lr-scaling", "linear", "--scaling-warmup-steps", "4",
                  *SHORT_RUN.args(), "--out", str(out), "--quiet")
    assert res.returncode == 0, res.stderr
    _match_one_process(torch.load(out / "model.pt"), lambda k: linear_scaling(4, k, 4))


def _match_one_process(distributed: dict[str, torch.Tensor], factor: Callable[[int], float] = lambda k: 1.0) -> None:
    run = SHORT_RUN
    nproc, steps, batch, lr, momentum, seed = run.nproc, run.steps, run.batch_size, run.lr, run.momentum, run.seed
    assert nproc == 4

    data = load_dataset("digits", seed=seed)
    loaders = [ShardLoader(data.train_x, data.train_y, r, nproc, batch, seed) for r in range(nproc)]
    torch.manual_seed(seed)
    model = build_model("mlp", data.input_shape, data.num_classes)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for step in range(steps):
        xs, ys = zip(*(loader.batch(step) for loader in loaders))
        opt.zero_grad()
        F.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
        for group in opt.param_groups:
            group["lr"] = lr * factor(step)
        opt.step()

    moved = 0.0
    for name, ref in model.state_dict().items():
        torch.testing.assert_close(distributed[name], ref, atol=1e-5, rtol=0)
        moved = max(moved, float((ref - start[name]).abs().max()))
    assert moved > 1e-3  # training really changed the parameters, so the comparison means something
