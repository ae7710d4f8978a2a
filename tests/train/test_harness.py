"""The built-in loop's experiment harness (``train/harness.py``): injected faults, slowdowns and paced
compute as :class:`~prague.train.trainer.StepHooks`, outside the library's training API."""

from __future__ import annotations

import sys
import textwrap
import time

import pytest

from prague.algorithms.api import StepTimes
from prague.errors import ConfigError
from prague.hetero.spec import InjectedCrash, parse_scenario
from prague.train.harness import Harness
from prague.train.pacing import Pace
from prague.train.trainer import StepRecord
from prague_testing import run_command

pytestmark = pytest.mark.timeout(120)


def _record(step: int, compute_s: float) -> StepRecord:
    return StepRecord(step, 0, 0.0, compute_s, 0.0, 0.0, 1.0, None)


def _run_step(harness: Harness, step: int, real_s: float = 0.0, inner_comm_s: float = 0.0) -> float:
    """Drive the hooks of one step as the trainer does; the step's seconds between its ends."""
    t0 = time.perf_counter()
    harness.before_compute(step)
    harness.before_forward(step)
    if real_s:
        time.sleep(real_s)
    harness.after_backward(step)
    harness.before_update(step, StepTimes(inner_comm_s=inner_comm_s))
    return time.perf_counter() - t0


def test_a_crash_fires_on_its_rank_and_step_only() -> None:
    scenario = parse_scenario("crash:1:3")
    on_rank_1, on_rank_0 = Harness(scenario, 1, 2), Harness(scenario, 0, 2)
    for step in range(3):
        on_rank_1.before_compute(step)
    on_rank_0.before_compute(3)
    with pytest.raises(InjectedCrash, match="rank 1 at step 3"):
        on_rank_1.before_compute(3)


def test_a_slow_rank_sleeps_its_slowdown_times_the_nominal_compute() -> None:
    scenario = parse_scenario("straggler:0:4")  # rank 0 takes 4x the nominal time
    slow, fast = Harness(scenario, 0, 2, nominal_s=0.01), Harness(scenario, 1, 2, nominal_s=0.01)
    assert _run_step(slow, 0) >= 0.03  # (4 - 1) x 10 ms
    assert slow.finish_step(_record(0, 0.031)).slowdown == 4.0
    assert fast.finish_step(_record(0, 0.001)).slowdown == 1.0
    assert slow.ema_s == pytest.approx(0.001, abs=1e-9)  # the compute without the injected sleep


def test_without_a_nominal_time_slowdowns_scale_the_measured_compute() -> None:
    harness = Harness(parse_scenario("straggler:0:3"), 0, 2)
    assert _run_step(harness, 0) < 0.02  # nothing measured yet: no sleep
    harness.finish_step(_record(0, 0.01))
    assert _run_step(harness, 1) >= 0.02  # (3 - 1) x the 10 ms measured
    restored = Harness(parse_scenario("straggler:0:3"), 0, 2)
    restored.load_state_dict(harness.state_dict())  # a checkpoint keeps the average
    assert restored.ema_s == harness.ema_s


def test_a_paced_step_lasts_its_pace_times_its_slowdown() -> None:
    harness = Harness(parse_scenario("straggler:0:2"), 0, 1, nominal_s=0.02, paced=True)
    for step in range(3):
        assert _run_step(harness, step, real_s=0.002) >= 0.04


def test_a_pace_the_real_pass_cannot_hold_is_refused_naming_the_time() -> None:
    harness = Harness(parse_scenario("homogeneous"), 0, 1, nominal_s=0.001, paced=True)
    with pytest.raises(ConfigError, match=r"more than the pace of 1 ms; raise --compute-ms"):
        for step in range(Pace.WARMUP_STEPS + 2 * Pace.WINDOW):  # judged after warm-up, on two windows
            _run_step(harness, step, real_s=0.003)
    with pytest.raises(ConfigError, match="paced compute needs compute_ms > 0"):
        Harness(parse_scenario("homogeneous"), 0, 1, paced=True)


def test_the_library_api_takes_no_experiment_knobs_and_runs_the_harness_as_hooks() -> None:
    """In a job of one: ``prague.wrap`` refuses a scenario (an experiment knob, not the library's), and a
    trainer with the harness as its hooks crashes at the injected step and reports its slowdowns."""
    script = textwrap.dedent("""
        import torch, torch.nn.functional as F
        from torch import nn
        import prague
        from prague.errors import ConfigError
        from prague.hetero.spec import InjectedCrash, parse_scenario
        from prague.train.harness import Harness

        prague.init()
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            prague.wrap(model, opt, algorithm="allreduce", scenario="straggler:0:2")
        except ConfigError as exc:
            print("refused:", exc)
        harness = Harness(parse_scenario("straggler:0:2+crash:0:2"), 0, 1, nominal_s=0.005)
        trainer = prague.wrap(model, opt, algorithm="allreduce", hooks=harness)
        x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
        for _ in range(2):
            rec = harness.finish_step(trainer.step(lambda m: F.cross_entropy(m(x), y)))
            print("slowdown", rec.slowdown, "compute", rec.compute_s >= 0.005)
        try:
            trainer.step(lambda m: F.cross_entropy(m(x), y))
        except InjectedCrash as exc:
            print("crashed:", exc)
        trainer.close()
        prague.shutdown()
    """)
    res = run_command([sys.executable, "-c", script], timeout_s=100)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "refused: method 'allreduce' has no option(s) ['scenario']" in res.stdout
    assert res.stdout.count("slowdown 2.0 compute True") == 2, res.stdout
    assert "crashed: injected crash of rank 0 at step 2" in res.stdout
