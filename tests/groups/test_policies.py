"""Property tests of the Group Generator policies, driven by a small discrete-event simulation.

Each simulated worker computes (its own speed, jitter and the paper's random slowdowns), asks the policy
for a group, and executes its groups in the order received with blocking semantics: a group executes only
once all its members have reached it. After its last iteration a worker calls ``finish`` and executes
the groups it was still committed to. The run must always complete (no deadlock), every member of a
group must receive the same (seq, members), and the policy-specific rules must hold.
"""

from __future__ import annotations

import copy
import dataclasses
import heapq
import itertools
import math
import pickle
import random
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import prague
from prague.errors import ConfigError
from prague.groups import (
    GENERATORS,
    Formation,
    GeneratorConfig,
    Group,
    GroupPolicy,
    Topology,
    make_generator,
    static_group,
    static_schedule,
)
from prague.groups.api import THRESHOLDS
from prague.groups.smart import chunk, divide

# ------------------------------------------------------------------------------------------------
# The event simulation
# ------------------------------------------------------------------------------------------------


@dataclass
class SimResult:
    received: dict[int, list[Group]]
    formations: list[Formation]
    waits_s: list[float]
    end_s: float
    stats: dict[str, float | int]
    groups: dict[int, Group] = field(default_factory=dict)


def simulate(
    name: str,
    config: GeneratorConfig,
    compute_s: Callable[[int, int], float],
    iterations: list[int],
    comm_s: float = 0.01,
) -> SimResult:
    """Run every worker for ``iterations[w]`` requests; fail on any inconsistency or deadlock."""
    formations: list[Formation] = []
    policy: GroupPolicy = make_generator(name, config, observer=formations.append)
    n = config.nproc
    events: list[tuple[float, int, str, object]] = []
    order = 0
    inbox: list[deque[Group]] = [deque() for _ in range(n)]
    at_group: list[Group | None] = [None] * n
    iters_done = [0] * n
    asked_at: list[float | None] = [None] * n
    finished = [False] * n
    done = [False] * n
    received: dict[int, list[Group]] = {w: [] for w in range(n)}
    by_seq: dict[int, Group] = {}
    arrived: dict[int, set[int]] = {}
    receivers: dict[int, list[int]] = defaultdict(list)
    waits: list[float] = []

    def push(t: float, kind: str, payload: object) -> None:
        nonlocal order
        order += 1
        heapq.heappush(events, (t, order, kind, payload))

    def advance(w: int, now: float) -> None:
        if at_group[w] is None and inbox[w]:
            g = inbox[w][0]
            at_group[w] = g
            here = arrived.setdefault(g.seq, set())
            here.add(w)
            if len(here) == g.size:
                push(now + (0.0 if g.is_local else comm_s), "exec", g)

    def deliver(answers: list[tuple[int, Group]], now: float) -> None:
        for w, g in answers:
            assert by_seq.setdefault(g.seq, g) == g, f"seq {g.seq} given as {by_seq[g.seq]} and as {g}"
            assert w in g.members, f"worker {w} handed {g}"
            assert not received[w] or received[w][-1].seq < g.seq, f"worker {w}: {g} after {received[w][-1]}"
            if not finished[w]:
                start = asked_at[w]
                assert start is not None, f"worker {w} handed {g} without asking"
                waits.append(now - start)
                asked_at[w] = None
            received[w].append(g)
            receivers[g.seq].append(w)
            inbox[w].append(g)
        for w in {w for w, _ in answers}:
            advance(w, now)

    def next_step(w: int, now: float) -> None:
        if finished[w]:
            if inbox[w]:
                advance(w, now)
            else:
                done[w] = True
        elif iters_done[w] < iterations[w]:
            push(now + compute_s(w, iters_done[w]), "request", w)
        else:
            finished[w] = True
            deliver(policy.finish(w, now), now)
            if not inbox[w]:
                done[w] = True

    for w in range(n):
        push(compute_s(w, 0), "request", w)
    now = 0.0
    steps = 0
    while True:
        steps += 1
        assert steps < 50 * (sum(iterations) + n) + 1000, "simulation does not terminate"
        deadline = policy.next_deadline()
        if deadline is not None and (not events or deadline <= events[0][0]):
            now = max(now, deadline)
            deliver(policy.poll(now), now)
            continue
        if not events:
            break
        now, _, kind, payload = heapq.heappop(events)
        if kind == "request":
            assert isinstance(payload, int)
            iters_done[payload] += 1
            asked_at[payload] = now
            deliver(policy.request(payload, now), now)
        else:
            assert isinstance(payload, Group)
            del arrived[payload.seq]
            for m in payload.members:
                assert inbox[m].popleft() == payload
                at_group[m] = None
            for m in payload.members:
                next_step(m, now)

    stuck = {w: (at_group[w], list(inbox[w])[:3], asked_at[w]) for w in range(n) if not done[w]}
    assert not stuck, f"deadlock: workers not done (at group, inbox head, asked at): {stuck}"
    assert list(policy.counts) == iterations  # type: ignore[attr-defined]
    for seq, g in by_seq.items():
        assert tuple(sorted(receivers[seq])) == g.members, f"{g} received by {receivers[seq]}"
    assert {f.group.seq for f in formations} == set(by_seq), "a formed group was never handed out"
    return SimResult(received, formations, waits, now, policy.stats(), by_seq)


def compute_model(
    n: int, speeds: list[float], seed: int, discrete: bool, slowdown: float
) -> Callable[[int, int], float]:
    """Per-iteration compute time: speed x jitter, and the paper's model (X-fold with probability 1/n)."""
    rng = random.Random(seed)

    def compute_s(worker: int, iteration: int) -> float:
        t = speeds[worker] * rng.uniform(0.5, 1.5)
        if rng.random() < 1.0 / n:
            t *= slowdown
        return float(max(1, round(t))) if discrete else t

    return compute_s


Case = tuple[GeneratorConfig, Callable[[int, int], float], list[int]]


@st.composite
def scenarios(draw: st.DrawFn, equal_iterations: bool = False) -> Case:
    nodes = draw(st.integers(1, 4))
    wpn = draw(st.integers(1, 4))
    n = nodes * wpn
    config = GeneratorConfig(
        nproc=n,
        topology=Topology(nodes, wpn),
        group_size=draw(st.integers(1, min(n, 5))),
        delta_c=draw(st.integers(1, 6)),
        seed=draw(st.integers(0, 2**31)),
        window_s=draw(st.sampled_from([0.05, 0.5, 3.0])),
        avoid_repeats=draw(st.booleans()),
    )
    speeds = draw(st.lists(st.floats(0.2, 5.0), min_size=n, max_size=n))
    per_worker = REQUESTS_PER_EXAMPLE // n
    if equal_iterations:
        iterations = [per_worker] * n
    else:
        iterations = draw(st.lists(st.integers(per_worker, per_worker * 3 // 2), min_size=n, max_size=n))
    seed, discrete = draw(st.integers(0, 2**31)), draw(st.booleans())
    slowdown = draw(st.sampled_from([1.0, 5.0]))
    compute = compute_model(n, speeds, seed, discrete, slowdown)
    return config, compute, iterations


# 40 examples x at least 505 requests (520 // n per worker, n <= 16): over 20,000 requests per policy.
EXAMPLES = 40
REQUESTS_PER_EXAMPLE = 520
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ------------------------------------------------------------------------------------------------
# Properties under random speeds and arrival orders
# ------------------------------------------------------------------------------------------------


def check_smart(config: GeneratorConfig, result: SimResult) -> None:
    by_batch: dict[int, list[Formation]] = defaultdict(list)
    for f in result.formations:
        assert f.requester is not None and f.kind in ("intra", "inter")
        by_batch[f.batch].append(f)
        c = f.counts
        for m in f.group.members:  # the step rule, with the counts at formation time (time's: its own tests)
            assert config.threshold != "steps" or m == f.requester or c[m] > c[f.requester] - config.delta_c, (
                f, config.delta_c)
    for batch, division in by_batch.items():
        members = [m for f in division for m in f.group.members]
        assert len(members) == len(set(members)), f"division {batch} not disjoint: {division}"
        assert division[0].requester in members
        sizes = sorted(f.group.size for f in division)
        s = config.group_size
        if division[0].kind == "inter" and s > 1:  # all full size but one (smaller, or S + 1 with a single)
            assert all(x in (s, s + 1) for x in sizes[1:]) and sizes.count(s + 1) <= 1, (sizes, s)


@SETTINGS
@given(scenarios(), st.sampled_from(THRESHOLDS))
def test_smart_consistent_deadlock_free_and_threshold(case: Case, rule: str) -> None:
    config, compute, iterations = case
    config = dataclasses.replace(config, threshold=rule)
    result = simulate("smart", config, compute, iterations)
    check_smart(config, result)


@SETTINGS
@given(scenarios())
def test_random_consistent_and_deadlock_free(case: Case) -> None:
    config, compute, iterations = case
    result = simulate("random", config, compute, iterations)
    for f in result.formations:
        assert f.requester in f.group.members
        assert f.group.size <= config.group_size
    assert result.stats["conflicts"] == sum(f.conflict for f in result.formations)


@SETTINGS
@given(scenarios())
def test_ready_consistent_deadlock_free_and_window(case: Case) -> None:
    config, compute, iterations = case
    result = simulate("ready", config, compute, iterations)
    for f in result.formations:
        assert f.group.size <= config.group_size
        if f.kind == "ready":
            assert f.group.size == config.group_size
    # No request waits for partners longer than the window.
    assert max(result.waits_s) <= config.window_s + 1e-9


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_ready_two_levels_consistent_deadlock_free_and_alternating(case: Case) -> None:
    """``levels = 2`` on every topology of several nodes of several workers: consistent, deadlock-free, no wait
    beyond the window; a node's group holds only that node's workers and is formed by a worker's second, fourth...
    request; a full group across nodes spans two nodes or more."""
    config, compute, iterations = case
    topology = config.topo
    if topology.nodes < 2 or topology.workers_per_node < 2:
        with pytest.raises(ConfigError, match="levels 2 alternates groups inside a node and across nodes"):
            dataclasses.replace(config, levels=2)
        return
    config = dataclasses.replace(config, levels=2)
    result = simulate("ready", config, compute, iterations)
    assert max(result.waits_s) <= config.window_s + 1e-9
    wpn = topology.workers_per_node
    node_groups = {f.group.seq for f in result.formations if f.kind == "node"}
    for f in result.formations:
        assert f.group.size <= config.group_size
        if f.kind == "node":
            assert len({m // wpn for m in f.group.members}) == 1, f
    for f in result.formations:
        if f.kind == "node":  # formed by a worker's second, fourth... request (its requests so far: its progress)
            assert f.requester is not None and f.counts[f.requester] % 2 == 0, f
        if f.kind == "ready" and len(f.group.members) > 1:  # across: two nodes or more
            assert len({m // wpn for m in f.group.members}) > 1, f
    assert result.stats["node_groups"] == len(node_groups)


def test_ready_two_levels_prefers_other_nodes_and_forms_a_node_group_at_once() -> None:
    """Across nodes, S waiting form a group once they are of two nodes, the oldest taking a partner of another node
    over its node-mate; a worker's second, fourth... request forms a group of its node at once when its active
    node-mates wait (whatever they asked for), alone at once when the others finished; a finish forms no node
    group (only everyone waiting groups whoever waits)."""
    topology = Topology(nodes=3, workers_per_node=2)  # ranks 0-1 node 0, 2-3 node 1, 4-5 node 2
    config = GeneratorConfig(nproc=6, topology=topology, group_size=2, seed=1, window_s=1.0, avoid_repeats=False,
                             levels=2)
    for seed in range(20):  # whatever the draws
        ready = make_generator("ready", dataclasses.replace(config, seed=seed))
        assert ready.request(0, 0.0, 0) == [] and ready.request(1, 0.1, 0) == []  # both of node 0: no group
        got = ready.request(2, 0.2, 0)
        assert [(w, g.members) for w, g in got] == [(0, (0, 2)), (2, (0, 2))]
    got = ready.request(0, 0.3, 1)  # 0's second request, and 1 waits: a group of node 0
    assert [(w, g.members) for w, g in got] == [(0, (0, 1)), (1, (0, 1))] and ready.stats()["node_groups"] == 1
    assert ready.request(3, 0.4, 0) == []
    assert [g.members for _, g in ready.request(2, 0.5, 1)] == [(2, 3), (2, 3)]  # 2's second: node 1
    assert ready.request(4, 0.6, 0) == [] and ready.request(5, 0.7, 0) == []  # both of node 2
    assert [g.members for _, g in ready.request(0, 0.8, 2)] == [(0, 4), (0, 4)]  # the oldest, 4, takes 0 over 5
    assert ready.finish(3, 0.9) == []
    assert [g.members for _, g in ready.request(2, 1.0, 2)] == [(2, 5), (2, 5)]  # 2's third: across
    assert [(w, g.members) for w, g in ready.request(2, 1.1, 3)] == [(2, (2,))]  # its fourth, its mate gone: alone
    assert ready.request(1, 1.2, 1) == []  # 1's second: 0 is not waiting
    assert ready.finish(0, 1.3) == [] and ready.waiting() == [1]  # 1's mate finished: no group on a finish
    assert [g.members for _, g in ready.request(4, 1.4, 1)] == [(1, 4), (1, 4)]  # across, with 1
    assert ready.request(5, 1.5, 1) == [] and ready.finish(1, 1.6) == [] and ready.finish(4, 1.7) == []
    assert [(w, g.members) for w, g in ready.finish(2, 1.8)] == [(5, (5,))]  # only 5 is left, and it waits
    assert ready.stats()["node_groups"] == 3
    one_level = make_generator("ready", dataclasses.replace(config, levels=1))
    assert one_level.request(0, 0.0, 0) == [] and one_level.request(1, 0.1, 0) != []  # one level: node-mates pair
    assert "node_groups" not in one_level.stats()


@settings(max_examples=10, deadline=None)
@given(scenarios(equal_iterations=True))
def test_static_policy_consistent_and_deadlock_free(case: Case) -> None:
    config, compute, iterations = case
    result = simulate("static", config, compute, iterations)
    for f in result.formations:
        it = f.group.seq // config.nproc
        assert f.group in static_schedule(it, config.topo)


@pytest.mark.parametrize("name", ["smart", "random", "ready", "static"])
def test_long_run_16_workers_paper_slowdown(name: str, report: Callable[[str], None]) -> None:
    """10,000 requests, 4 nodes x 4 workers, the paper's model: each iteration 5x slower with prob. 1/16."""
    config = GeneratorConfig(nproc=16, topology=Topology(4, 4), group_size=3, delta_c=4, seed=7, window_s=0.3)
    iterations = [625] * 16
    result = simulate(name, config, compute_model(16, [1.0] * 16, 11, False, 5.0), iterations)
    if name == "smart":
        check_smart(config, result)
    stats = result.stats
    no_wait_s = 625 * 1.0 * (1 + 4.0 / 16)  # mean compute time with slowdowns, nobody ever waiting
    line = (
        f"{name:>6}: 16 workers, 10000 requests, S=3: groups={stats['groups']} "
        f"mean_size={stats['mean_group_size']:.2f} local_steps={stats['local_steps']} "
        f"throughput/no-wait limit={no_wait_s / result.end_s:.2f}"
    )
    if "conflicts" in stats:
        line += f" conflicts={stats['conflicts']} ({stats['conflicts'] / stats['groups']:.0%} of groups)"
    if name == "ready":
        line += f" mean_wait={stats['mean_wait_s']:.3f}s holds={stats['holds']}"
    report(line)
    print(line)


# ------------------------------------------------------------------------------------------------
# Static schedule: the paper's table, cell by cell, and the general rule
# ------------------------------------------------------------------------------------------------

WHOLE_NODES: list[tuple[int, ...]] = [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15)]
PAPER_TABLE: dict[int, list[tuple[int, ...]]] = {
    0: [(0, 4, 8, 12), (2, 3), (6, 7), (10, 11), (14, 15), (1,), (5,), (9,), (13,)],
    1: WHOLE_NODES,
    2: [(1, 5, 9, 13), (0, 3), (4, 7), (8, 11), (12, 15), (2,), (6,), (10,), (14,)],
    3: WHOLE_NODES,
}


@pytest.mark.parametrize("iteration", range(12))
def test_static_table_matches_paper_4x4(iteration: int) -> None:
    topo = Topology(4, 4)
    expected = {rank: members for members in PAPER_TABLE[iteration % 4] for rank in members}
    for rank in range(16):
        g = static_group(iteration, rank, topo)
        assert g.members == expected[rank], (iteration, rank, g)
        assert g.seq == iteration * 16 + g.members[0]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.integers(1, 8), st.integers(0, 40))
def test_static_disjoint_and_covering(nodes: int, wpn: int, iteration: int) -> None:
    topo = Topology(nodes, wpn)
    groups = static_schedule(iteration, topo)
    ranks = [r for g in groups for r in g.members]
    assert sorted(ranks) == list(range(topo.size))
    for g in groups:
        for r in g.members:
            assert static_group(iteration, r, topo) == g
    assert all(g.seq // topo.size == iteration for g in groups)


# ------------------------------------------------------------------------------------------------
# Divisions, the ready preference, validation
# ------------------------------------------------------------------------------------------------


def test_chunk_remainders() -> None:
    assert chunk([1, 2, 3, 4, 5, 6, 7], 3) == [[1, 2, 3], [4, 5, 6, 7]]
    assert chunk([1, 2, 3, 4, 5], 3) == [[1, 2, 3], [4, 5]]
    assert chunk([1], 3) == [[1]]
    assert chunk([1, 2, 3], 1) == [[1], [2], [3]]


def test_divisions_intra_inside_nodes_inter_across() -> None:
    topo = Topology(4, 4)
    rng = random.Random(0)
    for _ in range(50):
        for g in divide(range(16), 4, topo, "intra", rng):
            assert len({topo.node_of(r) for r in g}) == 1
        for g in divide(range(16), 4, topo, "inter", rng):
            assert sorted(topo.node_of(r) for r in g) == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match="valid choices: inter, intra"):
        divide(range(4), 2, topo, "diagonal", rng)


def test_smart_alternates_divisions_and_applies_threshold() -> None:
    formations: list[Formation] = []
    config = GeneratorConfig(nproc=8, topology=Topology(2, 4), group_size=2, delta_c=2)
    smart = make_generator("smart", config, observer=formations.append)
    for _ in range(3):  # worker 0 runs ahead alone; its FIFO empties every time
        smart.request(0, 0.0)
    kinds: list[tuple[int, str]] = []
    for f in formations:
        if not kinds or kinds[-1][0] != f.batch:
            kinds.append((f.batch, f.kind))
    assert [k for _, k in kinds] == ["intra", "inter"] + ["intra"] * (len(kinds) - 2)
    # By its 3rd request worker 0 (c=3) is 2 ahead of everyone (c=0): 0 > 3 - 2 fails, so it is alone.
    last = [f for f in formations if f.batch == formations[-1].batch]
    assert [f.group.members for f in last] == [(0,)]


def test_smart_threshold_counts_iterations_not_requests() -> None:
    """A worker that averages in the background asks only when it submits an average: its requests lag
    its steps. The threshold compares the steps the requests report, so such a worker is not mistaken for
    a straggler, and a worker truly behind in steps still is."""
    config = GeneratorConfig(nproc=4, group_size=4, delta_c=3, seed=1)
    smart = make_generator("smart", config)
    for step in range(21):  # worker 0 asks after every step
        smart.request(0, 0.0, iteration=step)
    smart.request(1, 0.0, iteration=19)  # one request, 20 steps done
    smart.request(2, 0.0, iteration=2)  # truly behind: 3 steps
    smart.request(3, 0.0, iteration=18)
    assert list(smart.counts) == [21, 1, 1, 1] and list(smart.progress) == [21, 20, 3, 19]  # type: ignore[attr-defined]
    assert smart.eligible(0) == [0, 1, 3]  # type: ignore[attr-defined]
    # Without iterations each request counts as one step, and the same workers look 20 steps behind.
    plain = make_generator("smart", config)
    for _ in range(21):
        plain.request(0, 0.0)
    for w in (1, 2, 3):
        plain.request(w, 0.0)
    assert plain.eligible(0) == [0]  # type: ignore[attr-defined]


def test_smart_threshold_in_time_weighs_the_lag_by_each_workers_step_time() -> None:
    """``threshold="time"``: a worker 4x slower, two steps behind, needs eight of a fast requester's steps to reach
    its group: out of a division with ``delta_c=3``, where the step rule lets it in; a fast worker two steps
    behind is in (2 x 1 < 3); a worker whose time is not measured yet is judged by the step rule; a slow requester
    lets a fast worker far behind in (it catches up at its own pace), where the step rule keeps it out."""
    config = GeneratorConfig(nproc=4, group_size=4, delta_c=3, seed=1, threshold="time")
    smart = make_generator("smart", config)
    calls = [(2, 0.0, 0), (0, 1.0, 0), (1, 1.0, 0), (3, 1.0, 1), (0, 2.0, 1), (1, 2.0, 1), (0, 3.0, 2), (0, 4.0, 3),
             (2, 4.0, 1)]
    for worker, t, step in calls:
        smart.request(worker, t, iteration=step)
    assert [smart.step_time(w) for w in range(4)] == [1.0, 1.0, 4.0, None]  # type: ignore[attr-defined]
    assert list(smart.progress) == [4, 2, 2, 2]  # type: ignore[attr-defined]
    steps = make_generator("smart", dataclasses.replace(config, threshold="steps"))
    for worker, t, step in calls:
        steps.request(worker, t, iteration=step)
    assert smart.eligible(0) == [0, 1, 3]  # type: ignore[attr-defined]
    assert steps.eligible(0) == [0, 1, 2, 3]  # type: ignore[attr-defined]
    for policy in (smart, steps):
        policy.progress[1], policy.progress[2] = 4, 10  # type: ignore[attr-defined]
    # Workers 0 and 1: 6 behind at 1 s a step, under 3 x 4 s; worker 3, unmeasured: 2 > 10 - 3 fails.
    assert smart.eligible(2) == [0, 1, 2]  # type: ignore[attr-defined]
    assert steps.eligible(2) == [2]  # type: ignore[attr-defined]  # 4 > 10 - 3 fails for everyone


def test_smart_threshold_in_time_is_the_step_rule_for_equal_workers() -> None:
    """Workers of one speed: the same groups under both rules, call for call, over a run where the threshold
    excludes someone (one worker starts three steps late and stays three behind)."""
    answers = {}
    for rule in ("steps", "time"):
        config = GeneratorConfig(nproc=6, topology=Topology(2, 3), group_size=2, delta_c=2, seed=4, threshold=rule)
        smart = make_generator("smart", config)
        got = []
        for step in range(12):
            for w in range(6):
                if w == 5 and step < 3:
                    continue
                got.append(smart.request(w, 0.5 * step + 0.0625 * w, iteration=step if w != 5 else step - 3))
        answers[rule] = got
        excluded = smart.counters.extra["excluded_by_threshold"]
        assert excluded > 0
    assert answers["steps"] == answers["time"]
    with pytest.raises(ConfigError, match="unknown threshold 'seconds'; valid choices: steps, time"):
        GeneratorConfig(nproc=4, threshold="seconds")


def test_ready_forms_at_once_and_window() -> None:
    config = GeneratorConfig(nproc=4, group_size=2, window_s=1.0)
    ready = make_generator("ready", config)
    assert ready.request(2, 0.0) == []
    assert ready.next_deadline() == pytest.approx(1.0)
    [(a, g), (b, h)] = ready.request(0, 0.5)
    assert g == h and g.members == (0, 2) and {a, b} == {0, 2}
    assert ready.next_deadline() is None
    assert ready.request(1, 2.0) == []
    assert ready.poll(2.5) == []
    assert ready.poll(3.0) == [(1, Group(1, (1,)))]
    with pytest.raises(ConfigError, match="already waiting"):
        ready.request(3, 4.0)
        ready.request(3, 4.1)


@settings(max_examples=40, deadline=None)
@given(period=st.floats(0.004, 4.0), n=st.integers(2, 8), seed=st.integers(0, 1000))
def test_ready_adaptive_window_follows_the_time_between_requests(period: float, n: int, seed: int) -> None:
    """With window 0, workers asking every ``period`` seconds (each at its own phase) settle to a
    window of ADAPTIVE_SHARE x period, within the bounds; before anyone has asked twice it is the
    first window; and a request never waits longer than the window in force (which a later request's
    measurement may have moved while it waited)."""
    from prague.groups.ready import ADAPTIVE_SHARE, FIRST_WINDOW_S, MAX_WINDOW_S, MIN_WINDOW_S

    ready = make_generator("ready", GeneratorConfig(nproc=n, group_size=n + 1 if n < 8 else 8, seed=seed, window_s=0.0))
    assert ready.window_s == FIRST_WINDOW_S
    rng = random.Random(seed)
    phase = [rng.uniform(0, period) for _ in range(n)]
    events = sorted((phase[w] + k * period, w) for w in range(n) for k in range(12))
    waiting: dict[int, tuple[float, float]] = {}  # worker -> (asked at, window then)

    def settle(answers: list, now: float) -> None:
        for w, _ in answers:
            asked, window = waiting.pop(w)
            assert now - asked <= max(window, ready.window_s) + 1e-9

    for t, w in events:
        while (deadline := ready.next_deadline()) is not None and deadline <= t:
            settle(ready.poll(deadline), deadline)
        if w in waiting:  # still waiting (a long window): this iteration's request comes later
            continue
        waiting[w] = (t, ready.window_s)
        settle(ready.request(w, t), t)
    expected = min(MAX_WINDOW_S, max(MIN_WINDOW_S, ADAPTIVE_SHARE * period))
    assert ready.window_s == pytest.approx(expected, rel=0.35)
    assert ready.stats()["window_s"] == ready.window_s


def _rounds(ready: GroupPolicy, n: int, rounds: int, gap: int, start: int = 0) -> tuple[int, list[int]]:
    """Every worker of ``n`` asks once a round, ``gap`` steps after its previous request (an overlapped
    worker whose average came back late took ``gap - 1`` local steps); the step reached and the sizes of
    the groups formed."""
    sizes, step, now = [], start, float(start)
    for _ in range(rounds):
        for w in range(n):
            now += 0.001
            sizes += [len(g.members) for v, g in ready.request(w, now, step) if v == w]
        while (deadline := ready.next_deadline()) is not None:
            sizes += [len(g.members) for _, g in ready.poll(deadline)]
        step += gap
    return step, sizes


def test_ready_adapt_size_forms_smaller_groups_while_averages_come_back_late() -> None:
    """With ``adapt_size``: requests that skip steps (a mean gap above SHRINK_AT) bring the size down one at a
    time to 2, never below; requests at every step (under GROW_AT) bring it back up to ``group_size``, never
    above; gaps too long to be a late average (a worker back from other shards) count for nothing; and
    without ``adapt_size`` the size never moves."""
    from prague.groups.ready import ADAPT_EVERY, MAX_GAP, ReadyGenerator

    n = 12
    config = GeneratorConfig(nproc=n, group_size=4, seed=3, window_s=0.01, avoid_repeats=False, adapt_size=True)
    ready = make_generator("ready", config)  # no holds: every round forms whole groups as they fill
    assert ready.group_size == 4 and ready.stats()["group_size"] == 4
    step, sizes = _rounds(ready, n, 1 + -(-ADAPT_EVERY // n), 3)  # the first request of each counts no gap
    assert ready.group_size == 3 and 4 in sizes  # groups of 4 until the first window was counted
    step, sizes = _rounds(ready, n, 3 * ADAPT_EVERY // n, 3, step)
    assert ready.group_size == 2 and sizes[-n // 2:] == [2] * (n // 2)  # the last round: pairs only
    stats = ready.stats()
    assert stats["group_size"] == 2 and stats["size_changes"] == 2
    shard = ReadyGenerator(config, shards=2)  # a shard: a longer gap may be other shards' steps
    _, sizes = _rounds(shard, n, 4 * ADAPT_EVERY // n, MAX_GAP + 1)
    assert shard.group_size == 4 and set(sizes) == {4} and shard.stats()["size_changes"] == 0
    late = ReadyGenerator(config)  # alone, a long gap is a very late average
    _rounds(late, n, 1 + -(-ADAPT_EVERY // n), 5 * MAX_GAP)
    assert late.group_size == 3
    step, sizes = _rounds(ready, n, 6 * ADAPT_EVERY // n, 1, step)
    assert ready.group_size == 4 and sizes[-n // 4:] == [4] * (n // 4) and ready.stats()["size_changes"] == 4

    fixed = make_generator("ready", dataclasses.replace(config, adapt_size=False))
    _, sizes = _rounds(fixed, n, 4 * ADAPT_EVERY // n, 3)
    assert fixed.group_size == 4 and set(sizes) == {4} and "size_changes" not in fixed.stats()
    with pytest.raises(ConfigError, match="adapt_size must be True or False"):
        GeneratorConfig(nproc=4, adapt_size=1)  # type: ignore[arg-type]


def test_ready_median_of_a_large_job_lags_by_at_most_a_sixteenth_of_it() -> None:
    """Up to MEDIAN_EVERY workers measured, every request moves the adaptive window; beyond, it is half the
    exact median of the moving averages as they were at most 1/MEDIAN_EVERY of the workers ago, taken again
    far less often than at every request."""
    from prague.groups.ready import ADAPTIVE_SHARE, MEDIAN_EVERY

    n = 8 * MEDIAN_EVERY
    ready = make_generator("ready", GeneratorConfig(nproc=n, group_size=2, window_s=0.0, avoid_repeats=False))
    for w in range(n):  # first requests, in pairs: nothing measured yet
        ready.request(w, 0.0)
    periods = [0.01 * (w + 1) for w in range(n)]  # a second request measures each worker's period
    medians, windows = [], []
    for k in range(n):
        ready.request(k, periods[k])
        windows.append(ready.window_s)
        ordered = periods[: k + 1]
        mid = len(ordered) // 2
        medians.append(ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2)
        lagging = [j for j in range(k + 1) if ready.window_s == pytest.approx(ADAPTIVE_SHARE * medians[j])]
        assert lagging, f"the window after request {k} is no median of the periods measured so far"
        behind = k - max(lagging)
        if k < MEDIAN_EVERY:
            assert behind == 0
        assert behind <= (k + 1) / MEDIAN_EVERY
    late = range(2 * MEDIAN_EVERY, n)
    moves = sum(1 for k in late if windows[k] != windows[k - 1])
    assert 0 < moves <= len(late) // 2  # the median moved at every one of these requests; the window did not


def test_ready_deadline_is_the_oldest_waiting_even_out_of_order() -> None:
    """The window closes after the oldest waiting request, also when requests arrive out of time order
    (a replayed log, a clock step back), and that request anchors the group the window forms."""
    ready = make_generator("ready", GeneratorConfig(nproc=8, group_size=3, window_s=1.0, avoid_repeats=False))
    ready.request(5, 2.0)
    assert ready.next_deadline() == 3.0
    ready.request(7, 1.5)  # earlier than the request already waiting
    assert ready.next_deadline() == 2.5
    assert ready.poll(2.4) == []
    formed = ready.poll(2.5)
    assert sorted(w for w, _ in formed) == [5, 7] and formed[0][1].members == (5, 7)
    assert ready.next_deadline() is None
    ready.request(1, 3.0)
    assert ready.next_deadline() == 4.0


def test_a_fixed_window_stays_fixed() -> None:
    ready = make_generator("ready", GeneratorConfig(nproc=2, group_size=2, window_s=0.2))
    for k in range(5):
        ready.request(0, k * 10.0)
        ready.poll(k * 10.0 + 0.2)
    assert ready.window_s == 0.2 and ready.next_deadline() is None


def test_ready_group_size_one_is_an_immediate_local_step() -> None:
    ready = make_generator("ready", GeneratorConfig(nproc=3, group_size=1, window_s=10.0))
    for it in range(3):
        assert ready.request(1, float(it)) == [(1, Group(it, (1,)))]
    assert ready.next_deadline() is None


def test_ready_forms_at_once_when_everyone_else_finished() -> None:
    ready = make_generator("ready", GeneratorConfig(nproc=3, group_size=3, window_s=10.0))
    assert ready.finish(2, 0.0) == []
    assert ready.request(0, 0.0) == []
    assert [g.members for _, g in ready.request(1, 0.1)] == [(0, 1), (0, 1)]


def test_ready_prefers_partners_not_met_recently() -> None:
    """0 and 1 just met; when both wait again with 2, the oldest (0) should mostly pick 2."""
    picked_stranger = 0
    trials = 200
    for seed in range(trials):
        ready = make_generator("ready", GeneratorConfig(nproc=3, group_size=2, seed=seed, window_s=5.0))
        ready.request(0, 0.0)
        ready.request(1, 0.1)  # group {0, 1}
        assert ready.request(0, 1.0) == []
        assert ready.request(1, 1.1) == []  # a repeat of {0, 1}: held for one more arrival
        answers = ready.request(2, 1.2)
        members = answers[0][1].members
        assert 0 in members  # the oldest waiter anchors the group
        picked_stranger += members == (0, 2)
        assert ready.stats()["holds"] == 1
    assert picked_stranger / trials > 0.7  # weights 4 : 1 -> expected 0.8


class _KeepsEveryMeeting:
    """In place of a ready generator's list of meetings to drop: drops none (the matrix keeps every pair)."""

    def append(self, item: object) -> None:
        pass

    def __bool__(self) -> bool:
        return False


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("size", [2, 3])
def test_ready_forgets_meetings_older_than_its_horizon_without_deciding_otherwise(seed: int, size: int) -> None:
    """Pairs that met more than a horizon of groups ago weigh as strangers, so the generator drops them: its
    recency matrix stays within the pairs of a horizon of groups, and every answer is the one a generator that
    keeps every meeting gives (holds, partners, window groups), over a long run of unequal workers."""
    n = 10
    config = GeneratorConfig(nproc=n, group_size=size, seed=seed, window_s=0.05)
    kept, pruned = make_generator("ready", config), make_generator("ready", config)
    kept._met_order = _KeepsEveryMeeting()  # type: ignore[attr-defined]
    rng = random.Random(seed)
    waiting: set[int] = set()
    now = 0.0
    for _ in range(3000):
        now += rng.expovariate(200.0)
        idle = [w for w in range(n) if w not in waiting]
        if idle and rng.random() < 0.9:
            worker = rng.choice(idle)
            answers = kept.request(worker, now)
            assert pruned.request(worker, now) == answers
            waiting.add(worker)
        else:
            answers = kept.poll(now)
            assert pruned.poll(now) == answers
        waiting -= {w for w, _ in answers}
    assert kept.stats() == pruned.stats() and kept.stats()["holds"] > 0
    horizon = -(-n // size)
    assert len(pruned._last_met) <= horizon * math.comb(size, 2)  # type: ignore[attr-defined]
    assert len(kept._last_met) > len(pruned._last_met)  # type: ignore[attr-defined]


def repeat_rate(groups: dict[int, Group], horizon: int) -> float:
    """Share of groups (of 2 or more) in which every pair already met within the last ``horizon`` groups."""
    last: dict[tuple[int, int], int] = {}
    repeats = total = 0
    for seq in sorted(groups):
        pairs = list(itertools.combinations(groups[seq].members, 2))
        if pairs:
            total += 1
            repeats += all(seq - last.get(p, -horizon - 1) <= horizon for p in pairs)
            last.update((p, seq) for p in pairs)
    return repeats / total


def test_ready_avoid_repeats_improves_mixing(report: Callable[[str], None]) -> None:
    """With the hold, fewer groups re-pair workers that met within the last round of groups."""
    rates = {}
    for avoid in (False, True):
        config = GeneratorConfig(nproc=16, group_size=2, seed=0, window_s=0.3, avoid_repeats=avoid)
        result = simulate("ready", config, compute_model(16, [1.0] * 16, 0, False, 5.0), [200] * 16)
        rates[avoid] = (repeat_rate(result.groups, 8), 200 * 1.25 / result.end_s)
    report(
        " ready: 16 workers, S=2, groups re-pairing workers met within 8 groups: "
        f"avoid_repeats=False {rates[False][0]:.1%} (throughput/limit {rates[False][1]:.2f}), "
        f"True {rates[True][0]:.1%} ({rates[True][1]:.2f})"
    )
    assert rates[True][0] < rates[False][0]


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_unknown_and_finished_workers_rejected(name: str) -> None:
    policy = make_generator(name, GeneratorConfig(nproc=4, group_size=2))
    for bad in (-1, 4):
        with pytest.raises(ConfigError, match="unknown worker id"):
            policy.request(bad, 0.0)
    # Not an int: the pure build names it as above; a compiled one (make compiled) stops it at the call with
    # the type expected, and takes a bool for the int it is.
    pure = prague.BUILD == "pure"
    wrong_type = ConfigError if pure else (ConfigError, TypeError)
    for bad_type in (1.5, "2", True) if pure else (1.5, "2"):
        with pytest.raises(wrong_type, match="unknown worker id|int object expected"):
            policy.request(bad_type, 0.0)  # type: ignore[arg-type]
    assert policy.stats()["requests"] == 0
    policy.finish(3, 0.0)
    with pytest.raises(ConfigError, match="already called finish"):
        policy.request(3, 0.0)


def test_registry_and_config_validation() -> None:
    valid = "valid choices: random, ready, smart, static"
    with pytest.raises(ConfigError, match=f"unknown group generator 'clever'; {valid}"):
        make_generator("clever", GeneratorConfig(nproc=2))
    bad: list[tuple[dict[str, Any], str]] = [
        ({"nproc": 0}, "nproc must be an integer >= 1, got 0"),
        ({"nproc": 8, "topology": Topology(3, 2)}, "holds 6 ranks but nproc is 8"),
        ({"nproc": 4, "group_size": 0}, "group_size must be an integer >= 1, got 0"),
        ({"nproc": 4, "delta_c": 0}, "delta_c must be an integer >= 1, got 0"),
        ({"nproc": 4, "window_s": math.inf}, r"window_s must be a finite number of seconds >= 0 \(0: adaptive\), got inf"),
        ({"nproc": 4, "window_s": -0.1}, "got -0.1"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ConfigError, match=message):
            GeneratorConfig(**kwargs)
    with pytest.raises(ConfigError, match="workers_per_node must be an integer >= 1, got 0"):
        Topology(2, 0)
    with pytest.raises(ConfigError, match="sorted and distinct"):
        Group(0, (3, 1))
    # a group pickles and copies as itself, in the compiled build as well
    group = Group(4, (1, 5))
    for twin in (pickle.loads(pickle.dumps(group)), copy.copy(group), copy.deepcopy(group)):
        assert twin == group and type(twin) is Group and twin.members == (1, 5)
    # a group read from a file or a message: a ConfigError for any bad type too, in the compiled build as well
    assert Group.parse(2, [0, 3]) == Group(2, (0, 3)) == Group.formed(2, (0, 3))
    for seq, members, message in [("0", [1], "seq must be an integer"), (True, [1], "seq must be an integer"),
                                  (0, ["1"], "members must be a non-empty list"), (0, 1, "members must be a non-empty"),
                                  (0, [], "members must be a non-empty"), (-1, [1], "seq must be an integer >= 0"),
                                  (0, [2, 2], "sorted and distinct")]:
        with pytest.raises(ConfigError, match=message):
            Group.parse(seq, members)
    assert GeneratorConfig(nproc=6).topo == Topology(1, 6)
    assert GeneratorConfig(nproc=2, group_size=5).group_size == 2
    assert Topology(2, 3).node_of(4) == 1
