"""The slowdown model: statistics for a fixed seed, determinism, parsing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prague_testing import run_cli
from prague.errors import ConfigError
from prague.hetero.spec import parse_scenario, uniform, uniform_steps


@pytest.mark.parametrize("n", [4, 8, 16])
def test_paper_model_slows_each_worker_with_probability_one_over_n(n: int) -> None:
    sc = parse_scenario("paper:5", seed=7)
    steps = 20_000
    slowed = [[sc.slowdown(r, s, n) > 1 for s in range(steps)] for r in range(n)]
    for r in range(n):
        p = sum(slowed[r]) / steps
        assert abs(p - 1 / n) < 4 * (1 / n * (1 - 1 / n) / steps) ** 0.5 + 1e-3, (r, p)
    # independent across workers: P(both 0 and 1 slowed) ~ 1/n^2
    both = sum(a and b for a, b in zip(slowed[0], slowed[1])) / steps
    assert abs(both - 1 / n**2) < 0.01
    assert {sc.slowdown(0, s, n) for s in range(200)} == {1.0, 5.0}
    mean = sum(sc.slowdown(2, s, n) for s in range(steps)) / steps
    assert mean == pytest.approx(sc.mean_slowdown(2, n), rel=0.05)
    assert sc.mean_slowdown(2, n) == pytest.approx(1 + 4 / n)


def test_draws_are_a_pure_function_of_seed_rank_step() -> None:
    a, b = parse_scenario("paper:3", seed=1), parse_scenario("paper:3", seed=1)
    seq_a = [a.slowdown(r, s, 4) for s in range(500) for r in range(4)]
    seq_b = [b.slowdown(r, s, 4) for r in range(4) for s in range(500)]  # other call order
    assert sorted(seq_a) == sorted(seq_b)
    assert [a.slowdown(1, s, 4) for s in range(500)] == [b.slowdown(1, s, 4) for s in range(500)]
    c = parse_scenario("paper:3", seed=2)
    assert [a.slowdown(1, s, 4) for s in range(500)] != [c.slowdown(1, s, 4) for s in range(500)]
    assert all(0.0 <= uniform(3, r, s) < 1.0 for r in range(5) for s in range(100))


def test_straggler_crash_and_combination() -> None:
    sc = parse_scenario("straggler:1:3+crash:2:5")
    assert [sc.slowdown(r, 0, 4) for r in range(4)] == [1.0, 3.0, 1.0, 1.0]
    assert sc.crashes_at(2, 5) and not sc.crashes_at(2, 4) and not sc.crashes_at(1, 5)
    assert parse_scenario("homogeneous").is_homogeneous
    with pytest.raises(ConfigError, match="rank 1"):
        sc.check_world(1)


def test_hang_terms_are_faults_with_ranks_checked() -> None:
    sc = parse_scenario("paper:2+hang:3:7+crash:1:2")
    assert sc.hangs_at(3, 7) and not sc.hangs_at(3, 6) and not sc.crashes_at(3, 7)
    assert {(f.rank, f.step) for f in sc.faults} == {(3, 7), (1, 2)}
    with pytest.raises(ConfigError, match="rank 3"):
        sc.check_world(3)
    with pytest.raises(ConfigError, match="hang:RANK:STEP"):
        parse_scenario("hang:1")
    with pytest.raises(ConfigError, match="must be >= 0"):
        parse_scenario("hang:-1:2")


@pytest.mark.parametrize("bad", ["paper", "paper:x", "paper:0.5", "straggler:1", "straggler:-1:2",
                                 "crash:a:1", "slow:2", "paper:2+", "hang:x:1", "hang:1:2:3"])
def test_malformed_scenarios_name_the_term(bad: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_scenario(bad)
    assert "paper:X" in str(info.value) or "must be" in str(info.value)


@pytest.mark.timeout(180)
def test_emulated_compute_applies_the_straggler_factor(tmp_path: Path) -> None:
    out = tmp_path / "emu"
    res = run_cli("run", "--nproc", "2", "--steps", "12", "--compute", "emulated", "--compute-ms", "60",
                  "--slowdown", "straggler:1:3", "--model", "resnet18", "--data", "synthetic", "--out", str(out),
                  "--quiet")
    assert res.returncode == 0, res.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["compute_mode"] == "emulated" and summary["test_accuracy"] is None
    assert summary["parameters"] > 11_000_000
    fast, slow = summary["mean_compute_s"]
    # compute = the emulated wait plus the surrogate forward/backward over 11M parameters (~10 ms, more
    # under load); the straggler's extra is exactly (3 - 1) x 60 ms of injected delay
    assert fast >= 0.060
    assert slow - fast == pytest.approx(0.120, abs=0.025)
    # rank 0 waits for the straggler in DDP's collectives, which counts as communication, not compute
    assert summary["mean_comm_s"][0] > 0.08


@given(st.integers(0, 2**64 - 1), st.integers(0, 10**6), st.integers(0, 2**40), st.integers(0, 64),
       st.integers(0, 9))
def test_the_array_draws_are_the_single_draws(seed: int, rank: int, start: int, count: int, stream: int) -> None:
    assert uniform_steps(seed, rank, start, start + count, stream).tolist() == [
        uniform(seed, rank, step, stream) for step in range(start, start + count)]


@pytest.mark.parametrize("text", ["paper:5", "paper:5+paper:3", "paper:4+straggler:1:3:20-90", "straggler:2:4",
                                  "homogeneous"])
def test_slowdowns_drawn_a_block_at_a_time_are_the_step_by_step_ones(text: str) -> None:
    """The simulator's block of paper slowdowns, times the stragglers', is :meth:`Scenario.slowdown` at every step."""
    sc, n = parse_scenario(text, seed=11), 4
    for rank in range(n):
        for start in (0, 37):
            slowed = sc.paper_slowdowns(rank, start, start + 300, n)
            assert all(start <= step < start + 300 and factor > 1 for step, factor in slowed.items())
            assert [sc.straggler_slowdown(rank, step, slowed.get(step, 1.0)) for step in range(start, start + 300)] \
                == [sc.slowdown(rank, step, n) for step in range(start, start + 300)]
