"""A restarted Group Generator (issue: reliability): it continues from the groups the workers held, and a
whole run survives its service being killed (twice) mid-run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prague.errors import ConfigError
from prague.groups import GeneratorConfig, Group, Topology, make_generator
from prague.groups.service import GroupGeneratorCore, Held, parse_restore_state, restore_state
from prague_testing import run_cli, wait_gone

pytestmark = pytest.mark.timeout(240)


def _core(generator: str = "smart", nproc: int = 4) -> GroupGeneratorCore:
    config = GeneratorConfig(nproc=nproc, topology=Topology(1, nproc), group_size=3, seed=0)
    return GroupGeneratorCore(make_generator(generator, config))


@pytest.mark.parametrize("generator", ["smart", "random", "ready"])
def test_members_that_had_not_got_a_held_group_get_it_first(generator: str) -> None:
    """Worker 0 got group 7 = {0, 1, 2} and worker 1 got it too, but worker 2's last group is 5: the old
    instance had committed worker 2 to group 7, so the new one must hand it over before anything new;
    worker 3 (failed) is never grouped; new groups are numbered after 7."""
    core = _core(generator)
    g5, g7 = Group(5, (2, 3)), Group(7, (0, 1, 2))
    held = {0: Held(10, g7), 1: Held(9, g7), 2: Held(8, g5)}
    try:
        core.restore(*parse_restore_state(json.loads(json.dumps(restore_state(held, {3}))), 4))
        assert core.get_group(2, 9) == g7  # owed: the group its partners already wait in
        assert core.get_group(0, 10) == g7  # a retry of the answered iteration: the same group
        later = [core.request(w, 11, lambda: None) for w in (0, 1, 2)]
        for _ in range(50):  # the ready policy forms its group when all three asked (or on its timer)
            if all(later):
                break
            time.sleep(0.05)
            later = [g or core.request(w, 11, lambda: None) for w, g in zip((0, 1, 2), later)]
        assert all(g is not None and g.seq > 7 and 3 not in g.members for g in later), later
        assert core.finish(1) == [] or all(g.seq > 7 for g in core.finish(1))
    finally:
        core.stop()


def test_a_finished_worker_is_not_grouped_again_and_owes_its_last_groups() -> None:
    core = _core("smart", nproc=3)
    g4 = Group(4, (0, 1))
    try:
        core.restore({0: Held(-1, g4, finished=True), 1: Held(3, Group(2, (1, 2)))}, set())
        assert core.get_group(1, 4) == g4  # worker 0 finished committed to group 4: worker 1 runs it with it
        assert core.finish(2) == [Group(2, (1, 2))]  # worker 1 got it, worker 2 never did: still owed at finish
        with pytest.raises(ConfigError):
            core.get_group(0, 0)  # finished before the restart: no more groups
    finally:
        core.stop()


@pytest.mark.parametrize(("data", "words"), [
    ([], "'held'"),
    ({"held": {"x": {}}, "excluded": []}, "'x'"),
    ({"held": {"9": {"iteration": 1, "seq": 1, "members": [0, 9]}}, "excluded": []}, "9"),
    ({"held": {"1": {"iteration": 1, "seq": 1, "members": [0, 2]}}, "excluded": []}, "not a group of it"),
    ({"held": {"1": {"seq": 1}}, "excluded": []}, "held-group record"),
    ({"held": {}, "excluded": ["a"]}, "'a'"),
])
def test_a_malformed_restore_file_is_refused_by_name(data: object, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        parse_restore_state(data, 4)


def _services(out: Path) -> dict:
    return json.loads((out / "services.json").read_text())["services"][0]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--algorithm", "prague:smart", "--overlap", "off"]], ids=["ready", "smart-blocking"])
def test_a_run_survives_its_group_generator_being_killed_twice(tmp_path: Path, extra: list[str]) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "prague", "run", "--algorithm", "prague", "--nproc", "4", "--steps", "150",
           "--compute", "emulated", "--compute-ms", "40", "--out", str(out), "--quiet", *extra]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    try:
        killed = []
        for _ in range(2):
            deadline = time.monotonic() + 60
            while not (out / "services.json").exists() or _services(out)["pid"] in killed:
                assert launcher.poll() is None and time.monotonic() < deadline, "the service did not come back"
                time.sleep(0.05)
            time.sleep(1.5)  # mid-run
            pid = _services(out)["pid"]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        stdout, stderr = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.communicate()
    assert launcher.returncode == 0, stderr
    assert stderr.count("service 'group-generator' exited") == 2, stderr
    record = _services(out)
    assert record["restarts"] == 2 and record["pid"] not in killed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed_steps"] == [150] * 4 and summary["failures"] == []
    assert wait_gone(str(out), within_s=10.0) == []


def test_a_policy_that_fails_on_the_timer_fails_every_waiting_request_with_its_error() -> None:
    """The Group Generator's timer runs on the background-work primitive: a policy that raises when polled at
    its deadline ends the service, and a request waiting for a group gets that error, not a hang."""
    from prague.errors import CommError
    from prague.runtime.background import owner_of

    core = _core("ready", nproc=3)

    class Broken:
        """The policy, but its poll raises (a wrapper: a compiled build's policy cannot be patched)."""

        def __init__(self, policy: object) -> None:
            self._policy = policy

        def __getattr__(self, name: str) -> object:
            return getattr(self._policy, name)

        def poll(self, now_s: float) -> list:
            raise RuntimeError("the policy broke")

    core.policy = Broken(core.policy)  # type: ignore[assignment]
    try:
        assert owner_of(core._timer._threads[0]) is core._timer
        with pytest.raises(CommError, match="group generator's timer failed: RuntimeError\\('the policy broke'\\)"):
            core.get_group(0, 0)  # alone in the window: only the timer's poll could answer it
    finally:
        core.stop()
    assert not core._timer.alive
