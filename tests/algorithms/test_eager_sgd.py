"""eager-SGD: the round rules, no gradient lost or counted twice, identical replicas, late workers never block."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import defaultdict
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prague.algorithms.eager_sgd.decisions import (
    START, SYNC, Ledger, RoundTally, activation, initiator, is_sync_round, result_capacity, stale_weight, starts_round,
)
from prague.algorithms.eager_sgd.sim import SimEagerSGD
from prague.algorithms.registry import get_method
from prague.errors import ConfigError
from prague.groups.api import Topology
from prague.hetero.spec import parse_scenario
from prague.sim.cluster import Cluster, Link
from prague.sim.math import NoMath
from prague.sim.world import World
from prague_testing import run_cli

SRC = str(Path(__file__).resolve().parents[2] / "src")


# -- decisions ------------------------------------------------------------------------------------------
def test_sync_rounds_are_every_lth() -> None:
    assert [r for r in range(12) if is_sync_round(r, 4)] == [3, 7, 11]
    assert not any(is_sync_round(r, 0) for r in range(50))
    assert result_capacity(4) == 4 and result_capacity(0) >= 2


def test_solo_lets_anyone_start_majority_only_the_initiator() -> None:
    for r in range(20):
        assert all(starts_round("solo", w, r, 5, 1) for w in range(5))
        starters = [w for w in range(5) if starts_round("majority", w, r, 5, 1)]
        assert starters == [initiator(r, 5, 1)]
    with pytest.raises(ConfigError, match="quorum"):
        starts_round("everyone", 0, 0, 4, 0)


def test_majority_draws_among_the_survivors_the_same_way_while_none_failed() -> None:
    for r in range(50):
        assert [w for w in range(5) if starts_round("majority", w, r, 5, 1, live=range(5))] == [initiator(r, 5, 1)]
        survivors = (0, 2, 4)
        starters = [w for w in range(5) if starts_round("majority", w, r, 5, 1, live=survivors)]
        assert len(starters) == 1 and starters[0] in survivors  # never a failed rank, always exactly one
    assert not starts_round("majority", 0, 3, 5, 1, live=())


def test_majority_initiators_spread_over_the_ranks_and_depend_on_the_seed() -> None:
    picks = [initiator(r, 8, 3) for r in range(800)]
    counts = [picks.count(w) for w in range(8)]
    assert min(counts) > 50  # about 100 each
    assert picks != [initiator(r, 8, 4) for r in range(800)]


def test_majority_initiators_are_the_same_in_every_process() -> None:
    """Another interpreter, with another hash seed, draws the same initiators (no process-local state)."""
    code = "from prague.algorithms.eager_sgd.decisions import initiator; print([initiator(r, 7, 11) for r in range(64)])"
    env = {**os.environ, "PYTHONPATH": SRC, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == str([initiator(r, 7, 11) for r in range(64)])


def test_ledger_carries_late_gradients_with_their_staleness() -> None:
    ledger = Ledger()
    ledger.deposit(version=3)
    ledger.deposit(version=5)
    taken = ledger.take(round_id=5)
    assert taken.count == 2 and taken.staleness == (2, 0) and taken.fresh == 1
    assert ledger.take(round_id=6).count == 0  # nothing is taken twice
    assert ledger.deposited == 2 and ledger.taken == 2


def test_late_gradients_are_weighted_by_their_staleness() -> None:
    assert [stale_weight("inverse", s) for s in (-1, 0, 1, 3)] == [1.0, 1.0, 0.5, 0.25]
    assert stale_weight("none", 5) == 1.0
    with pytest.raises(ConfigError, match="inverse"):
        stale_weight("half", 1)
    ledger = Ledger()
    ledger.deposit(version=3, weight=0.5)
    ledger.deposit(version=4)
    taken = ledger.take(round_id=4)
    assert taken.weight == 1.5 and ledger.take(round_id=5).weight == 0.0


# -- the round protocol under random arrival orders (the simulator runs the same decision code) -------------
class ExactMath(NoMath):
    """Gradients as exact fractions: every computed gradient is remembered, every applied step too."""

    def __init__(self, seed: int) -> None:
        import random

        self._rng = random.Random(seed)
        self.computed = Fraction(0)
        self.applied: dict[int, list[Fraction]] = defaultdict(list)

    def gradient(self, w: int, step: int, at_snapshot: bool = False, lookahead: bool = False) -> Any:
        g = Fraction(self._rng.randrange(1, 2**40), self._rng.randrange(1, 1000))
        self.computed += g
        return g

    def apply(self, w: int, grad: Any, scale: float = 1.0) -> None:
        self.applied[w].append(grad)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 9), steps=st.integers(1, 30), quorum=st.sampled_from(["solo", "majority"]),
       sync_every=st.integers(0, 6), seed=st.integers(0, 2**16), cv=st.floats(0.0, 1.5),
       scenario=st.sampled_from(["homogeneous", "paper:4", "straggler:1:5"]), renormalize=st.sampled_from(["off", "on"]),
       stale_weight=st.sampled_from(["none", "inverse"]))
def test_every_gradient_is_applied_exactly_once_on_every_replica(n: int, steps: int, quorum: str, sync_every: int,
                                                                 seed: int, cv: float, scenario: str,
                                                                 renormalize: str, stale_weight: str) -> None:
    math = ExactMath(seed)
    cluster = Cluster(compute_s=0.1, compute_dist="lognormal" if cv else "constant", compute_cv=cv,
                      intra=Link(1e-4, 1e9), inter=Link(1e-4, 1e9))
    world = World(cluster=cluster, topology=Topology(1, n), scenario=parse_scenario(scenario, seed=seed),
                  steps=steps, state_bytes=4e6, seed=seed, math=math)
    options = get_method("eager-sgd").make_options({"sync_every": sync_every, "renormalize": renormalize,
                                                   "eager_seed": seed, "stale_weight": stale_weight}, quorum)
    method = SimEagerSGD(world, options)
    method.start()
    world.engine.run()
    method.check_done()
    stats = method.stats()
    assert stats["rounds"] == steps + 1  # one per iteration and the final one
    assert stats["contributed"] == n * steps and stats["mean_gradients_per_round"] * (steps + 1) == pytest.approx(n * steps)
    sequences = [math.applied[w] for w in range(n)]
    assert all(seq == sequences[0] for seq in sequences)  # every replica applies the same steps, in order
    if renormalize == "off" and stale_weight == "none":
        assert sum(sequences[0]) * n == math.computed  # each gradient exactly once, weighted 1/n
    elif renormalize == "off":  # late gradients weighted 1/(1 + s) <= 1: never more than the computed sum
        assert float(sum(sequences[0])) * n <= float(math.computed) * (1 + 1e-12)


def test_a_round_never_waits_for_a_worker_that_has_not_joined() -> None:
    """Solo, no synchronous rounds, one worker 20x slower: the others' rounds go on without it."""
    cluster = Cluster(compute_s=0.1, intra=Link(1e-5, 1e10), inter=Link(1e-5, 1e10))
    world = World(cluster=cluster, topology=Topology(1, 4), scenario=parse_scenario("straggler:2:20"), steps=40,
                  state_bytes=1e5, seed=0)
    options = get_method("eager-sgd").make_options({"sync_every": 0}, "solo")
    method = SimEagerSGD(world, options)
    method.start()
    world.engine.run()
    method.check_done()
    fast_end = max(world.end_s[0])
    assert world.end_s[2][0] > 1.9  # the straggler's first step takes 2 s
    # The fast workers are bounded only by how many results the straggler may hold unapplied.
    assert sum(1 for t in world.end_s[0] if t < world.end_s[2][0]) >= result_capacity(0) - 1
    assert fast_end < max(world.end_s[2])


# -- real processes ----------------------------------------------------------------------------------------
SCRIPT = textwrap.dedent('''
    """A worker whose gradients are known integers; checks what eager-sgd applied."""
    import json, random, sys, time
    import torch
    import torch.distributed as dist
    from torch import nn
    import prague

    algorithm, out, sync_every, sleepy = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    ctx = prague.init()
    model = nn.Linear(16, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    weight = sys.argv[5] if len(sys.argv) > 5 else "none"  # none: every gradient counts exactly once
    trainer = prague.wrap(model, optimizer, algorithm=algorithm, sync_every=sync_every, stale_weight=weight)
    rng = random.Random(100 + ctx.rank)
    steps, total = 14, torch.zeros(16, dtype=torch.float64)
    for step in range(steps):
        c = torch.tensor([float(rng.randint(-40, 40)) for _ in range(16)])
        total += c.double()
        pause = 1.5 if (ctx.rank == sleepy and step == 1) else rng.random() * 0.03

        def loss(m, c=c, pause=pause):
            time.sleep(pause)  # random arrival order; one long pause when asked
            return (m.weight.view(-1) * c).sum()  # its gradient is exactly c

        trainer.step(loss)
    trainer.close()
    stats = trainer.stats()
    final = model.weight.detach().view(-1).clone()
    finals = [torch.zeros(16) for _ in range(ctx.world_size)]
    dist.all_gather(finals, final)
    dist.all_reduce(total)
    if ctx.rank == 0:
        json.dump({"finals": [f.tolist() for f in finals], "total": total.tolist(), "stats": stats}, open(out, "w"))
    if ctx.rank == sleepy:
        json.dump(stats, open(out + ".sleepy", "w"))
    prague.shutdown()
''')


def _launch(tmp_path: Path, algorithm: str, sync_every: int, sleepy: int = -1, nproc: int = 4,
            weight: str = "none") -> dict[str, Any]:
    script = tmp_path / "known_gradients.py"
    script.write_text(SCRIPT)
    out = tmp_path / f"{algorithm.replace(':', '-')}-{sync_every}.json"
    res = run_cli("launch", "--nproc", str(nproc), str(script), algorithm, str(out), str(sync_every), str(sleepy),
                  weight, timeout_s=150.0, env={"PYTHONPATH": SRC})
    assert res.returncode == 0, res.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    if sleepy >= 0:
        result["sleepy"] = json.loads(Path(str(out) + ".sleepy").read_text())
    return result


@pytest.mark.timeout(200)
@pytest.mark.parametrize("algorithm,sync_every,weight", [("eager-sgd:solo", 0, "none"), ("eager-sgd:majority", 3, "none"),
                                                         ("eager-sgd:solo", 0, "inverse")])
def test_real_workers_apply_every_gradient_once_and_stay_bit_identical(tmp_path: Path, algorithm: str,
                                                                      sync_every: int, weight: str) -> None:
    result = _launch(tmp_path, algorithm, sync_every, weight=weight)
    finals, total = result["finals"], result["total"]
    assert all(f == finals[0] for f in finals)  # bit-identical replicas
    expected = [-t / 4 for t in total]  # lr 1, --renormalize off: the sum of every gradient over n
    if weight == "none":
        assert finals[0] == expected
    else:  # late gradients weighted 1/(1 + s): a different sum, the same on every replica
        assert result["stats"]["mean_staleness"] == 0 or finals[0] != expected
    assert any(abs(x) > 0 for x in expected)
    stats = result["stats"]
    assert stats["rounds"] == 15 and stats["contributed"] == 14
    assert stats["mean_gradients_per_round"] * 15 == pytest.approx(56)


@pytest.mark.timeout(200)
def test_real_workers_go_on_while_one_sleeps(tmp_path: Path) -> None:
    """Rank 2 sleeps 1.5 s in its second step; solo rounds started by the others carry on without it, so
    its late gradient lands in a much later round (staleness) and nothing is lost."""
    result = _launch(tmp_path, "eager-sgd:solo", 0, sleepy=2)
    finals, total = result["finals"], result["total"]
    assert all(f == finals[0] for f in finals) and finals[0] == [-t / 4 for t in total]
    staleness = {int(k): v for k, v in result["sleepy"]["staleness"].items()}
    assert max(staleness) >= 3, staleness  # rounds went on while it slept


LOOKAHEAD_SCRIPT = textwrap.dedent('''
    """Every round synchronous (--sync-every 1): eager-sgd is then plain momentum SGD on the mean gradient,
    and with --lookahead on each gradient is taken at the parameters shifted by -lr m v."""
    import json, sys
    import torch
    import torch.distributed as dist
    from torch import nn
    import prague

    lookahead, out = sys.argv[1], sys.argv[2]
    ctx = prague.init()
    model = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -2.0, 0.5, 3.0]]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = prague.wrap(model, optimizer, algorithm="eager-sgd:solo", sync_every=1, lookahead=lookahead)
    scale = 1.0 + ctx.rank  # rank r's loss: (1 + r) |w|^2 / 2, so its gradient is (1 + r) w
    for step in range(6):
        trainer.step(lambda m: 0.5 * scale * m.weight.square().sum())
    trainer.close()
    final = model.weight.detach().view(-1).clone()
    finals = [torch.zeros(4) for _ in range(ctx.world_size)]
    dist.all_gather(finals, final)
    if ctx.rank == 0:
        json.dump([f.tolist() for f in finals], open(out, "w"))
    prague.shutdown()
''')


@pytest.mark.timeout(200)
@pytest.mark.parametrize("lookahead", ["on", "off"])
def test_lookahead_takes_each_gradient_at_the_shifted_parameters(tmp_path: Path, lookahead: str) -> None:
    script, out = tmp_path / "lookahead.py", tmp_path / "finals.json"
    script.write_text(LOOKAHEAD_SCRIPT)
    res = run_cli("launch", "--nproc", "3", str(script), lookahead, str(out), timeout_s=150.0, env={"PYTHONPATH": SRC})
    assert res.returncode == 0, res.stderr[-3000:]
    finals = json.loads(out.read_text())
    assert all(f == finals[0] for f in finals)  # bit-identical replicas: the shift is undone exactly
    lr, m, mean_scale = 0.1, 0.9, 2.0  # the mean of 1, 2, 3

    def reference(shifted: bool) -> list[float]:
        x = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64)
        v = torch.zeros(4, dtype=torch.float64)
        for step in range(6):
            at = x - lr * m * v if shifted and step > 0 else x  # no momentum buffer before the first update
            v = m * v + mean_scale * at
            x = x - lr * v
        return x.tolist()

    assert finals[0] == pytest.approx(reference(lookahead == "on"), rel=1e-5)
    assert finals[0] != pytest.approx(reference(lookahead != "on"), rel=1e-3)


def test_what_a_finished_gradient_means_for_its_round_and_what_rounds_add_up_to() -> None:
    """The rounds' control flow both drivers follow: a synchronous round waits for everyone, a solo round
    is started by whoever finishes first, a majority round by its drawn initiator only."""
    assert activation("solo", 4, rank=2, round_id=3, nproc=4, seed=0) == SYNC  # every 4th round: 3, 7, ...
    assert activation("solo", 4, rank=2, round_id=1, nproc=4, seed=0) == START
    chosen = initiator(1, 4, 0)
    assert [activation("majority", 4, r, 1, 4, 0) for r in range(4)] == [START if r == chosen else None
                                                                          for r in range(4)]
    tally = RoundTally()
    tally.add(False, 3, 2, [0, 0, 1])
    tally.add(True, 4, 4, [0, 0, 0, 0])
    assert (tally.sync_rounds, tally.gradients, tally.fresh, dict(tally.staleness)) == (1, 7, 6, {0: 6, 1: 1})
