"""A job's processes end cleanly: closing a trainer lets its communicators go, shutdown lets the world go.

A gloo process group's worker threads live as long as the group is referenced; one still releasing a
collective when the interpreter finalises aborts the process at exit. These tests check the threads
themselves, in real jobs, so they fail whenever a method keeps a group past close, every time, instead
of aborting a user's script now and then under load.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from prague.algorithms.registry import METHODS
from prague_testing import run_cli

pytestmark = pytest.mark.timeout(240)

SCRIPT = textwrap.dedent("""
    import gc, json, sys, threading, time, warnings
    import torch, torch.distributed as dist, torch.nn.functional as F
    import prague
    from prague.runtime.background import owner_of
    from prague.runtime.context import communication_threads

    def python_threads():  # every Python thread but the main one, as NAME:OWNER (its background work, or -)
        return sorted(f"{t.name}:{o.what if (o := owner_of(t)) else '-'}" for t in threading.enumerate()
                      if t is not threading.main_thread())

    methods, result = sys.argv[1].split(","), sys.argv[2]
    ctx = prague.init()
    deadline = time.monotonic() + 10  # gloo's threads name themselves once running (two per group)
    while len(communication_threads()) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    seen = {"start": communication_threads()}
    for method in methods:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        trainer = prague.wrap(model, opt, algorithm=method)
        gen = torch.Generator().manual_seed(ctx.rank)
        for step in range(6):
            x = torch.randn(16, 8, generator=gen)
            y = (x[:, 0] > 0).long()
            trainer.step(lambda m: F.cross_entropy(m(x), y))
            if step == 3:
                seen[f"{method}/mid-run"] = python_threads()
        trainer.averaged_model()
        trainer.close()
        gc.collect()
        seen[method] = communication_threads()
        del trainer
    held = dist.new_group(list(range(ctx.world_size)))  # the user's own group, kept past shutdown
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prague.shutdown()
    seen["held"] = communication_threads()
    seen["warnings"] = [str(w.message) for w in caught]
    del held
    gc.collect()
    seen["end"] = communication_threads()
    seen["python"] = python_threads()
    with open(f"{result}.{ctx.rank}", "w") as f:
        json.dump(seen, f)
""")


# Every method, one trainer after another in one job. Two parameter-server methods cannot follow each
# other in one job (their shards' store keys would meet), so ps-eager gets a job of its own.
JOBS = [[m for m in METHODS if m != "ps-eager"], ["ps-eager"]]


def test_every_method_is_in_a_job() -> None:
    assert sorted(sum(JOBS, [])) == sorted(METHODS)


@pytest.mark.parametrize("methods", JOBS, ids=["+".join(j) for j in JOBS])
def test_close_and_shutdown_leave_no_gloo_threads(tmp_path: Path, methods: list[str]) -> None:
    script, result = tmp_path / "job.py", tmp_path / "threads"
    script.write_text(SCRIPT)
    res = run_cli("launch", "--nproc", "3", str(script), ",".join(methods), str(result), timeout_s=220)
    assert res.returncode == 0, res.stderr
    for rank in range(3):
        seen = json.loads(Path(f"{result}.{rank}").read_text())
        world = seen["start"]
        assert world, "the world group runs gloo worker threads while the job is up"
        for method in methods:  # each method's own communicators went with close()
            assert seen[method] == world, (rank, method, seen[method])
        # The world is gone; the group the script still holds keeps its threads, and shutdown says so.
        assert seen["held"] and len(seen["warnings"]) == 1, seen
        assert "still referenced" in seen["warnings"][0]
        assert seen["end"] == [], seen
        # Mid-run, every thread of the package is a background work's (the heartbeat at least); only
        # gRPC's own poller of its completion queue has no owner. After shutdown none of prague's is left
        # (the asyncio loop for gRPC, prague.groups.aio, is stopped; gRPC's poller is gRPC's).
        for method in methods:
            threads = seen[f"{method}/mid-run"]
            assert "prague-heartbeat:heartbeat" in threads, (method, threads)
            assert all(t.endswith(":-") == _grpc_poller(t) for t in threads), (method, threads)
        assert all(_grpc_poller(t) for t in seen["python"]), seen["python"]


def _grpc_poller(thread: str) -> bool:
    """Whether ``thread`` (NAME:OWNER) is gRPC's poller of its completion queue, started by gRPC itself."""
    return thread.endswith(":-") and "(_poll_wrapper)" in thread


OWN_GROUP = textwrap.dedent("""
    import sys
    import torch, torch.distributed as dist, torch.nn.functional as F
    import prague

    dist.init_process_group("gloo")  # the script's own default group, made before prague's
    ctx = prague.init()
    base = torch.nn.Linear(4, 2)
    model, opt = prague.prepare(base, torch.optim.SGD(base.parameters(), lr=0.1), "allreduce")
    for step in range(3):
        F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 2, (8,))).backward()
        opt.step()
        opt.zero_grad()
    prague.shutdown()
    assert dist.is_initialized(), "prague.shutdown() destroyed the script's own group"
    total = torch.ones(1)
    dist.all_reduce(total)  # still usable
    assert total.item() == dist.get_world_size(), total
    dist.destroy_process_group()
    print(f"rank {ctx.rank}: own group kept")
""")


def test_shutdown_leaves_a_default_group_the_script_made_alone(tmp_path: Path) -> None:
    script = tmp_path / "own.py"
    script.write_text(OWN_GROUP)
    res = run_cli("launch", "--nproc", "2", "--echo-all", str(script), timeout_s=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "rank 0: own group kept" in res.stdout and "rank 1: own group kept" in res.stdout, res.stdout
    assert "gloo worker thread" not in res.stderr, res.stderr
