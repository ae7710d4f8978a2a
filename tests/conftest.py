"""Fixtures shared by every test package (helpers live in prague_testing.py), and the check that the test
run leaves no process of its own behind.

Every process a test starts inherits ``PRAGUE_TEST_SESSION`` (set here, unique per run), so at the end
the run finds all of them through ``/proc/PID/environ``, also those whose parent died and that were
re-parented. Any still alive after a grace period is killed and fails the run, naming it (the pytest
process's own multiprocessing helpers, which end with it, excepted). Under pytest-xdist (``make test`` runs
two) the check is the controller's, once every worker has ended: a worker finishing early must not take
the other's running jobs for leftovers.

Hypothesis runs without its per-example deadline: the suite shares two cores between two pytest workers
and their jobs, and a property's correctness does not depend on how fast an example runs.
"""

from __future__ import annotations

import os
import uuid

import pytest
from hypothesis import HealthCheck, settings

# re-exported fixtures
from prague_testing import allreduce_run, mnist_dir, netns_lock, processes_of_session  # noqa: F401

SESSION_ENV = "PRAGUE_TEST_SESSION"

settings.register_profile("prague", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("prague")


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault(SESSION_ENV, uuid.uuid4().hex)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller checks once all have ended
        return
    left = processes_of_session(os.environ[SESSION_ENV], within_s=15.0, kill=True)
    if left:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        text = "processes started by the tests outlived them (killed now): " + "; ".join(
            f"{pid} {cmd[:120]}" for pid, cmd in left)
        if reporter is not None:
            reporter.write_line(text, red=True)
        else:
            print(text)
