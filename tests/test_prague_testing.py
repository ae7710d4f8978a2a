"""The test helpers can fail: what goes wrong in a thread started with ``start_thread`` fails the test
that joins it (a plain ``threading.Thread`` would only print it)."""

from __future__ import annotations

import threading
import time

import pytest

from prague_testing import join_all, start_thread

pytestmark = pytest.mark.timeout(30)


def test_an_assert_in_a_thread_fails_the_join() -> None:
    def check() -> None:
        assert 1 + 1 == 3, "arithmetic"

    thread = start_thread(check)
    with pytest.raises(AssertionError, match="arithmetic"):
        thread.join(timeout=5)


def test_pytest_fail_and_an_unmet_raises_in_a_thread_fail_the_join() -> None:
    thread = start_thread(pytest.fail, "from the thread")
    with pytest.raises(pytest.fail.Exception, match="from the thread"):
        thread.join(timeout=5)

    def expects_an_error() -> None:
        with pytest.raises(ValueError):
            pass

    thread = start_thread(expects_an_error)
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        thread.join(timeout=5)


def test_a_thread_still_running_fails_the_join() -> None:
    release = threading.Event()
    thread = start_thread(release.wait, 20.0, name="sleeper")
    with pytest.raises(pytest.fail.Exception, match=r"\['sleeper'\] still running after 0.2 s"):
        thread.join(timeout=0.2)
    release.set()
    thread.join(timeout=5)
    assert thread.result is True


def test_join_all_raises_the_error_raised_first() -> None:
    first_failed = threading.Event()

    def fails_first() -> None:
        first_failed.set()
        raise KeyError("first")

    def fails_after() -> None:
        first_failed.wait(5)
        time.sleep(0.05)
        raise ValueError("after")

    with pytest.raises(KeyError, match="first"):
        join_all([start_thread(fails_after), start_thread(fails_first)], 5)


def test_the_session_check_finds_and_kills_a_process_left_behind() -> None:
    """What the end-of-run check (conftest.py) relies on: a process carrying the token is found, also
    after it was orphaned into a session of its own, and killed."""
    import os
    import subprocess
    import sys
    import uuid

    from prague_testing import processes_of_session

    token = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                            env={**os.environ, "PRAGUE_TEST_SESSION": token}, start_new_session=True,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "up\n"  # exec'd: its environment is its own
        left = processes_of_session(token, within_s=0.5, kill=True)
        assert [pid for pid, _ in left] == [proc.pid]
        assert proc.wait(timeout=10) != 0  # killed
        assert processes_of_session(token, within_s=0.0) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
