"""Helper processes of a job (a Group Generator, parameter-server shards): what to start, how to know it
is ready, and who keeps it running.

A service announces that it is ready by writing a *ready file* atomically (its address, or a line
naming it). :func:`wait_ready` is the one wait for that file. :class:`ServiceKeeper` is the one owner
of a job's services in every launch mode: ``prague run``'s launcher (:mod:`prague.runtime.launcher`),
rank 0's guard under torchrun (:mod:`prague.runtime.guard`) and, for a script's own method under
torchrun, rank 0 itself (:mod:`prague.algorithms.prague.source`) each hold one. It starts the services,
publishes their ready text in the job's store, starts one that died again from the workers' state
(``ServiceSpec.restore``) and keeps ``services.json`` current.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prague import jobenv
from prague.jobenv import JobEnv
from prague.errors import CommError
from prague.io import atomic_write_json

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


def start_service(spec: ServiceSpec, log: Path | None = None, *, new_session: bool = False,
                  ) -> tuple[subprocess.Popen[bytes], str | None]:
    """Start ``spec`` as a child of this process (its output goes to ``log``, appended, or else to ours; it
    dies with this process, :mod:`prague.runtime.parent`; ``new_session``: in a session of its own, so
    that a signal to its group reaches whatever it starts) and wait until it has written its ready file,
    if it has one; return the process and the file's text. On failure the child is killed before
    raising, naming ``log``."""
    if spec.ready_file is not None:
        spec.ready_file.unlink(missing_ok=True)
    env = jobenv.child({**spec.env, jobenv.LAUNCHER_PID: str(os.getpid())})
    out = None
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        out = open(log, "ab")
    try:
        proc = subprocess.Popen(list(spec.argv), env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT if out else None, start_new_session=new_session)
    finally:
        if out is not None:
            out.close()  # the child holds its own copy
    if spec.ready_file is None:
        return proc, None
    try:
        return proc, wait_ready(spec.name, spec.ready_file, proc.poll, spec.ready_timeout_s)
    except ServiceNotReady as exc:
        stop_process(proc, grace_s=0.0)
        if log is not None:
            raise ServiceNotReady(spec.name, exc.exitcode, f"{exc.why}; its output ({log}):\n{tail(log)}") from None
        raise
    except BaseException:
        stop_process(proc, grace_s=0.0)
        raise


def tail(log: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a service's output file (``(no output)`` for none)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "(no output)"
    return "".join(text.splitlines(keepends=True)[-lines:]) or "(no output)"


class ServiceKeeper:
    """Starts a job's services in order, each ready before the next (see the module docstring). ``store``:
    where each one's ready text is published (``publish_key``) and whence ``restore`` reads the workers'
    state; ``services_file``: the ``services.json`` kept current (name, pid, address, restarts);
    ``log_dir``: each service's output goes to ``NAME.log`` there (restarts append); ``new_session``:
    each in a session of its own (the launcher signals process groups)."""

    def __init__(self, store: Any, specs: Sequence[ServiceSpec], *, services_file: Path | None = None,
                 log_dir: Path | None = None, new_session: bool = False) -> None:
        self.store, self.specs = store, list(specs)
        self.services_file, self.log_dir, self.new_session = services_file, log_dir, new_session
        self.procs: list[subprocess.Popen[bytes]] = []
        self.records: list[dict[str, Any]] = []
        self._lost: set[int] = set()

    def log(self, index: int) -> Path | None:
        return None if self.log_dir is None else self.log_dir / f"{self.specs[index].name}.log"

    def start(self) -> None:
        """Start every service; :class:`ServiceNotReady` (with its output) if one exits or is not ready
        in time, after stopping those already started."""
        try:
            for index, spec in enumerate(self.specs):
                proc, address = start_service(spec, self.log(index), new_session=self.new_session)
                self.procs.append(proc)
                self._publish(spec, address)
                self.records.append({"name": spec.name, "pid": proc.pid, "address": address, "restarts": 0})
                self._write()
        except BaseException:
            self.stop(grace_s=0.0)
            raise

    def _publish(self, spec: ServiceSpec, address: str | None) -> None:
        if spec.publish_key and address is not None:
            self.store.set(spec.publish_key, address)

    def _write(self) -> None:
        if self.services_file is not None and self.specs:
            atomic_write_json(self.services_file, {"launcher_pid": os.getpid(), "services": self.records})

    def watch(self) -> list[tuple[str, int, str]]:
        """Start again each service that died, if it can continue the job (at most :data:`MAX_RESTARTS`
        times); returns those that died and were not started again, each once: (name, exit code, the
        end of its output)."""
        lost = []
        for index, (spec, proc) in enumerate(zip(self.specs, self.procs)):
            code = proc.poll()
            if code is None or index in self._lost:
                continue
            if self._restart(index, code):
                continue
            self._lost.add(index)
            log = self.log(index)
            lost.append((spec.name, code, tail(log) if log is not None else "(its output is this process's)"))
        return lost

    def _restart(self, index: int, code: int) -> bool:
        spec, record = self.specs[index], self.records[index]
        if spec.restore is None or record["restarts"] >= MAX_RESTARTS:
            return False
        try:
            proc, address = start_service(restarted(spec, self.store), self.log(index), new_session=self.new_session)
        except CommError as exc:
            sys.stderr.write(f"prague: warning: could not restart service {spec.name!r}: {exc}\n")
            return False
        self.procs[index] = proc
        self._publish(spec, address)
        record.update(pid=proc.pid, address=address, restarts=record["restarts"] + 1)
        self._write()
        sys.stderr.write(f"prague: warning: service {spec.name!r} exited (code {code}); restarted it (pid "
                         f"{proc.pid}, restart {record['restarts']})\n")
        sys.stderr.flush()
        return True

    def terminate(self) -> None:
        """Ask every running service to stop (SIGTERM; to its whole group when in a session of its own)."""
        for proc in self.procs:
            if proc.poll() is None:
                _signal(proc, signal.SIGTERM, self.new_session)

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL what is left after ``grace_s``; reaps every service."""
        self.terminate()
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal(proc, signal.SIGKILL, self.new_session)  # also what it started, in its group
            proc.wait()


def _signal(proc: subprocess.Popen[bytes], sig: int, group: bool) -> None:
    try:
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
    except (ProcessLookupError, PermissionError):
        pass


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


def services_managed(job: JobEnv) -> bool:
    """Whether ``job`` (a worker's environment, read once) is one whose declared services were started by
    its owner (the launcher, rank 0's guard: ``$PRAGUE_MANAGED_SERVICES`` is "1"), so that a method finds
    them through the store, not by the method on rank 0 (a script's own method under torchrun or
    ``prague launch``)."""
    return job.managed_services


def services_file_from_env(job: JobEnv) -> Path | None:
    """The ``services.json`` a service this process starts is listed in (``$PRAGUE_SERVICES_FILE`` of
    ``job``): a script's own method's services, under ``prague launch --log-dir`` or ``prague guard
    --out``, go in the job owner's file, which names no service of its own then. None if unset."""
    return job.services_file
