"""``allreduce:backup``: each step applies the mean of the first n - b gradients to arrive, the same on every
replica; late gradients are dropped; the job ends cleanly when workers run different numbers of steps.

The rules are checked on every order of arrivals (hypothesis), the simulator model on a straggler, and
real workers with known integer gradients (``prague launch``, the user's own loop through ``prague.wrap``)
and under torchrun with the job-wide budget. Through ``prague.prepare``: tests/train/test_prepared.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections import defaultdict
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prague.algorithms.allreduce import AllReduceOptions
from prague.algorithms.allreduce.backup_rules import FINISHED, GRADIENT, accepted, complete, counts, quorum, starts
from prague.algorithms.allreduce.backup_sim import SimBackupAllReduce
from prague.algorithms.registry import get_method, parse_method
from prague.errors import ConfigError
from prague.groups.api import Topology
from prague.hetero.spec import parse_scenario
from prague.metrics.decisions import rank_path, read_decisions
from prague.sim.cluster import Cluster, Link
from prague.sim.world import World
from prague_testing import run_cli

pytestmark = pytest.mark.timeout(240)
SRC = str(Path(__file__).resolve().parents[2] / "src")


# -- the rules ----------------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 9), b=st.integers(0, 8), order=st.permutations(list(range(9))),
       finished=st.sets(st.integers(0, 8)))
def test_exactly_one_arrival_starts_a_round_and_it_takes_the_first_n_minus_b(n: int, b: int, order: list[int],
                                                                              finished: set[int]) -> None:
    b = min(b, n - 1)
    workers = [w for w in order if w < n]  # the order in which the workers add to the round's counter
    value, taken, starters = 0, [], []
    for w in workers:
        added = FINISHED if w in finished else GRADIENT
        value += added
        if added == GRADIENT and accepted(value, n, b):
            taken.append(w)
        if starts(value, added, n, b):
            starters.append(w)
    assert len(starters) == 1  # every worker adds once: the round starts, and only one add starts it
    training = [w for w in workers if w not in finished]
    assert taken == training[:quorum(n, b)]  # the first n - b gradients, in arrival order
    assert counts(value) == (len(training), n - len(training))
    # the starter is the (n - b)-th gradient, or the last worker to add when too few are still training
    start_at = workers.index(starters[0])
    assert complete(sum(FINISHED if w in finished else GRADIENT for w in workers[:start_at + 1]), n, b)


def test_options_defaults_and_bad_values() -> None:
    method, variant = parse_method("allreduce:backup")
    options = method.make_options({}, variant)
    assert options.backup == 1 and not options.equal_shares() and AllReduceOptions().equal_shares()
    assert method.variant_of(method.make_options({})) is None  # plain allreduce is DDP, labelled without a variant
    assert method.label(options) == "allreduce:backup"
    method.check_job(options, 2)
    with pytest.raises(ConfigError, match="--backup 4 leaves no worker to wait for in a job of --nproc 4; use at most 3"):
        method.check_job(method.make_options({"backup": 4}, "backup"), 4)
    with pytest.raises(ConfigError, match="--backup must be a whole number of workers >= 0"):
        method.make_options({"backup": -1}, "backup")
    for bad in (1.5, True):  # through the Python API: the type, named with the flag
        with pytest.raises(ConfigError, match=r"option backup of method 'allreduce' takes an int \(the CLI's --backup\)"):
            method.make_options({"backup": bad}, "backup")


def test_a_bad_backup_on_the_command_line_is_one_line_and_exit_2(tmp_path: Path) -> None:
    res = run_cli("run", "--algorithm", "allreduce:backup", "--backup", "2", "--nproc", "2", "--steps", "2",
                  "--out", str(tmp_path / "bad"), timeout_s=60)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines()[-1].endswith("use at most 1") and "Traceback" not in res.stderr


# -- the simulator ------------------------------------------------------------------------------------------
def _simulate(backup: int, steps: int = 40) -> tuple[World, SimBackupAllReduce]:
    cluster = Cluster(compute_s=0.1, intra=Link(1e-5, 1e10), inter=Link(1e-5, 1e10))
    world = World(cluster=cluster, topology=Topology(1, 4), scenario=parse_scenario("straggler:2:4"), steps=steps,
                  state_bytes=1e5, seed=0, claimed=4 * steps)
    method = SimBackupAllReduce(world, get_method("allreduce").make_options({"backup": backup}, "backup"))
    method.start()
    world.engine.run()
    method.check_done()
    return world, method


def test_simulated_rounds_go_on_without_a_persistent_straggler() -> None:
    world, method = _simulate(backup=1)
    stats = method.stats()
    fast, slow = len(world.end_s[0]), len(world.end_s[2])
    assert fast > 2 * slow  # 4x slower: it takes fewer batches (its claimed chunks, at its pace)
    assert world.end_s[0][-1] / fast < 0.12  # the fast workers' steps (0.1 s of compute) never wait for it
    # the straggler is late while the others train (on time at its first step and once they have run out)
    assert stats["dropped"] >= slow // 2
    assert stats["accepted"] + stats["dropped"] == sum(len(e) for e in world.end_s)
    # every round took three gradients until the fast workers ran out of batches
    assert stats["mean_gradients_per_round"] > 2.5
    waiting, _ = _simulate(backup=0)  # b = 0: every step waits for the straggler
    assert max(max(e) for e in waiting.end_s) > 2 * max(max(e) for e in world.end_s)


# -- real workers --------------------------------------------------------------------------------------------
SCRIPT = textwrap.dedent('''
    """A worker whose gradients are known multiples of 3; logs which round took each."""
    import json, random, sys, time
    import torch
    import torch.distributed as dist
    from torch import nn
    import prague
    from prague.metrics.decisions import DecisionLog

    out, sleepy, steps, api = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    ctx = prague.init()
    model = nn.Linear(8, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    log = DecisionLog(out + ".decisions", ctx.rank)
    if api == "wrap":
        trainer = prague.wrap(model, optimizer, algorithm="allreduce:backup", backup=1, decisions=log)
    else:
        prepared, opt = prague.prepare(model, optimizer, "allreduce:backup", backup=1, decisions=log)
    rng = random.Random(100 + ctx.rank)
    grads = []
    for step in range(steps):
        c = [3.0 * rng.randint(-10, 10) for _ in range(8)]
        grads.append(c)
        pause = 1.0 if (ctx.rank == sleepy and step == 1) else rng.random() * 0.02

        def loss(m, c=torch.tensor(c), pause=pause):
            time.sleep(pause)  # random arrival order; one long pause
            return (m(torch.eye(8)).view(-1) * c).sum()  # the forward pass gives w: its gradient is exactly c

        if api == "wrap":
            trainer.step(loss)
        else:  # the script's own loop
            loss(prepared).backward()
            opt.step()
            opt.zero_grad()
    stats = trainer.stats() if api == "wrap" else prepared._session.algorithm.stats()
    (trainer if api == "wrap" else prepared).close()
    log.close()
    final = model.weight.detach().view(-1).clone()
    finals = [torch.zeros(8) for _ in range(ctx.world_size)]
    dist.all_gather(finals, final)
    json.dump({"grads": grads, "stats": stats}, open(f"{out}.rank{ctx.rank}", "w"))
    if ctx.rank == 0:
        json.dump([f.tolist() for f in finals], open(out, "w"))
    prague.shutdown()
''')


@pytest.mark.timeout(200)
@pytest.mark.parametrize("api", ["wrap", "prepare"])
def test_each_round_applies_the_mean_of_exactly_the_gradients_it_took_on_every_replica(tmp_path: Path,
                                                                                       api: str) -> None:
    """4 workers, b = 1; rank 2 pauses 1 s in its second step, so that round goes on without it; through
    prague.wrap's closure and through a script's own loop (prague.prepare)."""
    script, out, nproc, steps = tmp_path / "known.py", tmp_path / "finals.json", 4, 8
    script.write_text(SCRIPT)
    res = run_cli("launch", "--nproc", str(nproc), str(script), str(out), "2", str(steps), api, timeout_s=150.0,
                  env={"PYTHONPATH": SRC})
    assert res.returncode == 0, res.stderr[-3000:]
    finals = json.loads(out.read_text())
    assert all(f == finals[0] for f in finals)  # bit-identical replicas
    taken: dict[int, list[list[float]]] = defaultdict(list)
    late = {}
    for rank in range(nproc):
        worker = json.loads(Path(f"{out}.rank{rank}").read_text())
        decisions = read_decisions(rank_path(Path(f"{out}.decisions"), rank))
        assert [d.step for d in decisions] == list(range(steps)) and all(d.kind == "arrival" for d in decisions)
        for d in decisions:
            if d.accepted and d.seq is not None:
                taken[d.seq].append(worker["grads"][d.step])
        late[rank] = [d.step for d in decisions if not d.accepted]
        assert worker["stats"]["accepted"] + worker["stats"]["dropped"] == steps
    assert 1 in late[2]  # the pause made it late
    assert all(len(g) <= 3 for g in taken.values())  # never more than n - b
    # while all four trained, every round took three (rounds at the end wait only for who still trains)
    assert all(len(taken[r]) == 3 for r in range(4))
    expected = [Fraction(0)] * 8
    for grads in taken.values():
        for i in range(8):
            expected[i] -= Fraction(sum(int(g[i]) for g in grads), len(grads))  # lr 1: minus each round's mean
    assert finals[0] == [float(x) for x in expected] and any(x != 0 for x in expected)


@pytest.mark.slow
def test_a_straggler_under_torchrun_and_the_budget_is_dropped_and_the_job_trains(tmp_path: Path) -> None:
    exe = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("torchrun not installed beside this Python")
    out = tmp_path / "torchrun"
    cmd = [exe, "--standalone", "--nproc-per-node", "3", "-m", "prague", "worker", "--algorithm", "allreduce:backup",
           "--model", "mlp", "--data", "digits", "--budget", "epochs:2", "--compute", "paced", "--compute-ms", "15",
           "--slowdown", "straggler:1:4", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    assert summary["shares"] == "claimed" and summary["variant"] == "backup"
    stats = summary["algorithm_stats"]
    assert len({s["rounds"] for s in stats}) == 1  # every worker took part in every round
    steps = summary["completed_steps"]
    assert steps[1] < min(steps[0], steps[2]) / 2  # the 4x slower rank takes fewer batches
    assert stats[1]["dropped"] > stats[1]["accepted"]
    # identical replicas (the distance of three equal ones from their float mean is rounding, not 0)
    assert summary["consensus_distance"] < 1e-5 and summary["best_replica_accuracy"] == summary["worst_replica_accuracy"]
    assert summary["test_accuracy"] > 0.6


@pytest.mark.timeout(120)
def test_workers_that_finish_first_apply_the_rounds_the_others_still_run(tmp_path: Path) -> None:
    """Per-worker --steps with a 4x straggler: the others finish their 80 steps when it has done about 20,
    and it runs its last 60 rounds alone, far more than the 16 unapplied results a worker may hold; the
    finished workers apply them as they come, so nobody's round thread stops the rounds."""
    out = tmp_path / "tail"
    res = run_cli("run", "--algorithm", "allreduce:backup", "--nproc", "3", "--steps", "80", "--compute", "emulated",
                  "--compute-ms", "5", "--slowdown", "straggler:2:4", "--out", str(out), "--quiet", timeout_s=100)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed_steps"] == [80, 80, 80]
    rounds = {s["rounds"] for s in summary["algorithm_stats"]}
    assert len(rounds) == 1 and rounds.pop() > 80 + 16  # the straggler's tail ran after the others finished
