"""Parameter servers: ``ps`` (sync, async) and ``ps-eager``.

Pure parts (staleness rules, the SGD rule, a shard's state machine) are tested in-process; the rest runs
the real CLI or ``prague launch`` under hard timeouts, including a shard process killed mid-run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import textwrap
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from prague_testing import REPO, SHORT_RUN, join_all, processes_mentioning, run_cli, start_thread, wait_gone
from prague.algorithms.ps import PSOptions
from prague.algorithms.ps.runtime import layout_for
from prague.algorithms.ps_eager import PSEagerOptions
from prague.algorithms.ps.protocol import Layout, shard_bounds
from prague.algorithms.ps.rules import accepts, staleness_scale
from prague.optim import SGDRule
from prague.algorithms.ps.client import ShardClients
from prague.algorithms.ps.server import ShardState, serve_worker
from prague.errors import CommError, ConfigError
from prague.workload.data import load_dataset
from prague.workload.models import build_model

pytestmark = pytest.mark.timeout(240)

SHARD_MARKER = "prague.algorithms.ps.server"


# ---------------------------------------------------------------------------------------------- pure


def test_staleness_rules() -> None:
    assert staleness_scale("none", 7, 4) == 1.0
    assert staleness_scale("inverse", 4, 4) == 0.25 and staleness_scale("inverse", 9, 4) == 1 / 9
    assert staleness_scale("inverse", 0, 4) == 1 / 3  # never more than the share of a push in turn
    assert staleness_scale("inverse", 0, 1) == 1.0 and staleness_scale("inverse", 5, 1) == 0.2
    assert staleness_scale("exp", 1, 4) == 1 / 3
    assert staleness_scale("exp", 7, 4) == pytest.approx(math.exp(-1) / 3)
    with pytest.raises(ConfigError, match="inverse"):
        staleness_scale("linear", 1, 4)
    assert accepts(100, 0) and accepts(3, 3) and not accepts(4, 3)


def test_the_inverse_rule_is_the_one_readme_help_and_docstring_state() -> None:
    def squeezed(text: str | None) -> str:
        return "".join((text or "").split())

    help_text = next(f.metadata["help"] for f in dataclasses.fields(PSOptions) if f.name == "staleness_lr")
    assert "lr/max(n-1,tau)" in squeezed((REPO / "README.md").read_text())
    assert "lr/max(n-1,tau)" in squeezed(help_text)
    assert "1/max(n-1,tau)" in squeezed(staleness_scale.__doc__)
    for n in range(2, 10):
        for tau in range(3 * n):
            assert staleness_scale("inverse", tau, n) == 1 / max(n - 1, tau), (n, tau)


def test_options_are_validated_with_the_bad_value() -> None:
    with pytest.raises(ConfigError, match="'bogus'.*async, sync"):
        PSOptions(ps_mode="bogus")
    with pytest.raises(ConfigError, match="-1"):
        PSEagerOptions(max_staleness=-1)
    with pytest.raises(ConfigError, match="0"):
        PSOptions(ps_shards=0)
    assert PSEagerOptions().staleness_lr == "inverse" and PSOptions().staleness_lr == "inverse"


def test_shard_bounds_cover_the_state() -> None:
    bounds = shard_bounds(10, 3)
    assert bounds == [(0, 3), (3, 6), (6, 10)]
    with pytest.raises(ConfigError):
        shard_bounds(2, 3)


def test_layout_needs_sgd_over_the_model() -> None:
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ConfigError, match="Adam"):
        layout_for(model, torch.optim.Adam(model.parameters()), 8, 8)
    layout = layout_for(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5, nesterov=True), 8, 8)
    assert (layout.lr, layout.momentum, layout.nesterov) == (0.1, 0.5, True)


@pytest.mark.parametrize("kwargs", [dict(momentum=0.9), dict(momentum=0.9, nesterov=True, weight_decay=1e-3),
                                    dict(momentum=0.5, dampening=0.1), dict()])
def test_sgd_rule_is_torch_sgd_bit_for_bit(kwargs: dict[str, Any]) -> None:
    torch.manual_seed(0)
    ref = torch.nn.Parameter(torch.randn(50))
    opt = torch.optim.SGD([ref], lr=0.05, **kwargs)
    mine = ref.detach().clone()
    rule = SGDRule(lr=0.05, **kwargs)
    buf = None
    for _ in range(4):
        grad = torch.randn(50)
        ref.grad = grad.clone()
        opt.step()
        buf = rule.step(mine, grad.clone(), buf)
    assert torch.equal(mine, ref.detach())


@pytest.mark.parametrize("kwargs", [dict(momentum=0.9), dict(momentum=0.9, nesterov=True, weight_decay=1e-3), dict()])
def test_scaled_sgd_rule_is_sgd_on_the_scaled_gradient(kwargs: dict[str, Any]) -> None:
    torch.manual_seed(1)
    start = torch.randn(50)
    plain, scaled = start.clone(), start.clone()
    rule = SGDRule(lr=0.05, **kwargs)
    buf_plain = buf_scaled = None
    for k in range(4):
        grad, scale = torch.randn(50), 1.0 / (k + 2)
        wd = kwargs.get("weight_decay", 0.0)
        # the reference: weight decay first, then the whole gradient times the scale
        no_decay = SGDRule(lr=0.05, **{**kwargs, "weight_decay": 0.0})
        buf_plain = no_decay.step(plain, (grad + wd * plain) * scale, buf_plain)
        buf_scaled = rule.step(scaled, grad, buf_scaled, scale)
    torch.testing.assert_close(scaled, plain, atol=1e-6, rtol=1e-6)


def _layout(total: int = 6, n_params: int = 4, lr: float = 0.5) -> Layout:
    return Layout(total, n_params, lr=lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False)


def test_sync_shard_applies_the_mean_once_all_have_pushed() -> None:
    state = ShardState("sync", 3, 0, 6, _layout())
    state.initialize(torch.zeros(6))
    pushes = [torch.tensor([1.0, 2, 3, 4, 10, 20]) * (w + 1) for w in range(3)]
    threads = [start_thread(state.push, w, 0, pushes[w].clone()) for w in range(3)]
    join_all(threads, 10)
    assert state.version == 1
    assert [(t.result.version, t.result.tau, t.result.accepted) for t in threads] == [(1, 0, True)] * 3
    # mean gradient (x2) times -lr on the parameters; buffers take the mean of the pushed values
    assert torch.equal(state.values, torch.tensor([-1.0, -2, -3, -4, 20, 40]))
    assert state.stats(1)["staleness_histogram"] == {"0": 1}


def test_sync_shard_sums_in_rank_order_whatever_the_arrival_order() -> None:
    torch.manual_seed(2)
    pushes = [torch.randn(6) * 10 ** k for k in range(4)]  # magnitudes where the order of a float sum shows
    results = []
    for order in ([3, 1, 0, 2], [0, 1, 2, 3], [2, 3, 1, 0]):
        state = ShardState("sync", 4, 0, 6, _layout())
        threads = []
        for w in order:
            threads.append(start_thread(state.push, w, 0, pushes[w].clone()))
            time.sleep(0.05)
        join_all(threads, 10)
        results.append(state.values.clone())
    expected = (pushes[0] + pushes[1] + pushes[2] + pushes[3]) / 4
    assert all(torch.equal(r, results[0]) for r in results)
    assert torch.equal(results[0][4:], expected[4:]) and torch.equal(results[0][:4], -0.5 * expected[:4])


def test_async_shard_keeps_one_momentum_buffer_per_worker() -> None:
    layout = Layout(3, 3, lr=1.0, momentum=0.5, dampening=0.0, weight_decay=0.0, nesterov=False)
    state = ShardState("async", 2, 0, 3, layout, staleness_lr="none")
    state.initialize(torch.zeros(3))
    out = torch.empty(3)
    g, h = torch.tensor([1.0, 0, 0]), torch.tensor([0.0, 1, 0])
    state.push(0, 0, g.clone(), out)          # b0 = g
    state.push(1, 1, h.clone(), out)          # b1 = h (worker 0's buffer does not leak into it)
    state.push(0, 2, g.clone(), out)          # b0 = 0.5 g + g
    assert torch.equal(state.values, -(g + h + 1.5 * g))


def test_sync_shard_fails_when_a_worker_leaves_mid_round() -> None:
    state = ShardState("sync", 2, 0, 6, _layout(), timeout_s=5)
    state.initialize(torch.zeros(6))

    def waiting_worker() -> None:  # blocked in the round that worker 1 will never join
        with pytest.raises(CommError):
            state.push(0, 0, torch.ones(6))

    t = start_thread(waiting_worker)
    time.sleep(0.2)
    with pytest.raises(CommError, match="same number of steps"):
        state.finish(1)
    t.join(timeout=10)  # re-raises here if worker 0's push did not fail


def test_async_shard_records_staleness_scales_and_rejects() -> None:
    state = ShardState("async", 2, 0, 6, _layout(lr=1.0), staleness_lr="inverse", max_staleness=2)
    state.initialize(torch.zeros(6))
    out = torch.empty(6)
    grad = torch.tensor([1.0, 1, 1, 1, 0, 0])
    assert state.push(0, 0, grad.clone(), out).tau == 0            # v0 -> v1, full step
    assert state.push(0, 0, grad.clone(), out).tau == 1            # v1 -> v2, full step
    r = state.push(1, 0, grad.clone(), out)                         # computed on v0, now v2: tau 2, half step
    assert (r.tau, r.accepted, r.version) == (2, True, 3)
    assert torch.equal(out[:4], torch.full((4,), -2.5))
    r = state.push(1, 0, grad.clone(), out)                         # tau 3 > 2: rejected, fresh values anyway
    assert (r.tau, r.accepted, r.version) == (3, False, 3)
    assert state.stats(0)["staleness_histogram"] == {"0": 1, "1": 1}
    assert state.stats(1) == {"staleness_histogram": {"2": 1}, "applied": 1, "rejected": 1, "version": 3}


# ---------------------------------------------------------------------------------------- processes


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def _run(out: Path, *args: str, timeout_s: float = 180) -> dict:
    res = run_cli("run", *args, "--out", str(out), "--quiet", timeout_s=timeout_s)
    assert res.returncode == 0, res.stderr
    return _summary(out)


def test_sync_ps_equals_allreduce_after_ten_steps(tmp_path: Path, allreduce_run: Path) -> None:
    assert SHORT_RUN.steps == 10
    summary = _run(tmp_path / "ps", "--algorithm", "ps", "--ps-mode", "sync", "--ps-shards", "2", *SHORT_RUN.args())
    ar, ps = torch.load(allreduce_run / "model.pt"), torch.load(tmp_path / "ps" / "model.pt")
    data = load_dataset("digits", seed=SHORT_RUN.seed)
    torch.manual_seed(SHORT_RUN.seed)
    start = build_model("mlp", data.input_shape, data.num_classes).state_dict()
    moved = 0.0
    for name, ref in ar.items():
        torch.testing.assert_close(ps[name], ref, atol=1e-5, rtol=0)
        moved = max(moved, float((ref - start[name]).abs().max()))
    assert moved > 1e-3  # training really moved the parameters, so the comparison means something
    assert summary["consensus_distance"] == pytest.approx(0.0, abs=1e-6)  # everyone pulled the same values
    for stats in summary["algorithm_stats"]:
        assert stats["mode"] == "sync" and stats["staleness_histogram"] == {"0": 20}  # 10 pushes x 2 shards
        assert stats["server_versions"] == [10, 10]


def test_async_ps_records_and_bounds_staleness(tmp_path: Path) -> None:
    summary = _run(tmp_path / "async", "--algorithm", "ps", "--ps-mode", "async", "--max-staleness", "1",
                   "--nproc", "3", "--steps", "20", "--model", "mlp", "--data", "synthetic")
    stats = summary["algorithm_stats"]
    applied = sum(s["applied"] for s in stats)
    assert applied + sum(s["rejected"] for s in stats) == 3 * 20
    assert all(int(t) <= 1 for s in stats for t in s["staleness_histogram"])
    assert all(s["server_versions"] == [applied] for s in stats)  # every applied update is one version
    assert summary["consensus_distance"] == pytest.approx(0.0, abs=1e-6)  # the final pull is common
    assert summary["variant"] == "async"


EAGER_NPROC, EAGER_STEPS, EAGER_SHARDS = 8, 40, 2


@pytest.fixture(scope="module")
def eager_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """One ``ps-eager`` run that two tests check: eight workers with paper:5 stragglers, two shards,
    updates staler than 1 rejected; 40 steps of 100 ms emulated compute (4 s, so that the workers' runs
    overlap however unevenly they start). Returns (output folder, summary)."""
    out = tmp_path_factory.mktemp("eager") / "eight"
    summary = _run(out, "--algorithm", "ps-eager", "--max-staleness", "1", "--nproc", str(EAGER_NPROC),
                   "--steps", str(EAGER_STEPS), "--ps-shards", str(EAGER_SHARDS), "--slowdown", "paper:5",
                   "--compute", "emulated", "--compute-ms", "100", "--model", "mlp", "--data", "synthetic",
                   timeout_s=200)
    return out, summary


def test_eager_ps_rejects_updates_above_max_staleness(eager_run: tuple[Path, dict]) -> None:
    stats = eager_run[1]["algorithm_stats"]
    rejected = sum(s["rejected"] for s in stats)
    assert rejected > 0  # a pull lags one push behind, so others' pushes make tau >= 2 regularly
    assert rejected == sum(s["rejections_seen"] for s in stats)
    assert all(int(t) <= 1 for s in stats for t in s["staleness_histogram"])
    assert sum(s["applied"] for s in stats) + rejected == EAGER_NPROC * EAGER_STEPS * EAGER_SHARDS


def test_eight_workers_with_eager_pulls_finish(eager_run: tuple[Path, dict]) -> None:
    out, summary = eager_run
    stats = summary["algorithm_stats"]
    assert EAGER_NPROC == 8 and summary["nproc"] == 8 and summary["steps"] == EAGER_STEPS
    # every push reached both shards
    assert sum(s["applied"] + s["rejected"] for s in stats) == 8 * EAGER_STEPS * EAGER_SHARDS
    assert len({tuple(s["server_versions"]) for s in stats}) == 1
    assert wait_gone(str(out)) == []


def test_a_reply_completed_in_the_background_is_seen_without_waiting() -> None:
    """ps-eager's early install needs :meth:`PendingReplies.done` to turn true once the shard has
    answered, without anyone calling ``wait()`` (a gloo receive alone never completes): one worker and
    one shard in this process, over a real gloo pair."""
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=30))
    state = ShardState("async", 1, 0, 6, _layout())
    server = start_thread(serve_worker, state, store, 0, 0, timedelta(seconds=30))
    clients = ShardClients(store, 0, [(0, 6)], timedelta(seconds=30))
    try:
        clients.init(torch.arange(6.0))
        into = torch.zeros(6)
        clients.pull(into)
        pending = clients.push(torch.ones(6), [0], 0, into, background=True)
        deadline = time.monotonic() + 20
        while not pending.done():  # never waits on the gloo work itself
            assert time.monotonic() < deadline, "the shard's answer was never seen as done"
            time.sleep(0.001)
        # Done means the values are in already: read before wait(), which only collects the header.
        assert into.tolist() == [-0.5, 0.5, 1.5, 2.5, 1.0, 1.0]  # x - lr * 1; buffers 1/n (all) of the way to 1
        (reply,) = pending.wait()
        assert (reply.version, reply.tau, reply.accepted) == (1, 0, True)
        clients.finish(into)
    finally:
        clients.close()
    server.join(30)


@pytest.mark.slow
def test_eager_pulls_are_installed_before_the_forward_pass_when_they_have_time_to_arrive(tmp_path: Path) -> None:
    """Every worker sleeps one compute time before each forward pass (a slowdown of 2 on every rank: the
    sleep precedes the forward), far longer than a shard's round trip, so the pull posted after the
    previous backward has arrived when the forward starts and must be installed there. Each gradient is
    then computed on the values right after its worker's previous push: about n - 1 other pushes land
    before it (tau about n - 1) instead of 2n - 1 when the pull is installed only after the next backward."""
    n, steps = 4, 30
    slow_everyone = "+".join(f"straggler:{r}:2" for r in range(n))
    summary = _run(tmp_path / "early", "--algorithm", "ps-eager", "--nproc", str(n), "--steps", str(steps),
                   "--compute", "emulated", "--compute-ms", "30", "--slowdown", slow_everyone,
                   "--model", "mlp", "--data", "synthetic", timeout_s=200)
    stats = summary["algorithm_stats"]
    for s in stats:  # every pull but the last is installed once, at one of the two points
        assert s["installs_before_forward"] + s["installs_after_backward"] == steps - 1
        assert s["installs_before_forward"] > (steps - 1) / 2, s
    applied = sum(s["applied"] for s in stats)
    mean_tau = sum(s["mean_staleness"] * s["applied"] for s in stats) / applied
    assert mean_tau < ((n - 1) + (2 * n - 1)) / 2, (mean_tau, [s["staleness_histogram"] for s in stats])


def _shard_pids(marker: str) -> list[int]:
    pids = []
    for pid in processes_mentioning(marker):
        try:
            if SHARD_MARKER in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                pids.append(pid)
        except OSError:
            continue
    return pids


def _kill_shard_when(ready: Callable[[], bool], find: Callable[[], list[int]], run_ended: threading.Event) -> None:
    """SIGKILL the first shard ``find`` names once ``ready()``; fail (in the test, through
    :func:`start_thread`) if none was killed within 120 s or before the run ended."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not run_ended.is_set():
        pids = find()
        if pids and ready():
            os.kill(pids[0], signal.SIGKILL)
            return
        time.sleep(0.2)
    pytest.fail("no shard was killed: " + ("the run ended first" if run_ended.is_set() else "the run never got going"))


def _training(progress_dir: Path) -> bool:
    logs = list(progress_dir.glob("rank*.jsonl"))
    return bool(logs) and all(f.stat().st_size > 0 for f in logs)


def test_dead_shard_fails_the_run_clearly(tmp_path: Path) -> None:
    out, run_ended = tmp_path / "dies", threading.Event()
    killer = start_thread(_kill_shard_when, lambda: _training(out / "metrics"), lambda: _shard_pids(str(out)),
                          run_ended, name="killer")
    # The hard timeout is the bound: the workers must notice the dead shard, not run their 100000 steps.
    # (How long noticing takes is measured by benchmarks/failure_detection.py.)
    res = run_cli("run", "--algorithm", "ps", "--ps-mode", "async", "--nproc", "2", "--steps", "100000",
                  "--compute", "emulated", "--compute-ms", "20", "--model", "mlp", "--data", "synthetic",
                  "--out", str(out), "--quiet", timeout_s=150)
    run_ended.set()
    killer.join(timeout=10)  # fails here if no shard was killed
    assert res.returncode == 1
    assert "ps-shard-0" in res.stderr or "parameter-server shard 0" in res.stderr, res.stderr
    assert wait_gone(str(out)) == []


SCRIPT = textwrap.dedent("""
    import json, sys, time
    import torch, torch.distributed as dist, torch.nn.functional as F
    import prague

    algorithm, steps, result = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    ctx = prague.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    trainer = prague.wrap(model, opt, algorithm=algorithm, ps_shards=2)
    gen = torch.Generator().manual_seed(ctx.rank)
    for step in range(steps):
        x = torch.randn(16, 8, generator=gen)
        y = (x[:, 0] > 0).long()
        trainer.step(lambda m: F.cross_entropy(m(x), y))
        time.sleep(0.01)
        if step == 3 and ctx.rank == 0:
            open(result + ".training", "w").close()
    trainer.close()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.zeros_like(flat) for _ in range(ctx.world_size)]
    dist.all_gather(every, flat)
    if ctx.rank == 0:
        spread = max(float((f - every[0]).abs().max()) for f in every)
        json.dump({"spread": spread, "stats": trainer.stats()}, open(result, "w"))
    prague.shutdown()
""")


def test_without_launcher_rank0_runs_the_shards(tmp_path: Path) -> None:
    script, result = tmp_path / "ps_script.py", tmp_path / "result.json"
    script.write_text(SCRIPT)
    res = run_cli("launch", "--nproc", "3", str(script), "ps-eager", "15", str(result), timeout_s=150)
    assert res.returncode == 0, res.stderr
    outcome = json.loads(result.read_text())
    assert outcome["spread"] == 0.0  # all ended on the server's final values
    assert outcome["stats"]["shards"] == 2 and outcome["stats"]["applied"] + outcome["stats"]["rejected"] == 30
    assert wait_gone(str(script)) == []


def _children_shards(script: str) -> list[int]:
    workers = set(processes_mentioning(script))
    found = []
    for pid in processes_mentioning(SHARD_MARKER):
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid in workers:
            found.append(pid)
    return found


def test_without_launcher_a_dead_shard_fails_the_workers(tmp_path: Path) -> None:
    script, result = tmp_path / "ps_dies.py", tmp_path / "result.json"
    script.write_text(SCRIPT)
    run_ended = threading.Event()
    killer = start_thread(_kill_shard_when, Path(str(result) + ".training").exists,
                          lambda: _children_shards(str(script)), run_ended, name="killer")
    res = run_cli("launch", "--nproc", "2", str(script), "ps", "1000000", str(result), timeout_s=150)
    run_ended.set()
    killer.join(timeout=10)  # fails here if no shard was killed
    assert res.returncode == 1
    assert "parameter-server shard" in res.stderr and "died" in res.stderr, res.stderr
    assert wait_gone(str(script)) == []


def test_a_shards_book_counts_versions_and_staleness_for_both_drivers() -> None:
    """The version and staleness bookkeeping the shard process and the simulator share."""
    from prague.algorithms.ps.rules import ShardBook

    book = ShardBook("async", 3, "inverse", max_staleness=2)
    first = book.admit(0, 0, step=0)
    assert (first.tau, first.accepted, first.version, first.scale) == (0, True, 1, pytest.approx(0.5))  # floor n-1
    assert book.admit(1, 0, step=0).tau == 1 and book.version == 2
    late = book.admit(2, 0, step=0)  # tau 2: still within the bound
    stale = book.admit(1, 0, step=1)  # tau 3 > 2: rejected, the version stays
    assert late.accepted and not stale.accepted and stale.scale == 0.0 and book.version == 3
    assert stale.record.to_dict()["accepted"] is False and stale.record.to_dict()["version"] == 3
    assert book.histogram[1] == {1: 1} and book.rejected == [0, 1, 0]
    with pytest.raises(ConfigError, match="ahead of this shard's version 3"):
        book.admit(0, 4, step=2)
    sync = ShardBook("sync", 2, "none", max_staleness=0)
    assert sync.contribute(0, 0, step=0).version == 1 and sync.version == 0
    assert sync.close_round() == 1 and sync.totals() == ({0: 2}, 0)
