"""Emulated hosts (network namespaces, a bridge, shaped veth links): set-up, teardown, stale clean-up,
workers placed in their host's namespace, and clear errors. Tests that build namespaces need root (or
CAP_NET_ADMIN and CAP_SYS_ADMIN) and are skipped, with the reason, without it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prague.errors import ConfigError
from prague.net.hosts import (
    EmulatedHosts, check_layout, host_of, missing_privileges, parse_rate, remove_stale,
)
from prague_testing import run_cli, wait_gone

#: These tests build network namespaces: one at a time, under make test's two workers (netns_lock).
pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("netns_lock")]
REASON = missing_privileges()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"emulated hosts unavailable: {REASON}")


def test_rates_parse_in_tc_units_and_bad_ones_name_the_forms() -> None:
    assert parse_rate("1gbit") == 10**9 and parse_rate("100mbit") == 10**8 and parse_rate("2.5mbit") == 2_500_000
    assert parse_rate("50mbps") == 400_000_000 and parse_rate(" 8kbit ") == 8000
    for bad in ("", "fast", "10", "10 furlongs", "-1gbit", "1kbit", "2tbit"):
        with pytest.raises(ConfigError, match="--link-rate"):
            parse_rate(bad)


def test_ranks_fill_hosts_in_contiguous_equal_blocks() -> None:
    assert [host_of(r, 8, 4) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [host_of(r, 4, 1) for r in range(4)] == [0] * 4
    check_layout(8, 8)
    for nproc, hosts in ((5, 2), (4, 0), (4, 500)):
        with pytest.raises(ConfigError, match="--hosts|--nproc"):
            check_layout(nproc, hosts)


@pytest.mark.parametrize("flags,expected", [
    (["--hosts", "3"], ["--nproc 4 is not a multiple of --hosts 3"]),
    (["--link-rate", "1gbit"], ["--link-rate", "--hosts"]),
    (["--hosts", "2", "--link-rate", "quick"], ["--link-rate 'quick'", "1gbit"]),
    (["--hosts", "2", "--algorithm", "prague:static", "--nodes", "4"], ["--nodes 4 differs from --hosts 2"]),
])
def test_bad_host_flags_are_one_line_before_anything_starts(tmp_path: Path, flags: list[str],
                                                            expected: list[str]) -> None:
    argv = ["run", "--nproc", "4", "--steps", "2", "--out", str(tmp_path / "run"), *flags]
    if "--algorithm" not in flags:
        argv += ["--algorithm", "allreduce"]
    res = run_cli(*argv, timeout_s=60)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and all(e in lines[0] for e in expected), res.stderr
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.skipif(shutil.which("capsh") is None or os.geteuid() != 0, reason="needs capsh and root to drop "
                    "capabilities")
def test_without_privileges_the_run_says_so_in_one_line_and_exits_2(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "prague", "run", "--algorithm", "allreduce", "--nproc", "2", "--steps", "2",
           "--hosts", "2", "--out", str(tmp_path / "run")]
    res = subprocess.run(["capsh", "--drop=cap_net_admin,cap_sys_admin", "--", "-c", " ".join(cmd)],
                         capture_output=True, text=True, timeout=60, env={**os.environ})
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "lacks CAP_NET_ADMIN and CAP_SYS_ADMIN" in lines[0] and "--hosts" in lines[0]


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split(" ")[0] for line in out.splitlines()}


@needs_netns
def test_set_up_and_tear_down_leave_nothing_and_teardown_is_idempotent() -> None:
    net = EmulatedHosts(3, parse_rate("100mbit"))
    with net:
        assert sorted(net.leftovers()) == sorted([net.namespace(h) for h in range(3)]
                                                 + [net.bridge] + [net.link(h) for h in range(3)])
        assert {net.namespace(h) for h in range(3)} <= _namespaces()
        qdisc = subprocess.run(["tc", "qdisc", "show", "dev", net.link(1)], capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc
        inner = subprocess.run(["ip", "netns", "exec", net.namespace(1), "ip", "-4", "-o", "addr", "show", "eth0"],
                               capture_output=True, text=True).stdout
        assert net.address(1) in inner
    assert net.leftovers() == []
    net.down()  # again: nothing to do, no error
    assert net.leftovers() == []


@needs_netns
def test_what_a_dead_launcher_left_is_removed_by_the_next_set_up() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid no process has now
    orphan = EmulatedHosts(2, parse_rate("1gbit"), owner=dead.pid)
    orphan.up()
    try:
        assert len(orphan.leftovers()) == 5
        mine = EmulatedHosts(1, parse_rate("1gbit"))
        with mine:  # up() removes the dead owner's namespaces and links, never a live owner's
            assert orphan.leftovers() == [] and len(mine.leftovers()) == 3
        assert remove_stale() == []
    finally:
        orphan.down()


def _worker_pids(out: Path) -> list[int]:
    """The run's worker processes (their command line names the run's folder)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"prague worker" in cmdline and str(out).encode() in cmdline:
            found.append(int(proc.name))
    return found


def _namespace_of(pid: int, hosts: dict[int, int]) -> int:
    """The emulated host whose namespace holds ``pid`` (-1: none of them, or the process is gone)."""
    try:
        return hosts.get(os.stat(f"/proc/{pid}/ns/net").st_ino, -1)
    except OSError:
        return -1


@needs_netns
def test_workers_run_in_their_hosts_namespaces_and_a_killed_launcher_is_cleaned_up_next_time(
        tmp_path: Path) -> None:
    out = tmp_path / "run"
    launcher = subprocess.Popen([sys.executable, "-m", "prague", "run", "--algorithm", "prague", "--nproc", "4",
                                 "--hosts", "2", "--link-rate", "1gbit", "--steps", "100000", "--compute", "emulated",
                                 "--compute-ms", "20", "--out", str(out), "--quiet"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    net = EmulatedHosts(2, 10**9, owner=launcher.pid)
    try:
        # A worker joins its namespace as its first act (setns), so a worker seen at its very start may
        # still be in the launcher's namespace: poll until every worker has joined, or the deadline.
        deadline = time.monotonic() + 60
        pids: list[int] = []
        placed: list[int] = []
        while time.monotonic() < deadline and placed != [0, 0, 1, 1]:
            time.sleep(0.5)
            pids = _worker_pids(out)
            if len(pids) == 4 and all(os.path.exists(f"/var/run/netns/{net.namespace(h)}") for h in range(2)):
                hosts = {os.stat(f"/var/run/netns/{net.namespace(h)}").st_ino: h for h in range(2)}
                placed = sorted(_namespace_of(pid, hosts) for pid in pids)
        assert len(pids) == 4, pids
        assert placed == [0, 0, 1, 1]  # two workers in each host's namespace
        assert os.stat("/proc/self/ns/net").st_ino != os.stat(f"/var/run/netns/{net.namespace(0)}").st_ino
        gg = json.loads((out / "services.json").read_text())["services"][0]["address"]
        bridge = subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", net.bridge], capture_output=True,
                                text=True).stdout.split()[3].split("/")[0]
        assert gg.startswith(bridge + ":")  # reachable from every host, through the bridge
        os.killpg(launcher.pid, signal.SIGKILL)  # no teardown runs: what it built stays
        launcher.wait(10)
        assert wait_gone(str(out), within_s=10.0) == []
        assert len(net.leftovers()) == 5
        with EmulatedHosts(1, 10**9):  # the next set-up removes it
            assert net.leftovers() == []
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        net.down()


@needs_netns
@pytest.mark.parametrize("algorithm", ["allreduce", "prague:smart", "ps:sync"])
def test_runs_on_emulated_hosts_and_leave_nothing_behind(tmp_path: Path, algorithm: str) -> None:
    out = tmp_path / "run"
    before = _namespaces()
    res = run_cli("run", "--algorithm", algorithm, "--nproc", "4", "--hosts", "2", "--link-rate", "200mbit",
                  "--steps", "20", "--out", str(out), "--quiet", timeout_s=150)
    assert res.returncode == 0, res.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed_steps"] == [20] * 4 and summary["test_accuracy"] > 0.3
    assert _namespaces() == before
    assert wait_gone(str(out), within_s=10.0) == []


def test_cross_traffic_parses_and_its_bursts_are_seeded() -> None:
    from prague.net.traffic import burst_plan, parse_cross_traffic

    assert parse_cross_traffic("bursts:0.3:20").text == "bursts:0.3:20"
    for bad in ("bursts:2:20", "bursts:0.3", "bursts:0.3:0", "0.3:20", "bursts:x:1", ""):
        with pytest.raises(ConfigError, match="bursts:P:MB"):
            parse_cross_traffic(bad)
    plan = burst_plan(7, 1, "in", 2000, 0.3)
    assert plan == burst_plan(7, 1, "in", 2000, 0.3) and 500 < sum(plan) < 700
    assert plan != burst_plan(7, 2, "in", 2000, 0.3) and plan != burst_plan(7, 1, "out", 2000, 0.3)
    assert not any(burst_plan(7, 1, "in", 100, 0.0)) and all(burst_plan(7, 1, "in", 100, 1.0))


def _sent_bytes(dev: str, ns: str | None = None) -> int:
    where = ["-n", ns] if ns else []
    out = subprocess.run(["tc", *where, "-s", "qdisc", "show", "dev", dev], capture_output=True, text=True).stdout
    return int(out.split("Sent ")[1].split(" ")[0])


@needs_netns
def test_cross_traffic_crosses_every_link_both_ways(tmp_path: Path) -> None:
    net = EmulatedHosts(2, parse_rate("200mbit"))
    with net:
        ready = tmp_path / "ready"
        proc = subprocess.Popen([sys.executable, "-m", "prague.net.traffic", "--namespaces",
                                 f"{net.namespace(0)},{net.namespace(1)}", "--addresses",
                                 f"{net.address(0)},{net.address(1)}", "--bridge", net.bridge_address,
                                 "--traffic", "bursts:1:1", "--ready-file", str(ready)], stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 30
            while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert ready.read_text() == "4 streams\n"
            before = [_sent_bytes(net.link(h)) for h in range(2)] + [_sent_bytes("eth0", net.namespace(h))
                                                                     for h in range(2)]
            time.sleep(1.0)  # about 10 bursts of 1 MB each way
            after = [_sent_bytes(net.link(h)) for h in range(2)] + [_sent_bytes("eth0", net.namespace(h))
                                                                    for h in range(2)]
            assert all(a - b > 3_000_000 for a, b in zip(after, before)), (before, after)
        finally:
            proc.kill()
            proc.wait(10)
    assert net.leftovers() == []


@needs_netns
def test_a_run_with_cross_traffic_trains_and_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = run_cli("run", "--algorithm", "allreduce", "--nproc", "4", "--hosts", "2", "--link-rate", "100mbit",
                  "--cross-traffic", "bursts:0.3:2", "--steps", "20", "--out", str(out), "--quiet", timeout_s=150)
    assert res.returncode == 0, res.stderr
    assert json.loads((out / "summary.json").read_text())["completed_steps"] == [20] * 4
    names = [s["name"] for s in json.loads((out / "services.json").read_text())["services"]]
    assert names == ["cross-traffic"]
    assert wait_gone(str(out), within_s=10.0) == []
    res = run_cli("run", "--algorithm", "allreduce", "--nproc", "4", "--cross-traffic", "bursts:0.3:2",
                  "--steps", "2", "--out", str(out), timeout_s=60)
    assert res.returncode == 2 and "--cross-traffic acts on the links of emulated hosts" in res.stderr
