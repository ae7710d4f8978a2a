"""``--math real``: real parameters in event order; accuracy against simulated time."""

from __future__ import annotations

import contextlib

import pytest
import torch

from prague.errors import ConfigError
from prague.optim import SGDRule
from prague.sim.cluster import Cluster, Link
from prague.sim.world import World
from prague.simulate.run import SimConfig, build, simulate


EVERY_S = 0.1


def _sim(algorithm: str, nproc: int, steps: int = 60, batch_size: int = 16, target: float | None = None,
         target_loss: float | None = None) -> dict:
    return simulate(SimConfig.of(algorithm=algorithm, scenario="paper:5", nproc=nproc, nodes=1, steps=steps,
                              batch_size=batch_size, model="mlp", data="digits", cluster=Cluster(compute_s=0.01),
                              math="real", lr=0.05, eval_every_s=EVERY_S, target_accuracy=target,
                              target_loss=target_loss)).to_dict()


def assert_common_clock(record: dict) -> None:
    """Points of the --eval-every-s grid on the simulated clock, then the job's end (the final mean)."""
    history = record["eval_history"]
    times = [h["wall_s"] for h in history]
    assert times == sorted(times) and times[0] == 0.0 and times[-1] == pytest.approx(record["wall_s"])
    assert all(abs(t / EVERY_S - round(t / EVERY_S)) < 1e-9 for t in times[:-1])
    assert history[-1]["accuracy"] == record["test_accuracy"]


@pytest.mark.parametrize("algorithm", ["allreduce", "prague:smart", "adpsgd", "ps:sync", "ps-eager"])
def test_real_math_learns_digits(algorithm: str) -> None:
    record = _sim(algorithm, nproc=8, target=0.6, target_loss=0.5)
    assert record["compute_mode"] == "real"
    assert record["test_accuracy"] > 0.8
    assert_common_clock(record)
    history = record["eval_history"]
    assert history[0]["accuracy"] < 0.3  # the initial model, at time 0
    # the time to target is the first scored point at or above it, in time order
    hit = min(h["wall_s"] for h in history if h["accuracy"] >= 0.6)
    assert record["time_to_target_s"] == hit
    assert all(h["accuracy"] < 0.6 for h in history if h["wall_s"] < hit)
    # the loss target, found in the same time-order pass: the first scored point at or below it
    assert record["target_loss"] == 0.5
    assert record["time_to_target_loss_s"] == min(h["wall_s"] for h in history if h["loss"] <= 0.5)
    smoothed = record["time_to_target_smoothed_s"]
    assert smoothed is not None and history[0]["wall_s"] <= smoothed <= record["wall_s"]
    # every worker's own final row, scored on its own
    assert record["worst_replica_accuracy"] <= record["best_replica_accuracy"]
    assert record["worst_replica_loss"] > 0
    if algorithm == "allreduce":
        assert record["consensus_distance"] == pytest.approx(0.0, abs=1e-6)
    elif algorithm.startswith("prague"):  # --final-average on: the replicas end as their average
        stats = record["algorithm_stats"][0]
        assert stats["final_average_ranks"] == 8 and stats["final_average_distance"] > 1e-3
        assert record["consensus_distance"] == pytest.approx(0.0, abs=1e-6)
        assert record["worst_replica_accuracy"] == record["best_replica_accuracy"]
        assert record["worst_replica_accuracy"] == pytest.approx(record["test_accuracy"], abs=0.002)
    else:
        assert record["consensus_distance"] > 0


def test_hundreds_of_workers_sample_from_the_whole_set() -> None:
    record = _sim("prague:ready", nproc=64, steps=20, batch_size=32)  # 1,437 images: < 1 batch per shard
    assert record["test_accuracy"] > 0.5
    assert_common_clock(record)


@pytest.mark.parametrize("max_in_flight", [1, 2, 3])
def test_overlapped_prague_with_averages_out_meets_at_the_mean(max_in_flight: int) -> None:
    """The runtime's rule in the simulator: two workers at 0 and 4, no local updates (learning rate 0),
    always grouped together, averages slower than a step so ``max_in_flight`` are out at once: they end
    at 2 and 2 (snapshots lacking the earlier corrections gave 4 and 0 with two out, 6 and -2 with three)."""
    config = SimConfig.of(algorithm="prague:random", nproc=2, steps=12, model="mlp", data="digits", math="real",
                          momentum=0.0, cluster=Cluster(compute_s=0.001, intra=Link.of(5000.0, 80.0)),
                          options={"group_size": 2, "max_in_flight": max_in_flight})
    world, method = build(config)
    with contextlib.closing(world):
        world.math._rule = SGDRule(0.0, 0.0)  # no local updates (a run's --lr must be > 0)
        values = world.math.X
        values[0].fill_(0.0)
        values[1].fill_(4.0)
        method.start()
        world.engine.run()
        method.check_done()
    assert method.stats()["busy_local_steps"] > 0  # steps that found max_in_flight averages out
    assert torch.equal(values[:2], torch.full_like(values[:2], 2.0))


def test_the_lookahead_gradient_is_taken_at_the_momentum_shifted_values() -> None:
    """eager-sgd's ``--lookahead on`` in the simulator: after a first step (a momentum buffer v), worker 0's
    gradient is the gradient at x - lr m v, not at x; before any step there is nothing to shift."""
    from prague.sim.math import MathConfig, RealMath

    math = RealMath(2, 4, MathConfig(lr=0.05, momentum=0.9))
    assert torch.equal(math.gradient(0, 0, lookahead=True), math.gradient(0, 0))
    math.local_step(0, 0)
    buf = math._bufs[0]
    assert buf is not None
    shifted = math.X[0] - 0.05 * 0.9 * buf
    assert torch.equal(math.gradient(0, 1, lookahead=True), math._grad(shifted, 0, 1))
    assert not torch.equal(math.gradient(0, 1, lookahead=True), math.gradient(0, 1))


def test_a_job_wide_budget_is_claimed_by_the_fast_workers_and_shared_equally_by_lockstep_methods() -> None:
    """--budget epochs:2 on digits (1,437 images, 44 batches of 32 an epoch): 88 batches. prague takes them
    from one counter with the runtime's rule: the 4x straggler takes fewer, every batch goes to one worker;
    allreduce needs every rank in every step: 88 // 8 = 11 each."""
    def run(algorithm: str) -> tuple[World, dict]:
        config = SimConfig.of(algorithm=algorithm, scenario="straggler:3:4", nproc=8, model="mlp", data="digits",
                           cluster=Cluster(compute_s=0.01), math="real", budget="epochs:2", eval_every_s=EVERY_S)
        world, method = build(config)
        with contextlib.closing(world):
            method.start()
            world.engine.run()
            method.check_done()
        return world, simulate(config).to_dict()

    world, record = run("prague")
    assert sorted(i for indices in world.batch_index for i in indices) == list(range(88))
    steps = [len(ends) for ends in world.end_s]
    assert sum(steps) == 88 and steps[3] < min(s for w, s in enumerate(steps) if w != 3)
    assert record["shares"] == "claimed" and record["budget"] == "epochs:2" and record["samples"] == 88 * 32
    assert record["worker_samples"] == [s * 32 for s in steps]
    world, record = run("allreduce")
    assert [len(ends) for ends in world.end_s] == [11] * 8 and world.batch_index == [[]] * 8
    assert record["shares"] == "equal" and record["samples"] == 88 * 32
    with pytest.raises(ConfigError, match="seconds:5 is not modelled"):
        SimConfig.of(algorithm="prague", budget="seconds:5")


def test_shared_momentum_travels_with_the_rows() -> None:
    """prague --share-momentum on in the simulator: a group average averages the members' momentum
    buffers too, and a delayed correction (values, corrections, add) moves both."""
    from prague.sim.math import MathConfig, RealMath

    math = RealMath(3, 4, MathConfig(lr=0.05, momentum=0.9))
    math.share_momentum = True
    math.local_step(0, 0)
    math.local_step(1, 0)
    m0, m1 = math._bufs[0].clone(), math._bufs[1].clone()
    snaps = {0: math.values(0), 1: math.values(1)}
    n = math.X.shape[1]
    assert snaps[0].numel() == 2 * n and torch.equal(snaps[0][n:], m0)
    for w, delta in math.corrections(snaps).items():
        math.add(w, delta)
    assert torch.allclose(math._bufs[0], (m0 + m1) / 2) and torch.allclose(math._bufs[1], (m0 + m1) / 2)
    assert torch.allclose(math.X[0], math.X[1])
    math.local_step(2, 1)
    math.average([0, 2])  # worker 2's buffer and worker 0's, averaged
    assert torch.allclose(math._bufs[0], math._bufs[2])
