"""``allreduce:drop``: a persistently slow rank leaves the job after two slow windows, a transient one stays;
the others go on as a smaller DDP job and take the leaver's batches; the summary names who left and when.

The rule and the budget's regrouping are checked on every case (hypothesis), the simulator model on a
straggler, real workers under ``prague run`` with the job-wide budget, and a slow rank leaving a script's
job through ``prague.prepare`` (the order checks: tests/train/test_prepared.py).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prague.algorithms.allreduce.drop_rules import WINDOWS, DropWatch, slow_ranks
from prague.algorithms.allreduce.drop_sim import SimDropAllReduce
from prague.algorithms.registry import get_method
from prague.errors import ConfigError
from prague.groups.api import Topology
from prague.hetero.spec import parse_scenario
from prague.sim.cluster import Cluster, Link
from prague.sim.world import World
from prague.workload.budget import EqualShares
from prague.workload.catalog import dataset_info
from prague_testing import run_cli

pytestmark = pytest.mark.timeout(240)


def test_a_rank_slow_in_two_windows_in_a_row_leaves_and_a_transient_one_stays() -> None:
    assert slow_ranks({0: 1.0, 1: 1.1, 2: 4.0, 3: 0.9}, 2.0) == {2}
    watch = DropWatch(2.0)
    assert watch.observe({0: 1.0, 1: 1.0, 2: 4.0, 3: 1.0}) == ()  # the first slow window: a probe
    assert watch.observe({0: 1.0, 1: 1.0, 2: 1.0, 3: 3.0}) == ()  # 2 recovered, 3 slow once
    assert watch.observe({0: 1.0, 1: 1.0, 2: 1.0, 3: 3.0}) == (3,)  # 3: twice in a row
    assert watch.observe({0: 1.0, 1: 1.0, 2: 5.0}) == ()
    # never the majority: three of five slow ranks are not "slower than the median"
    assert DropWatch(1.5, windows=1).observe({0: 1.0, 1: 1.0, 2: 9.0, 3: 9.0, 4: 9.0}) == ()
    assert WINDOWS == 2


@settings(max_examples=100, deadline=None)
@given(n=st.integers(2, 8), per_rank=st.integers(1, 12), drops=st.lists(st.tuples(st.integers(0, 11), st.integers(0, 7)),
                                                                       max_size=3))
def test_regrouping_shares_every_batch_once(n: int, per_rank: int, drops: list[tuple[int, int]]) -> None:
    """Whatever leaves when, the ranks still stepping take every batch of the budget not taken yet, once."""
    total = n * per_rank + n // 2  # a remainder of fewer than n batches is left out, as without regrouping
    plans = [EqualShares(r, n, total) for r in range(n)]
    live = list(range(n))
    taken: list[int] = []
    leave_at = {}
    for step, rank in drops:
        if rank < n:
            leave_at.setdefault(step, set()).add(rank)
    completed = 0
    while True:
        indices = [plans[r].next() for r in live]
        if all(i is None for i in indices):
            break
        assert None not in indices  # lockstep: every rank still in runs every step
        taken.extend(i for i in indices if i is not None)
        completed += 1
        leaving = leave_at.get(completed, set()) & set(live)
        if leaving and len(leaving) < len(live):
            live = [r for r in live if r not in leaving]
            for plan in plans:
                plan.regroup(completed, live)
    assert len(taken) == len(set(taken))  # no batch twice
    assert set(taken) <= set(range(total)) and total - len(taken) < len(live)  # all but a remainder
    with pytest.raises(ConfigError, match="at least one rank"):
        plans[0].regroup(completed, [])


def test_options_and_bad_values() -> None:
    method = get_method("allreduce")
    options = method.make_options({}, "drop")
    assert (options.drop_factor, options.drop_window) == (2.0, 20) and options.equal_shares()
    for bad, match in (({"drop_factor": 1.0}, "--drop-factor must be a number above 1"),
                       ({"drop_window": 0}, "--drop-window must be a whole number of steps >= 1, got 0")):
        with pytest.raises(ConfigError, match=match):
            method.make_options(bad, "drop")


def test_a_transient_straggler_scenario_parses_and_slows_only_its_steps() -> None:
    scenario = parse_scenario("straggler:1:4:5-10")
    assert [scenario.slowdown(1, k, 4) for k in (4, 5, 9, 10)] == [1.0, 4.0, 4.0, 1.0]
    assert scenario.slowdown(0, 6, 4) == 1.0 and scenario.mean_slowdown(1, 4) == 1.0
    for bad in ("straggler:1:4:5", "straggler:1:4:9-3", "straggler:1:4:a-3"):
        with pytest.raises(ConfigError, match="straggler"):
            parse_scenario(bad)


def _simulate(scenario: str, steps: int = 60) -> tuple[World, SimDropAllReduce]:
    cluster = Cluster(compute_s=0.1, intra=Link(1e-5, 1e10), inter=Link(1e-5, 1e10))
    world = World(cluster=cluster, topology=Topology(1, 4), scenario=parse_scenario(scenario), steps=steps,
                  state_bytes=1e5, seed=0)
    method = SimDropAllReduce(world, get_method("allreduce").make_options({"drop_window": 10}, "drop"))
    method.start()
    world.engine.run()
    method.check_done()
    return world, method


def test_simulated_drop_lets_the_persistent_straggler_go_and_keeps_the_transient_one() -> None:
    world, method = _simulate("straggler:2:4")
    assert method.stats()["left"] == {"2": 20}  # after two windows of 10 steps
    steps = [len(e) for e in world.end_s]
    # the others took its remaining batches (160 among three: one left over, as a budget's remainder)
    assert steps[2] == 20 and steps[0] == steps[1] == steps[3] == 20 + 160 // 3
    assert world.end_s[0][-1] < 0.4 * 20 + 0.1 * 60  # after it left, steps at the fast pace
    world, method = _simulate("straggler:2:4:0-10")  # slow in the first window only
    assert method.stats()["left"] == {} and [len(e) for e in world.end_s] == [60] * 4


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["straggler:2:4", "straggler:2:4:0-5"], ids=["persistent", "transient"])
def test_a_persistent_straggler_leaves_a_real_job_and_a_transient_one_stays(tmp_path: Path, scenario: str) -> None:
    out = tmp_path / "drop"
    res = run_cli("run", "--algorithm", "allreduce:drop", "--drop-window", "5", "--nproc", "3", "--model", "mlp",
                  "--data", "digits", "--budget", "epochs:1", "--compute", "paced", "--compute-ms", "15",
                  "--slowdown", scenario, "--out", str(out), "--quiet", timeout_s=150)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    if scenario.endswith("0-5"):  # slow in the first window only: it stays, and every rank takes a third
        assert summary["ranks"] == [0, 1, 2] and [s["left"] for s in summary["algorithm_stats"]] == [{}] * 3
        assert len(set(summary["completed_steps"])) == 1 and summary["test_accuracy"] > 0.6
        return
    assert summary["ranks"] == [0, 1]  # the run closed without the leaver
    assert [s["left"] for s in summary["algorithm_stats"]] == [{"2": 10}] * 2
    done = summary["completed_steps"]
    assert done[2] == 10 and done[0] == done[1] > 10
    # the budget's batches, all but a remainder of fewer than the two left: the leaver's share went to the others
    total = dataset_info("digits").train_samples // 32
    assert summary["samples"] == 32 * sum(done) and total - 2 < sum(done) <= total
    assert summary["test_accuracy"] > 0.6


DROP_SCRIPT = textwrap.dedent('''
    """allreduce:drop through prague.prepare: rank 2 is 0.15 s slower a step in its compute; it leaves."""
    import json, sys, time
    import torch
    from torch import nn
    import prague

    out = sys.argv[1]
    ctx = prague.init()
    torch.manual_seed(0)
    base = nn.Linear(4, 2)
    model, opt = prague.prepare(base, torch.optim.SGD(base.parameters(), lr=0.1), "allreduce:drop", drop_window=3)
    weights = []
    for step in range(12):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(100 * step + ctx.rank))
        loss = model(x).pow(2).mean()
        if ctx.rank == 2:
            time.sleep(0.15)  # in its compute: forward to backward
        loss.backward()
        opt.step()
        opt.zero_grad()
        weights.append(base.weight.detach().view(-1).tolist())
    final = model.averaged_model().weight.detach().view(-1).tolist()  # the ranks still in; a leaver its own
    json.dump({"weights": weights, "final": final}, open(f"{out}.rank{ctx.rank}", "w"))
    model.close()
    prague.shutdown()
''')


@pytest.mark.slow
def test_a_slow_rank_leaves_a_prepared_job_and_the_others_go_on(tmp_path: Path) -> None:
    """Under prague.prepare: the slow rank leaves after two slow windows of three steps; from then its
    steps change nothing, and the others keep one replica between them."""
    script, out = tmp_path / "drop.py", tmp_path / "result"
    script.write_text(DROP_SCRIPT)
    res = run_cli("launch", "--nproc", "3", str(script), str(out), timeout_s=150.0)
    assert res.returncode == 0, res.stderr[-3000:]
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(3)]
    assert ranks[0]["weights"] == ranks[1]["weights"]  # one replica between the two that stayed
    left = ranks[2]["weights"]
    assert left[6:] == [left[5]] * 6  # it left after step 6: its replica stays as it was
    assert ranks[0]["weights"][11] != left[11] and ranks[0]["weights"][5] == left[5]
    assert ranks[0]["final"] == ranks[0]["weights"][-1] and ranks[2]["final"] == left[-1]
