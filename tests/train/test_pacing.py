"""The accelerator-faithful paced clock (``train/pacing.py``): a step's forward part, then its backward
part spent layer by layer in autograd's order, with each gradient released when it would be ready on an
accelerator; the pace judged after warm-up; ``--compute-ms auto``'s probe."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from prague.errors import ConfigError
from prague.train.config import forward_share
from prague.train.pacing import Pace, module_cost, ready_shares
from prague.train.probe import pace_of, probe_pace
from prague.workload.models import build_model
from prague.net.hosts import missing_privileges
from prague.sim.costs import MIB, ddp_buckets
from prague.simulate.run import gradient_sizes
from prague_testing import run_cli

#: `serial`: these tests time real compute against the pace: `make test` runs them after its parallel part,
#: alone on the machine.
pytestmark = [pytest.mark.timeout(120), pytest.mark.serial]


def _shares(model: nn.Module, x: torch.Tensor) -> dict[str, float]:
    """Each parameter's ready share (by name) after one forward pass of ``model`` on ``x``."""
    order: list[nn.Module] = []
    costs: dict[nn.Module, float] = {}

    def count(module: nn.Module, args: object, output: object) -> None:
        if module not in costs:
            order.append(module)
            costs[module] = 0.0
        costs[module] += module_cost(module, output)

    handles = [m.register_forward_hook(count) for m in model.modules() if not any(True for _ in m.children())]
    model(x)
    for h in handles:
        h.remove()
    shares = ready_shares(order, costs)
    return {name: shares[p] for name, p in model.named_parameters()}


def test_the_split_is_read_from_f_to_b_and_bad_values_are_named() -> None:
    assert forward_share("1:2") == pytest.approx(1 / 3)
    assert forward_share("0:1") == 0.0
    for bad in ("2", "a:b", "1:0", "-1:2", "inf:1"):
        with pytest.raises(ConfigError, match="--pace-split"):
            forward_share(bad)


def test_in_the_mnist_cnn_fc1_is_ready_a_tenth_into_backward_and_conv1_last() -> None:
    shares = _shares(build_model("cnn", (1, 28, 28), 10), torch.zeros(2, 1, 28, 28))
    # Sequential: 0 conv1, 3 conv2, 8 fc1, 10 fc2
    assert shares["10.weight"] < 0.01
    assert 0.05 < shares["8.weight"] < 0.15  # 95% of the parameters, 10% of the arithmetic
    assert 0.9 < shares["3.weight"] < 1.0
    assert shares["0.weight"] == pytest.approx(1.0)
    assert shares["8.weight"] == shares["8.bias"]  # a module's parameters are ready together


def test_costs_follow_the_arithmetic_not_the_parameter_count() -> None:
    conv = nn.Conv2d(8, 16, 3, padding=1)
    out = conv(torch.zeros(1, 8, 10, 10))
    assert module_cost(conv, out) == 16 * 10 * 10 * 8 * 9
    linear = nn.Linear(30, 20)
    assert module_cost(linear, linear(torch.zeros(4, 30))) == 4 * 20 * 30
    relu = nn.ReLU()
    assert module_cost(relu, torch.zeros(3, 5)) == 15


def _paced_step(pace: Pace, model: nn.Module, x: torch.Tensor, y: torch.Tensor, factor: float = 1.0) -> dict[str, float]:
    """One paced step of a method that sends each gradient as soon as it is computed, through the pace's
    gate (as DDP sends its buckets); when each was sent, s after the step's start."""
    sent: dict[str, float] = {}

    def send(name: str, p: torch.Tensor) -> object:
        def hook(grad: torch.Tensor) -> None:
            pace.gate([p])
            sent.setdefault(name, time.perf_counter())
        return hook

    handles = [p.register_hook(send(name, p)) for name, p in model.named_parameters()]
    t0 = time.perf_counter()
    pace.begin(factor)
    F.cross_entropy(model(x), y).backward()
    sent["backward"] = time.perf_counter()
    pace.pad_rest()
    sent["end"] = time.perf_counter()
    for h in handles:
        h.remove()
    return {k: v - t0 for k, v in sent.items()}


def test_each_gradient_is_sent_when_it_would_be_ready_on_an_accelerator() -> None:
    torch.manual_seed(0)
    model = build_model("cnn", (1, 28, 28), 10)
    x, y = torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))
    pace = Pace(0.3, rank=0, split="1:2")
    pace.attach(model)
    _paced_step(pace, model, x, y)  # the first step measures the costs
    shares = _shares(model, x)
    for factor in (1.0, 2.0):
        times = _paced_step(pace, model, x, y, factor)
        backward = 0.2 * factor
        forward_end = 0.1 * factor
        for name in ("10.weight", "8.weight", "3.weight", "0.weight"):
            # never before it is due (sleeping does not end early); sent right after the gate opens
            assert times[name] >= forward_end + backward * shares[name] - 1e-3, (name, factor, times)
        assert times["8.weight"] < forward_end + backward * 0.5  # fc1 well before conv2: DDP can overlap it
        assert times["end"] >= 0.3 * factor - 1e-3
    pace.detach()
    pace.begin(1.0)
    t0 = time.perf_counter()
    model(x)
    assert time.perf_counter() - t0 < 0.05  # unhooked: the forward pass is real time only


def test_without_a_gate_the_real_backward_runs_at_once_and_the_step_is_padded_at_its_end() -> None:
    """A method that sends nothing inside backward: the real backward pass is not held anywhere (its
    arithmetic never piles up at a deadline); the step still takes its nominal time."""
    model = build_model("cnn", (1, 28, 28), 10)
    x, y = torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))
    pace = Pace(0.3, rank=0)
    pace.attach(model)
    for _ in range(2):
        t0 = time.perf_counter()
        pace.begin(1.0)
        F.cross_entropy(model(x), y).backward()
        backward_end = time.perf_counter() - t0
        pace.pad_rest()
        # the forward part, then the real backward only (a few ms); held at a gate it would end with the
        # backward part, at 0.3 s: 0.25 leaves room for a busy machine's scheduling (0.2024 s seen under load)
        assert 0.1 - 1e-3 <= backward_end < 0.25
        assert time.perf_counter() - t0 >= 0.3 - 1e-3
    assert pace.due(list(model.parameters())) is None  # outside a step: nothing to wait for


def test_a_copy_of_a_hooked_model_is_not_paced_outside_a_step() -> None:
    model = build_model("mlp", (1, 8, 8), 10)
    pace = Pace(0.5, rank=0)
    pace.attach(model)
    clone = copy.deepcopy(model)  # evaluation and averaged_model copy the model
    t0 = time.perf_counter()
    with torch.no_grad():
        clone(torch.zeros(2, 1, 8, 8))
        model(torch.zeros(2, 1, 8, 8))
    assert time.perf_counter() - t0 < 0.25
    pace.detach()


def test_the_pace_is_judged_after_warm_up_and_only_on_a_sustained_excess() -> None:
    pace = Pace(0.1, rank=3)
    for _ in range(Pace.WARMUP_STEPS):
        pace.record(1.0)  # start-up: ten times the pace, ignored
    for _ in range(Pace.WINDOW):
        pace.record(0.2)  # one window over the pace: not yet sustained
    for _ in range(Pace.WINDOW):
        pace.record(0.1)  # held again: the count starts over
    for _ in range(Pace.WINDOW):
        pace.record(0.2)
    with pytest.raises(ConfigError, match=r"rank 3's steps take 200\.0 ms .* more than the pace of 100 ms; raise "
                                          r"--compute-ms to at least 260, give --compute-ms auto"):
        for _ in range(Pace.WINDOW):
            pace.record(0.2)


def test_a_slowed_step_is_judged_against_its_slowed_nominal_time() -> None:
    pace = Pace(0.1, rank=0)
    pace.begin(4.0)
    for _ in range(Pace.WARMUP_STEPS + 3 * Pace.WINDOW):
        pace.record(0.4)  # a 4x straggler's steps hold their 400 ms


def test_the_auto_pace_is_the_slowest_median_with_a_margin_rounded_up() -> None:
    assert pace_of(70.0) == 110.0  # 70 x 1.5 = 105 -> 110
    assert pace_of(1.0) == 10.0
    assert pace_of(40.0, margin=1.0) == 40.0


def test_the_probe_runs_the_workers_together_and_returns_a_pace_above_their_steps() -> None:
    probe = probe_pace("mlp", "digits", 16, workers=2)
    assert probe.workers == 2 and probe.step_ms > 0
    assert probe.ms >= probe.step_ms * probe.margin
    assert probe.ms % 10 == 0
    with pytest.raises(ConfigError, match="probe process failed"):
        probe_pace("no-such-model", "digits", 16, workers=1)


NETNS = missing_privileges()


def _paced_allreduce(out: Path, rate: str, pace_ms: int, steps: int) -> dict[str, Any]:
    """A paced ``allreduce`` run of the CNN on two emulated hosts; its summary. Only the step's timing is
    checked: one evaluation point (``--eval-every-s``), not one a second, each averaging the model over
    the slow link."""
    res = run_cli("run", "--algorithm", "allreduce", "--nproc", "2", "--hosts", "2", "--link-rate", rate,
                  "--steps", str(steps), "--compute", "paced", "--compute-ms", str(pace_ms), "--data", "synthetic",
                  "--model", "cnn", "--eval-every-s", "600", "--quiet", "--out", str(out), timeout_s=200)
    assert res.returncode == 0, res.stderr
    return json.loads((out / "summary.json").read_text())


def _cnn_buckets() -> tuple[list[float], float]:
    """The CNN's gradients (3x32x32 inputs) in DDP's default buckets (the fc layers first, then the
    convolutions), and when the first is ready, as a share of the backward part (fc1's)."""
    buckets = ddp_buckets(gradient_sizes("cnn", "synthetic"), 25 * MIB, MIB)
    fc1 = _shares(build_model("cnn", (3, 32, 32), 10), torch.zeros(2, 3, 32, 32))["8.weight"]
    return buckets, fc1


def _ring_s(size_bytes: float, rate_bits: float) -> float:
    return size_bytes * 8 / rate_bits  # a ring all-reduce over 2 ranks sends the whole buffer each way


@pytest.mark.slow
@pytest.mark.usefixtures("netns_lock")
@pytest.mark.skipif(NETNS is not None, reason=f"emulated hosts unavailable: {NETNS}")
def test_allreduce_hides_its_first_bucket_behind_the_paced_backward_on_a_fast_enough_link(tmp_path: Path) -> None:
    """Two emulated hosts at 200 Mbit/s: the fc bucket's all-reduce (2.1 MB each way, about 85 ms) starts
    about 10% into a 200 ms backward part and hides behind the convolutions' backward; only the small last
    bucket is exposed, so `allreduce` keeps at least 95% of the no-wait limit (the old clock, which padded
    before the real pass, exposed all of it: about 70% at 150 Mbit/s). Measured here: 96.5-97.1% in six runs
    alone on the machine (at 200 Mbit/s and 1 Gbit/s, paces of 300 and 500 ms alike), 94-97% in earlier
    suite runs; the rest is the last bucket (about 3 ms), the step's own work outside the pace (the
    optimizer's step, the next batch) and the emulated link's delays."""
    (fc, conv), fc1 = _cnn_buckets()
    assert _ring_s(fc, 200e6) < 0.2 * (1 - fc1) * 0.5  # it fits, with room for the emulated link's own delays
    summary = _paced_allreduce(tmp_path / "run", "200mbit", 300, steps=36)
    assert summary["fraction_of_limit"] >= 0.95, summary
    assert max(summary["mean_comm_s"]) < 0.5 * _ring_s(fc, 200e6), summary["mean_comm_s"]


@pytest.mark.slow
@pytest.mark.usefixtures("netns_lock")
@pytest.mark.skipif(NETNS is not None, reason=f"emulated hosts unavailable: {NETNS}")
def test_on_a_link_too_slow_to_hide_the_exposed_time_is_what_does_not_fit_behind_backward(tmp_path: Path) -> None:
    """At 25 Mbit/s the fc bucket's all-reduce takes about 0.67 s: what does not fit between its start
    (fc1's gradient, about 10% into the 200 ms backward part) and the backward's end is exposed, then the
    conv bucket's all-reduce."""
    (fc, conv), fc1 = _cnn_buckets()
    summary = _paced_allreduce(tmp_path / "run", "25mbit", 300, steps=6)
    expected = _ring_s(fc, 25e6) - 0.2 * (1 - fc1) + _ring_s(conv, 25e6)
    for comm in summary["mean_comm_s"]:
        assert expected * 0.8 < comm < expected * 1.25, (comm, expected)
