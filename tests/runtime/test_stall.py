"""Stall warnings (issue: reliability): a worker that waits too long names the ranks it waits for."""

from __future__ import annotations

import io
import json
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from prague.runtime.stall import COMM, COMPUTE, PHASE_KEY, STALL_KEY, Phase, StallWatch, holding_up, stall_message
from prague_testing import run_cli

pytestmark = pytest.mark.timeout(240)


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def test_the_ranks_holding_up_a_step_are_those_still_computing() -> None:
    phases = {1: (7, COMM), 2: (7, COMPUTE), 3: (6, COMM), 4: (5, COMPUTE), 6: (9, COMM)}
    assert holding_up(7, [1, 2, 3, 4, 5], phases) == [2, 4, 5]  # 5 never reported: not there yet
    assert holding_up(7, [1, 3, 6], phases) == [3]  # nobody computes: the one still in an earlier collective
    assert holding_up(7, [1, 6], phases) == []


def test_a_watch_warns_only_while_communicating_and_again_when_the_wait_doubles() -> None:
    store = _store()
    store.set(f"{PHASE_KEY}1", "3,comm")
    store.set(f"{PHASE_KEY}2", "2,compute")
    phase, out = Phase(), io.StringIO()
    watch = StallWatch(store.clone(), 0, 3, phase, lambda: None, warn_s=0.4, out=out)
    try:
        phase.compute(3)
        time.sleep(1.0)  # computing for a second is not waiting
        assert watch.warnings == []
        phase.communicate()
        time.sleep(2.0)  # a warning at 0.4 s, another once the wait doubled
    finally:
        watch.stop()
    assert len(watch.warnings) >= 2 and all(w["ranks"] == [2] for w in watch.warnings)
    first, second = watch.warnings[:2]
    assert 0.4 <= first["waited_s"] < second["waited_s"] and second["waited_s"] >= 2 * first["waited_s"] - 0.01
    assert json.loads(store.get(f"{STALL_KEY}0")) == watch.warnings[-1]
    assert store.get(f"{PHASE_KEY}0").decode() == "3,comm"  # its own phase, published for the others
    line = out.getvalue().splitlines()[0]
    assert line.startswith("prague: warning: rank 0 has waited") and "in step 3 for rank 2 (last reported computing step 2)" in line
    assert stall_message({**first, "ranks": []}).endswith("for no peer that is behind (a service, or a message in flight)")


def test_the_default_threshold_follows_the_measured_step_time() -> None:
    watch = StallWatch(_store(), 0, 2, Phase(), lambda: None)
    try:
        assert watch.threshold_s() is None  # too few steps measured: no guess
        for _ in range(5):
            watch.step_done(0.3)
        assert watch.threshold_s() == pytest.approx(3.0)
        watch.durations.clear()
        for _ in range(5):
            watch.step_done(0.01)
        assert watch.threshold_s() == 1.0  # never below a second
    finally:
        watch.stop()
    with pytest.raises(ValueError, match="> 0"):
        StallWatch(_store(), 0, 2, Phase(), lambda: None, warn_s=0.0)


@pytest.mark.slow
@pytest.mark.parametrize(("algorithm", "code"), [("allreduce", 1), ("prague:static", 0), ("ps:sync", 1)])
def test_waiting_workers_name_the_hung_rank(tmp_path: Path, algorithm: str, code: int) -> None:
    """Rank 2 freezes at step 15: before its lease runs out, the launcher prints the others' warnings
    naming it (prague's from its background averages); then the run goes on without it (prague) or
    stops naming it. (prague's default ``ready`` generator groups only workers that ask: nobody waits
    for a frozen one, so nothing to warn about.)"""
    res = run_cli("run", "--algorithm", algorithm, "--nproc", "3", "--steps", "30", "--compute", "emulated",
                  "--compute-ms", "30", "--slowdown", "hang:2:15", "--lease-s", "3", "--stall-warn-s", "1",
                  "--out", str(tmp_path / "run"), "--quiet", timeout_s=120)
    assert res.returncode == code, res.stderr
    warnings = [line for line in res.stderr.splitlines() if "has waited" in line]
    named = [line for line in warnings if " for rank " in line]
    assert named, res.stderr
    assert all(" for rank 2 (" in line for line in named), named
    assert {line.split()[3].removesuffix("'s") for line in warnings} <= {"0", "1"}  # 'prague: warning: rank R ...'
    # A loaded machine may also make a worker wait before the hang with nobody behind (its first step's
    # rendezvous, a slow service): such a warning names no peer, never a wrong one.
    for line in set(warnings) - set(named):
        assert "for no peer that is behind" in line and int(line.split(" in step ")[1].split()[0]) < 15, line


def test_a_watch_warns_of_any_work_of_the_process_that_waits_on_peers() -> None:
    """Not only the method's works: any background work of the process in a communicating operation (a
    communicator's rendezvous, say) is watched and named in the warning."""
    import threading

    from prague.runtime.background import COMMUNICATING, FunctionWork

    store = _store()
    store.set(f"{PHASE_KEY}1", "2,compute")
    release = threading.Event()
    holder: list[FunctionWork] = []

    def body(index: int) -> None:
        with holder[0].operation(5, COMMUNICATING):
            release.wait(10)

    rendezvous = FunctionWork("rendezvous of ranks [0, 1]", "test-rendezvous", body, start=False)
    holder.append(rendezvous)
    phase, out = Phase(), io.StringIO()
    watch = StallWatch(store.clone(), 0, 2, phase, lambda: None, warn_s=0.3, out=out)
    try:
        phase.compute(5)  # the training thread computes: only the other work waits
        rendezvous.start()
        time.sleep(1.2)
    finally:
        release.set()
        rendezvous.stop()
        watch.stop()
    assert watch.warnings and all(w["what"] == "rendezvous of ranks [0, 1] " for w in watch.warnings), watch.warnings
    assert "rendezvous of ranks [0, 1]" in out.getvalue()
