"""The sharded Group Generator (``--gg-shards``): parts by whole nodes drawn again every epoch, a ``ready``
generator per part, and the simulator driving the same objects."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prague.algorithms.prague import PragueOptions
from prague.algorithms.prague.runtime import Prague
from prague_testing import wait_gone

from prague.errors import ConfigError
from prague.groups import GeneratorConfig, Topology
from prague.groups.ready import ReadyGenerator
from prague.groups.shards import ShardedGenerator, ShardPlan, ShardView, auto_shards, merged_stats
from prague.simulate.run import SimConfig, simulate


def test_every_worker_has_one_shard_per_epoch_and_a_node_stays_together() -> None:
    topology = Topology(nodes=10, workers_per_node=4)
    plan = ShardPlan(topology, shards=3, epoch_steps=5, seed=7)
    for epoch in range(6):
        parts = [plan.members(s, epoch) for s in range(3)]
        assert sorted(w for part in parts for w in part) == list(range(40))
        assert sorted(len(p) for p in parts) == [12, 12, 16]  # 3, 3 and 4 whole nodes
        for s, part in enumerate(parts):
            for node in range(10):
                inside = [node * 4 + i in part for i in range(4)]
                assert all(inside) or not any(inside), (epoch, s, node)
            for w in part:
                assert plan.shard_of(w, epoch * 5) == plan.shard_of(w, epoch * 5 + 4) == s
    # the parts are drawn again: some worker changes shard between epochs, the same for the same seed
    assert any(plan.shard_of(w, 0) != plan.shard_of(w, 5) for w in range(40))
    again = ShardPlan(topology, shards=3, epoch_steps=5, seed=7)
    assert [again.shard_of(w, 23) for w in range(40)] == [plan.shard_of(w, 23) for w in range(40)]


def test_bad_shard_settings_are_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match="more than the job's 2 node"):
        ShardPlan(Topology(2, 8), shards=3)
    with pytest.raises(ConfigError, match="--gg-shards must be an integer >= 1"):
        ShardPlan(Topology(2, 8), shards=0)
    with pytest.raises(ConfigError, match="--gg-epoch-steps must be an integer >= 1"):
        ShardPlan(Topology(2, 8), shards=2, epoch_steps=0)
    assert auto_shards(16, 2) == 1 and auto_shards(1024, 128) == 4 and auto_shards(16384, 2048) == 64
    assert auto_shards(1024, 2) == 2  # at most one per node


def _drive(policy: ShardedGenerator, workers: int, steps: int, seed: int) -> list[tuple[int, int, tuple[int, ...]]]:
    """Workers asking after each step at random times, the timers polled when due: every answer as
    (worker, seq, members), in order."""
    rng = random.Random(seed)
    clock = [rng.random() * 0.01 for _ in range(workers)]
    step = [0] * workers
    waiting: set[int] = set()
    answers: list[tuple[int, int, tuple[int, ...]]] = []

    def take(got: list) -> None:
        for w, g in got:
            answers.append((w, g.seq, g.members))
            waiting.discard(w)

    now = 0.0
    while any(s < steps for s in step) or waiting:
        ready = [w for w in range(workers) if w not in waiting and step[w] < steps]
        deadline = policy.next_deadline()
        upcoming = min((clock[w] for w in ready), default=float("inf"))
        if deadline is not None and deadline <= upcoming:
            now = max(now, deadline)
            take(policy.poll(now))
            continue
        w = min(ready, key=clock.__getitem__)
        now = max(now, clock[w])
        waiting.add(w)
        take(policy.request(w, now, step[w]))
        step[w] += 1
        clock[w] = now + 0.01 * (1 + 3 * (w == 0)) * (0.8 + 0.4 * rng.random())
    for w in range(workers):
        take(policy.finish(w, now))
    return answers


class _EagerShards:
    """The job's shards each told of a finish or a failure at once, as one service per shard is: what
    :class:`ShardedGenerator`, which tells a shard of a finish only when next asking it, must decide exactly
    as."""

    def __init__(self, config: GeneratorConfig, plan: ShardPlan) -> None:
        self.plan, self.shards, self._asked = plan, [ShardView(config, s, plan.shards) for s in range(plan.shards)], \
            [0] * config.nproc

    def request(self, worker: int, now_s: float, iteration: int | None = None) -> list:
        step = self._asked[worker] if iteration is None else iteration
        self._asked[worker] += 1
        return self.shards[self.plan.shard_of(worker, step)].request(worker, now_s, iteration)

    def finish(self, worker: int, now_s: float) -> list:
        return [a for shard in self.shards for a in shard.finish(worker, now_s)]

    def exclude(self, worker: int, now_s: float) -> list:
        return [a for shard in self.shards for a in shard.exclude(worker, now_s)]

    def poll(self, now_s: float) -> list:
        return [a for shard in self.shards for a in shard.poll(now_s)]

    def next_deadline(self) -> float | None:
        return min((d for d in (s.next_deadline() for s in self.shards) if d is not None), default=None)

    def stats(self) -> dict:
        return merged_stats([s.stats() for s in self.shards], [s.counters.members for s in self.shards])


def _drive_unequal(policy, workers: int, seed: int, failed: int) -> list[tuple[str, int, int, tuple[int, ...]]]:
    """Workers of unequal lengths (5-30 steps) finishing while others still ask, worker ``failed`` excluded
    while it waits, mid-run: every answer as (call, worker, seq, members), in order."""
    rng = random.Random(seed)
    steps = [rng.randint(5, 30) for _ in range(workers)]
    clock = [rng.random() * 0.01 for _ in range(workers)]
    step, waiting, done = [0] * workers, set(), set()
    answers: list[tuple[str, int, int, tuple[int, ...]]] = []

    def take(call: str, got: list) -> None:
        for w, g in got:
            answers.append((call, w, g.seq, g.members))
            waiting.discard(w)

    now = 0.0
    while len(done) < workers:
        ready = [w for w in range(workers) if w not in waiting and w not in done]
        deadline = policy.next_deadline()
        upcoming = min((clock[w] for w in ready), default=float("inf"))
        if deadline is not None and deadline <= upcoming:
            now = max(now, deadline)
            take("poll", policy.poll(now))
            continue
        w = min(ready, key=clock.__getitem__)
        now = max(now, clock[w])
        if step[w] == steps[w]:
            done.add(w)
            take("finish", policy.finish(w, now))
            continue
        waiting.add(w)
        take("request", policy.request(w, now, step[w]))
        step[w] += 1
        clock[w] = now + 0.01 * (1 + 3 * (w % 5 == 0)) * (0.8 + 0.4 * rng.random())
        if w == failed and step[w] >= 8 and w in waiting:  # it fails while it waits for a group
            done.add(w)
            waiting.discard(w)
            answers.append(("failed", w, -1, ()))
            take("exclude", policy.exclude(w, now))
    return answers


@pytest.mark.parametrize("size,shards,window,levels",
                         [(3, 4, 0.05, 1), (2, 4, 0.1, 1), (3, 8, 0.0, 1), (3, 4, 0.05, 2)])
def test_finishes_told_late_decide_as_told_at_once(size: int, shards: int, window: float, levels: int) -> None:
    """The in-process generator tells a shard of a finish only when it next asks it (or at once where the
    finish forms groups: everyone still active waits there); every answer and counter is the same as with
    every shard told at once, including the end, where the last workers are grouped by who is left, and a
    worker failing while it waits."""
    topology = Topology(nodes=8, workers_per_node=4)
    config = GeneratorConfig(nproc=32, topology=topology, group_size=size, seed=5, window_s=window, levels=levels)
    calls = set()
    for seed in range(6):
        plan = ShardPlan(topology, shards=shards, epoch_steps=3, seed=seed)
        lazy, eager = ShardedGenerator(config, plan), _EagerShards(config, plan)
        got = _drive_unequal(lazy, 32, seed, failed=seed + 1)
        assert got == _drive_unequal(eager, 32, seed, failed=seed + 1)
        assert lazy.stats() == eager.stats()
        calls |= {call for call, *_ in got}
    # requests, the window and a finish formed groups (the all-here rule), and a worker failed
    assert {"request", "poll", "finish", "failed"} <= calls


def test_a_shard_remembers_meetings_for_one_round_of_its_own_part() -> None:
    """A shard groups only its part (about nproc / shards workers), so a round of its groups is its part's, not the
    job's: its recency matrix keeps the pairs of that many groups (``ReadyGenerator``'s horizon). With the job's round
    as the horizon, each of the shards kept pairs over the whole job, a matrix of about nproc pairs a shard."""
    topology = Topology(nodes=16, workers_per_node=4)
    config = GeneratorConfig(nproc=64, topology=topology, group_size=2, seed=3, window_s=0.004)
    policy = ShardedGenerator(config, ShardPlan(topology, shards=8, epoch_steps=4, seed=3))
    answers = _drive(policy, 64, 40, seed=4)
    assert len({seq for _, seq, _ in answers}) > 8 * 40  # each shard formed many rounds of groups
    part_round = -(-(64 // 8) // 2)  # 8 workers a shard, pairs: 4 groups a round
    remembered = [len(shard.policy._last_met) for shard in policy.shards]  # type: ignore[attr-defined]
    assert max(remembered) <= part_round and sum(remembered) > 0
    whole = ReadyGenerator(config)  # one generator for the job: its round is the job's
    assert whole.last_met(0, 1) is None and whole._horizon == 32  # type: ignore[attr-defined]


def test_a_finish_is_refused_as_one_shard_refuses_it() -> None:
    topology = Topology(nodes=4, workers_per_node=2)
    policy = ShardedGenerator(GeneratorConfig(nproc=8, topology=topology, group_size=3, seed=1, window_s=0.01),
                              ShardPlan(topology, shards=2, epoch_steps=2, seed=1))
    assert policy.request(0, 0.0, 0) == []
    with pytest.raises(ConfigError, match="worker 0 is waiting for a group"):
        policy.finish(0, 0.001)
    assert policy.finish(5, 0.001) == []
    with pytest.raises(ConfigError, match="worker 5 already called finish"):
        policy.finish(5, 0.002)
    with pytest.raises(ConfigError, match="worker 5 already called finish"):
        policy.request(5, 0.002, 1)  # whichever shard it asks has heard of the finish
    with pytest.raises(ConfigError, match="unknown worker id 9"):
        policy.finish(9, 0.002)


def test_groups_form_inside_one_shard_and_every_request_is_answered_once() -> None:
    topology = Topology(nodes=8, workers_per_node=4)
    config = GeneratorConfig(nproc=32, topology=topology, group_size=3, seed=1, window_s=0.004)
    plan = ShardPlan(topology, shards=4, epoch_steps=3, seed=1)
    policy = ShardedGenerator(config, plan)
    answers = _drive(policy, 32, 30, seed=2)
    assert sorted(w for w, _, _ in answers) == sorted(w for w in range(32) for _ in range(30))
    seqs: dict[int, tuple[int, ...]] = {}
    for _, seq, members in answers:
        assert seqs.setdefault(seq, members) == members  # one seq, one group, across every shard
    # each group's members were served by one shard: the one its seq names
    per_worker_step = {}
    counts = [0] * 32
    for w, seq, members in answers:
        per_worker_step[(w, seq)] = counts[w]
        counts[w] += 1
    for w, seq, members in answers:
        assert plan.shard_of(w, per_worker_step[(w, seq)]) == seq % 4
    assert policy.stats()["shards"] == 4 and policy.stats()["requests"] == 32 * 30
    assert sum(1 for _, _, m in answers if len(m) > 1) > 0.5 * len(answers)


def test_the_parts_mix_over_epochs() -> None:
    """Within an epoch no group crosses parts; over the epochs every worker is connected to every other
    through the groups (what lets the replicas reach consensus)."""
    topology = Topology(nodes=8, workers_per_node=2)
    config = GeneratorConfig(nproc=16, topology=topology, group_size=2, seed=3, window_s=0.004)
    policy = ShardedGenerator(config, ShardPlan(topology, shards=4, epoch_steps=2, seed=3))
    answers = _drive(policy, 16, 40, seed=4)
    parent = list(range(16))

    def root(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for _, _, members in answers:
        for m in members[1:]:
            parent[root(m)] = root(members[0])
    assert len({root(w) for w in range(16)}) == 1


def test_the_simulator_drives_the_same_sharded_objects_and_reports_each_shard() -> None:
    options = {"gg_seed": 0, "group_size": 3, "window_ms": 20.0, "when_busy": "wait", "gg_shards": 4,
               "gg_epoch_steps": 5}
    record = simulate(SimConfig.of(algorithm="prague:ready", scenario="paper:5", nproc=32, nodes=8, steps=30,
                                   model="mlp", seed=3, trace=True, options=options)).to_dict()
    stats = record["algorithm_stats"][0]
    assert stats["gg_shards"] == 4 and len(stats["gg_utilization_per_shard"]) == 4
    assert stats["gg_utilization"] == max(stats["gg_utilization_per_shard"]) > 0
    # the same calls through a fresh sharded generator built from the flags give the same groups
    topology = Topology(8, 4)
    policy = ShardedGenerator(GeneratorConfig(nproc=32, topology=topology, group_size=3, seed=3, window_s=0.020),
                              ShardPlan(topology, 4, 5, seed=3))
    kinds = set()
    for what, worker, t, answers in record["sim"]["trace"]:
        kinds.add(what)
        got = (policy.request(worker, t) if what == "request" else policy.finish(worker, t) if what == "finish"
               else policy.poll_shard(worker, t))
        assert [(w, g.seq, g.members) for w, g in got] == list(answers), (what, worker, t)
    assert {"request", "finish"} <= kinds


def test_sharding_needs_the_ready_generator() -> None:
    with pytest.raises(ConfigError, match="needs the ready generator"):
        simulate(SimConfig.of(algorithm="prague:smart", nproc=8, nodes=4, steps=2, model="mlp",
                              options={"gg_shards": 2}))
    with pytest.raises(ConfigError, match="needs the ready generator"):
        PragueOptions(generator="random", gg_shards=3)


def test_a_job_in_shards_starts_one_service_per_shard(tmp_path: Path) -> None:
    resources = Prague.job_resources(PragueOptions(gg_shards=2, nodes=2), 8, tmp_path)
    names = [spec.name for spec in resources.services]
    assert names == ["group-generator-0", "group-generator-1"]
    for s, spec in enumerate(resources.services):
        argv = list(spec.argv)
        assert argv[argv.index("--shard") + 1] == str(s) and argv[argv.index("--shards") + 1] == "2"
        assert spec.publish_key.endswith(f"/shard{s}")
    # the default: one service up to 256 workers
    assert [spec.name for spec in Prague.job_resources(PragueOptions(nodes=2), 8, tmp_path).services] == \
        ["group-generator"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_real_job_asks_the_shard_the_plan_names_and_survives_a_shard_killed(tmp_path: Path) -> None:
    """4 workers on 2 nodes, 2 shards, the parts drawn again every 5 steps: every group a worker ran came
    from the shard the plan names for it at that step; shard 1, killed mid-run, is started again."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "prague", "run", "--algorithm", "prague", "--nproc", "4", "--nodes", "2",
           "--gg-shards", "2", "--gg-epoch-steps", "5", "--overlap", "off", "--steps", "100", "--compute",
           "emulated", "--compute-ms", "30", "--log-decisions", "--seed", "4", "--out", str(out), "--quiet"]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    try:
        deadline, log = time.monotonic() + 60, out / "decisions" / "rank0.jsonl"
        while not log.exists() or len(log.read_text().splitlines()) < 20:  # mid-run
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[1]
            time.sleep(0.05)
        killed = _services(out)[1]["pid"]
        os.kill(killed, signal.SIGKILL)
        stdout, stderr = launcher.communicate(timeout=150)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.communicate()
    assert launcher.returncode == 0, stderr
    assert "service 'group-generator-1' exited" in stderr, stderr
    records = _services(out)
    assert [r["restarts"] for r in records] == [0, 1] and records[1]["pid"] != killed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed_steps"] == [100] * 4 and summary["failures"] == []
    plan = ShardPlan(Topology(2, 2), 2, 5, seed=4)
    grouped = 0
    for rank in range(4):
        for line in (out / "decisions" / f"rank{rank}.jsonl").read_text().splitlines():
            decision = json.loads(line)
            if decision["kind"] == "group" and decision.get("seq") is not None:
                assert decision["seq"] % 2 == plan.shard_of(rank, decision["step"]), (rank, decision)
                grouped += len(decision["members"]) > 1
    assert grouped > 100
    assert wait_gone(str(out), within_s=10.0) == []


def _services(out: Path) -> list[dict]:
    return json.loads((out / "services.json").read_text())["services"]


def test_the_parts_mix_the_replicas_about_as_well_as_one_generator() -> None:
    """--math mixing: each local step adds unit noise to every worker's vector; averaging keeps them
    together. Without averaging they would spread about sqrt(8 x 100) = 28 apart; one generator and 4
    shards keep them within a few steps' noise, the shards within 1.5x of one generator."""
    got = {}
    for shards in (1, 4):
        record = simulate(SimConfig.of(algorithm="prague:ready", scenario="paper:5", nproc=64, nodes=16, steps=100,
                                       model="mlp", math="mixing", seed=1, options={"gg_shards": shards})).to_dict()
        # the replicas' spread at the last step (the final average over everyone then removes it)
        got[shards] = record["algorithm_stats"][0]["final_average_distance"]
        assert record["consensus_distance"] < 1e-6 * got[shards]
    assert 0 < got[1] < 6 and 0 < got[4] < 1.5 * got[1], got


def test_shards_in_one_process_share_one_list_of_finished_flags() -> None:
    """The in-process generator keeps one list of finished flags for all its shards (not one over the whole job per
    shard): a finish told to one shard is read by every other, an exclusion of a worker already gone changes
    nothing, and the flags cannot be shared once a worker has finished."""
    topology = Topology(nodes=4, workers_per_node=2)
    config = GeneratorConfig(nproc=8, topology=topology, group_size=2, seed=1, window_s=0.01)
    policy = ShardedGenerator(config, ShardPlan(topology, shards=4, epoch_steps=1, seed=2))
    flags = policy.shards[0].policy.finished
    assert all(shard.policy.finished is flags for shard in policy.shards)
    assert policy.finish(3, 0.0) == []
    assert flags[3] and policy.shards[0].policy.active_count == 8  # told when next asked ...
    policy.stats()
    assert {shard.policy.active_count for shard in policy.shards} == {7}  # ... each counting it once
    assert policy.exclude(3, 0.1) == [] and {shard.policy.active_count for shard in policy.shards} == {7}
    with pytest.raises(ConfigError, match="worker 3 already called finish"):
        policy.request(3, 0.2, 5)
    with pytest.raises(ConfigError, match="all unset"):
        policy.shards[1].policy.share_finished([False] * 8)  # its list has a finished worker
    with pytest.raises(ConfigError, match="8 flags"):
        ShardView(config, 0, 2).policy.share_finished([False] * 7)
