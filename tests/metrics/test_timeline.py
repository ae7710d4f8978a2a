"""The run timeline: a Chrome trace with one track per worker, and `prague timeline OUT`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prague.errors import ConfigError
from prague.metrics.timeline import build_trace, load_trace, summarize
from prague_testing import run_cli

pytestmark = pytest.mark.timeout(180)


def _records(rank: int, steps: int, compute: float, comm: float, wait: float) -> list[dict]:
    return [{"step": k, "rank": rank, "t_end_s": (k + 1) * (compute + comm), "compute_s": compute, "comm_s": comm,
             "wait_s": wait, "slowdown": 1.0, "loss": None} for k in range(steps)]


def test_every_step_is_a_compute_then_a_communicate_slice_with_its_wait_and_group() -> None:
    records = {0: _records(0, 3, 0.010, 0.004, 0.001), 2: _records(2, 3, 0.020, 0.002, 0.0)}
    decisions = {0: [{"step": 1, "kind": "group", "members": [0, 2]}, {"step": 2, "kind": "partner", "partner": 2}]}
    trace = build_trace(records, decisions)
    json.loads(json.dumps(trace))  # plain JSON
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in slices} == {0, 2}
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"rank 0", "rank 2"}
    for e in slices:
        assert e["dur"] >= 0 and e["ts"] >= 0 and {"name", "ts", "dur", "pid", "tid"} <= set(e)
    by = {(e["pid"], e["name"], e["args"]["step"]): e for e in slices}
    compute, comm, wait = by[(0, "compute", 1)], by[(0, "communicate", 1)], by[(0, "wait", 1)]
    assert compute["ts"] + compute["dur"] == pytest.approx(comm["ts"])  # back to back
    assert comm["ts"] + comm["dur"] == pytest.approx(0.028 * 1e6)  # ends at the step's end
    assert comm["ts"] <= wait["ts"] and wait["ts"] + wait["dur"] <= comm["ts"] + comm["dur"] + 1e-6
    assert comm["args"]["group"] == [0, 2] and by[(0, "communicate", 2)]["args"]["partner"] == 2
    assert (2, "wait", 0) not in by  # no wait, no slice


def test_summary_shares_add_up_and_name_the_slowest_steps() -> None:
    records = {0: _records(0, 4, 0.010, 0.010, 0.005), 1: _records(1, 4, 0.030, 0.010, 0.0)}
    records[1][2] = {**records[1][2], "compute_s": 0.2, "t_end_s": records[1][2]["t_end_s"] + 0.17}
    text = summarize(build_trace(records), slowest=1)
    lines = text.splitlines()
    assert lines[1].split()[:2] == ["0", "4"] and "50.0%" in lines[1] and "25.0%" in lines[1]  # compute, wait
    assert "slowest steps (of 8):" in text and "rank 1 step 2: 210.0 ms" in lines[-1]
    assert summarize({"traceEvents": []}) == "no steps in this timeline"


def test_a_run_writes_its_timeline_and_prague_timeline_reads_it(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = run_cli("run", "--algorithm", "dssync", "--nproc", "3", "--steps", "12", "--timeline", "--log-decisions",
                  "--out", str(out), "--quiet", timeout_s=120)
    assert res.returncode == 0, res.stderr
    trace = json.loads((out / "timeline.json").read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in slices} == {0, 1, 2}
    assert sum(1 for e in slices if e["name"] == "compute") == 36
    assert all("group" in e["args"] for e in slices if e["name"] == "communicate")
    shown = run_cli("timeline", str(out), timeout_s=60)
    assert shown.returncode == 0, shown.stderr
    assert [line.split()[0] for line in shown.stdout.splitlines()[1:4]] == ["0", "1", "2"]
    # Without --timeline the same table comes from the step records.
    (out / "timeline.json").unlink()
    assert run_cli("timeline", str(out), timeout_s=60).stdout.splitlines()[:4] == shown.stdout.splitlines()[:4]


def test_background_threads_get_a_track_each_with_their_stages() -> None:
    records = {0: _records(0, 2, 0.010, 0.004, 0.0)}
    background = {0: [
        {"work": "background average", "thread": 0, "stage": "waiting", "step": 0, "start_s": 0.010, "end_s": 0.011},
        {"work": "background average", "thread": 0, "stage": "communicating", "step": 0, "start_s": 0.011,
         "end_s": 0.019},
        {"work": "lossy chunk all-reduce", "thread": 1, "stage": "communicating", "step": 1, "start_s": 0.02,
         "end_s": 0.025},
        {"work": "lossy chunk all-reduce", "thread": 0, "stage": "communicating", "step": 1, "start_s": 0.02,
         "end_s": 0.024},
    ]}
    trace = build_trace(records, None, background)
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {1: "background average", 2: "lossy chunk all-reduce 0", 3: "lossy chunk all-reduce 1"}
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X" and e.get("cat") == "background"]
    assert [(e["tid"], e["name"], e["args"]["step"]) for e in slices] == [
        (1, "waiting", 0), (1, "communicating", 0), (3, "communicating", 1), (2, "communicating", 1)]
    assert slices[1]["ts"] == pytest.approx(11000) and slices[1]["dur"] == pytest.approx(8000)
    assert "0" in summarize(trace).splitlines()[1]  # the step table is the training thread's alone


def test_a_run_with_background_averages_shows_them_on_its_timeline(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = run_cli("run", "--algorithm", "prague", "--nproc", "2", "--steps", "10", "--compute", "emulated",
                  "--compute-ms", "20", "--data", "synthetic", "--timeline", "--out", str(out), "--quiet",
                  timeout_s=120)
    assert res.returncode == 0, res.stderr
    trace = json.loads((out / "timeline.json").read_text())
    for rank in (0, 1):
        lines = [json.loads(x) for x in (out / "metrics" / "background" / f"rank{rank}.jsonl").read_text().splitlines()]
        # the method's averages, and the process's other works: the pair's communicator, built once
        assert {x["work"] for x in lines} == {"background average", "rendezvous of ranks [0, 1]"}, lines
        lines = [x for x in lines if x["work"] == "background average"]
        steps = [x["step"] for x in lines if x["stage"] == "waiting"]
        assert steps == sorted(steps) and len(steps) >= 5  # one request per step, asked in order
        mine = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == rank]
        ours = [e for e in mine if e.get("cat") == "background"]
        assert {e["name"] for e in ours} <= {"waiting", "communicating"} and any(e["name"] == "communicating"
                                                                             for e in ours)
        end = max(e["ts"] + e["dur"] for e in mine if e["tid"] == 0)
        assert all(0 <= e["ts"] <= end + 5e6 for e in ours)  # on the run's clock, not another one


def test_bad_timeline_folders_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="holds no run"):
        load_trace(tmp_path)
    (tmp_path / "timeline.json").write_text("{broken")
    res = run_cli("timeline", str(tmp_path), timeout_s=60)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and "not a Chrome trace" in res.stderr
    res = run_cli("timeline", str(tmp_path / "nope"), timeout_s=60)
    assert res.returncode == 2 and "is not a folder" in res.stderr
