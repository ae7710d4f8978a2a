"""lossy: the chunk plan, the send order, the stop rule every rank agrees on, the deadline; real workers
that agree on every mask, stay bit-identical and lose no gradient (applied + carried = computed)."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prague.algorithms.lossy.decisions import (
    IN_FLIGHT, Deadline, Hierarchy, Steps, deadline_elements, dropped_chunks, dropped_share, next_ages, plan_chunks, priority_order, required_count, stop_points,
    stream_queues, MIN_CHUNKS_PER_STREAM,
)
from prague.algorithms.registry import get_method
from prague.errors import ConfigError
from prague_testing import bench_records, run_cli

SRC = str(Path(__file__).resolve().parents[2] / "src")


# -- decisions ------------------------------------------------------------------------------------------
@given(st.integers(1, 5000), st.integers(1, 700), st.integers(1, 8), st.integers(1, 6), st.integers(1, 900))
def test_the_plan_covers_the_gradient_once_in_order(total: int, chunk: int, streams: int, tiers: int,
                                                    smallest: int) -> None:
    smallest = min(smallest, chunk)
    plan = plan_chunks(total, chunk, streams, tiers, smallest)
    assert sum(plan.sizes) == total and plan.starts[0] == 0
    assert all(a + n == b for a, n, b in zip(plan.starts, plan.sizes, plan.starts[1:]))
    assert all(n >= 1 for n in plan.sizes)
    assert plan.count >= min(max(1, total // smallest), MIN_CHUNKS_PER_STREAM * streams)
    if plan.count > math.ceil(total / chunk):  # cut finer than chunk for the streams: never below the smallest
        assert min(plan.sizes) >= smallest
    if total >= MIN_CHUNKS_PER_STREAM * streams * chunk:
        assert max(plan.sizes) <= chunk
    assert max(plan.sizes) <= max(chunk, total // plan.count + 1)
    assert list(plan.tiers) == sorted(plan.tiers) and plan.tiers[0] == 0 and plan.tiers[-1] < tiers


def test_a_small_gradient_gets_fewer_chunks_not_smaller_ones() -> None:
    assert plan_chunks(1000, 400, 4, 1).count == 16  # at least 4 per stream by default
    assert plan_chunks(1000, 400, 4, 1, min_elements=100).count == 10
    assert plan_chunks(1000, 400, 4, 1, min_elements=400).count == 3  # never above chunk_elements either
    assert plan_chunks(50, 400, 4, 1, min_elements=400).count == 1


def test_order_puts_dropped_chunks_first_then_front_layers_then_large_magnitudes() -> None:
    plan = plan_chunks(80, 10, 2, 2)  # 8 chunks, tiers 0,0,0,0,1,1,1,1
    magnitudes = [0.1, 0.9, 0.5, 0.2, 5.0, 0.1, 0.3, 0.2]
    assert priority_order(plan, magnitudes, [0] * 8) == [1, 2, 3, 0, 4, 6, 7, 5]
    ages = [0, 0, 0, 0, 0, 0, 2, 1]  # chunk 6 dropped twice in a row, 7 once: they go first
    assert priority_order(plan, magnitudes, ages)[:2] == [6, 7]
    assert stream_queues([5, 4, 3, 2, 1, 0], 4) == [[5, 1], [4, 0], [3], [2]]


def test_stops_cover_what_any_rank_started_and_the_required_prefix() -> None:
    plan = plan_chunks(100, 10, 2, 1)  # 10 chunks of 10
    order = list(range(10))
    queues = stream_queues(order, 2)  # [0,2,4,6,8], [1,3,5,7,9]
    assert required_count(plan, order, 0.1) == 9 and required_count(plan, order, 0.0) == 10
    assert required_count(plan, order, 0.5) == 5
    # Required 5 -> stream 0 needs 3 (0,2,4), stream 1 needs 2 (1,3); rank 1 started 4 on stream 1.
    stops = stop_points([[1, 0], [2, 4], [3, 1]], 5, [5, 5])
    assert stops == [3, 4]
    assert dropped_chunks(queues, stops) == [6, 8, 9]
    assert dropped_share(plan, [6, 8, 9]) == pytest.approx(0.3)
    assert next_ages([0, 1, 2], [1]) == [0, 2, 0]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_proposals_give_one_mask_within_the_loss_bound_and_no_chunk_dropped_twice_running(data: Any) -> None:
    total = data.draw(st.integers(1, 400))
    streams = data.draw(st.integers(1, 5))
    plan = plan_chunks(total, data.draw(st.integers(1, 60)), streams, data.draw(st.integers(1, 4)))
    max_loss = data.draw(st.sampled_from([0.0, 0.05, 0.1, 0.3, 0.5]))
    ages = [0] * plan.count
    previous: set[int] = set()
    for _ in range(4):  # consecutive steps
        magnitudes = data.draw(st.lists(st.floats(0, 10), min_size=plan.count, max_size=plan.count))
        order = priority_order(plan, magnitudes, ages)
        queues = stream_queues(order, streams)
        lengths = [len(q) for q in queues]
        ranks = data.draw(st.integers(1, 6))
        proposals = [[data.draw(st.integers(0, n)) for n in lengths] for _ in range(ranks)]
        required = required_count(plan, order, max_loss)
        stops = stop_points(proposals, required, lengths)
        assert stop_points(list(reversed(proposals)), required, lengths) == stops  # every rank computes the same
        assert all(stop >= p[s] for p in proposals for s, stop in enumerate(stops))
        dropped = dropped_chunks(queues, stops)
        assert dropped_share(plan, dropped) <= max_loss + 1e-12
        assert not previous & set(dropped)  # a chunk dropped last step goes first in this one
        previous = set(dropped)
        ages = next_ages(ages, dropped)


def test_the_deadline_waits_for_warm_up_then_follows_the_median_rate() -> None:
    deadline = Deadline(slack=1.5, window=3, warmup=2)
    assert deadline.budget_s(1000) is None
    deadline.observe(1000, 1.0)
    deadline.observe(0, 1.0)  # nothing moved: not a measurement
    assert deadline.budget_s(1000) is None
    deadline.observe(1000, 0.5)
    deadline.observe(1000, 0.25)  # rates 1000, 2000, 4000: median 2000
    assert deadline.budget_s(1000) == pytest.approx(1.5 * 0.5)
    deadline.observe(1000, 0.25)  # the window forgets the oldest: median 4000
    assert deadline.budget_s(1000) == pytest.approx(1.5 * 0.25)


def test_the_steps_plan_stop_and_settle_in_the_order_both_drivers_use() -> None:
    """The control flow the runtime and the simulator share: during warm-up a step sends everything; then
    a deadline, agreed stops, the dropped chunks aged and first in the next order, the rate observed."""
    plan = plan_chunks(1200, 100, 2, 3)
    steps = Steps(plan, streams=2, max_loss=0.5, deadline=Deadline(slack=1.0, warmup=1))
    first = steps.plan([0.0] * plan.count)
    assert sorted(first.order) == list(range(plan.count)) and first.lengths == [6, 6]
    assert steps.budget_s(first, IN_FLIGHT) is None and steps.deadlines_s == []  # warm-up: everything goes
    settled = steps.settle(first, first.lengths, 1.0)
    assert settled.dropped == [] and settled.share == 0.0 and steps.shares == [0.0]
    second = steps.plan([0.0] * plan.count)
    budget = steps.budget_s(second, IN_FLIGHT)
    assert budget is not None and steps.deadlines_s == [budget]
    stops = stop_points([[4, 3]], steps.required(second), second.lengths)
    settled = steps.settle(second, stops, 0.5)
    assert settled.dropped == dropped_chunks(second.queues, stops) and settled.dropped
    assert settled.share == pytest.approx(dropped_share(plan, settled.dropped)) and settled.share <= 0.5
    assert steps.ages == next_ages([0] * plan.count, settled.dropped)
    assert set(steps.plan([0.0] * plan.count).order[:len(settled.dropped)]) == set(settled.dropped)  # first next time
    assert steps.deadline.observed == 2


@pytest.mark.parametrize("flag,value", [("max_loss", 0.6), ("max_loss", -0.1), ("streams", 0), ("streams", 65),
                                        ("chunk_mb", 0.0), ("chunk_mb", float("inf")), ("deadline_slack", 0.0),
                                        ("priority_tiers", 0), ("deadline_quantile", 1.1),
                                        ("deadline_quantile", float("nan")), ("hierarchy", "rings"),
                                        ("min_chunk_kb", 0.0), ("min_chunk_kb", 5000.0)])
def test_bad_options_are_refused_with_the_flag(flag: str, value: object) -> None:
    with pytest.raises(ConfigError, match="--" + flag.replace("_", "-")):
        get_method("lossy").make_options({flag: value})


def test_the_simulator_runs_lossy_beside_allreduce(tmp_path: Path) -> None:
    res = run_cli("simulate", "--algorithms", "allreduce,lossy", "--scenarios", "homogeneous", "--nproc", "8",
                  "--nodes", "4", "--steps", "30", "--model", "resnet18", "--out", str(tmp_path / "sim"), "--quiet",
                  timeout_s=120.0, env={"PYTHONPATH": SRC})
    assert res.returncode == 0, res.stderr[-2000:]
    runs = {r["algorithm"]: r for r in bench_records(tmp_path / "sim")}
    stats = runs["lossy"]["algorithm_stats"][0]
    assert len(stats["dropped_share"]) == 30 and stats["chunks"] >= 16
    assert max(stats["dropped_share"]) <= 0.1  # constant-rate links: nothing late, nothing beyond the bound
    assert runs["lossy"]["throughput_samples_per_s"] > 0


def test_hierarchy_groups_ranks_by_host_and_spreads_stream_leaders() -> None:
    layout = Hierarchy.of(["b", "b", "a", "a", "c", "c", "a"])
    assert layout.hosts == ((0, 1), (2, 3, 6), (4, 5)) and layout.two_level
    assert layout.leaders(0) == (0, 2, 4) and layout.leaders(1) == (1, 3, 5) and layout.leaders(2) == (0, 6, 4)
    assert [layout.host_of(r) for r in range(7)] == [0, 0, 1, 1, 2, 2, 1]
    assert not Hierarchy.of(["x"] * 4).two_level  # one host: one ring is the same path
    assert not Hierarchy.of(["a", "b", "c"]).two_level  # one rank per host: likewise
    with pytest.raises(ValueError):
        layout.host_of(7)


def test_the_deadline_leaves_room_for_the_chunks_in_flight() -> None:
    plan = plan_chunks(100, 10, 2, 1)  # 10 chunks of 10
    order = list(range(10))
    queues = stream_queues(order, 2)  # [0,2,4,6,8], [1,3,5,7,9]
    # After chunk 0, the last IN_FLIGHT chunks of each stream start by the deadline: 100 - 10 - 4 x 10.
    assert deadline_elements(plan, order, queues, 2) == 50
    assert deadline_elements(plan, order, queues, 1) == 70
    assert deadline_elements(plan, order, stream_queues(order, 10), IN_FLIGHT) == 0  # every chunk starts at once
    fast_and_slow = Deadline(slack=1.0, quantile=1.0, window=4, warmup=1)
    median = Deadline(slack=1.0, quantile=0.5, window=4, warmup=1)
    for rate in (100.0, 200.0, 400.0):
        fast_and_slow.observe(int(rate), 1.0)
        median.observe(int(rate), 1.0)
    assert fast_and_slow.budget_s(400) == pytest.approx(1.0)  # at the fastest recent rate
    assert median.budget_s(400) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        Deadline(slack=1.0, quantile=1.5)


# -- real processes ----------------------------------------------------------------------------------------
SCRIPT = textwrap.dedent('''
    """Workers whose gradients are known integers; lossy drops as much as it may at every step."""
    import json, random, sys, time
    import torch
    import torch.distributed as dist
    from torch import nn
    import prague
    from prague.metrics.decisions import DecisionLog

    out, hierarchy = sys.argv[1], sys.argv[2]
    if hierarchy == "hosts":  # two hosts of two ranks: the two-level path (reduce, ring of leaders, broadcast)
        import os  # the job's environment is read once, by prague.init()
        os.environ["PRAGUE_HOST_LABEL"] = f"host{int(os.environ['RANK']) // 2}"
    ctx = prague.init()
    SIZE = 256  # elements of the gradient
    model = nn.Linear(SIZE, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    log = DecisionLog(out + ".decisions", ctx.rank)
    # chunks of 8 float32 elements: 16 per stream, so a stream has started only a few (2 in flight) when
    # the deadline (1e-6 x the step) stops it, and every step past the warm-up drops up to --max-loss
    trainer = prague.wrap(model, optimizer, algorithm="lossy", max_loss=0.5, deadline_slack=1e-6, streams=2,
                          chunk_mb=8 * 4 / 2**20, min_chunk_kb=0.001, hierarchy=hierarchy, decisions=log)
    rng = random.Random(100 + ctx.rank)
    total = torch.zeros(SIZE, dtype=torch.float64)
    for step in range(24):
        c = torch.tensor([float(rng.randint(-40, 40)) for _ in range(SIZE)])
        total += c.double()
        pause = rng.random() * 0.02

        def loss(m, c=c, pause=pause):
            time.sleep(pause)  # ranks arrive in a random order
            return (m.weight.view(-1) * c).sum()  # its gradient is exactly c

        trainer.step(loss)
    carried = trainer.algorithm.residual.double().clone()
    trainer.close()
    log.close()
    stats = trainer.stats()
    final = model.weight.detach().view(-1).clone()
    finals = [torch.zeros(SIZE) for _ in range(ctx.world_size)]
    dist.all_gather(finals, final)
    dist.all_reduce(total)
    dist.all_reduce(carried)
    shares = [None] * ctx.world_size
    dist.all_gather_object(shares, stats["dropped_share"])
    if ctx.rank == 0:
        json.dump({"finals": [f.tolist() for f in finals], "total": total.tolist(), "carried": carried.tolist(),
                   "shares": shares, "stats": stats}, open(out, "w"))
    prague.shutdown()
''')


@pytest.mark.timeout(200)
@pytest.mark.parametrize("hierarchy", ["flat", "hosts"])
def test_real_workers_agree_on_every_mask_and_lose_no_gradient(tmp_path: Path, hierarchy: str) -> None:
    script = tmp_path / "known_gradients.py"
    script.write_text(SCRIPT)
    out = tmp_path / "lossy.json"
    res = run_cli("launch", "--nproc", "4", str(script), str(out), hierarchy, timeout_s=150.0,
                  env={"PYTHONPATH": SRC})
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(out.read_text())
    finals, total, carried = result["finals"], result["total"], result["carried"]
    assert all(f == finals[0] for f in finals)  # every rank applied the same masked mean: bit-identical
    # lr 1, plain SGD: final = -(sum of what was sent) / n, so n * (-final) + carried = sum of computed.
    assert [4 * -f + r for f, r in zip(finals[0], carried)] == pytest.approx(total, abs=1e-6)
    shares = result["shares"]
    assert all(s == shares[0] for s in shares) and len(shares[0]) == 24
    assert sum(1 for s in shares[0] if s > 0) >= 15  # the deadline (1e-6 x the step) really dropped chunks
    assert max(shares[0]) <= 0.5 and any(r != 0 for r in carried) == (shares[0][-1] > 0)
    logs = [(tmp_path / "lossy.json.decisions" / f"rank{r}.jsonl").read_text() for r in range(4)]
    assert all(log == logs[0] for log in logs)  # the same chunks dropped at every step on every rank
    assert result["stats"]["carried_share_end"] == shares[0][-1]
    assert result["stats"]["hierarchy"] == ("hosts (2 hosts)" if hierarchy == "hosts" else "flat")
