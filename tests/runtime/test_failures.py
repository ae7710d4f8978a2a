"""Surviving a dead or hung worker (issue: reliability): leases, the failed set, and whole runs.

A ``crash:RANK:STEP`` worker raises; a ``hang:RANK:STEP`` worker freezes (SIGSTOP) without exiting.
Methods that survive failures (``Method.survives_failures``) train to the end without it and report
it; the others stop, naming the rank. Every run here has a hard timeout and must leave no process.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from prague.algorithms.registry import METHODS
from prague.groups import GeneratorConfig, Group, make_generator
from prague.runtime import liveness
from prague.runtime.liveness import (
    Failure, Heartbeat, LeaseWatch, Membership, PeerFailed, declare_failure, mark_done, read_counters, read_progress,
    wait_settled,
)
from prague_testing import run_cli, wait_gone

pytestmark = pytest.mark.timeout(300)


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def test_lease_expires_once_per_stall_and_rearms_when_the_counter_moves() -> None:
    watch = LeaseWatch(lease_s=2.0)
    assert watch.observe({0: 1, 1: 1}, 0.0) == []
    assert watch.observe({0: 2, 1: 1}, 1.9) == []
    assert watch.observe({0: 3, 1: 1}, 2.0) == [1]  # rank 1 has not moved for 2 s
    assert watch.observe({0: 4, 1: 1}, 9.0) == []  # reported once
    assert watch.observe({0: 4, 1: 2}, 9.5) == []  # rank 1 beats again: a new lease
    assert watch.observe({0: 4, 1: 2}, 11.5) == [0, 1]
    with pytest.raises(ValueError, match="lease_s"):
        LeaseWatch(0.0)


def test_a_worker_that_reported_its_error_gets_time_to_exit_before_its_lease_runs_out() -> None:
    """Its exit code, not a lease, should name a crash whose interpreter takes long to unwind; one that
    reported and then froze is still reported, after the grace."""
    watch = LeaseWatch(lease_s=2.0, exit_grace_s=5.0)
    asked: list[list[int]] = []

    def reported(late: list[int]) -> set[int]:
        asked.append(late)
        return {1} & set(late)

    assert watch.observe({0: 1, 1: 1, 2: 1}, 0.0, reported) == []
    assert watch.observe({0: 1, 1: 1, 2: 2}, 1.9, reported) == [] and asked == []  # no lease ran out: nobody read
    assert watch.observe({0: 1, 1: 1, 2: 3}, 3.0, reported) == [0]  # rank 1 reported: not hung yet
    assert asked == [[0, 1]]  # only the stalled ranks' reports are read
    assert watch.observe({0: 1, 1: 1, 2: 4}, 6.9, reported) == []
    assert watch.observe({0: 1, 1: 1, 2: 5}, 7.0, reported) == [1]  # lease + grace: frozen on its way out
    assert asked[-1] == [1]  # rank 0, reported, is silent until it moves
    with pytest.raises(ValueError, match="exit_grace_s"):
        LeaseWatch(1.0, exit_grace_s=-1.0)


def test_a_worker_that_left_has_no_lease_and_counts_on_if_it_joins_again() -> None:
    """prague.shutdown stops the heartbeat and says so: the seconds its interpreter then takes to exit are
    not a hang; a worker that joins again beats on from there."""
    store = _store()
    beat = Heartbeat(store.clone(), 1, interval_s=0.01)
    time.sleep(0.1)
    assert read_counters(store, [0, 1]).get(1, 0) > 0 and 0 not in read_counters(store, [0, 1])
    beat.leave()
    assert read_counters(store, [1]) == {}
    again = Heartbeat(store.clone(), 1, interval_s=0.01)
    try:
        time.sleep(0.1)
        assert read_counters(store, [1])[1] >= 0
    finally:
        again.leave()


def test_a_worker_that_leaves_publishes_the_steps_it_did_since_its_last_beat() -> None:
    """The job's summary reads each rank's steps from its progress: a worker that finishes and leaves
    within one heartbeat of its last step still has every step counted."""
    store = _store()
    beat = Heartbeat(store.clone(), 2, interval_s=60.0)  # no beat falls between the steps and the leave
    try:
        deadline = time.monotonic() + 10
        while not read_counters(store, [2]) and time.monotonic() < deadline:  # its first beat, at once
            time.sleep(0.01)
        beat.steps = 240
    finally:
        beat.leave()
    assert read_progress(store, [2]) == {2: 240}


def test_first_declaration_wins_and_moves_the_epoch() -> None:
    store = _store()
    view = Membership(store.clone(), 4)
    assert view.failed() == {} and view.epoch == 0
    assert declare_failure(store, Failure(2, 20, "crash", "exit code 1"))
    assert not declare_failure(store, Failure(2, 25, "hang"))  # already declared: kept as it was
    assert view.failed() == {2: Failure(2, 20, "crash", "exit code 1")} and view.epoch == 1
    assert view.failed_among((0, 2, 3)) == [2] and view.failed_among((0, 1)) == []
    assert Failure(2, 20, "crash").summary() == {"rank": 2, "step": 20, "kind": "crash"}


def test_waiting_for_a_member_ends_when_it_is_declared_failed() -> None:
    store = _store()
    view = Membership(store.clone(), 3)
    threading.Timer(0.3, declare_failure, (store.clone(), Failure(1, 4, "hang"))).start()
    t0 = time.monotonic()
    with pytest.raises(PeerFailed, match=r"rank\(s\) \[1\] failed") as info:
        view.wait_keys(store.clone(), ["never/0", "never/1"], (0, 1), timeout_s=30.0, what="handshake",
                       slice_s=0.2)
    assert info.value.ranks == (1,) and time.monotonic() - t0 < 10.0
    # Nobody failed: the wait ends at its timeout with CommError (PeerFailed's base), not PeerFailed.
    with pytest.raises(Exception, match="not every member arrived") as info2:
        view.wait_keys(store.clone(), ["never/2"], (0, 2), timeout_s=0.5, what="handshake", slice_s=0.2)
    assert not isinstance(info2.value, PeerFailed)


def test_a_key_written_before_the_declaration_lets_every_waiter_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """A member that wrote its handshake key and then froze is declared failed: a waiter that looks at
    the failed set after the declaration passes, as one that saw the key first did; so either every
    member passes the handshake or none does. (Its first look runs out, as a slice does when a key
    arrives just after it: the key is there by the time the waiter looks at the failed set.)"""
    original, looks = liveness.await_keys, []

    def first_runs_out(st: dist.Store, keys: list[str], timeout_s: float) -> bool:
        looks.append(1)
        return False if len(looks) == 1 else original(st, keys, timeout_s)

    monkeypatch.setattr(liveness, "await_keys", first_runs_out)
    store = _store()
    view = Membership(store.clone(), 3)
    store.set("hs/0", "x")
    store.set("hs/1", "x")  # rank 1 wrote its key, then froze and was declared
    declare_failure(store, Failure(1, 4, "hang"))
    view.wait_keys(store.clone(), ["hs/0", "hs/1"], (0, 1), timeout_s=30.0, what="handshake", slice_s=0.2)
    assert len(looks) == 1  # it passed on the failed-set look, not on a second look at the keys
    looks.clear()
    with pytest.raises(PeerFailed):  # a key missing with its writer declared failed: nobody passes
        view.wait_keys(store.clone(), ["hs/0", "hs/2"], (0, 1), timeout_s=30.0, what="handshake", slice_s=0.2)


def test_reports_leave_out_the_members_declared_failed_without_one() -> None:
    store = _store()
    view = Membership(store.clone(), 4)
    store.set("end/0", "1")
    store.set("end/2", "0")  # rank 2 reported, then failed: its report still counts
    declare_failure(store, Failure(2, 3, "crash"))
    threading.Timer(0.3, declare_failure, (store.clone(), Failure(3, 3, "hang"))).start()
    threading.Timer(0.5, store.set, ("end/1", "1")).start()
    keys = {r: f"end/{r}" for r in range(4)}
    assert view.wait_reports(store.clone(), keys, timeout_s=30.0, what="outcome", slice_s=0.2) == {
        0: b"1", 1: b"1", 2: b"0"}
    with pytest.raises(Exception, match=r"ranks \[1\] did not report within 0.5 s"):
        view.wait_reports(store.clone(), {0: "end/0", 1: "never/1"}, timeout_s=0.5, what="outcome", slice_s=0.2)


def test_survivors_are_the_done_ranks_once_every_rank_is_done_or_failed() -> None:
    store = _store()
    view = Membership(store.clone(), 3)
    mark_done(store, 0)
    result: list[tuple[int, ...]] = []
    waiter = threading.Thread(target=lambda: result.append(wait_settled(store.clone(), view, 20.0)))
    waiter.start()
    time.sleep(0.2)
    assert not result  # rank 1 and 2 are neither
    declare_failure(store, Failure(1, 3, "crash"))
    mark_done(store, 2)
    waiter.join(20.0)
    assert result == [(0, 2)]


@pytest.mark.parametrize("name", ["smart", "random", "ready"])
def test_an_excluded_worker_is_never_grouped_again(name: str) -> None:
    formed: list[Group] = []
    policy = make_generator(name, GeneratorConfig(nproc=5, group_size=3, seed=1, window_s=0.01),
                            observer=lambda f: formed.append(f.group))
    now = 0.0
    for worker in (0, 1, 2):  # under ready, 2 is left waiting for partners when it fails
        policy.request(worker, now)
    before = len(formed)
    settled = policy.exclude(2, now)
    assert all(w != 2 for w, _ in settled)  # no answer for the failed worker
    assert policy.exclude(2, now) == []  # idempotent
    answered = 0
    for _ in range(30):
        for worker in (0, 1, 3, 4):
            now += 0.001
            answered += len(policy.request(worker, now))
        now += 0.05
        answered += len(policy.poll(now))
    assert answered > 0 and len(formed) > before
    assert all(2 not in g.members for g in formed[before:])
    assert 2 not in policy.active()


def test_the_methods_that_survive_failures() -> None:
    assert {m.name for m in METHODS.values() if m.survives_failures} == {"prague", "dssync", "adpsgd", "eager-sgd"}


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


RUN = ["--nproc", "4", "--steps", "60", "--compute", "emulated", "--compute-ms", "20", "--lease-s", "2", "--quiet"]


# Each surviving method once, crashes and hangs alternating; the other pairs run elsewhere: dssync's crash and
# eager-sgd's hang under torchrun (tests/net), adpsgd's crash on a real model, eager-sgd's crash with hangs below.
@pytest.mark.parametrize("algorithm,fault", [
    ("prague:ready", "crash"), ("prague:ready", "hang"), ("prague:smart", "crash"), ("prague:random", "hang"),
    ("prague:static", "hang"), ("dssync", "hang"), ("adpsgd", "hang"), ("eager-sgd", "crash"),
])
def test_survivors_train_to_the_end(tmp_path: Path, algorithm: str, fault: str) -> None:
    out = tmp_path / "run"
    res = run_cli("run", "--algorithm", algorithm, *RUN, "--slowdown", f"{fault}:2:20", "--out", str(out),
                  timeout_s=150)
    assert res.returncode == 0, res.stderr
    assert "warning: rank 2" in res.stderr and ("crashed" in res.stderr if fault == "crash" else "hung" in res.stderr
                                                or "stopped making progress" in res.stderr)
    summary = _summary(out)
    assert summary["failures"] == [{"rank": 2, "step": 20, "kind": fault}]
    assert summary["completed_steps"] == [60, 60, 20, 60]
    assert len(summary["algorithm_stats"]) == 3 and summary["ranks"] == [0, 1, 3]  # the survivors'
    assert wait_gone(str(out), within_s=10.0) == []
    if algorithm.startswith("prague"):  # the simulator plays the same scenario out: the same failure
        from prague.simulate.run import SimConfig, simulate

        simulated = simulate(SimConfig.of(algorithm=algorithm, nproc=4, steps=60, compute="emulated", compute_ms=20,
                                          lease_s=2.0, scenario=f"{fault}:2:20")).to_dict()
        assert simulated["failures"] == summary["failures"]
        assert simulated["completed_steps"] == summary["completed_steps"]


def test_prague_blocking_survives_a_hang_too(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = run_cli("run", "--algorithm", "prague:ready", "--overlap", "off", *RUN, "--slowdown", "hang:1:10",
                  "--out", str(out), timeout_s=150)
    assert res.returncode == 0, res.stderr
    summary = _summary(out)
    assert summary["failures"] == [{"rank": 1, "step": 10, "kind": "hang"}]
    assert summary["completed_steps"] == [60, 10, 60, 60]
    assert wait_gone(str(out), within_s=10.0) == []


def test_a_member_frozen_between_handshake_and_rendezvous_does_not_hold_the_others(tmp_path: Path) -> None:
    """With real steps of about a millisecond, rank 2's background averager often passes a group's
    handshake and is frozen before the backend's rendezvous; the other members then wait in the store
    for its address. They must give up once it is declared failed, not after the 300 s timeout."""
    out = tmp_path / "run"
    res = run_cli("run", "--algorithm", "prague:random", "--nproc", "4", "--steps", "60", "--model", "mlp", "--data",
                  "digits", "--slowdown", "hang:2:20", "--lease-s", "2", "--out", str(out), "--quiet", timeout_s=120)
    assert res.returncode == 0, res.stderr
    summary = _summary(out)
    assert summary["failures"] == [{"rank": 2, "step": 20, "kind": "hang"}]
    assert summary["completed_steps"] == [60, 60, 20, 60]
    assert wait_gone(str(out), within_s=10.0) == []


def test_survivors_average_a_real_model(tmp_path: Path) -> None:
    """Real training on digits: the survivors' averaged model is evaluated and saved."""
    out = tmp_path / "run"
    res = run_cli("run", "--algorithm", "prague", "--nproc", "4", "--steps", "40", "--slowdown", "crash:3:10",
                  "--model", "mlp", "--data", "digits", "--save-model", "--lease-s", "2", "--out", str(out),
                  "--quiet", timeout_s=150)
    assert res.returncode == 0, res.stderr
    summary = _summary(out)
    assert summary["failures"] == [{"rank": 3, "step": 10, "kind": "crash"}]
    assert summary["test_accuracy"] > 0.5 and (out / "model.pt").exists()


def test_adpsgd_survives_failed_passives_and_actives_on_a_real_model(tmp_path: Path) -> None:
    """Rank 1 (passive) crashes, rank 0 (active) hangs: the other active averages with passive 3 only,
    passive 3 stops waiting for rank 0's goodbye, and the survivors' model is evaluated."""
    out = tmp_path / "run"
    res = run_cli("run", "--algorithm", "adpsgd", "--nproc", "4", "--steps", "50", "--model", "mlp", "--data",
                  "digits", "--slowdown", "crash:1:10+hang:0:20", "--lease-s", "2", "--out", str(out), "--quiet",
                  timeout_s=150)
    assert res.returncode == 0, res.stderr
    summary = _summary(out)
    assert sorted(summary["failures"], key=lambda f: f["rank"]) == [{"rank": 0, "step": 20, "kind": "hang"},
                                                                   {"rank": 1, "step": 10, "kind": "crash"}]
    assert summary["completed_steps"] == [20, 10, 50, 50] and summary["ranks"] == [2, 3]
    active, passive = summary["algorithm_stats"]
    assert active["role"] == "active" and set(active["peers"]) <= {"1", "3"}
    assert active["requests_initiated"] == 50  # every step averaged with a live passive: none was lost
    assert passive["role"] == "passive" and passive["requests_served"] > 0
    assert summary["test_accuracy"] > 0.5
    assert wait_gone(str(out), within_s=10.0) == []


@pytest.mark.parametrize("quorum,faults", [("majority", "crash:0:12"), ("solo", "crash:1:15+hang:3:40")])
def test_eager_sgd_survivors_keep_identical_replicas(tmp_path: Path, quorum: str, faults: str) -> None:
    """The survivors resume the rounds on a communicator of their own: every one applies the same
    results, so their replicas stay equal, and each recovery is counted on every survivor."""
    out = tmp_path / "run"
    res = run_cli("run", "--algorithm", "eager-sgd", "--quorum", quorum, "--nproc", "4", "--steps", "60",
                  "--model", "mlp", "--data", "digits", "--slowdown", faults, "--lease-s", "2", "--out", str(out),
                  "--quiet", timeout_s=150)
    assert res.returncode == 0, res.stderr
    summary = _summary(out)
    failed = {f["rank"] for f in summary["failures"]}
    assert len(failed) == faults.count("+") + 1
    assert all(summary["completed_steps"][r] == 60 for r in range(4) if r not in failed)
    stats = summary["algorithm_stats"]
    assert [s["recoveries"] for s in stats] == [len(failed)] * (4 - len(failed))
    assert all(s["rounds"] == 61 for s in stats)  # a round that broke on one survivor only was sent to it
    assert summary["consensus_distance"] < 1e-4  # one sequence of results: the replicas agree
    assert summary["test_accuracy"] > 0.5
    assert wait_gone(str(out), within_s=10.0) == []


@pytest.mark.parametrize("fault", ["crash", "hang"])
def test_allreduce_cannot_go_on_and_says_which_rank(tmp_path: Path, fault: str) -> None:
    out = tmp_path / "run"
    t0 = time.monotonic()
    res = run_cli("run", "--algorithm", "allreduce", *RUN, "--steps", "100000", "--slowdown", f"{fault}:2:20",
                  "--out", str(out), timeout_s=120)
    assert res.returncode == 1
    assert "rank 2" in res.stderr
    if fault == "hang":
        assert "stopped making progress" in res.stderr
    assert time.monotonic() - t0 < 60.0
    assert wait_gone(str(out), within_s=10.0) == []


def test_services_json_names_each_service_with_its_pid_and_address(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = run_cli("run", "--algorithm", "prague:smart", "--nproc", "2", "--steps", "5", "--data", "synthetic",
                  "--out", str(out), "--quiet", timeout_s=120)
    assert res.returncode == 0, res.stderr
    listed = json.loads((out / "services.json").read_text())
    (gg,) = listed["services"]
    assert gg["name"] == "group-generator" and gg["restarts"] == 0
    host, port = gg["address"].rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0 and isinstance(gg["pid"], int)
    assert not Path(f"/proc/{gg['pid']}").exists() or "prague.groups.service" not in Path(
        f"/proc/{gg['pid']}/cmdline").read_bytes().decode(errors="replace")  # stopped with the run
    # A method without services writes none (and a stale one is not left behind).
    res = run_cli("run", "--algorithm", "allreduce", "--nproc", "2", "--steps", "3", "--data", "synthetic",
                  "--out", str(out), "--quiet", timeout_s=120)
    assert res.returncode == 0, res.stderr
    assert not (out / "services.json").exists()


def test_speed_report_names_the_slow_ranks() -> None:
    from prague.metrics.summary import speed_report

    text = speed_report([0, 1, 3], [320.0, 300.0, 100.0], [0.05, 0.05, 0.15], [0.0] * 3, [0.01, 0.02, 0.0], 32)
    assert "slowest: rank 3 (0.33x)" in text and "rank 0" not in text.splitlines()[-1]
    even = speed_report([0, 1], [320.0, 300.0], [0.05, 0.05], [0.0, 0.0], [0.0, 0.0], 32)
    assert "no worker below 90%" in even
    # lockstep (all-reduce): equal rates, but rank 2's compute made the others wait in communication
    lockstep = speed_report([0, 1, 2], [16.0] * 3, [0.05, 0.05, 2.0], [1.95, 1.95, 0.0], [0.0] * 3, 32)
    assert "slowest: rank 2 (0.03x) of the median worker's compute speed" in lockstep


def test_run_prints_the_speed_report_naming_the_straggler(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = run_cli("run", "--algorithm", "prague:ready", "--nproc", "3", "--steps", "30", "--compute", "emulated",
                  "--compute-ms", "20", "--slowdown", "straggler:1:4", "--out", str(out), "--quiet", timeout_s=120)
    assert res.returncode == 0, res.stderr
    assert "steps/s" in res.stdout and "slowest: rank 1 (" in res.stdout, res.stdout
    summary = _summary(out)
    assert summary["ranks"] == [0, 1, 2] and len(summary["worker_samples_per_s"]) == 3
    assert summary["worker_samples_per_s"][1] < 0.5 * min(summary["worker_samples_per_s"][0],
                                                             summary["worker_samples_per_s"][2])


GUARDED_SCRIPT = Path(__file__).with_name("guarded_script.py")


def test_prague_launch_keeps_a_scripts_own_loop_going_when_its_method_survives(tmp_path: Path) -> None:
    """``prague launch`` learns from the script's workers, when they prepare the method, whether it goes
    on without a failed worker (a method that does not stops the job, as every launch test of a failing
    script shows): prague does, and the Group Generator rank 0's script started is started again by
    rank 1."""
    rank = 0
    res = run_cli("launch", "--nproc", "3", "--echo-all", "--log-dir", str(tmp_path), str(GUARDED_SCRIPT), "prague",
                  "30", f"kill:{rank}:10", timeout_s=150)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"warning: rank {rank} crashed" in res.stderr, res.stderr[-3000:]
    assert "rank 1 starts the Group Generator again: its host, rank 0, failed" in res.stdout + res.stderr
    assert all(f"rank {r} done 30" in res.stdout for r in range(3) if r != int(rank)), res.stdout
    # the script's service is listed beside the logs (by rank 1, its new host, last)
    listed = json.loads((tmp_path / "services.json").read_text())["services"]
    assert [s["name"] for s in listed] == ["group-generator"], listed


def test_the_leaders_in_turn_follow_the_order_in_which_failures_were_declared() -> None:
    store = dist.HashStore()
    assert liveness.leaders_in_turn(store, 5) == [0]
    for rank in (2, 0, 1, 4):  # a follower, the leader, the next leader, a follower
        assert liveness.declare_failure(store, liveness.Failure(rank, 3, "crash"))
    assert not liveness.declare_failure(store, liveness.Failure(0, 4, "hang"))  # declared once
    assert liveness.leaders_in_turn(store, 5) == [0, 1, 3]
    summary = liveness.job_summary(5, None, [1, 1, 1, 0, 1], [3, 3, 3, 9, 3],
                                   liveness.Membership(store, 5).failed(), [0, 1, 3])
    assert summary["ok"] and summary["ranks"] == [3] and [f["rank"] for f in summary["failures"]] == [0, 1, 2, 4]


def test_a_failure_rate_crashes_the_rank_whose_failure_time_comes_first(tmp_path: Path) -> None:
    """``failures:P``: a seed under which exactly one of 4 ranks fails 1-2.5 s into a job of about 4.5 s (the
    draws are the scenario's own; the others' fall after 9 s); that rank crashes at the first step after it,
    the others go on to the end."""
    from prague.hetero.spec import parse_scenario

    def early(seed: int) -> list[int]:
        drawn = parse_scenario("failures:0.9999", seed=seed)
        return [r for r in range(4) if drawn.failure_time_s(r) < 9.0]

    seed = next(s for s in range(5000) if len(early(s)) == 1
                and 1.0 < parse_scenario("failures:0.9999", seed=s).failure_time_s(early(s)[0]) < 2.5)
    rank = early(seed)[0]
    out = tmp_path / "run"
    res = run_cli("run", "--algorithm", "prague", "--nproc", "4", "--steps", "150", "--compute", "emulated",
                  "--compute-ms", "30", "--lease-s", "2", "--slowdown", "failures:0.9999", "--seed", str(seed),
                  "--out", str(out), "--quiet", timeout_s=150)
    assert res.returncode == 0, res.stderr
    summary = _summary(out)
    assert [(f["rank"], f["kind"]) for f in summary["failures"]] == [(rank, "crash")]
    steps = summary["completed_steps"]
    assert 0 < steps[rank] < 150 and [s for r, s in enumerate(steps) if r != rank] == [150] * 3
    assert wait_gone(str(out), within_s=10.0) == []
