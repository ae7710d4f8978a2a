"""The job's environment: the one module of prague that reads or writes environment variables.

A process learns its place in a job from the variables whoever started it set: torchrun's (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_*``,
which ``prague run``'s launcher sets too) and prague's own (``PRAGUE_*``, named below). They are read here,
checked and typed, into one :class:`JobEnv` (:func:`current`); the environments prague gives the
processes it starts are written here too (:func:`child`, :func:`replace`, :func:`overridden`). No other
module of the package touches ``os.environ`` (a test keeps it so).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

from prague.errors import ConfigError

#: The process whose death kills this one (``prague run``'s launcher, a torchrun guard, the fork server):
#: set by whoever starts a worker or a service, read by :mod:`prague.runtime.parent`.
LAUNCHER_PID = "PRAGUE_LAUNCHER_PID"
#: How the launcher starts workers: ``fork`` (from the fork server) or ``exec``.
WORKER_START = "PRAGUE_WORKER_START"
#: "1": the job's declared services were started by its owner (launcher or guard), not by rank 0's method.
MANAGED_SERVICES = "PRAGUE_MANAGED_SERVICES"
#: The ``services.json`` a service started by this process is listed in.
SERVICES_FILE = "PRAGUE_SERVICES_FILE"
#: "1" in the child of a torchrun guard: it trains, it does not guard.
GUARDED = "PRAGUE_GUARDED"
#: The network namespace (an emulated host of ``prague run --hosts``) a worker joins first.
NETNS = "PRAGUE_NETNS"
#: The Group Generator's shared secret.
GG_TOKEN = "PRAGUE_GG_TOKEN"
#: The host a process says it runs on (overrides machine name and network namespace).
HOST_LABEL = "PRAGUE_HOST_LABEL"
#: Where a script's records go (its steps, its own metrics): ``prague launch --log-dir``, ``prague guard --out``.
OUT = "PRAGUE_OUT"
#: Where else a script's numbers go (``--report-to`` of ``prague launch`` and ``prague guard``: tensorboard, csv).
REPORT_TO = "PRAGUE_REPORT_TO"
#: Every variable of prague's own.
PRAGUE_VARIABLES = (LAUNCHER_PID, WORKER_START, MANAGED_SERVICES, SERVICES_FILE, GUARDED, NETNS, GG_TOKEN, HOST_LABEL,
                    OUT, REPORT_TO)

_LAUNCH_HINT = "start the job with `prague launch`, `prague run` or torchrun"


def _int(environ: Mapping[str, str], name: str, hint: str) -> int | None:
    raw = environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer; {hint}") from None


@dataclasses.dataclass(frozen=True)
class JobEnv:
    """One process's view of its job, as its environment gives it; ``None`` where a variable is unset."""

    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    local_world_size: int | None = None
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    #: torchrun's restarts of the job (``--max-restarts``); None outside torchrun.
    restart_count: int | None = None
    #: Started by torchrun's agent (``TORCHELASTIC_RUN_ID``).
    torchelastic: bool = False
    #: The job's store is the agent's (``TORCHELASTIC_USE_AGENT_STORE=True``; our launcher says so too).
    agent_store: bool = False
    launcher_pid: int | None = None
    worker_start: str | None = None
    managed_services: bool = False
    services_file: Path | None = None
    guarded: bool = False
    gg_token: str | None = None
    host_label: str | None = None
    netns: str | None = None
    #: The folder of a script's records (:data:`OUT`).
    out: Path | None = None
    #: Where else a script's numbers go (:data:`REPORT_TO`), as given: ``tensorboard,csv``.
    report_to: str | None = None
    #: ``OMP_NUM_THREADS``, when set to a positive count.
    threads: int | None = None

    @classmethod
    def read(cls, environ: Mapping[str, str]) -> JobEnv:
        """The job as ``environ`` describes it. Raises :class:`ConfigError` naming a malformed variable."""
        restarts = environ.get("TORCHELASTIC_RESTART_COUNT")
        restart_count = None
        if restarts is not None:
            try:
                restart_count = max(0, int(restarts or "0"))
            except ValueError:
                raise ConfigError(f"TORCHELASTIC_RESTART_COUNT={restarts!r} is not a count; it is torchrun's to "
                                  "set") from None
        threads = environ.get("OMP_NUM_THREADS", "")
        return cls(
            rank=_int(environ, "RANK", _LAUNCH_HINT), world_size=_int(environ, "WORLD_SIZE", _LAUNCH_HINT),
            local_rank=_int(environ, "LOCAL_RANK", _LAUNCH_HINT),
            local_world_size=_int(environ, "LOCAL_WORLD_SIZE", _LAUNCH_HINT),
            master_addr=environ.get("MASTER_ADDR") or "127.0.0.1",
            master_port=_int(environ, "MASTER_PORT", _LAUNCH_HINT),
            restart_count=restart_count, torchelastic="TORCHELASTIC_RUN_ID" in environ,
            agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            launcher_pid=_int(environ, LAUNCHER_PID, "it is set by prague's launcher; unset it"),
            worker_start=environ.get(WORKER_START) or None,
            managed_services=environ.get(MANAGED_SERVICES) == "1",
            services_file=Path(environ[SERVICES_FILE]) if environ.get(SERVICES_FILE) else None,
            guarded=environ.get(GUARDED) == "1", gg_token=environ.get(GG_TOKEN),
            host_label=environ.get(HOST_LABEL) or None, netns=environ.get(NETNS) or None,
            out=Path(environ[OUT]) if environ.get(OUT) else None, report_to=environ.get(REPORT_TO) or None,
            threads=int(threads) if threads.isdigit() and int(threads) > 0 else None,
        )

    @property
    def launched(self) -> bool:
        """Whether a launcher (ours or torchrun) described a job (``WORLD_SIZE`` is set)."""
        return self.world_size is not None

    @property
    def under_launcher(self) -> bool:
        """Whether a prague process (launcher, guard or fork server) started this one and watches it."""
        return self.launcher_pid is not None

    @property
    def under_torchrun(self) -> bool:
        """Started by torchrun's agent (not by ``prague run``'s launcher, which sets the same rank
        variables), and not already a guard's child."""
        return self.torchelastic and self.agent_store and not self.under_launcher and not self.guarded

    @property
    def attempt(self) -> int:
        """Which attempt of the job this is: torchrun's restart count, 0 otherwise."""
        return self.restart_count or 0

    def need(self, name: str) -> int:
        """The integer field ``name`` (``rank``, ``world_size``, ``master_port``...), or a
        :class:`ConfigError` naming its variable when it is unset."""
        value = getattr(self, name)
        if value is None:
            raise ConfigError(f"environment variable {name.upper()} is not set; {_LAUNCH_HINT}")
        return int(value)


def current() -> JobEnv:
    """This process's job, read now from its environment."""
    return JobEnv.read(os.environ)


def variables() -> Mapping[str, str]:
    """This process's whole environment, to read: for the variables that are not the job's (the allocator's, which
    :mod:`prague.simulate.memory` reads and sets for the process it starts)."""
    return os.environ


def child(updates: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a process this one starts: its own, with ``updates``."""
    return {**os.environ, **(updates or {})}


def replace(environ: Mapping[str, str], launcher_pid: int | None = None) -> None:
    """Make ``environ`` this process's whole environment (a worker forked from the fork server becomes
    what ``Popen(env=environ)`` would have started), with ``launcher_pid`` as its watched parent."""
    os.environ.clear()
    os.environ.update(environ)
    if launcher_pid is not None:
        os.environ[LAUNCHER_PID] = str(launcher_pid)


@contextlib.contextmanager
def overridden(updates: Mapping[str, str]) -> Iterator[None]:
    """``updates`` set in this process's environment for the ``with`` block (what a child started inside
    it inherits), then the previous values (or their absence) restored."""
    saved = {key: os.environ.get(key) for key in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
