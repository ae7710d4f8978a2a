"""The job's environment, read in one place (prague.jobenv): parsing, errors that name the variable,
the launcher and torchrun distinctions, and child environments that leave this process's alone."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from prague import jobenv
from prague.errors import ConfigError
from prague.jobenv import JobEnv


def test_an_empty_environment_is_no_job() -> None:
    job = JobEnv.read({})
    assert not job.launched and not job.under_launcher and not job.under_torchrun
    assert job.attempt == 0 and job.restart_count is None and job.master_addr == "127.0.0.1"
    with pytest.raises(ConfigError, match="environment variable RANK is not set; start the job with"):
        job.need("rank")


def test_torchruns_variables_are_typed() -> None:
    job = JobEnv.read({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                       "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "2",
                       "TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_USE_AGENT_STORE": "True", "OMP_NUM_THREADS": "2"})
    assert (job.rank, job.world_size, job.local_rank, job.local_world_size) == (3, 8, 1, 4)
    assert (job.master_addr, job.need("master_port"), job.attempt, job.threads) == ("10.0.0.2", 29500, 2, 2)
    assert job.launched and job.under_torchrun


@pytest.mark.parametrize(("name", "value", "message"), [
    ("RANK", "one", r"RANK='one' is not an integer"),
    ("MASTER_PORT", "29500x", r"MASTER_PORT='29500x' is not an integer"),
    ("TORCHELASTIC_RESTART_COUNT", "x", r"TORCHELASTIC_RESTART_COUNT='x' is not a count; it is torchrun's"),
    (jobenv.LAUNCHER_PID, "pid", r"PRAGUE_LAUNCHER_PID='pid' is not an integer; it is set by prague's launcher"),
])
def test_a_malformed_variable_is_named(name: str, value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        JobEnv.read({name: value})


def test_prague_variables_say_who_started_the_process(tmp_path: Path) -> None:
    job = JobEnv.read({jobenv.LAUNCHER_PID: "42", jobenv.MANAGED_SERVICES: "1", jobenv.GUARDED: "1",
                       jobenv.SERVICES_FILE: str(tmp_path / "services.json"), jobenv.NETNS: "h0",
                       jobenv.GG_TOKEN: "secret", jobenv.HOST_LABEL: "a", jobenv.WORKER_START: "exec",
                       jobenv.REPORT_TO: "csv"})
    assert job.under_launcher and job.launcher_pid == 42 and job.managed_services and job.guarded
    assert job.services_file == tmp_path / "services.json"
    assert (job.netns, job.gg_token, job.host_label, job.worker_start, job.report_to) == ("h0", "secret", "a", "exec",
                                                                                           "csv")
    assert set(jobenv.PRAGUE_VARIABLES) == {jobenv.LAUNCHER_PID, jobenv.WORKER_START, jobenv.MANAGED_SERVICES,
                                            jobenv.SERVICES_FILE, jobenv.GUARDED, jobenv.NETNS, jobenv.GG_TOKEN,
                                            jobenv.HOST_LABEL, jobenv.OUT, jobenv.REPORT_TO}
    assert all(v.startswith("PRAGUE_") for v in jobenv.PRAGUE_VARIABLES)


def test_child_and_overridden_leave_this_processs_environment_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRAGUE_HOST_LABEL", "before")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = jobenv.child({"PRAGUE_HOST_LABEL": "child"})
    assert env["PRAGUE_HOST_LABEL"] == "child" and jobenv.current().host_label == "before"
    with jobenv.overridden({"OMP_NUM_THREADS": "1", "PRAGUE_HOST_LABEL": "inside"}):
        assert jobenv.current().threads == 1 and jobenv.current().host_label == "inside"
    assert "OMP_NUM_THREADS" not in os.environ and jobenv.current().host_label == "before"
    with pytest.raises(RuntimeError), jobenv.overridden({"PRAGUE_HOST_LABEL": "raised"}):
        raise RuntimeError
    assert jobenv.current().host_label == "before"
