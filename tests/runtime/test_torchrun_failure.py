"""Workers that fail under torchrun. A method that needs every rank (``allreduce``): torchrun stops the job
in bounded time, exits non-zero naming the rank, and nothing is left behind; with ``--max-restarts`` it
restarts from the last checkpoint, after a crash or a hang that the rank's guard detects. A method that goes on without a failed worker: each rank's guard
(:mod:`prague.runtime.guard`) declares its crashed or hung worker failed and the others finish.

Runs torchrun as ``python -m torch.distributed.run`` with this interpreter."""

from __future__ import annotations

import json
import os
import re
import sys
import uuid
from pathlib import Path

import pytest

from prague_testing import processes_of_session, run_command

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]


def test_a_crashing_worker_under_torchrun_fails_the_job_naming_its_rank(tmp_path: Path) -> None:
    # allreduce cannot go on without a worker (prague would: each rank's guard keeps the job going)
    out, case = tmp_path / "crash", uuid.uuid4().hex  # every process of this job carries ``case``
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "prague", "worker", "--algorithm", "allreduce", "--steps", "100000", "--slowdown", "crash:1:5",
           "--compute", "emulated", "--compute-ms", "10", "--data", "synthetic", "--out", str(out)]
    # Bounded by the hard timeout: rank 0 must be stopped, not waited for (100000 steps).
    res = run_command(cmd, timeout_s=150, env={"OMP_NUM_THREADS": "1", "PRAGUE_TEST_CASE": case})
    assert res.returncode != 0
    assert "InjectedCrash" in res.stderr and "[rank 1] Traceback" in res.stderr, res.stderr[-3000:]
    # torchrun's report lists rank 1 (rank 0's collective breaks in the same second, so either may be
    # named the root cause: torchrun orders failures by time)
    report = res.stderr[res.stderr.index("prague FAILED"):]
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)\n\s*exitcode\s*:\s*1", report), res.stderr[-3000:]
    assert processes_of_session(case, within_s=10.0, kill=True) == []
    assert not (out / "summary.json").exists()


# allreduce's crash restarts on two emulated machines (tests/net): here its hang, and a parameter server's crash
@pytest.mark.parametrize("algorithm,fault", [("ps-eager", "crash:1:20"), ("allreduce", "hang:1:20")])
def test_torchrun_restarts_a_method_that_needs_every_rank_from_its_last_checkpoint(tmp_path: Path, algorithm: str,
                                                                                   fault: str) -> None:
    # The fault fires once per job: the restarted attempt resumes at step 20, where it fired, and goes on.
    # A hang is found by rank 1's guard within --lease-s (not the 300 s communication timeout), which kills
    # the worker and fails, so that torchrun restarts the job.
    out, case = tmp_path / "restart", uuid.uuid4().hex
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
           "-m", "prague", "worker", "--algorithm", algorithm, "--steps", "40", "--checkpoint-every", "10",
           "--slowdown", fault, "--lease-s", "2", "--compute", "emulated", "--compute-ms", "10", "--quiet",
           "--out", str(out)]
    res = run_command(cmd, timeout_s=150, env={"OMP_NUM_THREADS": "1", "PRAGUE_TEST_CASE": case})
    assert res.returncode == 0, res.stderr[-4000:]
    if fault.startswith("crash"):
        assert res.stderr.count("InjectedCrash: injected crash of rank 1 at step 20") == 1, res.stderr[-4000:]
    else:
        assert res.stderr.count("error: rank 1 stopped making progress") == 1, res.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["completed_steps"] == [40, 40] and summary["failures"] == []
    steps = [json.loads(line)["step"] for line in (out / "metrics" / "rank1.jsonl").read_text().splitlines()]
    assert steps == list(range(40))  # the checkpoint's 20 steps, then the resumed attempt's 20
    if algorithm.startswith("ps"):  # rank 0's guard runs the shards, as prague run's launcher does
        services = json.loads((out / "services.json").read_text())["services"]
        assert [s["name"] for s in services] == ["ps-shard-0"] and services[0]["pid"] > 0
    assert processes_of_session(case, within_s=10.0, kill=True) == []


# crash:0:20 is the crash case, of the rank whose guard runs the Group Generator: the harder one
# adpsgd's survivors under torchrun: test_prague_guard_keeps_a_scripts_own_loop_going_without_a_failed_worker
@pytest.mark.parametrize("algorithm,fault", [("prague:smart", "hang:1:20"), ("prague", "crash:0:20")])
def test_under_torchrun_the_others_go_on_without_a_failed_worker(tmp_path: Path, algorithm: str, fault: str) -> None:
    # crash:0:20 kills the worker of the rank whose guard runs the Group Generator: the service lives on
    out, case = tmp_path / "survive", uuid.uuid4().hex
    kind, rank, _ = fault.split(":")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           "-m", "prague", "worker", "--algorithm", algorithm, "--steps", "40", "--slowdown", fault, "--lease-s", "2",
           "--compute", "emulated", "--compute-ms", "10", "--quiet", "--out", str(out)]
    res = run_command(cmd, timeout_s=150, env={"OMP_NUM_THREADS": "1", "PRAGUE_TEST_CASE": case})
    assert res.returncode == 0, res.stderr[-4000:]
    assert f"warning: rank {rank} " in res.stderr, res.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failures"] == [{"rank": int(rank), "step": 20, "kind": kind}]
    assert summary["completed_steps"] == [20 if r == int(rank) else 40 for r in range(3)]
    assert summary["ranks"] == [r for r in range(3) if r != int(rank)]
    if algorithm.startswith("prague"):  # rank 0's guard started it and wrote where it runs
        services = json.loads((out / "services.json").read_text())["services"]
        assert [s["name"] for s in services] == ["group-generator"]
    assert processes_of_session(case, within_s=10.0, kill=True) == []


GUARDED_SCRIPT = Path(__file__).with_name("guarded_script.py")


@pytest.mark.parametrize("algorithm,fault", [("prague", "kill:0:10"), ("adpsgd", "hang:2:10"),
                                             ("allreduce", "crash:1:10")])
def test_prague_guard_keeps_a_scripts_own_loop_going_without_a_failed_worker(tmp_path: Path, algorithm: str,
                                                                             fault: str) -> None:
    # The guard does not know the method: the script's prepare says whether it goes on (prague, adpsgd)
    # or needs every worker (allreduce: the job fails, naming the rank, for torchrun to stop or restart).
    case = uuid.uuid4().hex
    kind, rank, _ = fault.split(":")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", "-m", "prague",
           "guard", "--lease-s", "2", "--out", str(tmp_path), str(GUARDED_SCRIPT), algorithm, "30", fault]
    res = run_command(cmd, timeout_s=150, env={"OMP_NUM_THREADS": "1", "PRAGUE_TEST_CASE": case})
    survivors = [r for r in range(3) if r != int(rank)]
    # a script's steps travel with its heartbeat (at most one beat late; exactly, for an exception)
    what = {"crash": r"crashed \(exit code -?\d+\) after 10 steps", "kill": r"crashed \(exit code -9\) after \d+ steps",
            "hang": r"stopped making progress .* after \d+ steps"}[kind]
    if algorithm == "allreduce":
        assert res.returncode != 0, res.stderr[-4000:]
        assert re.search(rf"error: rank {rank} {what}; the method needs every worker", res.stderr), res.stderr[-4000:]
    else:
        assert res.returncode == 0, res.stderr[-4000:]
        assert re.search(rf"warning: rank {rank} {what}; the other workers go on", res.stderr), res.stderr[-4000:]
        assert all(f"rank {r} done 30" in res.stdout for r in survivors), res.stdout
    if algorithm == "prague" and rank == "0":  # the script's Group Generator died with rank 0's process
        assert "warning: rank 1 starts the Group Generator again: its host, rank 0, failed" in res.stderr
        # listed in the guard's --out by the script's own rank 0, then by its new host
        listed = json.loads((tmp_path / "services.json").read_text())["services"]
        assert [s["name"] for s in listed] == ["group-generator"] and ":" in listed[0]["address"], listed
    assert processes_of_session(case, within_s=10.0, kill=True) == []


def test_prague_guard_outside_torchrun_is_a_usage_error(tmp_path: Path) -> None:
    res = run_command([sys.executable, "-m", "prague", "guard", str(GUARDED_SCRIPT), "prague", "5", "none"],
                      timeout_s=60)
    assert res.returncode == 2 and "runs under torchrun" in res.stderr and "prague launch" in res.stderr
    res = run_command([sys.executable, "-m", "prague", "guard", str(tmp_path / "missing.py")], timeout_s=60)
    assert res.returncode == 2 and "does not exist" in res.stderr


def test_a_worker_with_settings_that_cannot_work_fails_the_job_under_torchrun(tmp_path: Path) -> None:
    # exit 2 is the same on every rank: the guard passes it on instead of going on without the worker
    out, case = tmp_path / "bad", uuid.uuid4().hex
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "prague", "worker", "--algorithm", "prague", "--steps", "80", "--compute", "paced",
           "--compute-ms", "0.001", "--quiet", "--out", str(out)]
    res = run_command(cmd, timeout_s=150, env={"OMP_NUM_THREADS": "1", "PRAGUE_TEST_CASE": case})
    assert res.returncode != 0 and "exitcode  : 2" in res.stderr, res.stderr[-4000:]
    assert processes_of_session(case, within_s=10.0, kill=True) == []


def test_only_a_worker_torchrun_started_guards() -> None:
    from prague.jobenv import GUARDED, LAUNCHER_PID, JobEnv
    from prague.runtime.guard import under_torchrun

    torchrun = {"TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_USE_AGENT_STORE": "True", "RANK": "0"}
    assert under_torchrun(JobEnv.read(torchrun))
    assert not under_torchrun(JobEnv.read({**torchrun, GUARDED: "1"}))  # the guard's child trains
    assert not under_torchrun(JobEnv.read({**torchrun, LAUNCHER_PID: "1"}))  # prague run's launcher sets them too
    assert not under_torchrun(JobEnv.read({"RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"}))
    assert not under_torchrun(JobEnv.read({**torchrun, "TORCHELASTIC_USE_AGENT_STORE": "False"}))  # no agent store


USAGE_SCRIPT = """
import torch, prague
ctx = prague.init()
base = torch.nn.Linear(4, 2)
prague.prepare(base, torch.optim.SGD(base.parameters(), lr=0.1), "prague", group_size="abc")
"""
USAGE_MESSAGE = "option group_size of method 'prague' takes an int (the CLI's --group-size), got 'abc' (str)"
#: The same error in a script that shuts prague down in a `finally` block: it reaches the exception hook
#: after prague.shutdown().
USAGE_FINALLY_SCRIPT = """
import torch, prague
ctx = prague.init()
try:
    base = torch.nn.Linear(4, 2)
    prague.prepare(base, torch.optim.SGD(base.parameters(), lr=0.1), "prague", group_size="abc")
finally:
    prague.shutdown()
"""


@pytest.mark.parametrize("how", ["alone", "launch", "launch-finally", "guard"])
def test_a_usage_error_in_a_script_is_one_line_and_exit_2(tmp_path: Path, how: str) -> None:
    """A prague.errors ConfigError raised in a script's ranks reaches the console once, as one line,
    with exit code 2: run alone, under `prague launch` (also after the script's own `finally:
    prague.shutdown()`), and under torchrun's `prague guard`."""
    script, case = tmp_path / "usage.py", uuid.uuid4().hex
    script.write_text(USAGE_FINALLY_SCRIPT if how == "launch-finally" else USAGE_SCRIPT)
    how, launch = ("launch", [sys.executable, "-m", "prague", "launch", "--nproc", "2", "--echo-all", "--log-dir",
                              str(tmp_path / "logs"), str(script)]) if how.startswith("launch") else (how, [])
    cmd = {"alone": [sys.executable, str(script)],
           "launch": launch,
           "guard": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                     "-m", "prague", "guard", "--out", str(tmp_path / "out"), str(script)]}[how]
    res = run_command(cmd, timeout_s=120, env={"OMP_NUM_THREADS": "1", "PRAGUE_TEST_CASE": case})
    assert res.returncode != 0
    ours = [line for line in (res.stdout + res.stderr).splitlines() if USAGE_MESSAGE in line]
    assert len(ours) == 1, res.stdout + res.stderr
    before_torchrun = res.stderr.split("Traceback (most recent call last):\n  File \"<frozen runpy>\"")[0]
    assert "Traceback" not in res.stdout and "Traceback" not in before_torchrun  # torchrun's own report follows
    if how == "alone":
        assert res.returncode == 2 and ours[0] == f"prague: error: {USAGE_MESSAGE}"
    elif how == "launch":
        assert res.returncode == 2 and ours[0].startswith("prague launch: error: worker rank ")
        assert "failed after it" not in ours[0] and "go on without" not in res.stdout + res.stderr
        logs = [(tmp_path / "logs" / f"rank{r}.log").read_text() for r in range(2)]
        assert any("Traceback" in log and USAGE_MESSAGE in log for log in logs), logs  # kept whole in the log
    else:
        assert "exitcode  : 2" in res.stderr and ours[0].startswith("prague guard: error: rank "), res.stderr[-3000:]
    assert processes_of_session(case, within_s=10.0, kill=True) == []


SURVIVOR_SCRIPT = Path(__file__).with_name("survivor_script.py")


@pytest.mark.slow
@pytest.mark.parametrize("launcher,algorithm", [("launch", "prague"), ("guard", "adpsgd")])
def test_a_scripts_own_collectives_go_on_over_the_living_ranks(tmp_path: Path, launcher: str, algorithm: str) -> None:
    """Four workers; three are killed, one an epoch: while the others are in model.averaged_model(), while
    they are in prague.barrier(), and the leader before its checkpoint (survivor_script.py). The job ends
    with exit 0, every epoch is done and saved, the broadcasts came from whoever led, and the killed
    leader is followed by the lowest living rank, which says so. Each launcher with one of the two methods
    that survive differently (a Group Generator's groups, AD-PSGD's pairs): the collectives and the
    leadership are the job's, not the method's, so the other two pairings add no case."""
    case = uuid.uuid4().hex
    args = [str(SURVIVOR_SCRIPT), algorithm, str(tmp_path)]
    if launcher == "launch":
        cmd = [sys.executable, "-m", "prague", "launch", "--nproc", "4", "--log-dir", str(tmp_path / "logs"),
               *args]  # echoes the leader's output
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m",
               "prague", "guard", "--lease-s", "3", "--timeline", "--report-to", "csv", "--out",
               str(tmp_path / "guard"), *args]
    res = run_command(cmd, timeout_s=150, env={"OMP_NUM_THREADS": "1", "PRAGUE_TEST_CASE": case})
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    assert "rank 2 done" in res.stdout, res.stdout  # the one survivor (the leader at the end: shown by both)
    assert [p.name for p in sorted(tmp_path.glob("epoch*.pt"))] == [f"epoch{e}.pt" for e in range(4)]
    for epoch, live, leader in ((0, [0, 1, 2, 3], 0), (1, [0, 1, 2], 0), (2, [0, 2], 0), (3, [2], 2)):
        assert f"leader {leader} epoch {epoch} " in res.stdout and f"epoch {epoch} " in res.stdout, res.stdout
        line = next(x for x in res.stdout.splitlines() if f"leader {leader} epoch {epoch} " in x)
        assert line.endswith(f"live {live}"), line
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "rank 2 leads the job now (rank 0 failed)" in res.stderr, res.stderr[-3000:]
    # how the job ended, in --log-dir or the guards' --out (written by rank 0's launcher or guard)
    folder = tmp_path / ("logs" if launcher == "launch" else "guard")
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["ok"] and summary["ranks"] == [2], summary
    assert sorted(f["rank"] for f in summary["failures"]) == [0, 1, 3], summary
    assert all(f["kind"] == "crash" for f in summary["failures"]), summary
    assert summary["leaders"] == [0, 2], summary
    assert summary["exit_codes"][2] == 0 and all(summary["exit_codes"][r] != 0 for r in (0, 1, 3)), summary
    assert len(list((folder / "metrics").glob("rank*.jsonl"))) == 4  # each rank's steps
    user = [json.loads(line) for line in (folder / "metrics" / "user-rank2.jsonl").read_text().splitlines()]
    assert [u["step"] for u in user] == [0, 1, 2, 3] and all("epoch_loss" in u for u in user), user
    if launcher == "guard":  # --timeline and --report-to csv under torchrun too
        trace = json.loads((folder / "timeline.json").read_text())
        events = trace["traceEvents"] if isinstance(trace, dict) else trace
        assert {e.get("pid") for e in events if e.get("ph") == "X"} >= {0, 1, 2, 3}, "a rank's steps missing"
        rows = (folder / "metrics" / "rank2.csv").read_text().splitlines()
        assert any(",user/epoch_loss," in r for r in rows) and any(",time/compute_s," in r for r in rows)
    assert processes_of_session(case, within_s=10.0, kill=True) == []


BROKEN_CALL_SCRIPT = """
import os, signal, time, torch, torch.distributed as dist, prague
ctx = prague.init()
base = torch.nn.Linear(4, 2)
model, opt = prague.prepare(base, torch.optim.SGD(base.parameters(), lr=0.1), "prague")
prague.barrier()
if ctx.rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(1.0)
dist.all_reduce(torch.ones(1))  # the script's own collective: rank 1 is gone
"""


def test_a_scripts_own_collective_broken_by_a_failure_ends_its_rank_with_one_line(tmp_path: Path) -> None:
    """A plain torch.distributed call that a failed peer breaks: the rank ends with one line naming the
    failed rank and the calls that survive, and the launcher counts it as the failure's consequence."""
    script, case = tmp_path / "broken.py", uuid.uuid4().hex
    script.write_text(BROKEN_CALL_SCRIPT)
    res = run_command([sys.executable, "-m", "prague", "launch", "--nproc", "3", "--echo-all", "--log-dir",
                       str(tmp_path / "logs"), str(script)], timeout_s=120,
                      env={"OMP_NUM_THREADS": "1", "PRAGUE_TEST_CASE": case})
    out = res.stdout + res.stderr
    assert res.returncode != 0, out[-3000:]
    lines = [line for line in out.splitlines() if "torch.distributed call broke: rank 1 failed" in line]
    assert lines and all("prague.barrier()" in line and "model.averaged_model()" in line for line in lines), out
    assert "failed for the same reason as rank 1" in out, out[-3000:]
    assert "every other rank failed after it, its own torch.distributed call broken by that failure" in res.stderr
    assert "Traceback" not in out, out[-3000:]  # kept in the ranks' logs
    assert processes_of_session(case, within_s=10.0, kill=True) == []
