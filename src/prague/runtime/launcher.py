"""The single-machine launcher behind ``prague run`` and ``prague launch``.

It hosts the job's rendezvous store (a ``TCPStore`` on a port the OS picks), starts one process per
rank with the same environment torchrun gives (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT,
``TORCHELASTIC_USE_AGENT_STORE=True``), starts any service processes the method needs, shows progress,
and guarantees that no process outlives it:

- returns 0 only if every worker exited 0, or, for a method that survives failures
  (``LaunchSpec.survivable``; for a script's own method, what its workers published when they set it
  up, :func:`prague.runtime.guard.publish_survival`), if every worker that did not fail exited 0;
- holds every worker's lease (:mod:`prague.runtime.liveness`): a worker whose heartbeat stops for
  ``lease_s`` while its process runs has hung;
- when a worker fails (exits non-zero, or hangs) and the method cannot survive it, stops the others at
  once (SIGTERM, then SIGKILL after ``grace_s``) and raises :class:`WorkerFailed` carrying that
  worker's rank and traceback; when the method survives it, declares the failure in the store (the
  survivors read it there), kills a hung worker (so its peers' connections to it fail at once), warns
  on stderr naming the rank, and waits for the others (:attr:`Job.failures`);
- keeps the job's services with a :class:`~prague.runtime.services.ServiceKeeper`: starts one that dies
  mid-run again if it can continue the job (``ServiceSpec.restore``: the Group Generator, from the groups
  the workers published), and keeps ``services.json`` (pid, address, restarts) current;
- prints on its stderr the stall warnings the workers publish (:mod:`prague.runtime.stall`);
- Ctrl-C (SIGINT) or SIGTERM to the launcher does the same and raises ``KeyboardInterrupt``.

Workers run in their own sessions, so a terminal's Ctrl-C reaches only the launcher, which then stops
them; they also ask the kernel to kill them if the launcher dies (``PR_SET_PDEATHSIG``). ``prague
worker`` processes are forked from a preloaded fork server rather than started as new interpreters
(:mod:`prague.runtime.forkserver`): the same environment, session and output, without each worker
importing torch again.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import IO

import torch.distributed as dist

from prague import jobenv
from prague.errors import EXIT_USAGE, ConfigError, WorkerFailed
from prague.io import atomic_write_json
from prague.runtime.background import FunctionWork
from prague.runtime.context import ERROR_KEY, SURVIVABLE
from prague.runtime.forkserver import ForkedWorker, forkable, start_mode
from prague.runtime.liveness import (
    LAUNCHER_TICK_S, PROGRESS_KEY, Failure, LeaseWatch, announce_failure, job_summary, progress_steps, read_counters,
    read_keys,
)
from prague.runtime.services import ServiceKeeper, ServiceNotReady, ServiceSpec
from prague.runtime.guard import published_survival
from prague.runtime.stall import STALL_KEY, stall_message


@dataclass(frozen=True)
class LaunchSpec:
    """What to start: ``argv`` once per rank, ``nproc`` times."""

    argv: Sequence[str]
    nproc: int
    log_dir: Path | None = None
    echo_ranks: frozenset[int] = frozenset()
    grace_s: float = 5.0
    env: dict[str, str] = field(default_factory=dict)
    services: Sequence[ServiceSpec] = ()
    survivable: bool | None = False  # None: the workers say when they set their method up (a script)
    lease_s: float = 10.0
    services_file: Path | None = None  # where to list the services (pid, address, restarts) for an operator
    master_addr: str = "127.0.0.1"  # where workers reach the store (the bridge's address with emulated hosts)
    rank_env: Sequence[dict[str, str]] = ()  # per rank, on top of ``env`` (an emulated host's namespace)
    service_env: dict[str, str] = field(default_factory=dict)  # for services, on top of ``env``
    summary_file: Path | None = None  # where to write how the job ended (a script's: prague launch --log-dir)

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ConfigError(f"--nproc must be >= 1, got {self.nproc}")
        if not self.lease_s > 0:
            raise ConfigError(f"--lease-s must be > 0, got {self.lease_s!r}")
        if not self.argv:
            raise ConfigError("nothing to launch: the command is empty")
        if self.rank_env and len(self.rank_env) != self.nproc:
            raise ConfigError(f"rank_env has {len(self.rank_env)} entries for {self.nproc} ranks")


class _Proc:
    """One child process whose merged stdout/stderr is drained by a thread into a log and a tail.
    ``prague worker`` processes are forked from the preloaded fork server unless ``fork`` is False
    (:mod:`prague.runtime.forkserver`); anything else is started with :class:`subprocess.Popen`."""

    def __init__(self, label: str, argv: Sequence[str], env: dict[str, str], log_path: Path | None, echo: bool,
                 fork: bool = False) -> None:
        self.label = label
        self.tail: collections.deque[str] = collections.deque(maxlen=200)
        self.popen: subprocess.Popen[str] | ForkedWorker
        if fork and forkable(argv) and start_mode(jobenv.JobEnv.read(env)) == "fork":
            self.popen = ForkedWorker(argv, env)
        else:
            self.popen = subprocess.Popen(
                list(argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, text=True, errors="replace", bufsize=1,
            )
        self._log: IO[str] | None = open(log_path, "w", buffering=1) if log_path else None
        self.echo = echo  # its output goes to the console too (it may start to: a new leader's)
        self.exit_time: float | None = None
        self._reader = FunctionWork(f"reader of {label}'s output", f"drain-{label}", self._drain)

    def _drain(self, _index: int = 0) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.tail.append(line)
            if self._log:
                self._log.write(line)
            if self.echo:
                sys.stdout.write(f"[{self.label}] {line}")
                sys.stdout.flush()
        self.popen.wait()
        self.exit_time = time.monotonic()

    def poll(self) -> int | None:
        return self.popen.poll()

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def finish(self) -> None:
        self._reader.join(2.0)
        if self._log:
            self._log.close()
            self._log = None

    def log_only(self, text: str) -> None:
        """Write ``text`` to this process's log, not to the console (once its own output has ended)."""
        self._reader.join(2.0)
        if self._log:
            self._log.write(text if text.endswith("\n") else text + "\n")


class Job:
    """A running launch; use :func:`launch` unless you need the store before the workers start."""

    def __init__(self, spec: LaunchSpec) -> None:
        self.spec = spec
        self.store = dist.TCPStore("127.0.0.1", 0, spec.nproc, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=60))
        self.port = self.store.port
        self.workers: list[_Proc] = []
        self.services = ServiceKeeper(self.store, [], services_file=spec.services_file, log_dir=spec.log_dir,
                                      new_session=True)
        self.leases = LeaseWatch(spec.lease_s)
        self.failures: dict[int, Failure] = {}  # workers lost by a method that survives them
        self.leaders: list[int] = [0]  # the job's leader (lowest living rank), each time it moved
        self._stalls_seen: dict[int, bytes] = {}
        self._stalls_read = 0.0

    def base_env(self) -> dict[str, str]:
        env = jobenv.child({
            "MASTER_ADDR": self.spec.master_addr, "MASTER_PORT": str(self.port), "WORLD_SIZE": str(self.spec.nproc),
            "LOCAL_WORLD_SIZE": str(self.spec.nproc), "TORCHELASTIC_USE_AGENT_STORE": "True",
            "PYTHONUNBUFFERED": "1", jobenv.LAUNCHER_PID: str(os.getpid()),
        })
        # n workers share this machine's cores: one intra-op thread each unless the user says otherwise.
        env.setdefault("OMP_NUM_THREADS", "1")
        env.update(self.spec.env)
        return env

    def _log_path(self, name: str) -> Path | None:
        if self.spec.log_dir is None:
            return None
        self.spec.log_dir.mkdir(parents=True, exist_ok=True)
        return self.spec.log_dir / f"{name}.log"

    def start(self) -> None:
        env = self.base_env()
        self.services.specs = [dataclasses.replace(svc, env={**env, **self.spec.service_env, **svc.env})
                               for svc in self.spec.services]
        try:
            self.services.start()
        except ServiceNotReady as exc:
            raise WorkerFailed(-1, exc.exitcode, str(exc)) from None
        for rank in range(self.spec.nproc):
            wenv = {**env, **(self.spec.rank_env[rank] if self.spec.rank_env else {}), "RANK": str(rank),
                    "LOCAL_RANK": str(rank)}
            self.workers.append(
                _Proc(f"rank {rank}", self.spec.argv, wenv, self._log_path(f"rank{rank}"), rank in self.spec.echo_ranks,
                      fork=True)
            )

    def progress(self) -> dict[int, str]:
        """Latest progress string each worker published (``step,steps,loss``)."""
        try:
            return {rank: v.decode() for rank, v in read_keys(self.store, PROGRESS_KEY, range(self.spec.nproc)).items()}
        except RuntimeError:
            return {}

    def reported_errors(self) -> dict[int, tuple[float, str]]:
        """Tracebacks the workers published before exiting: rank -> (time, traceback)."""
        try:
            reports = read_keys(self.store, ERROR_KEY, range(self.spec.nproc))
        except RuntimeError:
            return {}
        errors: dict[int, tuple[float, str]] = {}
        for rank, text in reports.items():
            try:
                report = json.loads(text.decode())
                errors[rank] = (float(report["time"]), str(report["traceback"]))
            except (ValueError, KeyError):
                pass
        return errors

    def first_failure(self, settle_s: float = 1.0) -> WorkerFailed:
        """The failure that came first: when one rank raises, its peers soon fail too (their collectives
        break), so collect the reports for ``settle_s`` and blame the earliest."""
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline and any(w.poll() is None for w in self.workers):
            time.sleep(0.05)
        errors = self.reported_errors()
        if errors:
            rank = min(errors, key=lambda r: errors[r][0])
            detail = errors[rank][1]
            for r, (_, text) in errors.items():  # a script's usage error: its rank printed nothing (the
                if self.workers[r].poll() == EXIT_USAGE:  # console gets one line), its log keeps it whole
                    self.workers[r].log_only(text)
        else:  # nothing published (a script not using run_worker): blame the first to exit
            failed = [r for r, w in enumerate(self.workers) if w.poll() not in (None, 0)]
            for r in failed:
                self.workers[r].finish()
            rank = min(failed, key=lambda r: self.workers[r].exit_time or float("inf"))
            detail = "".join(self.workers[rank].tail) or "(no output)"
            popen = self.workers[rank].popen
            lost = popen.lost_exit() if isinstance(popen, ForkedWorker) else None
            if lost is not None:
                detail += f"\n({lost})"
        others = sorted(r for r, w in enumerate(self.workers) if w.poll() not in (None, 0) and r != rank)
        if self.workers[rank].poll() == EXIT_USAGE:  # settings that cannot work fail every rank alike
            others = [r for r in others if self.workers[r].poll() != EXIT_USAGE]
        if others:
            detail += f"\n(ranks {others} failed after it)"
        return WorkerFailed(rank, self.workers[rank].poll(), detail)

    def steps_done(self, rank: int) -> int:
        """The steps ``rank`` reported finished (its progress key), 0 before its first."""
        return progress_steps(self.progress().get(rank))

    def _hung(self, codes: list[int | None]) -> list[int]:
        """Running workers whose lease ran out."""
        running = [r for r, c in enumerate(codes) if c is None]
        try:
            counters = read_counters(self.store, running)
            # of those whose lease ran out, the ones that reported an error: on their way out
            hung = self.leases.observe(counters, time.monotonic(),
                                       lambda late: read_keys(self.store, ERROR_KEY, late))
        except RuntimeError:
            return []
        return [r for r in hung if r not in self.failures]

    def _survivable(self) -> bool:
        if self.spec.survivable is not None:
            return self.spec.survivable
        try:
            return published_survival(self.store, range(self.spec.nproc))
        except RuntimeError:
            return False

    def _lose(self, rank: int, kind: str, detail: str) -> None:
        """A survivable failure: declare it, warn (or, for a rank whose own
        torch.distributed call broke under an earlier failure, say it failed for that reason); say when
        the job's leader, its lowest living rank, moves."""
        leader = self.leader()
        after = self.reported_after(rank) if kind == "crash" and self.failures else []
        if after:
            detail = (f"failed for the same reason as rank {after[0]} (its torch.distributed call broke when that "
                      "rank failed)")
        failure = Failure(rank, self.steps_done(rank), kind, detail)
        self.failures[rank] = failure
        now = self.leader()
        if now != leader and now >= 0 and self.workers[leader].echo:  # before the failure is declared: what
            self.workers[now].echo = True  # the new leader prints once it learns of it reaches the console
        if after:  # the rank said what to use instead (SURVIVABLE) in its own line
            announce_failure(self.store, failure, "the others go on where they use prague's collectives")
        else:
            announce_failure(self.store, failure)
        if now != leader and now >= 0:
            self.leaders.append(now)
            sys.stderr.write(f"prague: rank {now} leads the job now (rank {leader} failed)\n")
            sys.stderr.flush()

    def write_summary(self, error: BaseException | None) -> None:
        """``spec.summary_file``, if set: how the job ended (its exit, each rank's last step, the failures
        survived, and who led), written atomically."""
        if self.spec.summary_file is None:
            return
        codes = [w.poll() for w in self.workers]
        progress = self.progress()
        atomic_write_json(self.spec.summary_file, job_summary(
            self.spec.nproc, None if error is None else str(error).splitlines()[0], codes,
            [progress_steps(progress.get(r)) for r in range(len(self.workers))], self.failures, self.leaders))

    def leader(self) -> int:
        """The lowest rank not lost, -1 if none is left."""
        return next((r for r in range(len(self.workers)) if r not in self.failures), -1)

    def reported_after(self, rank: int) -> list[int]:
        """The ranks whose failure ``rank`` reported as the cause of its own (its collective's peers)."""
        try:
            raw = read_keys(self.store, ERROR_KEY, [rank]).get(rank)
            after = json.loads(raw.decode()).get("after", []) if raw else []
        except (RuntimeError, ValueError):
            return []
        return [int(r) for r in after if int(r) in self.failures]

    def report_stalls(self, every_s: float = 1.0) -> None:
        """Print each stall warning a worker published since the last look (:mod:`prague.runtime.stall`);
        looks at most every ``every_s``."""
        now = time.monotonic()
        if now - self._stalls_read < every_s:
            return
        self._stalls_read = now
        try:
            reports = read_keys(self.store, STALL_KEY, range(self.spec.nproc))
        except RuntimeError:
            return
        for rank, raw in sorted(reports.items()):
            if self._stalls_seen.get(rank) != raw and rank not in self.spec.echo_ranks:  # echoed ones print their own
                sys.stderr.write(stall_message(json.loads(raw)) + "\n")
                sys.stderr.flush()
            self._stalls_seen[rank] = raw

    def stop(self) -> None:
        """Stop every child: SIGTERM, then SIGKILL those still alive after the grace period."""
        procs = self.workers
        for p in procs:
            if p.poll() is None:
                p.signal_group(signal.SIGTERM)
        self.services.terminate()
        deadline = time.monotonic() + self.spec.grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.05)
        for p in procs:
            p.signal_group(signal.SIGKILL)  # also reaps grandchildren left in the group
            try:
                p.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            p.finish()
        self.services.stop(grace_s=max(0.0, deadline - time.monotonic()))

    def wait(self, on_tick: Callable[["Job"], None] | None = None, tick_s: float = LAUNCHER_TICK_S) -> None:
        """Block until all workers exit 0 (then stop services) or one fails (then stop all and raise)."""
        while True:
            codes = [w.poll() for w in self.workers]
            hung = self._hung(codes)
            crashed = [r for r, code in enumerate(codes) if code not in (None, 0) and r not in self.failures]
            survivable = bool(hung or crashed) and self._survivable()  # asked only when a worker failed
            for rank in hung:
                detail = f"stopped making progress (no heartbeat for {self.spec.lease_s:g} s; --lease-s)"
                # fencing, whether the others go on or not: its peers' connections to it fail now, and a frozen
                # process ignores the SIGTERM of stop(), which would wait out its grace
                self.workers[rank].signal_group(signal.SIGKILL)
                if not survivable:
                    self.stop()
                    raise WorkerFailed(rank, None, f"rank {rank} {detail}; this method cannot go on without it")
                self._lose(rank, "hang", detail)
            # A worker that found its settings cannot work (exit 2: a ConfigError, such as a pace it cannot
            # hold or a wrong token) is no failure to survive: the others have the same settings.
            if crashed and (not survivable or any(codes[r] == EXIT_USAGE for r in crashed)):
                failure = self.first_failure()
                self.stop()
                raise failure
            for rank in crashed:
                self._lose(rank, "crash", f"crashed (exit code {codes[rank]})")
            if len(self.failures) == len(self.workers):
                first = next(iter(self.failures.values()))  # the cause; the others failed after it
                cause = f"rank {first.rank} {first.detail} after {first.step} steps; every other rank failed after it"
                if all(r == first.rank or self.reported_after(r) for r in self.failures):
                    # each of them said so (its own torch.distributed call broke): their lines said it all
                    detail = f"{cause}, its own torch.distributed call broken by that failure; {SURVIVABLE}"
                else:
                    detail = f"{cause}:\n{self.first_failure(settle_s=0.0).detail}"
                self.stop()
                raise WorkerFailed(first.rank, self.workers[first.rank].poll(), detail)
            lost = self.services.watch() if any(c is None for c in codes) else []
            if lost:
                name, code, output = lost[0]
                self.stop()
                raise WorkerFailed(-1, code, f"service {name!r} exited early:\n{output}")
            if all(c == 0 or r in self.failures for r, c in enumerate(codes)):
                self.stop()
                return
            self.report_stalls()
            if on_tick is not None:
                on_tick(self)
            time.sleep(tick_s)


def launch(spec: LaunchSpec, on_tick: Callable[[Job], None] | None = None) -> Job:
    """Run ``spec`` to completion; see the module docstring for the failure contract.

    SIGINT/SIGTERM received while waiting stop every child before ``KeyboardInterrupt`` propagates.
    """
    job = Job(spec)
    previous = signal.getsignal(signal.SIGTERM)

    def _terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    in_main = threading.current_thread() is threading.main_thread()
    if in_main:
        signal.signal(signal.SIGTERM, _terminate)
    try:
        job.start()
        job.wait(on_tick)
        job.write_summary(None)
    except BaseException as exc:
        job.stop()
        job.write_summary(exc)
        raise
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
    return job
