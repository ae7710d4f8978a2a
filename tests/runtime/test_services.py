"""ServiceKeeper, the one owner of a job's services (the launcher's, rank 0's guard's under torchrun): it
starts them ready, publishes their address, restarts one that can continue the job, reports one that
cannot once, with its output, and keeps services.json current. Real processes, a real store."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from prague.runtime.services import ServiceKeeper, ServiceNotReady, ServiceSpec

pytestmark = pytest.mark.timeout(60)

# writes its ready file (an address made of its pid and argv's last word), then runs until stopped
SERVE = ("import os, sys, time, pathlib; p = pathlib.Path(sys.argv[1]); t = p.with_suffix('.tmp'); "
         "t.write_text(f'{os.getpid()}:{sys.argv[-1]}'); t.rename(p); print('serving', flush=True); time.sleep(600)")


def _spec(tmp_path: Path, name: str, restore: bool) -> ServiceSpec:
    ready = tmp_path / f"{name}.ready"
    return ServiceSpec(name, [sys.executable, "-c", SERVE, str(ready), "first"], ready_file=ready,
                       publish_key=f"test/{name}", restore=(lambda store: ["again"]) if restore else None)


def _wait_lost_or_restarted(keeper: ServiceKeeper, restarts: int) -> list[tuple[str, int, str]]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        lost = keeper.watch()
        if lost or keeper.records[0]["restarts"] == restarts:
            return lost
        time.sleep(0.05)
    raise AssertionError("the keeper neither restarted nor reported the service")


@pytest.fixture
def store() -> dist.Store:
    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def test_a_service_that_can_continue_is_started_again_and_published(tmp_path: Path, store: dist.Store) -> None:
    keeper = ServiceKeeper(store, [_spec(tmp_path, "gen", restore=True)], services_file=tmp_path / "services.json",
                           log_dir=tmp_path / "logs")
    keeper.start()
    try:
        first = keeper.records[0]["pid"]
        assert store.get("test/gen").decode() == f"{first}:first"
        os.kill(first, signal.SIGKILL)
        assert _wait_lost_or_restarted(keeper, restarts=1) == []
        second = keeper.records[0]["pid"]
        assert second != first and store.get("test/gen").decode() == f"{second}:again"  # restore's arguments
        listed = json.loads((tmp_path / "services.json").read_text())["services"]
        assert listed == [{"name": "gen", "pid": second, "address": f"{second}:again", "restarts": 1}]
        assert (tmp_path / "logs" / "gen.log").read_text().count("serving") == 2  # one log, both instances
    finally:
        keeper.stop(grace_s=1.0)
    assert all(p.poll() is not None for p in keeper.procs)


def test_a_service_that_cannot_continue_is_reported_once_with_its_output(tmp_path: Path, store: dist.Store) -> None:
    keeper = ServiceKeeper(store, [_spec(tmp_path, "shard", restore=False)], log_dir=tmp_path / "logs")
    keeper.start()
    try:
        os.kill(keeper.records[0]["pid"], signal.SIGKILL)
        lost = _wait_lost_or_restarted(keeper, restarts=1)
        assert lost == [("shard", -signal.SIGKILL, "serving\n")]
        assert keeper.watch() == []  # reported once
    finally:
        keeper.stop(grace_s=1.0)


def test_a_service_that_exits_before_it_is_ready_names_itself_and_its_output(tmp_path: Path,
                                                                            store: dist.Store) -> None:
    bad = ServiceSpec("broken", [sys.executable, "-c", "print('no token given'); raise SystemExit(2)"],
                      ready_file=tmp_path / "broken.ready")
    keeper = ServiceKeeper(store, [_spec(tmp_path, "gen", restore=True), bad], log_dir=tmp_path / "logs")
    with pytest.raises(ServiceNotReady, match=r"(?s)'broken' exited with code 2 before it was ready.*no token given"):
        keeper.start()
    assert all(p.poll() is not None for p in keeper.procs)  # the one already started is stopped too
