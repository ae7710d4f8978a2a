"""``--math real``: real parameters in event order; accuracy against simulated time."""

from __future__ import annotations

import pytest

from prague.sim.cluster import Cluster
from prague.simulate.run import SimConfig, simulate


def _sim(algorithm: str, nproc: int, steps: int = 60, batch_size: int = 16) -> dict:
    return simulate(SimConfig(algorithm=algorithm, scenario="paper:5", nproc=nproc, nodes=1, steps=steps,
                              batch_size=batch_size, model="mlp", data="digits", cluster=Cluster(compute_s=0.01),
                              math="real", lr=0.05, eval_every=20)).to_dict()


@pytest.mark.parametrize("algorithm", ["allreduce", "prague:smart", "adpsgd", "ps:sync", "ps-eager"])
def test_real_math_learns_digits(algorithm: str) -> None:
    record = _sim(algorithm, nproc=8)
    assert record["compute_mode"] == "real"
    assert record["test_accuracy"] > 0.8
    history = record["eval_history"]
    assert [h["step"] for h in history] == [20, 40, 60]
    assert all(h["wall_s"] > 0 for h in history) and history[-1]["wall_s"] <= record["wall_s"] + 1e-9
    if algorithm == "allreduce":
        assert record["consensus_distance"] == pytest.approx(0.0, abs=1e-6)
    else:
        assert record["consensus_distance"] > 0


def test_hundreds_of_workers_sample_from_the_whole_set() -> None:
    record = _sim("prague:ready", nproc=64, steps=20, batch_size=32)  # 1,437 images: < 1 batch per shard
    assert record["test_accuracy"] > 0.5
    assert record["eval_history"][-1]["step"] == 20
