"""The command line as a user runs it, on paths no other test takes end to end: ``prague bench``,
``--epochs``, MNIST and synthetic data, ``--target-accuracy`` with evaluation, and the progress bar.

Every run is tiny (2 workers, a few steps, emulated compute where the arithmetic does not matter).
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import Any

import pytest

from prague_testing import bench_records, run_cli

pytestmark = pytest.mark.timeout(180)

# Two workers, emulated compute of 5 ms a step (no arithmetic, no data loaded).
TINY = ["--nproc", "2", "--compute", "emulated", "--compute-ms", "5", "--data", "synthetic", "--model", "mlp"]


def _summary(out: Path) -> dict[str, Any]:
    return json.loads((out / "summary.json").read_text())


def _metrics(out: Path, rank: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()]


def _table_rows(text: str, table: int = 1) -> dict[tuple[str, str], dict[str, str]]:
    """The rows of one of the bench's tables in ``text`` (stdout or bench.md), keyed (method, scenario):
    0, time to accuracy; 1, throughput."""
    tables: list[list[str]] = []
    previous = False
    for line in text.splitlines():  # a table is a run of lines starting with "|"
        if line.startswith("|") and not previous:
            tables.append([])
        if line.startswith("|"):
            tables[-1].append(line)
        previous = line.startswith("|")
    lines = [line for line in tables[table] if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in lines[1:]]
    return {(r["method"], r["scenario"]): r for r in rows}


# prague bench


@pytest.mark.slow
def test_bench_writes_a_consistent_table_and_json_and_a_rerun_keeps_the_earlier_runs(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    algorithms, scenarios = ["allreduce", "dssync"], ["homogeneous", "straggler:1:3"]
    res = run_cli("bench", "--algorithms", ",".join(algorithms), "--scenarios", ",".join(scenarios), *TINY,
                  "--steps", "6", "--out", str(out), "--quiet", timeout_s=150)
    assert res.returncode == 0, res.stderr
    pairs = [(a, s) for s in scenarios for a in algorithms]  # scenario by scenario, in the order given
    assert re.findall(r"^== (\S+) / (\S+)$", res.stdout, re.M) == pairs

    records = bench_records(out)
    assert [(r["algorithm"], r["scenario"]) for r in records] == pairs
    for r in records:
        assert r["nproc"] == 2 and r["steps"] == 6 and r["compute_mode"] == "emulated" and r["compute_ms"] == 5
        assert r["throughput_samples_per_s"] > 0 and r["wall_s"] > 0 and r["no_wait_limit_samples_per_s"] > 0
        assert r["fraction_of_limit"] == pytest.approx(r["throughput_samples_per_s"] / r["no_wait_limit_samples_per_s"])
        assert r["host"]["cpu"] and r["host"]["logical_cpus"] >= 1  # the machine that ran it
        # The bench lists each run's own record; only the no-wait limit is made one per scenario.
        own = _summary(out / "runs" / f"{r['algorithm']}_{r['scenario'].replace(':', '-')}")
        harmonized = {"no_wait_limit_samples_per_s", "fraction_of_limit"}
        assert {k: v for k, v in r.items() if k not in harmonized} == {k: v for k, v in own.items() if k not in harmonized}
    # One no-wait limit per scenario: 32 samples per step of each worker, over the least step compute any
    # run measured, plus, for rank 1, twice the 5 ms it sleeps more as a straggler 3x slower.
    base = min(r["base_compute_s"] for r in records)
    limit = {"homogeneous": 2 * 32 / base, "straggler:1:3": 32 / base + 32 / (base + 2 * 0.005)}
    assert all(r["no_wait_limit_samples_per_s"] == pytest.approx(limit[r["scenario"]]) for r in records)
    assert [r["mean_slowdown"] for r in records] == [[1.0, 1.0]] * 2 + [[1.0, 3.0]] * 2

    # The printed table and bench.md's are the same, and every ratio follows from the JSON's throughputs.
    rows = _table_rows(res.stdout)
    assert rows == _table_rows((out / "bench.md").read_text())
    rate = {(r["algorithm"], r["scenario"]): r["throughput_samples_per_s"] for r in records}
    for r in records:
        key = (r["algorithm"], r["scenario"])
        row = rows[key]
        assert row["mode"] == "emulated, 5 ms" and row["local steps"] == "-"
        tta = _table_rows(res.stdout, 0)[key]
        assert tta["time to target (s)"] == "n/a" and tta["final accuracy"] == "-" and tta["seeds"] == "1"
        assert tta["job time (s)"] == f"{r['job_s']:.1f}" and tta["samples"] == str(2 * 6 * 32)
        assert row["throughput (samples/s)"] == f"{rate[key]:.1f}"
        assert row["vs allreduce"] == f"{rate[key] / rate[('allreduce', key[1])]:.2f}x"
        assert row["vs homogeneous allreduce"] == f"{rate[key] / rate[('allreduce', 'homogeneous')]:.2f}x"
        assert row["of no-wait limit"] == f"{100 * r['fraction_of_limit']:.0f}%"
    assert "prague bench --algorithms allreduce,dssync" in (out / "bench.md").read_text()
    assert f"; on {records[0]['host']['cpu']}, " in (out / "bench.md").read_text()
    for plot in ("throughput.png", "accuracy.png"):
        assert (out / plot).read_bytes().startswith(b"\x89PNG")

    # A second bench into the same folder re-runs its own pairs and leaves the earlier runs' files as
    # they were; bench.json and bench.md then describe the second bench.
    kept = {p: p.read_bytes() for p in (out / "runs").rglob("*")
            if p.is_file() and not p.is_relative_to(out / "runs" / "dssync_homogeneous")}
    again = run_cli("bench", "--algorithms", "dssync", "--scenarios", "homogeneous", *TINY, "--steps", "6",
                    "--out", str(out), "--quiet", timeout_s=120)
    assert again.returncode == 0, again.stderr
    assert {p: p.read_bytes() for p in kept} == kept
    records = bench_records(out)
    assert [(r["algorithm"], r["scenario"]) for r in records] == [("dssync", "homogeneous")]
    assert records[0]["wall_s"] == _summary(out / "runs" / "dssync_homogeneous")["wall_s"]
    assert _table_rows((out / "bench.md").read_text())[("dssync", "homogeneous")]["vs allreduce"] == "n/a"


@pytest.mark.slow
def test_bench_repeat_runs_every_cell_with_each_seed(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    res = run_cli("bench", "--algorithms", "allreduce,prague", "--scenarios", "homogeneous", *TINY, "--steps", "4",
                  "--seed", "5", "--repeat", "2", "--report-to", "csv", "--out", str(out), "--quiet", timeout_s=150)
    assert res.returncode == 0, res.stderr
    records = bench_records(out)
    for run in sorted((out / "runs").iterdir()):  # --report-to csv: each run's ranks' numbers, as they come
        rows = (run / "metrics" / "rank0.csv").read_text().splitlines()
        assert rows[0] == "step,time_s,name,value" and any(",time/compute_s," in r for r in rows[1:]), run
    assert [(r["algorithm"], r["seed"]) for r in records] == [("allreduce", 5), ("prague", 5), ("allreduce", 6),
                                                             ("prague", 6)]
    for r in records:
        assert _summary(out / "runs" / f"{r['algorithm']}_homogeneous_seed{r['seed']}")["seed"] == r["seed"]
    cells = json.loads((out / "bench.json").read_text())["cells"]
    assert [(c["method"], c["seeds"]) for c in cells] == [("allreduce", [5, 6]), ("prague:ready", [5, 6])]
    jobs = sorted(r["job_s"] for r in records if r["algorithm"] == "allreduce")
    assert cells[0]["job_s"] == {"median": jobs[0], "min": jobs[0], "max": jobs[1]}
    assert _table_rows(res.stdout, 0)[("allreduce", "homogeneous")]["seeds"] == "2"
    bad = run_cli("bench", *TINY, "--steps", "2", "--repeat", "0", "--out", str(tmp_path / "x"), timeout_s=60)
    assert bad.returncode == 2 and "--repeat" in bad.stderr

    # --resume: a bench stopped during its last run (bench.json without it, its folder half written)
    # runs that one again, from scratch, and keeps the others as they were.
    document = json.loads((out / "bench.json").read_text())
    assert document["resume"]["runs"] == [f"runs/{a}_homogeneous_seed{s}" for a, s in
                                          [("allreduce", 5), ("prague", 5), ("allreduce", 6), ("prague", 6)]]
    document["records"].pop()
    document["resume"]["runs"].pop()
    (out / "bench.json").write_text(json.dumps(document))
    stale = out / "runs" / "prague_homogeneous_seed6" / "stale.txt"
    stale.write_text("left by the interrupted run")
    argv = ["bench", "--algorithms", "allreduce,prague", "--scenarios", "homogeneous", *TINY, "--steps", "4",
            "--seed", "5", "--repeat", "2", "--report-to", "csv", "--out", str(out)]
    resumed = run_cli(*argv, "--resume", "--quiet", timeout_s=120)
    assert resumed.returncode == 0, resumed.stderr
    assert re.findall(r"^== .*$", resumed.stdout, re.M) == ["== prague / homogeneous / seed 6"]
    after = bench_records(out)
    # The kept runs are the same runs; only the benchmark-wide no-wait limit (the least base compute of all
    # its runs: report.harmonize_limits) follows the set, which now holds the re-run.
    shared = ("no_wait_limit_samples_per_s", "fraction_of_limit")
    kept = [{k: v for k, v in r.items() if k not in shared} for r in after[:3]]
    assert kept == [{k: v for k, v in r.items() if k not in shared} for r in records[:3]]
    assert len({r["no_wait_limit_samples_per_s"] for r in after}) == 1
    assert (after[3]["algorithm"], after[3]["seed"]) == ("prague", 6)
    assert not stale.exists()
    # other arguments than the bench's own, or no --out: a clear refusal, nothing touched
    before = (out / "bench.json").read_bytes()
    other = run_cli(*[a if a != "4" else "5" for a in argv], "--resume", timeout_s=60)
    assert other.returncode == 2 and "--resume" in other.stderr and "--steps 4" in other.stderr
    assert (out / "bench.json").read_bytes() == before
    no_out = run_cli(*argv[:-2], "--resume", timeout_s=60)
    assert no_out.returncode == 2 and "--out" in no_out.stderr


# --epochs


@pytest.mark.slow
@pytest.mark.parametrize("compute", ["real", "emulated"])
def test_epochs_set_the_steps_from_each_workers_shard(tmp_path: Path, compute: str) -> None:
    """Steps = ceil(epochs x full batches of the smallest shard). digits has 1,437 training images
    (scikit-learn's 1,797, 80/20): 2 workers hold 718 each, 11 batches of 64, so 1.5 epochs are 17 steps.
    With emulated compute the workers load no data and count from the catalog: the same 17."""
    out = tmp_path / compute
    res = run_cli("run", "--nproc", "2", "--data", "digits", "--model", "mlp", "--batch-size", "64", "--epochs", "1.5",
                  "--compute", compute, "--compute-ms", "5", "--out", str(out), "--quiet", timeout_s=120)
    assert res.returncode == 0, res.stderr
    steps = math.ceil(1.5 * ((1437 // 2) // 64))
    assert steps == 17
    s = _summary(out)
    assert s["steps"] == steps and s["completed_steps"] == [steps, steps] and s["batch_size"] == 64
    for rank in range(2):
        assert [m["step"] for m in _metrics(out, rank)] == list(range(steps))


@pytest.mark.parametrize("where", ["runtime", "simulator"])
def test_fractional_epochs_are_not_rounded_up_by_float_error(where: str) -> None:
    """1.1 epochs of 50 steps are 55 steps, in a run and in its simulation alike (2 workers, batch 81:
    synthetic's 8,192 images give 4,096 each, 50 batches)."""
    from prague.train.config import RunConfig

    cfg = RunConfig(epochs=1.1, data="synthetic", nproc=2, batch_size=81)
    if where == "runtime":
        from prague.train.loop import total_steps

        assert total_steps(cfg, 50) == 55
    else:
        from prague.simulate.run import SimConfig

        assert SimConfig(cfg).steps == 55


# MNIST and synthetic data


@pytest.mark.slow
@pytest.mark.parametrize("data, shape", [("mnist", (1, 28, 28)), ("synthetic", (3, 32, 32))])
def test_a_short_real_run_on_each_data_set_gives_a_sane_summary(tmp_path: Path, request: pytest.FixtureRequest,
                                                                  data: str, shape: tuple[int, int, int]) -> None:
    from prague.workload.models import build_model, parameter_count

    where = ["--data-dir", str(request.getfixturevalue("mnist_dir"))] if data == "mnist" else []
    out, nproc, steps, batch = tmp_path / data, 2, 8, 16
    res = run_cli("run", "--nproc", str(nproc), "--steps", str(steps), "--batch-size", str(batch), "--data", data,
                  *where, "--model", "mlp", "--out", str(out), timeout_s=120)  # no --quiet, on pipes
    assert res.returncode == 0, res.stderr
    assert_no_progress_bar(res)
    s = _summary(out)
    assert s["data"] == data and s["compute_mode"] == "real" and s["failures"] == []
    assert s["parameters"] == parameter_count(build_model("mlp", shape, 10))  # the model saw this data's shape
    assert s["steps"] == steps and s["completed_steps"] == [steps] * nproc
    for rank in range(nproc):
        records = _metrics(out, rank)
        assert [r["step"] for r in records] == list(range(steps))
        assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in records)
    # nproc x batch samples per step: the no-wait limit is that over the step's compute time.
    assert s["no_wait_limit_samples_per_s"] == pytest.approx(nproc * batch / s["base_compute_s"])
    assert s["throughput_samples_per_s"] > 0
    assert 0.0 <= s["test_accuracy"] <= 1.0
    # The common clock's grid from 0, then the job's end: the averaged final states.
    assert s["eval_history"][0]["wall_s"] == 0.0
    last = s["eval_history"][-1]
    assert {"wall_s": last["wall_s"], "accuracy": last["accuracy"]} == {"wall_s": s["job_s"], "accuracy": s["test_accuracy"]}
    assert math.isfinite(last["loss"]) and last["loss"] > 0  # the held-out loss beside the accuracy
    assert s["worst_replica_accuracy"] <= s["best_replica_accuracy"]
    assert s["job_s"] == s["wall_s"] and s["samples"] == nproc * steps * batch
    if data == "mnist":
        assert s["test_accuracy"] > 0.2  # 8 steps of 2 x 16 images: well above chance (0.1)
    assert f"test accuracy {100 * s['test_accuracy']:.2f}%" in res.stdout


# --target-accuracy with evaluation


@pytest.mark.slow
def test_target_accuracy_records_when_it_was_reached_and_when_not(tmp_path: Path) -> None:
    """``--target-accuracy`` records the time on the common clock at which the average of the replicas
    first reached the target (it does not stop the run: every worker trains all its steps). The history
    holds the grid points every ``--eval-every-s`` (all of them: fewer than the curve's limit) and the
    job's end; paced steps of 20 ms make the 30 steps last about 0.6 s."""
    from prague.train.evaluation import CURVE_POINTS

    run = ["run", "--nproc", "2", "--steps", "30", "--data", "digits", "--model", "mlp", "--quiet",
           "--compute", "paced", "--compute-ms", "20", "--eval-every-s", "0.1"]
    reached, missed = tmp_path / "reached", tmp_path / "missed"
    res = run_cli(*run, "--target-accuracy", "0.7", "--out", str(reached), timeout_s=120)
    assert res.returncode == 0, res.stderr
    s = _summary(reached)
    history = s["eval_history"]
    assert 0.6 <= s["job_s"] < 0.6 * CURVE_POINTS / 6  # 30 paced steps, and few enough points to score all
    times = [h["wall_s"] for h in history]
    assert times[:-1] == pytest.approx([0.1 * j for j in range(len(times) - 1)])
    assert times[-1] == s["job_s"] and times[-2] <= s["job_s"] < times[-2] + 0.1
    assert history[-1]["accuracy"] == s["test_accuracy"] and history[0]["accuracy"] < 0.5  # the initial model
    first = next(h for h in history if h["accuracy"] >= 0.7)
    assert s["target_accuracy"] == 0.7 and s["time_to_target_s"] == first["wall_s"]
    assert s["steps"] == 30 and s["completed_steps"] == [30, 30]
    assert f"time to target {first['wall_s']:.1f} s" in res.stdout

    res = run_cli(*run, "--target-accuracy", "1.0", "--out", str(missed), timeout_s=120)
    assert res.returncode == 0, res.stderr
    m = _summary(missed)
    assert all(h["accuracy"] < 1.0 for h in m["eval_history"])
    assert m["time_to_target_s"] is None and m["target_accuracy"] == 1.0
    assert m["completed_steps"] == [30, 30]
    assert "time to target - s" in res.stdout


def test_eval_every_in_steps_is_refused_for_real_runs(tmp_path: Path) -> None:
    res = run_cli("run", *TINY, "--steps", "2", "--eval-every", "5", "--out", str(tmp_path / "r"), timeout_s=60)
    assert res.returncode == 2 and "--eval-every-s" in res.stderr and len(res.stderr.strip().splitlines()) == 1


# The progress bar


def assert_no_progress_bar(res: subprocess.CompletedProcess[str]) -> None:
    """A run without --quiet whose output went to pipes (not a terminal) printed no progress bar."""
    for text in (res.stdout, res.stderr):
        assert "\r" not in text and "step/s" not in text and "steps [" not in text, text


def _run_on_a_terminal(args: list[str], timeout_s: float) -> tuple[int, str, str]:
    """Run ``python -m prague ARGS`` with its stderr on a pseudo-terminal of 120 columns (stdout a pipe);
    return (exit code, stdout, what reached the terminal). Kills its process group after ``timeout_s``."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "prague", *args], stdout=subprocess.PIPE, stderr=slave,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    os.close(slave)
    seen = bytearray()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: every holder of the terminal has closed it
                    break
                if not chunk:
                    break
                seen += chunk
            elif proc.poll() is not None:
                break
        else:
            pytest.fail(f"prague {' '.join(args)} did not finish in {timeout_s} s:\n{seen.decode(errors='replace')}")
        code = proc.wait(timeout=10)
        assert proc.stdout is not None
        return code, proc.stdout.read().decode(), seen.decode(errors="replace")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        os.close(master)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.slow
def test_progress_bar_on_a_terminal(tmp_path: Path) -> None:
    """tqdm draws the bar when stderr is a terminal (``disable=None``): all workers' steps done of their
    total, each worker's count, the line cleared at the end. (On pipes nothing of it appears:
    :func:`assert_no_progress_bar`, checked on the runs of each data set.)"""
    args = ["run", "--nproc", "2", "--compute", "emulated", "--compute-ms", "20", "--steps", "40", "--data", "synthetic"]
    code, stdout, terminal = _run_on_a_terminal([*args, "--out", str(tmp_path / "tty")], timeout_s=120)
    assert code == 0, terminal
    drawn = re.findall(r"(\d+)/80 \[.*?steps \[(\d+), (\d+)\]\]", terminal)  # of 2 workers x 40 steps
    assert drawn and all(int(n) == int(a) + int(b) for n, a, b in drawn), terminal
    assert max(int(n) for n, _, _ in drawn) > 0
    assert terminal.rstrip(" ").endswith("\r")  # leave=False: the bar's line is cleared
    assert "\r" not in stdout and "samples/s" in stdout  # the report stays on stdout, clean



# What a command leaves behind


_SUBREAPER = """
import ctypes, os, subprocess, sys
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: the run's orphans come here
res = subprocess.run(sys.argv[1:], capture_output=True, text=True)
left = []
for child in open(f"/proc/self/task/{os.getpid()}/children").read().split():
    try:
        state = open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        continue
    if state != "Z":  # an orphan that exited but was not reaped yet is not running
        left.append(open(f"/proc/{child}/cmdline").read().replace(chr(0), " ")[:120])
print(res.returncode, left)
"""


def test_run_returns_only_after_every_process_it_started_has_exited(tmp_path: Path) -> None:
    """Whatever `prague run` started (workers, the fork server they come from, services) has exited when
    it returns: none is re-parented to the process that ran it (a subreaper here) still running."""
    cmd = [sys.executable, "-m", "prague", "run", *TINY, "--algorithm", "prague", "--steps", "3", "--quiet",
           "--out", str(tmp_path / "r")]
    res = subprocess.run([sys.executable, "-c", _SUBREAPER, *cmd], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "0 []", res.stdout


def test_a_run_of_the_default_length_says_it_is_a_quick_check(tmp_path: Path) -> None:
    """One pass over each worker's shard (the default) is no trained model: the run says so and how to
    train longer; with a length given it does not."""
    res = run_cli("run", "--nproc", "2", "--compute", "emulated", "--compute-ms", "1", "--out", str(tmp_path / "a"),
                  "--quiet", timeout_s=120)
    assert res.returncode == 0, res.stderr
    assert "note: the run's length was the default" in res.stdout and "--epochs E" in res.stdout
    res = run_cli("run", "--nproc", "2", "--steps", "3", "--compute", "emulated", "--compute-ms", "1", "--out",
                  str(tmp_path / "b"), "--quiet", timeout_s=120)
    assert res.returncode == 0 and "note:" not in res.stdout, res.stdout
