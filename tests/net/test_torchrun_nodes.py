"""Several machines for real: network namespaces as machines, each running its own torchrun
(``--nnodes 2 --rdzv-backend c10d``), so the job's store, the ranks' connections and the services a rank
starts (the Group Generator, parameter-server shards) are reached over the emulated links, never over a
loopback the machines would not share. Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN): skipped, with
the reason, without it."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from prague.net.hosts import EmulatedHosts, missing_privileges, parse_rate

#: These tests build network namespaces: one at a time, under make test's two workers (netns_lock).
pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("netns_lock")]
REASON = missing_privileges()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"emulated machines unavailable: {REASON}")

NODES, PER_NODE = 2, 2
RDZV_PORT = 29431


@pytest.fixture
def machines(netns_lock: None) -> Iterator[EmulatedHosts]:
    """Two machines for one test, built and removed under the lock that keeps namespace tests apart."""
    with EmulatedHosts(NODES, parse_rate("10gbit")) as net:
        yield net


def torchrun_nodes(net: EmulatedHosts, worker_args: Sequence[str], job: str, timeout_s: float = 150.0,
                   torchrun_args: Sequence[str] = ()) -> list[tuple[int | None, str]]:
    """One torchrun per machine (:meth:`EmulatedHosts.torchrun`), each running ``prague worker WORKER_ARGS``."""
    return net.torchrun(worker_args, per_host=PER_NODE, job=job, port=RDZV_PORT, timeout_s=timeout_s,
                        torchrun_args=torchrun_args, env={"OMP_NUM_THREADS": "1"})


@needs_netns
# allreduce trains on two machines in the restart test below; prague, whose rank 0 starts the Group Generator
# that the other machine's ranks reach at rank 0's machine address, in test_two_machines_go_on_without_a_failed_worker
@pytest.mark.parametrize("algorithm", ["ps-eager"])
def test_two_machines_train_with_every_service_reached_over_the_links(machines: EmulatedHosts, tmp_path: Path,
                                                                      algorithm: str) -> None:
    # ps-eager: rank 0 starts the shards, which every rank of the other machine reaches over the link
    out = tmp_path / "run"
    results = torchrun_nodes(machines, ["--algorithm", algorithm, "--steps", "30", "--compute", "emulated",
                                        "--compute-ms", "10", "--quiet", "--out", str(out)], job=f"two-{algorithm}")
    for node, (code, text) in enumerate(results):
        assert code == 0, f"machine {node} exited {code}:\n{text[-4000:]}"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["nproc"] == NODES * PER_NODE
    assert summary["completed_steps"] == [30] * (NODES * PER_NODE) and summary["failures"] == []


def test_a_service_listens_on_loopback_only_when_the_job_is_on_one_machine() -> None:
    from prague.errors import ConfigError
    from prague.jobenv import JobEnv
    from prague.runtime.context import service_host

    assert service_host(JobEnv.read({})) == "127.0.0.1"  # a job of one
    job = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.7"}
    assert service_host(JobEnv.read(job)) == "127.0.0.1"  # every rank on this machine
    job.update(LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.2")
    assert service_host(JobEnv.read(job)) == "127.0.0.1"  # the address this machine reaches the store from
    job.update(MASTER_ADDR="no-such-host.invalid")
    with pytest.raises(ConfigError, match="MASTER_ADDR='no-such-host.invalid'"):
        service_host(JobEnv.read(job))


@needs_netns
def test_allreduce_on_two_machines_survives_a_crash_by_restarting_from_its_checkpoint(machines: EmulatedHosts,
                                                                                      tmp_path: Path) -> None:
    out = tmp_path / "run"  # one disk for both machines here: the checkpoint is complete where both read it
    results = torchrun_nodes(machines, ["--algorithm", "allreduce", "--steps", "60", "--checkpoint-every", "10",
                                        "--slowdown", "crash:2:20", "--compute", "emulated", "--compute-ms", "10",
                                        "--quiet", "--out", str(out)], job="two-restart",
                             torchrun_args=["--max-restarts", "1"])
    for node, (code, text) in enumerate(results):
        assert code == 0, f"machine {node} exited {code}:\n{text[-4000:]}"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["completed_steps"] == [60] * (NODES * PER_NODE)


@needs_netns
# prague's crash of a rank that holds no service runs on one machine under torchrun (tests/runtime)
@pytest.mark.parametrize("algorithm,fault", [("prague", "hang:0:20"), ("dssync", "crash:2:20"),
                                             ("eager-sgd", "hang:2:20")])
def test_two_machines_go_on_without_a_failed_worker(machines: EmulatedHosts, tmp_path: Path, algorithm: str,
                                                     fault: str) -> None:
    # each rank's guard declares its own worker failed; hang:0:20 freezes the worker of the rank whose guard
    # runs the Group Generator, on the machine that also holds the rendezvous store
    out = tmp_path / "run"
    kind, rank, _ = fault.split(":")
    results = torchrun_nodes(machines, ["--algorithm", algorithm, "--steps", "60", "--slowdown", fault, "--lease-s", "2",
                                        "--compute", "emulated", "--compute-ms", "10", "--quiet", "--out", str(out)],
                             job=f"fail-{algorithm}-{kind}-{rank}")
    for node, (code, text) in enumerate(results):
        assert code == 0, f"machine {node} exited {code}:\n{text[-4000:]}"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failures"] == [{"rank": int(rank), "step": 20, "kind": kind}]
    world = NODES * PER_NODE
    assert summary["completed_steps"] == [20 if r == int(rank) else 60 for r in range(world)]
