"""Failures in the simulator: a crash or a hang stops its worker at the scenario's step, the launcher's own
rules declare it (a crash at its next look, a hang once the lease runs out), groups go on over their live
members, the Group Generator excludes it, and the record lists it as a real run's does."""

from __future__ import annotations

import dataclasses
import math

import pytest

from prague.errors import ConfigError
from prague.groups.api import Topology
from prague.hetero.spec import parse_scenario
from prague.runtime.liveness import HEARTBEAT_S, LAUNCHER_TICK_S
from prague.sim.cluster import PAPER
from prague.sim.world import World
from prague.simulate.run import SimConfig, simulate, simulate_charged


def _world(lease_s: float = 10.0) -> World:
    return World(cluster=PAPER, topology=Topology(1, 4), scenario=parse_scenario("homogeneous"), steps=4,
                 state_bytes=1e6, seed=0, lease_s=lease_s)


@pytest.mark.parametrize("kind,at,expected", [
    ("crash", 1.03, 1.2),  # the launcher's next look
    ("hang", 1.03, 1.2 + 2.0),  # the last beat (1.0) seen at 1.2, then the 2 s lease
    ("hang", 1.71, 1.6 + 2.0),  # the last beat at 1.5, seen at 1.6
])
def test_a_failure_is_declared_when_the_launcher_would(kind: str, at: float, expected: float) -> None:
    assert (HEARTBEAT_S, LAUNCHER_TICK_S) == (0.5, 0.2)  # the expectations above assume these
    world = _world(lease_s=2.0)
    seen: list[tuple[int, float]] = []
    world.on_declared(lambda rank: seen.append((rank, world.engine.now)))
    world.engine.at(at, lambda _: world.stop_here(2, 7, kind))
    world.engine.run()
    assert [r for r, _ in seen] == [2] and seen[0][1] == pytest.approx(expected, abs=1e-6)
    assert world.declared[2].summary() == {"rank": 2, "step": 7, "kind": kind}


@pytest.mark.parametrize("joined", [True, False])
def test_a_group_waiting_for_a_failed_member_goes_on_without_it_once_declared(joined: bool) -> None:
    """Rank 3 joins the group at 0.9 s (or not) and crashes at 0.95 s (declared at 1.0 s); the others, there
    at 0.97 s, wait until the declaration, then average without it."""
    world = _world()
    ran: list[tuple[tuple[int, ...], float]] = []
    done = []
    members = (0, 1, 3)

    def join(rank: int) -> None:
        done.append(world.meet("g", members, rank=rank, on_done=lambda m: ran.append((m, world.engine.now))))

    if joined:
        world.engine.at(0.9, join, 3)
    world.engine.at(0.95, lambda _: world.stop_here(3, 1, "crash"))
    for rank in (0, 1):
        world.engine.at(0.97, join, rank)
    world.engine.run()
    assert [m for m, _ in ran] == [(0, 1)] and ran[0][1] >= 1.0
    assert all(sig.fired for sig in done) and world.open_meetings == 0


@pytest.mark.parametrize("generator", ["ready", "smart", "random", "static"])
@pytest.mark.parametrize("overlap", ["on", "off"])
def test_prague_survivors_finish_and_the_record_lists_the_failures(generator: str, overlap: str) -> None:
    record = simulate(SimConfig.of(algorithm=f"prague:{generator}", scenario="crash:0:5+hang:6:30+paper:5", nproc=8,
                                   nodes=2, steps=40, model="mlp", lease_s=2.0,
                                   options={"overlap": overlap})).to_dict()
    assert record["failures"] == [{"rank": 0, "step": 5, "kind": "crash"}, {"rank": 6, "step": 30, "kind": "hang"}]
    assert record["completed_steps"] == [5, 40, 40, 40, 40, 40, 30, 40]


@pytest.mark.parametrize("algorithm", ["dssync", "adpsgd", "eager-sgd:solo", "eager-sgd:majority"])
def test_other_survivors_finish_and_the_record_lists_the_failures(algorithm: str) -> None:
    record = simulate(SimConfig.of(algorithm=algorithm, scenario="crash:0:5+hang:6:30+paper:5", nproc=8, steps=40,
                                   model="mlp", lease_s=2.0)).to_dict()
    assert record["failures"] == [{"rank": 0, "step": 5, "kind": "crash"}, {"rank": 6, "step": 30, "kind": "hang"}]
    assert record["completed_steps"] == [5, 40, 40, 40, 40, 40, 30, 40]


@pytest.mark.parametrize("algorithm", ["dssync", "adpsgd", "eager-sgd:solo", "eager-sgd:majority"])
def test_other_survivors_still_average_real_models(algorithm: str) -> None:
    record = simulate(SimConfig.of(algorithm=algorithm, scenario="crash:3:10", nproc=4, steps=60, model="mlp",
                                   data="digits", math="real", lease_s=2.0)).to_dict()
    assert record["failures"] == [{"rank": 3, "step": 10, "kind": "crash"}]
    assert record["test_accuracy"] > 0.5


def test_prague_survivors_still_average_real_models() -> None:
    record = simulate(SimConfig.of(algorithm="prague", scenario="crash:3:10", nproc=4, steps=60, model="mlp",
                                   data="digits", math="real", lease_s=2.0)).to_dict()
    assert record["failures"] == [{"rank": 3, "step": 10, "kind": "crash"}]
    assert record["test_accuracy"] > 0.5


def test_every_method_that_survives_failures_at_run_time_plays_them_out_here() -> None:
    from prague.algorithms.registry import METHODS

    for method in METHODS.values():
        if method.survives_failures:
            assert method.sim_class().models_failures, method.name


def test_eager_sgd_survivors_recover_as_the_runtime_does() -> None:
    """A round that waited for the failed worker breaks: its contributions are lost, and the rounds go on
    over the survivors, one recovery for each failure."""
    record = simulate(SimConfig.of(algorithm="eager-sgd:majority", scenario="crash:2:10+hang:5:25", nproc=6,
                                   steps=40, model="mlp", lease_s=2.0)).to_dict()
    stats = record["algorithm_stats"][0]
    assert stats["recoveries"] == 2 and stats["lost_gradients"] > 0
    assert stats["rounds"] == 41
    assert record["completed_steps"] == [40, 40, 10, 40, 40, 25]


def test_a_failure_rate_draws_one_seeded_failure_time_per_rank() -> None:
    scenario = parse_scenario("failures:0.5", seed=3)
    times = [scenario.failure_time_s(r) for r in range(4000)]
    assert times == [parse_scenario("failures:0.5", seed=3).failure_time_s(r) for r in range(4000)]
    mean = 3600.0 / -math.log(0.5)  # exponential: half the workers fail within the first hour
    assert abs(sum(times) / len(times) - mean) < 0.06 * mean
    assert abs(sum(t < 3600.0 for t in times) / len(times) - 0.5) < 0.03
    assert parse_scenario("homogeneous").failure_time_s(0) == math.inf
    for bad in ("failures:0", "failures:1", "failures:nan", "failures:x"):
        with pytest.raises(ConfigError, match="failures"):
            parse_scenario(bad)


def test_under_a_failure_rate_each_rank_crashes_at_the_first_step_after_its_failure_time() -> None:
    scenario = "failures:0.999+paper:5"
    record = simulate(SimConfig.of(algorithm="prague", scenario=scenario, nproc=64, nodes=16, steps=400,
                                   model="mlp", seed=2)).to_dict()
    drawn = parse_scenario(scenario, seed=2)
    failed = {f["rank"]: f["step"] for f in record["failures"]}
    assert failed, "some worker must fail at this rate (about 2 per minute among 64)"
    assert all(f["kind"] == "crash" for f in record["failures"])
    assert record["completed_steps"] == [failed.get(r, 400) for r in range(64)]
    # the ranks that ran to the end failed after their end, those that failed before
    assert all(drawn.failure_time_s(r) <= record["wall_s"] for r in failed)


def test_a_method_that_restarts_is_charged_detection_restart_and_the_steps_since_its_checkpoint() -> None:
    from prague.sim.restarts import charge

    ends = [0.1 * (k + 1) for k in range(100)]  # step k ends at 0.1 (k + 1) s: 10 s in all
    crash = parse_scenario("crash:3:50")  # fires when the run reaches step 50, at 5.0 s
    got = charge(ends, crash, 8, restart_s=20.0, lease_s=2.0, checkpoint_every=20)
    assert [f.summary() for f in got.failures] == [{"rank": 3, "step": 50, "kind": "crash"}]
    # seen at the launcher's next look (5.2 s), 20 s to restart, back to the checkpoint at step 40 (4.0 s)
    assert got.restarts == 1 and got.extra_s == pytest.approx(5.2 + 20.0 - 4.0)
    hang = charge(ends, parse_scenario("hang:3:50"), 8, 20.0, 2.0, None)  # the lease, and no checkpoint
    assert hang.extra_s == pytest.approx(5.2 + 2.0 + 20.0 - 0.0)
    late = charge(ends, parse_scenario("crash:3:100"), 8, 20.0, 2.0, 20)  # a step the run never starts
    assert late.restarts == 0 and late.extra_s == 0.0


def test_allreduce_under_a_failure_rate_restarts_and_takes_longer() -> None:
    base = SimConfig.of(algorithm="allreduce", scenario="paper:5", nproc=64, nodes=16, steps=300, model="mlp",
                        seed=2, checkpoint_every=50)
    clean = simulate(base).to_dict()
    failing = simulate(dataclasses.replace(base, run=dataclasses.replace(
        base.run, scenario="paper:5+failures:0.999"))).to_dict()
    assert failing["restarts"] == len(failing["failures"]) > 0
    assert failing["job_s"] > clean["job_s"] + failing["restarts"] * PAPER.restart_s
    # one run, charged for each scenario: the records of the runs simulated one by one, but for run_s
    scenarios = ["paper:5", "paper:5+failures:0.999", "paper:5+crash:3:100+failures:0.5"]
    charged = [r.to_dict() for r in simulate_charged(base, scenarios)]
    alone = [clean, failing, simulate(dataclasses.replace(base, run=dataclasses.replace(
        base.run, scenario=scenarios[2]))).to_dict()]
    for one, other in zip(charged, alone):
        for record in (one, other):
            record["sim"].pop("run_s")
            record.pop("command", None)
        assert one == other
    assert charged[2]["scenario"] == "paper:5+crash:3:100+failures:0.5" and charged[2]["restarts"] >= 1
    with pytest.raises(ConfigError, match="differ in more than"):
        simulate_charged(base, ["paper:5", "paper:4+failures:0.1"])
    with pytest.raises(ConfigError, match="simulate each"):
        simulate_charged(SimConfig.of(algorithm="prague", scenario="paper:5", nproc=64, nodes=16, steps=300,
                                      model="mlp"), ["paper:5", "paper:5+failures:0.1"])
    with pytest.raises(ConfigError, match="charges as time"):
        SimConfig.of(algorithm="allreduce", scenario="crash:1:3", nproc=4, steps=5, model="mlp", math="real")


def test_adpsgd_actives_stop_drawing_a_failed_passive_once_it_is_declared(tmp_path) -> None:
    """Ranks 1 and 3 are the passives of 4 workers; rank 1 crashes at step 5. Exchanges queued at it break
    once it is declared, the actives draw again, and from then on they only pick rank 3."""
    from prague.metrics.decisions import rank_path, read_decisions

    record = simulate(SimConfig.of(algorithm="adpsgd", scenario="crash:1:5", nproc=4, steps=40, model="mlp",
                                   lease_s=2.0, decisions=tmp_path)).to_dict()
    assert record["failures"] == [{"rank": 1, "step": 5, "kind": "crash"}]
    assert record["completed_steps"] == [40, 5, 40, 40]
    for active in (0, 2):
        partners = [(d.step, d.partner) for d in read_decisions(rank_path(tmp_path, active)) if d.kind == "partner"]
        assert {p for _, p in partners} == {1, 3}  # rank 1 was drawn before it failed
        last_with_1 = max(i for i, (_, p) in enumerate(partners) if p == 1)
        assert all(p == 3 for _, p in partners[last_with_1 + 1:]) and len(partners) - last_with_1 > 20
        steps = [s for s, _ in partners]
        assert sorted(set(steps)) == list(range(40))  # every step averaged (a broken one drew again)
