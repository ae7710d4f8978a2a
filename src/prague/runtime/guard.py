"""The built-in worker under torchrun: each rank's process guards the one that trains.

torchrun ends the whole job (or, with ``--max-restarts``, starts every worker again) as soon as one of its
processes exits non-zero, and nothing under it watches heartbeats: a hung worker holds the job until the
communication timeout. What ``prague run``'s launcher gives the workers on one machine, someone outside
each worker who sees it crash or hang, declares it failed in the job's store (the survivors read the
failed set there, :class:`~prague.runtime.liveness.Membership`) and kills a hung one so that its peers'
connections to it fail at once, is under torchrun done by every rank's own process for its worker:

- ``prague worker`` started by torchrun becomes the rank's *guard*: it starts the same command again as
  its child (``PRAGUE_GUARDED=1``), which trains, and holds the child's lease
  (:class:`~prague.runtime.liveness.LeaseWatch` over its heartbeat in the store);
- a child that exits non-zero is declared failed (kind ``crash``); one whose heartbeat stops for
  ``--lease-s`` is declared failed (``hang``) and then killed;
- for a method that goes on without a failed worker (``Method.survives_failures``) the guard then exits
  0, so torchrun sees no failure and the other ranks go on. For one that needs every worker (``allreduce``,
  the parameter servers, ``lossy``) it exits 1, and torchrun stops the job or, with ``--max-restarts``,
  starts it again from its last checkpoint (:mod:`prague.train.loop`) without waiting for the
  communication timeout; the guards whose children only failed because of that one say nothing. A child
  that exits 2 (settings that cannot work, the same on every rank) fails the job in either case;
- rank 0's guard owns the job's services (:class:`ServiceKeeper`, as the launcher does on one machine):
  it starts those the method declares (the Group Generator, the parameter-server shards) before its
  child, on this machine's address towards the store, publishes their addresses and the environment
  every rank's child needs (the generator's token) in the store, starts a service that dies again from
  the workers' state, and keeps ``services.json`` current. A crash of rank 0's *worker* therefore leaves
  the services running;
- every guard waits at the end until every rank's guard has seen its child end, so that rank 0's
  services outlive every worker that may still ask them, then exits: 0 if at least one worker finished.

A script of the user's own (``prague.prepare``) is guarded the same way with ``torchrun ... -m prague
guard train.py ARGS``: the guard does not know the method, so the child says whether it survives failed
workers when it sets the method up (:func:`publish_survival`, under :data:`SURVIVES_KEY`); a child that
fails before that fails the job. Its services are rank 0's child's own (a Group Generator it starts
itself); when that rank fails, the survivors start it again on the lowest living rank
(:mod:`prague.algorithms.prague.source`).

What cannot be survived: the death of a guard (its whole process tree: a killed torchrun agent, a lost
machine). torchrun then sees a failed worker and stops or restarts the job, as for any torchrun job; if
that machine held the rendezvous store (the ``--rdzv-endpoint`` host), every rank loses the store and the
job ends. A rank 0 guard that dies takes the services with it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from prague import jobenv
from prague.errors import EXIT_USAGE, CommError, usage_message
from prague.io import atomic_write_json
from prague.runtime.context import ERROR_KEY, attempt_store
from prague.runtime.liveness import (
    PROGRESS_KEY, Failure, Inactivity, LeaseWatch, Membership, announce_failure, await_keys, job_summary,
    leaders_in_turn, progress_steps, read_counters, read_keys,
)
from prague.runtime.services import ServiceKeeper, ServiceSpec

ENV_KEY = "prague/guard/env"  # the environment rank 0's guard publishes for every rank's child
ENDED_KEY = "prague/guard/ended/"  # + rank: that rank's child has ended (finished, crashed or killed)
USAGE_SAID_KEY = "prague/guard/usage-said"  # the rank whose guard printed the job's usage error
SURVIVES_KEY = "prague/guard/survives/"  # + rank: "1" if the method of that rank's child survives failures
TICK_S = 0.2
#: For a method that needs every rank: how long a guard whose child reported its error after another
#: rank's child did waits for that rank's declaration before it declares its own (and, quiet, for that
#: rank's guard to end before its own).
ATTRIBUTION_S = 1.0


def under_torchrun(env: jobenv.JobEnv | None = None) -> bool:
    """Whether this process (``env``: its environment, read now by default) was started by torchrun's agent
    (not by ``prague run``'s launcher, which sets the same rank variables), and is not already a guarded
    child."""
    return (env or jobenv.current()).under_torchrun


def publish_survival(store: dist.Store, rank: int, survives: bool) -> None:
    """In a worker started by a guard or by ``prague launch``'s launcher (a script's own method): tell
    whoever watches it whether the method goes on without a failed worker. Nothing otherwise."""
    if jobenv.current().under_launcher:
        store.set(f"{SURVIVES_KEY}{rank}", "1" if survives else "0")


def published_survival(store: dist.Store, ranks: Iterable[int]) -> bool:
    """Whether any of ``ranks`` said its method survives failed workers (:func:`publish_survival`;
    every rank runs the same method, so one speaks for all); False if none said so yet."""
    return any(v == b"1" for v in read_keys(store, SURVIVES_KEY, ranks).values())


class Guard:
    """One rank's guard; see the module docstring. ``argv``: the child's command; ``services``/``env``: what
    the method declared (used on rank 0); ``survives``: whether the method goes on without a failed
    worker (None: the child says, :func:`publish_survival`); ``out``: the run's folder (``services.json``)."""

    def __init__(self, argv: Sequence[str], *, services: Sequence[ServiceSpec], env: dict[str, str],
                 survives: bool | None, lease_s: float, out: Path, timeout_s: float,
                 summary_file: Path | None = None, child_env: dict[str, str] | None = None) -> None:
        job = jobenv.current()
        self.rank, self.world_size = job.need("rank"), job.need("world_size")
        self.argv, self.survives, self.lease_s, self.timeout_s = list(argv), survives, lease_s, timeout_s
        self.store = attempt_store(dist.TCPStore(job.master_addr, job.need("master_port"), self.world_size,
                                                 is_master=False, timeout=timedelta(seconds=timeout_s)), job)
        # the services run with the environment the method declared for the job (the generator's token)
        specs = [dataclasses.replace(spec, env={**env, **spec.env}) for spec in services] if self.rank == 0 else []
        self.out = out  # a script's records go there too (its steps, its metrics)
        self.summary_file = summary_file  # rank 0 writes how a script's job ended there
        self.child_env = dict(child_env or {})  # this guard's own settings for its child (--report-to)
        self.services_file = out / "services.json"  # a script's own services are listed there too
        self.keeper = ServiceKeeper(self.store, specs, services_file=self.services_file, log_dir=out / "logs")
        self.membership = Membership(self.store, self.world_size)
        self.env = env
        self.child: subprocess.Popen[bytes] | None = None
        self.failure: Failure | None = None

    def run(self) -> int:
        """Guard the child until the job has settled; the exit code for torchrun. Rank 0's guard then
        writes how the job ended in ``summary_file``, if given (a script's job: :func:`job_summary`)."""
        code: int | None = None
        try:
            code = self._guard()
            return code
        finally:
            if self.rank == 0 and self.summary_file is not None:
                self._write_summary(code, self.summary_file)

    def _write_summary(self, code: int | None, path: Path) -> None:
        """``path``: what every guard knows through the store at this point (ranks that have
        not ended have no exit code yet); best effort: the store may be gone with the job."""
        try:
            ranks = range(self.world_size)
            ended = read_keys(self.store, ENDED_KEY, ranks)
            progress = read_keys(self.store, PROGRESS_KEY, ranks)
            summary = job_summary(
                self.world_size, None if code == 0 else f"rank 0's guard exited with code {code}",
                [int(ended[r]) if r in ended else None for r in ranks], [progress_steps(progress.get(r)) for r in ranks],
                self.membership.failed(), leaders_in_turn(self.store, self.world_size))
            atomic_write_json(path, summary)
        except (RuntimeError, OSError, ValueError) as exc:  # a store that went away, an unwritable folder
            sys.stderr.write(f"prague guard: warning: cannot write {path}: {exc}\n")

    def _guard(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)  # torchrun stops its workers with SIGTERM
        try:
            env = self._job_env()
            self.child = subprocess.Popen(self.argv, env=jobenv.child({
                **env, **self.child_env, jobenv.GUARDED: "1", jobenv.LAUNCHER_PID: str(os.getpid()),
                jobenv.SERVICES_FILE: str(self.services_file.resolve()), jobenv.OUT: str(self.out.resolve())}))
            code = self._watch_child()
            self.store.set(f"{ENDED_KEY}{self.rank}", str(code))
            if code == EXIT_USAGE:  # settings that cannot work: the job fails, as unguarded
                self._say_usage_error()
                return code
            if code != 0 and not self._survives():  # torchrun stops the job, or restarts it
                if self.failure is None:  # another rank's failure ended this child: it is torchrun's cause
                    self._let_the_failed_end_first()
                return code if code > 0 else 1
            try:
                self._wait_for_every_rank()
            except CommError as exc:
                sys.stderr.write(f"prague: error: {exc}\n")
                return 1
            return 0 if code == 0 or (self.failure is not None and self._someone_finished()) else (code or 1)
        finally:
            self._stop_child()
            self.keeper.stop()

    def _say_usage_error(self) -> None:
        """The child's usage error (a ConfigError it published), as one line on the console, said by the
        first guard whose child had one: once for the job (every rank usually fails alike)."""
        report = read_keys(self.store, ERROR_KEY, [self.rank]).get(self.rank)
        message = usage_message(json.loads(report.decode()).get("traceback", "")) if report else None
        if message is None:
            return
        if self.store.compare_set(USAGE_SAID_KEY, "", str(self.rank)).decode() == str(self.rank):
            sys.stderr.write(f"prague guard: error: rank {self.rank}: {message}\n")
            sys.stderr.flush()

    def _job_env(self) -> dict[str, str]:
        """Rank 0: start the services and publish the children's environment; the others read it."""
        if self.rank == 0:
            self.keeper.start()
            self.store.set(ENV_KEY, json.dumps(self.env))
            return self.env
        deadline = time.monotonic() + self.timeout_s
        while True:  # in slices: torchrun's SIGTERM (rank 0 failed) is handled between them
            if await_keys(self.store, [ENV_KEY], 1.0):
                return dict(json.loads(self.store.get(ENV_KEY)))
            if time.monotonic() > deadline:
                raise CommError(f"rank {self.rank}'s guard: rank 0 did not publish the job's services "
                                f"within {self.timeout_s:g} s")

    def _watch_child(self) -> int:
        assert self.child is not None
        leases = LeaseWatch(self.lease_s)
        while True:
            code = self.child.poll()
            if code is not None:
                if code not in (0, EXIT_USAGE):
                    self._declare("crash", f"crashed (exit code {code})")
                return code
            self._watch_services()
            if leases.observe(read_counters(self.store, [self.rank]), time.monotonic(),  # an error reported: exiting
                              lambda late: read_keys(self.store, ERROR_KEY, late)):
                self._declare("hang", f"stopped making progress (no heartbeat for {self.lease_s:g} s; --lease-s)")
                self.child.kill()  # fencing: its peers' connections to it fail now
                self.child.wait()
                return -signal.SIGKILL
            time.sleep(TICK_S)

    def _watch_services(self) -> None:
        for name, code, output in self.keeper.watch():  # the workers asking it fail, and are declared so
            sys.stderr.write(f"prague: warning: service {name!r} exited (code {code}) and cannot be started "
                             f"again:\n{output}\n")
            sys.stderr.flush()

    def _survives(self) -> bool:
        if self.survives is None:  # the child's method said so, if it got that far
            return published_survival(self.store, [self.rank])
        return self.survives

    def _declare(self, kind: str, detail: str) -> None:
        survives = self._survives()
        if not survives:
            others = [r for r in range(self.world_size) if r != self.rank]
            if self.membership.wait_declared(others, ATTRIBUTION_S if self._another_failed_first() else 0.0):
                return  # the job is ending: this worker failed because another did, which is declared
        steps = progress_steps(read_keys(self.store, PROGRESS_KEY, [self.rank]).get(self.rank))
        self.failure = Failure(self.rank, steps, kind, detail)
        if survives:
            announce_failure(self.store, self.failure)
        else:
            announce_failure(self.store, self.failure, "the method needs every worker: torchrun stops the job, or "
                             "with --max-restarts starts it again from its last checkpoint", level="error")

    def _another_failed_first(self) -> bool:
        """Whether another rank's child reported an error (the report a worker leaves in the store before it
        exits, :func:`prague.runtime.context.report_failure`) before this rank's did: then this child's
        error is most likely that failure seen from here (a broken collective), and the other rank's guard
        is the one to declare it. A child killed without a report (SIGKILL) reports at no time."""
        reports = read_keys(self.store, ERROR_KEY, range(self.world_size))
        times = {}
        for rank, text in reports.items():
            try:
                times[rank] = float(json.loads(text)["time"])
            except (ValueError, KeyError, TypeError):
                continue
        own = times.pop(self.rank, float("inf"))
        return any(t < own for t in times.values())

    def _let_the_failed_end_first(self) -> None:
        """Before this guard exits because another rank failed: wait (at most ATTRIBUTION_S) until the
        declared ranks' guards have ended, and a moment more, so torchrun, which reports the first worker
        to exit as the root cause and stops the others, names the rank that failed."""
        failed = list(self.membership.failed())
        deadline = time.monotonic() + ATTRIBUTION_S
        while time.monotonic() < deadline:
            if set(failed) <= set(read_keys(self.store, ENDED_KEY, failed)):
                time.sleep(ATTRIBUTION_S / 2)  # its guard's exit, then torchrun's next look (0.1 s apart)
                return
            time.sleep(TICK_S / 4)

    def _wait_for_every_rank(self) -> None:
        """Until every rank's child has ended (rank 0's services serve them to the end); the wait counts
        inactivity, as every wait on peers does."""
        idle = Inactivity(self.store, self.timeout_s, slice_s=TICK_S)
        while True:
            ended = read_keys(self.store, ENDED_KEY, range(self.world_size))
            waiting = [r for r in range(self.world_size) if r not in ended]
            if not waiting:
                return
            self._watch_services()
            if idle.expired(waiting):
                raise CommError(f"rank {self.rank}'s guard: ranks {waiting} neither ended nor made progress "
                                f"for {self.timeout_s:g} s")
            time.sleep(TICK_S)

    def _someone_finished(self) -> bool:
        ended = read_keys(self.store, ENDED_KEY, range(self.world_size))
        return any(v == b"0" for v in ended.values())

    def _stop_child(self) -> None:
        if self.child is not None and self.child.poll() is None:
            self.child.kill()
            self.child.wait()

    def _on_signal(self, signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # the finally clauses stop the child and the services

