"""Helper processes of a job (a Group Generator, parameter-server shards): what to start, and how to
know it is ready.

A service announces that it is ready by writing a *ready file* atomically (its address, or a line
naming it). :func:`wait_ready` is the one wait for that file, used by the launcher
(:mod:`prague.runtime.launcher`) and by :func:`start_service`, which rank 0 uses under torchrun,
where no launcher exists.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prague.errors import CommError
from prague.runtime.parent import LAUNCHER_PID_ENV

POLL_S = 0.05
MAX_RESTARTS = 5  # a service that dies more often than this in one job is not started again


@dataclass(frozen=True)
class ServiceSpec:
    """A helper process the job needs (a group generator, a parameter-server shard).

    It is started before the workers with the job's environment plus ``env`` and stopped after them.
    If ``ready_file`` is set, the workers start only once the service has written it, and its text is
    published in the job store under ``publish_key``. If the service exits while workers are running,
    the job fails with its name and output.
    """

    name: str
    argv: Sequence[str]
    env: dict[str, str] = field(default_factory=dict)
    ready_file: Path | None = None
    publish_key: str | None = None
    ready_timeout_s: float = 60.0
    #: A service that can be restarted if it dies mid-run: given the job's store, the arguments to add
    #: to ``argv`` so that the new instance continues from the workers' state. None: not restartable.
    restore: Callable[[Any], Sequence[str]] | None = None


class ServiceNotReady(CommError):
    """A service exited, or did not write its ready file in time."""

    def __init__(self, name: str, exitcode: int | None, why: str) -> None:
        self.name, self.exitcode, self.why = name, exitcode, why
        super().__init__(f"service {name!r} {why}")


def wait_ready(name: str, ready_file: Path, exitcode: Callable[[], int | None], timeout_s: float) -> str:
    """Wait until ``ready_file`` exists and return its text, stripped.

    ``exitcode()`` is polled meanwhile (``Popen.poll``): a service that exits first, or takes longer
    than ``timeout_s``, raises :class:`ServiceNotReady`. The service writes the file atomically, so its
    existence means its content is complete."""
    deadline = time.monotonic() + timeout_s
    while not ready_file.exists():
        code = exitcode()
        if code is not None:
            raise ServiceNotReady(name, code, f"exited with code {code} before it was ready")
        if time.monotonic() > deadline:
            raise ServiceNotReady(name, None, f"was not ready within {timeout_s:g} s")
        time.sleep(POLL_S)
    return ready_file.read_text().strip()


def start_service(spec: ServiceSpec, log: Path | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``spec`` as a child of this process (its output goes to ``log``, appended, or else to ours; it
    dies with this process, :mod:`prague.runtime.parent`) and wait until it is ready; return the process
    and its ready file's text. On failure the child is killed before raising, naming ``log``."""
    if spec.ready_file is None:
        raise ValueError(f"service {spec.name!r} has no ready file to wait for")
    spec.ready_file.unlink(missing_ok=True)
    env = {**os.environ, **spec.env, LAUNCHER_PID_ENV: str(os.getpid())}
    out = None
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        out = open(log, "ab")
    try:
        proc = subprocess.Popen(list(spec.argv), env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT if out else None)
    finally:
        if out is not None:
            out.close()  # the child holds its own copy
    try:
        return proc, wait_ready(spec.name, spec.ready_file, proc.poll, spec.ready_timeout_s)
    except ServiceNotReady as exc:
        stop_process(proc, grace_s=0.0)
        if log is not None:
            raise ServiceNotReady(spec.name, exc.exitcode, f"{exc.why} (its output: {log})") from None
        raise
    except BaseException:
        stop_process(proc, grace_s=0.0)
        raise


def restarted(spec: ServiceSpec, store: Any) -> ServiceSpec:
    """``spec`` for a new instance after the old one died: its ``argv`` plus what ``spec.restore``
    derives from the job's ``store``."""
    if spec.restore is None:
        raise ValueError(f"service {spec.name!r} cannot be restarted: it has no restore function")
    return dataclasses.replace(spec, argv=[*spec.argv, *spec.restore(store)])


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """Wait up to ``grace_s`` for ``proc`` to exit by itself, then kill it; always reaps it."""
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
