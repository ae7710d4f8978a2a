"""Start ``prague worker`` processes, and ``prague launch``'s scripts, from a preloaded fork server instead of a
fresh interpreter each.

A worker spends about 4 s of CPU importing before it does anything: torch (1.5 s), ``torch._dynamo``
(1.5 s; every ``torch.optim`` optimizer imports it) and, for the digits data set, scikit-learn (1.2 s).
Eight workers on a two-core machine wait over 15 s for that. So the launcher starts one server process
(Python's ``multiprocessing`` fork server) that imports all of it once (:mod:`prague.preload`),
and forks each worker from it: a worker costs a fork, and a ``prague bench`` of many runs pays the
imports once.

Forking is safe only from a single-threaded process: the server is started with one BLAS/OpenMP
thread (numpy's OpenBLAS would otherwise start a pool at import) and imports nothing that starts
threads; a forked worker then sets its own thread count from the job's ``OMP_NUM_THREADS``. Each worker
gets the environment, working directory, session and output pipe that :class:`subprocess.Popen` would
give it, so the launcher treats both kinds the same (:class:`ForkedWorker` has the part of the
``Popen`` interface it uses). The server exits when the launcher does; its workers ask the kernel to
kill them when the server dies (``PR_SET_PDEATHSIG``), so none outlives the launcher.

A script ``prague launch`` runs (``python script.py ARGS``) is forked the same way and run as the interpreter runs
it (:func:`_run_script`): a 4-rank launch of a small script took 9-10 s instead of 13-14 s here.

``PRAGUE_WORKER_START=exec`` starts every worker as a fresh interpreter instead (what torchrun does).

Left to itself the server would exit only once the launcher's interpreter has exited (it watches a pipe
the launcher holds), still tearing down its imports for 1-3 s after the command returned; the CLI
calls :func:`stop` at the end of every command, which kills it and waits until it has gone.
"""

from __future__ import annotations

import atexit
import io
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import runpy
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence

import setproctitle

from prague import jobenv
from prague.errors import ConfigError
from prague.runtime.parent import set_parent_death_signal

START_MODES = ("fork", "exec")
PRELOAD = "prague.preload"
#: What training imports beyond :data:`PRELOAD`, preloaded only for jobs that train (not emulated compute):
#: every ``torch.optim`` optimizer imports ``torch._dynamo`` on first use, 1.4 s.
TRAINING_PRELOAD = ("torch._dynamo",)
#: The fork server's own thread settings: one thread everywhere, so that forking from it is safe.
_SINGLE_THREADED = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_lock = threading.Lock()


def start_mode(env: jobenv.JobEnv) -> str:
    """``fork`` (default on Linux) or ``exec``, from ``$PRAGUE_WORKER_START``."""
    mode = env.worker_start or ("fork" if sys.platform.startswith("linux") else "exec")
    if mode not in START_MODES:
        raise ConfigError(f"${jobenv.WORKER_START} must be one of {', '.join(START_MODES)}, got {mode!r}")
    return "exec" if not sys.platform.startswith("linux") else mode


def forkable(argv: Sequence[str]) -> bool:
    """Whether ``argv`` is this interpreter running ``prague worker``, or a Python script (``prague launch``'s
    ranks: ``python script.py ARGS``, the script an existing ``.py`` file): the commands forked."""
    argv = list(argv)
    if argv[:4] == [sys.executable, "-m", "prague", "worker"]:
        return True
    return (len(argv) >= 2 and argv[0] == sys.executable and argv[1].endswith(".py") and not argv[1].startswith("-")
            and os.path.isfile(argv[1]))


def preload_modules(trains: bool = True, imports: Sequence[str] = ()) -> list[str]:
    """What the fork server imports before it forks: prague's runtime (:data:`PRELOAD`), what training
    needs if the jobs ``trains`` (emulated compute does not), and ``imports``: what the job's method and
    data set import anyway (:attr:`prague.algorithms.spec.Method.worker_imports`,
    :func:`prague.workload.catalog.loader_imports`); each once, in that order."""
    return list(dict.fromkeys([PRELOAD, *(TRAINING_PRELOAD if trains else ()), *imports]))


def _context(trains: bool = True, imports: Sequence[str] = ()) -> multiprocessing.context.ForkServerContext:
    """The fork server, started on first use with :func:`preload_modules` and a single-threaded environment.
    Later jobs reuse it as it is: a worker imports what it lacks itself."""
    ctx = multiprocessing.get_context("forkserver")
    with _lock:
        ctx.set_forkserver_preload(preload_modules(trains, imports))
        with jobenv.overridden(_SINGLE_THREADED):  # the server inherits it when it starts
            multiprocessing.forkserver.ensure_running()
    return ctx


def prestart(trains: bool = True, imports: Sequence[str] = ()) -> None:
    """Start the fork server now (unless workers are to be exec'd) with :func:`preload_modules`, so that
    its imports overlap the launcher's own preparations; the first fork waits for them."""
    if start_mode(jobenv.current()) == "fork":
        _context(trains, imports)


def stop() -> None:
    """Stop this process's fork server, if it started one, and the resource tracker it shares with it,
    and wait until both have exited (a later job starts new ones). The server is killed, then reaped by
    ``multiprocessing``'s own stop (which closes the pipe it watches and removes its socket): it holds nothing
    to save (no file; its workers have exited or die with it), and an orderly exit would first tear down
    its imports, torch's included (0.8 s of a 5 s two-worker run, measured). The tracker, a small
    interpreter, is stopped the orderly way; left alone it would exit only after this process, a moment
    the command's caller could see."""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    tracker = getattr(multiprocessing.resource_tracker, "_resource_tracker", None)
    with _lock:
        pid = getattr(server, "_forkserver_pid", None)
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # gone already: the stop below reaps it
                pass
        for process in (server, tracker):  # the server holds the tracker's pipe too: it goes first
            stopping = getattr(process, "_stop", None)
            if stopping is not None:
                stopping()


def server_pid() -> int | None:
    """The pid of the fork server this process started, None if it started none (or stopped it)."""
    pid = getattr(getattr(multiprocessing.forkserver, "_forkserver", None), "_forkserver_pid", None)
    return pid if isinstance(pid, int) else None


def running(pid: int) -> bool:
    """Whether process ``pid`` is running, read from ``/proc`` (not by waiting on it, which would reap a child
    someone else waits for): False once it has exited, a zombie whose status is not yet read included."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            state = fh.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def server_running() -> bool | None:
    """Whether the fork server this process started is still running (None: it started none);
    ``multiprocessing`` reaps it itself, so :func:`running` reads it."""
    pid = server_pid()
    return None if pid is None else running(pid)


class ForkedWorker:
    """A ``prague worker`` forked from the fork server; the subset of :class:`subprocess.Popen` the
    launcher uses (``pid``, ``stdout``, ``poll``, ``wait``)."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str]) -> None:
        if not forkable(argv):
            raise ConfigError(f"only `{sys.executable} -m prague worker ...` or `{sys.executable} SCRIPT.py ...` can "
                              f"be forked, got {list(argv)[:4]}")
        self.args = list(argv)
        ctx = _context()
        read_fd, write_fd = os.pipe()
        writer = multiprocessing.connection.Connection(write_fd, readable=False)
        self._process = ctx.Process(target=_worker_main, args=(list(argv[1:]), dict(env), writer, server_pid()),
                                    name="prague-worker")
        try:
            self._process.start()
        finally:
            writer.close()  # the worker holds its own copy; EOF on stdout then means it exited
        assert self._process.pid is not None  # started
        self.pid: int = self._process.pid
        self.stdout: io.TextIOWrapper = open(read_fd, encoding="utf-8", errors="replace")  # noqa: SIM115
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def lost_exit(self) -> str | None:
        """What an exit code of 255 may mean besides the worker's own ``exit(255)``: ``multiprocessing`` reports
        255 when the fork server's report of the exit never comes, which happens when the server is gone (its
        workers die with it, or, if they ignore that, run on unreported). None for any other code."""
        if self.poll() != 255:
            return None
        if server_running() is False:
            return ("the fork server had exited, so this worker's exit was never reported: 255 stands for the lost "
                    "status, not for the worker's own code")
        return ("the fork server is still running: either the worker exited with 255 itself, or its report of the "
                "exit was lost on the way")


def _worker_main(args: list[str], env: dict[str, str], out: multiprocessing.connection.Connection,
                 server: int | None = None) -> None:
    """In the forked worker: become what ``Popen(argv, env=env, start_new_session=True, stdout=PIPE,
    stderr=STDOUT)`` would have started, then run ``python ARGS`` in it (``-m prague worker ...``, or a
    script)."""
    os.setsid()
    setproctitle.setproctitle(" ".join([sys.executable, *args]))  # what ps shows: the command
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    out.close()
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True, write_through=True)
    # The server is this process's parent: named by the launcher, since by now it may have died and left this
    # process to another parent. Every forked process (a launched script too, whether or not it joins prague's
    # context) dies with it, or exits at once if it is already gone.
    jobenv.replace(env, launcher_pid=os.getppid() if server is None else server)
    set_parent_death_signal()
    threads = jobenv.current().threads
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    if args[0] == "-m":
        sys.argv = [sys.executable, *args[2:]]
        runpy.run_module("prague", run_name="__main__", alter_sys=True)  # what `python -m prague ARGS` runs
    else:
        _run_script(args[0], args[1:])


def _run_script(path: str, args: list[str]) -> None:
    """Run ``path`` as the interpreter runs ``python path ARGS``, and end the process as it would: ``__main__``
    is the script, ``sys.argv`` is ``[path, *ARGS]`` and its folder is first on ``sys.path``; an uncaught
    exception goes to ``sys.excepthook`` (prague's one-line usage errors are printed there) and exits 1,
    ``SystemExit`` exits with its code, ``KeyboardInterrupt`` ends the process by SIGINT; then the ``atexit``
    functions run, the streams are flushed, and the process exits (``multiprocessing``'s own handling of the
    target would print every exception's traceback and skip ``atexit``)."""
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    code, interrupted = 0, False
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        interrupted = True
    except BaseException:  # noqa: BLE001 -- the interpreter's top level: every exception ends the script
        sys.excepthook(*sys.exc_info())
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if interrupted:  # as the interpreter does: die by the signal, so the parent sees it
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _exit_code(code: object) -> int:
    """The exit status of ``SystemExit(code)``, as the interpreter makes it: None is 0, an integer itself,
    anything else is printed to stderr and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    sys.stderr.write(f"{code}\n")
    return 1
