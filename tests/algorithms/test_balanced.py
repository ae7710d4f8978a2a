"""``allreduce:balanced``: each worker's share of a step's samples follows its speed, and the update is the
mean over all the step's samples.

The split rule and the sample positions are checked on every case (hypothesis), the simulator model on a
straggler, real workers with known gradients through ``prague.prepare`` (the sample-weighted mean), and
``prague run`` under the job-wide budget with a straggler that recovers (the shares follow it).
"""

from __future__ import annotations

import json
import textwrap
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prague.algorithms.allreduce.balanced_rules import balance, offsets
from prague.algorithms.allreduce.balanced_sim import SimBalancedAllReduce
from prague.algorithms.registry import get_method
from prague.errors import ConfigError
from prague.groups.api import Topology
from prague.hetero.spec import parse_scenario
from prague.sim.cluster import Cluster, Link
from prague.sim.world import World
from prague.workload.data import GlobalBatches, ShardLoader
from prague_testing import run_cli

pytestmark = pytest.mark.timeout(240)
SRC = str(Path(__file__).resolve().parents[2] / "src")


@settings(max_examples=200, deadline=None)
@given(times=st.lists(st.floats(1e-4, 10.0), min_size=1, max_size=9), extra=st.integers(0, 500))
def test_shares_sum_to_the_step_and_follow_speed(times: list[float], extra: int) -> None:
    total = len(times) + extra
    shares = balance(times, total)
    assert sum(shares) == total and min(shares) >= 1
    for i, ti in enumerate(times):  # a faster worker never gets fewer samples than a slower one, but for rounding
        for j, tj in enumerate(times):
            if ti < tj:
                assert shares[i] >= shares[j] - 1
    assert offsets(shares) == [sum(shares[:i]) for i in range(len(shares))]


def test_a_4x_slower_worker_takes_about_a_quarter() -> None:
    shares = balance([1.0] * 7 + [4.0], 256)
    assert shares[:7] == [35] * 7 or set(shares[:7]) <= {35, 36}
    assert 8 <= shares[7] <= 10  # a quarter of the others' 35, and at least one sample each first
    assert balance([0.0, float("nan"), 1.0], 30) == [10, 10, 10]  # nothing measured: the median's
    with pytest.raises(ValueError, match="at least one"):
        balance([1.0, 1.0, 1.0], 2)


@settings(max_examples=50, deadline=None)
@given(start=st.integers(0, 400), count=st.integers(1, 200))
def test_samples_at_any_position_are_the_batches_own_cut_anywhere(start: int, count: int) -> None:
    x, y = torch.arange(100).float().unsqueeze(1), torch.arange(100)
    batches = GlobalBatches(x, y, batch_size=8, seed=3)  # 12 batches an epoch: 4 samples left out each time
    flat = torch.cat([batches.batch(g)[1] for g in range(80)])
    assert torch.equal(batches.samples(start, count)[1], flat[start:start + count])
    shard = ShardLoader(x, y, rank=1, world_size=2, batch_size=8, seed=3)
    flat = torch.cat([shard.batch(s)[1] for s in range(80)])
    assert torch.equal(shard.samples(start, count)[1], flat[start:start + count])
    with pytest.raises(ConfigError, match="count >= 1"):
        batches.samples(0, 0)


def test_options() -> None:
    options = get_method("allreduce").make_options({}, "balanced")
    assert options.rebalance_every == 20 and options.equal_shares()
    with pytest.raises(ConfigError, match="--rebalance-every must be a whole number of steps >= 1, got 0"):
        get_method("allreduce").make_options({"rebalance_every": 0}, "balanced")


def test_simulated_shares_make_a_straggler_finish_with_the_others() -> None:
    cluster = Cluster(compute_s=0.1, intra=Link(1e-5, 1e10), inter=Link(1e-5, 1e10))

    def run(sync: str) -> tuple[World, dict]:
        world = World(cluster=cluster, topology=Topology(1, 4), scenario=parse_scenario("straggler:3:4"), steps=60,
                      state_bytes=1e5, seed=0)
        method = get_method("allreduce")
        model = method.sim_class(sync)(world, method.make_options({"rebalance_every": 10}, sync))
        model.start()
        world.engine.run()
        model.check_done()
        return world, model.stats()

    world, stats = run("balanced")
    assert stats["rebalances"] == 6
    assert stats["shares"][3] == pytest.approx(stats["shares"][0] / 4, rel=0.15)
    ddp, _ = run("ddp")
    # after the first window every step lasts as long as the others' (about 1.2 batches of 0.1 s), not 0.4 s
    assert max(world.end_s[0]) < 0.6 * max(ddp.end_s[0])
    assert isinstance(SimBalancedAllReduce, type)


SCRIPT = textwrap.dedent('''
    """Known per-sample gradients through prague.prepare; rank 2 is slow per sample, so it is given fewer."""
    import json, sys, time
    import torch
    from torch import nn
    import prague

    out, steps = sys.argv[1], int(sys.argv[2])
    ctx = prague.init()
    base = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        base.weight.zero_()
    model, opt = prague.prepare(base, torch.optim.SGD(base.parameters(), lr=1.0), "allreduce:balanced",
                                rebalance_every=2)
    log = []
    for step in range(steps):
        count = model.batch_share() or 6
        # sample i of this rank at this step has the gradient c_i (its loss is w . c_i); the loss of a step is
        # the mean over its samples
        c = torch.tensor([[float((7 * step + 3 * ctx.rank + i) % 11 - 5) for _ in range(4)] for i in range(count)])
        c[:, 1] *= 2
        loss = (model(c) ).mean()  # d/dw of mean_i (w . c_i) = mean_i c_i
        if ctx.rank == 2:  # slower per sample in its compute (forward to backward: what the variant times)
            time.sleep(0.02 * count)  # 120 ms a step of 6, well above any noise
        loss.backward()
        opt.step()
        opt.zero_grad()
        log.append(c.tolist())
    final = model.averaged_model().weight.detach().view(-1).tolist()
    json.dump({"log": log, "final": final, "own": base.weight.detach().view(-1).tolist()},
              open(f"{out}.rank{ctx.rank}", "w"))
    model.close()
    prague.shutdown()
''')


@pytest.mark.timeout(200)
def test_the_update_is_the_mean_over_every_sample_of_the_step(tmp_path: Path) -> None:
    script, out, steps = tmp_path / "balanced.py", tmp_path / "result", 8
    script.write_text(SCRIPT)
    res = run_cli("launch", "--nproc", "3", str(script), str(out), str(steps), timeout_s=150.0,
                  env={"PYTHONPATH": SRC})
    assert res.returncode == 0, res.stderr[-3000:]
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(3)]
    assert ranks[0]["own"] == ranks[1]["own"] == ranks[2]["own"]  # one update on every replica
    counts = [[len(r["log"][k]) for r in ranks] for k in range(steps)]
    assert counts[0] == [6, 6, 6] and counts[-1][2] < counts[-1][0]  # split after two steps; rank 2 is slower
    assert all(sum(c) == 18 for c in counts)
    expected = [Fraction(0)] * 4
    for k in range(steps):
        samples = [s for r in ranks for s in r["log"][k]]
        for j in range(4):  # lr 1: minus the mean over every sample of the step
            expected[j] -= Fraction(sum(Fraction(s[j]) for s in samples), len(samples))
    assert ranks[0]["own"] == pytest.approx([float(e) for e in expected], abs=1e-4)


@pytest.mark.slow
def test_the_shares_follow_a_straggler_that_recovers(tmp_path: Path) -> None:
    out = tmp_path / "balanced"
    res = run_cli("run", "--algorithm", "allreduce:balanced", "--rebalance-every", "5", "--nproc", "3", "--model",
                  "mlp", "--data", "digits", "--budget", "epochs:4", "--compute", "paced", "--compute-ms", "20",
                  "--slowdown", "straggler:2:4:0-20", "--out", str(out), "--quiet", timeout_s=150)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["shares"] == "equal" and summary["test_accuracy"] > 0.6
    steps = [json.loads(line) for line in (out / "metrics" / "rank2.jsonl").read_text().splitlines()]
    others = [json.loads(line) for line in (out / "metrics" / "rank0.jsonl").read_text().splitlines()]
    assert len(steps) == len(others) > 45  # 179 batches of 32 in four epochs, 96 samples a step
    slow = [s["samples"] for s in steps[10:20]]  # split twice while it is 4x slower
    fast = [s["samples"] for s in others[10:20]]
    assert max(slow) * 3 < min(fast), (slow, fast)  # about a quarter of the others' samples
    recovered = [s["samples"] for s in steps[30:]]  # it recovered at step 20: split again twice since
    assert recovered and min(recovered) > 24, recovered  # back to about a third of the 96 samples
