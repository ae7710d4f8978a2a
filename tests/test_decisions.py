"""A real run and the simulator make the same decisions, from the same flags and seed.

Every worker of ``prague run --log-decisions`` writes its decisions to ``OUT/decisions/rankR.jsonl``;
``prague simulate --log-decisions`` writes the same files for its simulated workers
(``OUT/runs/<method>_<scenario>/decisions/``). The runs use ``--seed 7``: a seed that did not reach a
worker, a service or the simulator would show up as different decisions.

* ``prague:static``, ``dssync``, ``adpsgd`` and ``ps:sync`` decide from the seed alone: every rank's
  real log equals its simulated log, line for line.
* ``prague:smart|random|ready`` and ``ps:async``/``ps-eager`` decide from the order in which workers
  reach the Group Generator or a shard, which differs between a real run and a simulation. The real
  services write that order (``gg.jsonl``: every policy call with its time; ``ps-shardK.jsonl``: every
  push in the order the shard handled it). Replayed through the simulator's own decision objects, built
  from the same flags (the policy :class:`~prague.algorithms.prague.sim.SimPrague` builds, a fresh
  :class:`~prague.algorithms.ps.sim.Shards`), the order must give exactly the answers the service
  gave, and those answers must be exactly what every real worker logged.

The multi-process tests are marked ``slow`` (about 10 s each on 2 cores).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from prague.algorithms.ps.protocol import Layout
from prague.algorithms.ps.server import ShardState
from prague.cli import build_parser, main
from prague.errors import ConfigError
from prague.groups import GeneratorConfig, make_generator
from prague.groups.service import GroupGeneratorCore
from prague.groups.trace import PolicyCall, replay
from prague.io import JsonLines, read_json_lines
from prague.metrics.decisions import (
    DECISIONS_DIR, Decision, DecisionLog, ShardPush, gg_trace_path, rank_path, read_decisions, read_shard_trace,
    shard_trace_path,
)
from prague.simulate.cli import cluster_from_args, sim_config
from prague.simulate.run import SimConfig, build
from prague.train.config import RunConfig, config_from_args, read_job, run_folder, write_job
from prague_testing import processes_mentioning, run_cli

NPROC, STEPS, SEED = 4, 6, 7
FLAGS = ["--nproc", str(NPROC), "--steps", str(STEPS), "--compute", "emulated", "--compute-ms", "5",
         "--data", "digits", "--model", "mlp", "--seed", str(SEED), "--log-decisions", "--quiet"]


# -- helpers ----------------------------------------------------------------------------------------

def _wait_gone(marker: str, within_s: float = 15.0) -> list[int]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and processes_mentioning(marker):
        time.sleep(0.2)
    return processes_mentioning(marker)


def _real(out: Path, algorithm: str, options: Sequence[str]) -> Path:
    """``prague run`` with :data:`FLAGS`; the decisions folder. No process of the run may be left."""
    res = run_cli("run", "--algorithm", algorithm, *FLAGS, *options, "--out", str(out), timeout_s=150)
    assert res.returncode == 0, res.stderr
    assert _wait_gone(str(out)) == [], "processes of the run are still alive"
    return out / DECISIONS_DIR


def _simulated(out: Path, algorithm: str, options: Sequence[str], scenario: str = "homogeneous") -> Path:
    """``prague simulate`` (in this process) with the same flags; the run's decisions folder."""
    assert main(["simulate", "--algorithms", algorithm, "--scenarios", scenario, *FLAGS, *options,
                 "--out", str(out)]) == 0
    return run_folder(out, algorithm, scenario) / DECISIONS_DIR


def _sim_config(algorithm: str, options: Sequence[str]) -> SimConfig:
    """The simulator's configuration of these flags, exactly as ``prague simulate`` builds it (no log)."""
    args = build_parser().parse_args(["simulate", "--algorithms", algorithm, *FLAGS, *options])
    run = config_from_args(args, algorithm=algorithm, scenario="homogeneous", nproc=args.nproc, out=Path("unused"))
    return dataclasses.replace(sim_config(run, cluster=cluster_from_args(args), math_mode="none", nodes=1),
                               decisions=None)


def _logs(folder: Path) -> list[list[Decision]]:
    return [read_decisions(rank_path(folder, r)) for r in range(NPROC)]


def _gg_trace(folder: Path) -> list[PolicyCall]:
    return [PolicyCall.from_dict(d) for d in read_json_lines(gg_trace_path(folder))]


def _groups_handed_out(calls: list[PolicyCall]) -> list[list[Decision]]:
    """What each worker's log must hold, given the policy's calls: the group of a worker's i-th request is
    logged as step i (its i-th average; the same as its step when it asked every step); those it still
    gets at its finish run after its last step (step STEPS)."""
    requests = [sum(1 for c in calls if c.call == "request" and c.worker == w) for w in range(NPROC)]
    logs: list[list[Decision]] = [[] for _ in range(NPROC)]
    for call in calls:
        for w, group in call.answers:
            i = len(logs[w])
            logs[w].append(Decision.of_group(i if i < requests[w] else STEPS, group.members, group.seq))
    return logs


def _pushes_answered(traces: list[list[ShardPush]]) -> list[list[Decision]]:
    """What each worker's log must hold, given every shard's trace: per step, one line per shard."""
    logs: list[list[Decision]] = [[] for _ in range(NPROC)]
    for shard, trace in enumerate(traces):
        for p in trace:
            logs[p.worker].append(Decision.of_push(p.step, shard, p.tau, p.scale, p.accepted))
    return [sorted(log, key=lambda d: (d.step, d.shard)) for log in logs]


def _replay_shard(config: SimConfig, trace: list[ShardPush]) -> list[ShardPush]:
    """Push in the recorded order, with the recorded base versions, through the simulator's shards."""
    world, method = build(config)
    out = []
    for p in trace:
        a = method.shards.push_async(world, p.worker, None, p.base_version, world.engine.now, p.step)
        out.append(ShardPush(p.worker, p.step, p.base_version, a.tau, a.scale, a.accepted, a.version))
    return out


def _shard_traces(folder: Path, shards: int) -> list[list[ShardPush]]:
    return [read_shard_trace(shard_trace_path(folder, k)) for k in range(shards)]


# -- the record, the files and the services' traces, in one process ---------------------------------

def test_decisions_are_one_json_line_each_without_unused_fields(tmp_path: Path) -> None:
    decisions = [Decision.of_group(0, (0, 2, 3), 5), Decision.of_group(1, (1, 3)), Decision.of_partner(2, 3),
                 Decision.of_push(3, 1, 4, 1 / 3, True), Decision.of_push(4, 0, 9, 0.0, False)]
    with DecisionLog(tmp_path, 2) as log:
        for d in decisions:
            log.write(d)
        assert len(rank_path(tmp_path, 2).read_text().splitlines()) == len(decisions)  # on disk at once
    lines = [json.loads(line) for line in rank_path(tmp_path, 2).read_text().splitlines()]
    assert lines[0] == {"step": 0, "kind": "group", "members": [0, 2, 3], "seq": 5}
    assert lines[1] == {"step": 1, "kind": "group", "members": [1, 3]}
    assert lines[2] == {"step": 2, "kind": "partner", "partner": 3}
    assert lines[3] == {"step": 3, "kind": "push", "shard": 1, "tau": 4, "scale": 1 / 3, "accepted": True}
    assert read_decisions(rank_path(tmp_path, 2)) == decisions
    with DecisionLog(tmp_path, 2):  # a new run's log starts empty
        pass
    assert read_decisions(rank_path(tmp_path, 2)) == []
    with pytest.raises(ValueError, match="group, partner, push"):
        Decision(0, "nosuch")


def test_the_flag_is_a_run_setting_the_workers_read_from_the_job(capsys: pytest.CaptureFixture[str],
                                                                 tmp_path: Path) -> None:
    assert RunConfig().log_decisions is False
    for on in (False, True):
        job = write_job(RunConfig(out=tmp_path, log_decisions=on))
        assert read_job(job).log_decisions is on
    for command in ("run", "worker", "bench", "simulate"):
        args = build_parser().parse_args([command, "--log-decisions"])
        assert args.log_decisions is True
        with pytest.raises(SystemExit) as exit_:
            main([command, "--help"])
        assert exit_.value.code == 0 and "--log-decisions" in capsys.readouterr().out


def test_service_trace_replays_through_a_fresh_policy(tmp_path: Path) -> None:
    config = GeneratorConfig(nproc=NPROC, group_size=2, seed=SEED)
    now = [0.0]
    core = GroupGeneratorCore(make_generator("smart", config), clock=lambda: now[0])
    path = tmp_path / "gg.jsonl"
    try:
        core.trace_to(path)
        core.trace_to(path)  # every worker asks; the same path is fine
        with pytest.raises(ConfigError, match="already writes its trace"):
            core.trace_to(tmp_path / "other.jsonl")
        for k in range(5):
            for w in (3, 0, 2, 1) if k % 2 else (1, 2, 0, 3):
                now[0] += 0.001
                core.get_group(w, k)
        for w in range(NPROC):
            core.finish(w)
    finally:
        core.stop()
    trace = [PolicyCall.from_dict(d) for d in read_json_lines(path)]
    assert [c.call for c in trace] == ["request"] * 20 + ["finish"] * NPROC
    assert trace[0].now_s == pytest.approx(0.001)
    assert replay(make_generator("smart", config), trace) == trace
    assert replay(make_generator("smart", dataclasses.replace(config, seed=SEED + 1)), trace) != trace


def test_shard_trace_replays_through_the_simulated_shards(tmp_path: Path) -> None:
    """The real shard's rules (:class:`ShardState`) against the simulator's (:class:`Shards`), push by push."""
    layout = Layout(total=4, n_params=4, lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False)
    trace_file = JsonLines(tmp_path / "ps-shard0.jsonl")
    state = ShardState("async", 3, 0, 4, layout, staleness_lr="inverse", max_staleness=3, trace=trace_file)
    out = torch.empty(4)
    seen = [0, 0, 0]
    for step, w in enumerate([0, 1, 2, 0, 0, 0, 1, 2, 2, 1]):  # worker 1 and 2 fall behind: stale, rejected
        reply = state.push(w, seen[w], torch.ones(4), out, step)
        seen[w] = reply.version
    trace_file.close()
    trace = read_shard_trace(tmp_path / "ps-shard0.jsonl")
    assert len(trace) == 10 and not all(p.accepted for p in trace) and len({p.scale for p in trace}) > 2
    config = SimConfig.of(algorithm="ps:async", nproc=3, steps=4, model="mlp",
                       options={"staleness_lr": "inverse", "max_staleness": 3})
    assert _replay_shard(config, trace) == trace


def test_simulate_writes_the_logs_of_a_run_beside_its_services_traces(tmp_path: Path) -> None:
    """``prague simulate --log-decisions``: the run's folder, and logs that follow the traces as a real
    run's must (with slowdowns, so the ready window expires and polls show up in the trace)."""
    ready = _simulated(tmp_path, "prague:ready", ["--group-size", "2", "--window-ms", "2"], scenario="paper:5")
    assert ready == tmp_path / "runs" / "prague-ready_paper-5" / "decisions"
    calls = _gg_trace(ready)
    assert {c.call for c in calls} == {"request", "poll", "finish"}
    assert _logs(ready) == _groups_handed_out(calls)
    _, method = build(_sim_config("prague:ready", ["--group-size", "2", "--window-ms", "2"]))
    assert replay(method.policy, calls) == calls

    pushes = _simulated(tmp_path, "ps:async", ["--ps-shards", "2"], scenario="paper:5")
    traces = _shard_traces(pushes, 2)
    assert traces[0] == traces[1]  # the simulator's shards share one order
    assert _logs(pushes) == _pushes_answered(traces)


def test_without_the_flag_nothing_is_logged(tmp_path: Path) -> None:
    world, method = build(SimConfig.of(algorithm="prague:smart", nproc=4, steps=3, model="mlp"))
    assert world.decisions is None and world.decision_dir is None
    assert main(["simulate", "--algorithms", "dssync", "--scenarios", "homogeneous", "--nproc", "4", "--steps", "3",
                 "--model", "mlp", "--quiet", "--out", str(tmp_path)]) == 0
    assert not list(tmp_path.rglob(DECISIONS_DIR))


# -- real runs against the simulator ---------------------------------------------------------------

EXACT = {
    "prague:static": ["--nodes", "2"],
    "dssync": ["--group-size", "2"],
    "adpsgd": [],
    "ps:sync": ["--ps-shards", "2"],
}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("algorithm", sorted(EXACT))
def test_real_workers_log_what_simulated_workers_log(algorithm: str, tmp_path: Path) -> None:
    options = EXACT[algorithm]
    real = _logs(_real(tmp_path / "real", algorithm, options))
    simulated = _logs(_simulated(tmp_path / "sim", algorithm, options))
    for rank in range(NPROC):
        assert real[rank] == simulated[rank], f"rank {rank}"
    lines = [len(log) for log in real]
    if algorithm == "adpsgd":  # even ranks are active: one partner per step; passives decide nothing
        assert lines == [STEPS, 0, STEPS, 0]
        assert len({d.partner for log in real for d in log}) == 2  # both passives were chosen
    elif algorithm == "ps:sync":
        assert lines == [2 * STEPS] * NPROC
        assert {(d.tau, d.scale, d.accepted) for log in real for d in log} == {(0, 1.0, True)}
    else:
        assert lines == [STEPS] * NPROC
        assert len({d.members for log in real for d in log}) > 1  # the groups change from step to step


REPLAYED_GROUPS = {
    "prague:smart": ["--group-size", "2", "--threshold", "time"],  # its decisions read the times the trace records
    "prague:random": ["--group-size", "2"],
    "prague:ready": ["--group-size", "2", "--window-ms", "20"],
}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("algorithm", sorted(REPLAYED_GROUPS))
def test_real_groups_replay_through_the_simulator_policy(algorithm: str, tmp_path: Path) -> None:
    options = REPLAYED_GROUPS[algorithm]
    folder = _real(tmp_path / "real", algorithm, options)
    calls = _gg_trace(folder)
    # One request per step, except the steps a worker took locally while its average was still out.
    skipped = [w["busy_local_steps"] for w in json.loads((folder.parent / "summary.json").read_text())["algorithm_stats"]]
    assert sum(c.call == "request" for c in calls) == NPROC * STEPS - sum(skipped)
    assert sorted(c.worker for c in calls if c.call == "finish") == list(range(NPROC))
    _, method = build(_sim_config(algorithm, options))
    assert replay(method.policy, calls) == calls  # the simulator's policy answers every call as the service did
    real = _logs(folder)
    assert real == _groups_handed_out(calls)  # and every worker ran exactly the groups it was handed
    assert all(len(log) >= STEPS - skipped[w] for w, log in enumerate(real))
    assert len({d.members for log in real for d in log}) > 1


REPLAYED_PUSHES = {
    "ps:async": ["--ps-shards", "2", "--max-staleness", "4"],
    "ps-eager": ["--max-staleness", "6"],
}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("algorithm", sorted(REPLAYED_PUSHES))
def test_real_pushes_replay_through_the_simulated_shards(algorithm: str, tmp_path: Path) -> None:
    options = REPLAYED_PUSHES[algorithm]
    shards = 2 if "--ps-shards" in options else 1
    folder = _real(tmp_path / "real", algorithm, options)
    traces = _shard_traces(folder, shards)
    config = _sim_config(algorithm, options)
    for trace in traces:
        assert sorted((p.worker, p.step) for p in trace) == [(w, k) for w in range(NPROC) for k in range(STEPS)]
        assert _replay_shard(config, trace) == trace  # same tau, scale, acceptance and version, push by push
    assert _logs(folder) == _pushes_answered(traces)  # what every worker logged is what its shards answered
    assert any(p.tau > 0 for trace in traces for p in trace)
