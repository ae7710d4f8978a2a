"""Joining a job: read the launcher's or torchrun's environment, build the store and the process group.

Both ``prague run``/``prague launch`` and ``torchrun`` export the same variables (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT). When an agent hosts the rendezvous store (torchrun, or our
launcher, both signalled by ``TORCHELASTIC_USE_AGENT_STORE=True``) every rank connects as a client;
otherwise rank 0 hosts it, as with ``init_method="env://"``. A script started with none of these
variables runs as a job of one.

The backend and the device are chosen by two pure functions, :func:`pick_backend` and
:func:`device_for`, which tests call with any GPU count.
"""

from __future__ import annotations

import atexit
import gc
import json
import signal
import os
import socket
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# Imported before any process group exists, on purpose: this module binds ``group=group.WORLD`` as
# default arguments when first imported (torch's optimizers import it through torch._dynamo). Imported
# after init_process_group, those defaults keep the world group alive after destroy_process_group(),
# with its gloo worker threads; a worker thread still releasing a finished collective when the
# interpreter finalises then aborts the process ("terminate called without an active exception").
# Imported first, the defaults are None, which these functions read as the world group anyway.
import torch.distributed.nn.functional  # noqa: F401

from prague import jobenv
from prague.jobenv import JobEnv
from prague.errors import EXIT_USAGE, ConfigError
from prague.runtime.liveness import PROGRESS_KEY, Heartbeat, Membership, progress_text
from prague.runtime.parent import set_parent_death_signal

DEFAULT_TIMEOUT_S = 300.0
ERROR_KEY = "prague/error/"
BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")


def pick_backend(requested: str, gpu_count: int, local_world_size: int, device: str = "auto") -> str:
    """The job's backend: ``requested``, or for ``"auto"`` NCCL when this machine has a GPU for each of
    its ``local_world_size`` ranks and gloo otherwise (NCCL cannot put two ranks of one communicator on
    one GPU), and gloo for the ``"cpu"`` device. Raises :class:`ConfigError` for an unknown name, and for ``"nccl"`` with fewer GPUs than
    local ranks (none included)."""
    if requested not in BACKENDS:
        raise ConfigError(f"unknown backend {requested!r}; valid choices: {', '.join(BACKENDS)}")
    if local_world_size < 1:
        raise ConfigError(f"LOCAL_WORLD_SIZE must be >= 1, got {local_world_size}")
    enough = gpu_count >= local_world_size
    if requested == "auto":
        return "nccl" if gpu_count > 0 and enough and device != "cpu" else "gloo"
    if requested == "nccl" and gpu_count == 0:
        raise ConfigError("backend 'nccl' needs CUDA, which is not available here; use --backend gloo")
    if requested == "nccl" and not enough:
        raise ConfigError(f"backend 'nccl' needs one GPU per rank, but this machine runs {local_world_size} ranks "
                          f"on {gpu_count} GPU(s); use --backend gloo, or at most {gpu_count} processes per machine")
    return requested


def device_for(backend: str, local_rank: int, requested: str = "auto", gpu_count: int = 0) -> torch.device:
    """Where a rank keeps its model and the tensors of its collectives. ``auto``: its own GPU
    (``local_rank``) under NCCL, the CPU under gloo; ``cpu``: the CPU (gloo only: NCCL reaches device
    memory alone); ``cuda``: a GPU even under gloo, the ranks of a machine sharing its ``gpu_count`` GPUs
    in turn (local rank modulo the count), which runs real GPU compute with more ranks than GPUs (gloo
    reduces CUDA tensors through the host)."""
    if requested not in DEVICES:
        raise ConfigError(f"unknown device {requested!r}; valid choices: {', '.join(DEVICES)}")
    if requested == "cpu":
        if backend == "nccl":
            raise ConfigError("device 'cpu' cannot use backend 'nccl', which reaches GPU memory only; "
                              "use --backend gloo with --device cpu")
        return torch.device("cpu")
    if requested == "cuda":
        if gpu_count <= 0:
            raise ConfigError("device 'cuda' needs a CUDA GPU, and none is visible here; use --device cpu")
        return torch.device("cuda", local_rank % gpu_count)
    return torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")


@dataclass
class DistContext:
    """What a worker knows about the job it belongs to.

    ``store`` is the job-wide key-value store; methods build members-only communicators and publish
    service addresses through it (under their own key prefixes).
    """

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    store: dist.Store
    timeout_s: float
    #: The job's environment, read once by :func:`init` (:mod:`prague.jobenv`) and passed down with the
    #: context: the worker's modules read it here, never from the process environment.
    job: JobEnv = field(default_factory=lambda: JobEnv.read({}), repr=False, compare=False)
    _named: dict[str, int] = field(default_factory=dict, repr=False, compare=False)
    _claimed: set[str] = field(default_factory=set, repr=False, compare=False)
    _once: set[str] = field(default_factory=set, repr=False, compare=False)

    def namespace(self, kind: str, name: str | None = None) -> str:
        """The store-key namespace of a method made in this job (:func:`prague.prepare`'s ``name``,
        :func:`prague.train.trainer.make_algorithm`): ``name`` when given (ConfigError if this job has
        one of that name already, or if it is empty or holds a ``/``), else ``KIND/K``, K counting this
        job's earlier unnamed methods of that ``kind``. Every component of the method keys the store
        under it, each under a fixed child name of its own (``NAMESPACE/groups``, ``NAMESPACE/gg``), so
        two methods of one job never share keys. Unnamed, every rank names alike as long as it prepares
        its methods in the same order, as every rank must call DDP's collectives in the same order."""
        if name is not None:
            if not name or "/" in name:
                raise ConfigError(f"a method's name must be a non-empty string without '/', got {name!r}; "
                                  "name it like 'student' or 'run-2'")
            chosen = name
        else:
            count = self._named.get(kind, 0)
            self._named[kind] = count + 1
            chosen = f"{kind}/{count}"
        if chosen in self._claimed:
            raise ConfigError(f"this job has a method named {chosen!r} already; give each prepared method a "
                              "name of its own (name=...)")
        self._claimed.add(chosen)
        return chosen

    def first_of_job(self, key: str) -> bool:
        """Whether ``key`` is claimed here for the first time in this job (a component the job may hold
        only once, such as a parameter server's own shards)."""
        if key in self._once:
            return False
        self._once.add(key)
        return True

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout_s)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def private_store(self) -> dist.Store:
        """A connection of its own to the job's store, for a background thread that may block in
        ``wait``: one store client sends its requests one at a time over one socket, so a thread
        waiting there for slow peers would hold up every other request of the process (the training
        loop's progress updates included). Falls back to the shared client where the store cannot be
        cloned. Open one when a component starts and keep it, never per operation: a connection opened
        while the job runs can stall the store for every client for seconds (measured: 5 s pauses of
        all 8 workers of a run whose communicators each opened one)."""
        clone = getattr(self.store, "clone", None)
        return clone() if clone is not None else self.store


_CONTEXT: DistContext | None = None
_LEFT: DistContext | None = None  # the context shutdown() ended: where a later uncaught error is still reported
_OWNS_WORLD = False  # whether init() created the default process group (shutdown destroys only that one)
_HEARTBEAT: Heartbeat | None = None  # this worker's, from init() to shutdown()


def report_steps(steps: int) -> None:
    """This worker has done ``steps`` steps: published with its next heartbeat (a script's loop; the
    built-in loop publishes its progress itself). Costs no store request on the calling thread."""
    if _HEARTBEAT is not None:
        _HEARTBEAT.steps = steps


def attempt_store(store: dist.Store, job: JobEnv) -> dist.Store:
    """The job's store as this attempt of the job sees it. torchrun (``--max-restarts``) starts the workers
    again on the same store, which outlives them: a restart's keys go under a prefix of their own (as
    torch's env:// rendezvous does), so an earlier attempt's (its ranks' addresses, its failed set, its
    services) cannot mislead this one. The first attempt, and every other launch, use the store as is."""
    attempt = job.attempt  # of ``job``, the environment its caller read
    return store if attempt == 0 else dist.PrefixStore(f"prague/attempt{attempt}", store)


def service_host(job: JobEnv) -> str:
    """The address at which a service this process starts (a rank that hosts the Group Generator under
    torchrun) is reached by every rank of the job: loopback when the whole job runs on this machine
    (``LOCAL_WORLD_SIZE`` equals ``WORLD_SIZE``, or no job environment), else this machine's address on
    its route to the job's store (``MASTER_ADDR``), the one the other machines already reach it by.
    ``job``: the environment the caller read (a worker's is its context's)."""
    world = job.world_size or 1
    if (job.local_world_size or world) >= world:
        return "127.0.0.1"
    master, port = job.master_addr, job.master_port or 1
    try:
        family, _, _, _, where = socket.getaddrinfo(master, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:  # a UDP connect sends nothing: it picks a route
            probe.connect(where)
            return str(probe.getsockname()[0])
    except OSError as exc:
        raise ConfigError(f"cannot find this machine's address towards the job's store at MASTER_ADDR={master!r} "
                          f"({exc}); the other machines could not reach a service started here") from exc


def init(backend: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S, device: str = "auto") -> DistContext:
    """Join the job described by the environment and initialise ``torch.distributed``.

    Called once per worker process, on every rank, before wrapping a model. ``backend="auto"`` picks
    NCCL when this machine has a GPU for each of its ranks (``LOCAL_WORLD_SIZE``) and gloo otherwise
    (:func:`pick_backend`); ``device`` (:func:`device_for`) ``"cuda"`` puts gloo ranks on the GPUs too, so
    that several ranks share one GPU. Returns the context (also kept for :func:`context`).
    Raises :class:`ConfigError` for a malformed environment; a rendezvous that does not complete within
    ``timeout_s`` raises torch's timeout error.
    """
    global _CONTEXT, _OWNS_WORLD
    if _CONTEXT is not None:
        return _CONTEXT
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; valid choices: {', '.join(BACKENDS)}")
    if not timeout_s > 0:
        raise ConfigError(f"timeout_s must be > 0, got {timeout_s!r}")
    if device not in DEVICES:
        raise ConfigError(f"unknown device {device!r}; valid choices: {', '.join(DEVICES)}")
    job = jobenv.current()
    local_world_size = 1
    if job.launched:  # torchrun and our launcher set LOCAL_WORLD_SIZE; else assume one machine
        local_world_size = job.local_world_size or job.need("world_size")
    gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = pick_backend(backend, gpu_count, local_world_size, device)

    set_parent_death_signal()
    timeout = timedelta(seconds=timeout_s)
    if job.launched:
        rank, world_size = job.need("rank"), job.need("world_size")
        local_rank = job.local_rank if job.local_rank is not None else rank
        host, port = job.master_addr, job.need("master_port")
        if not 0 <= rank < world_size:
            raise ConfigError(f"RANK={rank} is outside 0..WORLD_SIZE-1 (WORLD_SIZE={world_size})")
        agent_store = job.agent_store
        store: dist.Store = attempt_store(dist.TCPStore(
            host, port, world_size, is_master=(rank == 0 and not agent_store), timeout=timeout,
            multi_tenant=not agent_store,
        ), job)
    else:
        rank, world_size, local_rank = 0, 1, 0
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)

    where = device_for(backend, local_rank, device, gpu_count)
    if where.type == "cuda":
        torch.cuda.set_device(where)
    if not dist.is_initialized():  # a script that made its own default group keeps it: prague uses it
        _OWNS_WORLD = True
        dist.init_process_group(
            backend, store=dist.PrefixStore("prague/world", store), rank=rank, world_size=world_size,
            timeout=timeout,
        )
    _CONTEXT = DistContext(rank, world_size, local_rank, backend, where, store, timeout_s, job)
    if job.launched:  # the launcher holds this worker's lease
        global _HEARTBEAT
        _HEARTBEAT = Heartbeat(_CONTEXT.private_store(), rank)
    previous_hook = sys.excepthook
    under_launcher = job.under_launcher

    def _report_then_print(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        after = _failed_before() if isinstance(exc, RuntimeError) else []
        published = report_failure(exc, after)
        if after:  # a torch.distributed call of the script's broke under another rank's failure: one line
            sys.stderr.write(f"prague: error: rank {_CONTEXT.rank if _CONTEXT else '?'}'s torch.distributed call "
                             f"broke: rank {after[0]} failed; {SURVIVABLE}\n")
            sys.stderr.flush()
            return
        if not isinstance(exc, ConfigError):
            previous_hook(kind, exc, tb)
            return
        # A usage error in a script: one line, as the CLI gives it, and exit code 2 once the script's own
        # exit handlers have run. Under a launcher or guard the line is theirs to print (once for the
        # job, from the traceback published above), so the rank prints nothing, unless nothing could be
        # published (the store is gone).
        global _USAGE_FAILED
        _USAGE_FAILED = True
        if not under_launcher or not published:
            sys.stderr.write(f"prague: error: {exc}\n")

    sys.excepthook = _report_then_print
    atexit.register(_at_exit)  # registered now: it runs after the handlers the script registers later
    return _CONTEXT


_USAGE_FAILED = False  # a script's uncaught ConfigError ended it (init's exception hook)


def _at_exit() -> None:
    """At exit, while the interpreter is still whole: collect garbage, so that a process group the script
    destroyed but that a reference cycle still holds (a DDP module's reducer, a trainer) is freed now and
    its gloo worker threads are joined; freed while the interpreter finalises, such a group aborts the
    process ("terminate called without an active exception": a plain torch script that destroys its
    group and exits did so in 2 of 30 runs, 0 of 30 with this collection). Then, after a script's
    uncaught usage error: flush the standard streams and end with exit code 2 (Python's own would be 1)."""
    gc.collect()
    if not _USAGE_FAILED:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(EXIT_USAGE)


def _usage_error_before_init(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
    """``sys.excepthook`` from this module's import on: a script's uncaught usage error raised before
    :func:`init` (``prague.prepare`` called first) is one line and exit code 2, as after it; anything else
    goes to the hook that was there before. :func:`init` puts its own hook in front of this one."""
    if isinstance(exc, ConfigError) and _CONTEXT is None:
        global _USAGE_FAILED
        _USAGE_FAILED = True
        sys.stderr.write(f"prague: error: {exc}\n")
        return
    _HOOK_BEFORE_PRAGUE(kind, exc, tb)


_HOOK_BEFORE_PRAGUE = sys.excepthook
sys.excepthook = _usage_error_before_init
atexit.register(_at_exit)  # the exit code 2 of a usage error raised before init


#: What a script whose own collective broke under a failure is told to use instead.
SURVIVABLE = ("use prague.barrier(), prague.all_reduce(), prague.broadcast() and model.averaged_model(), which go "
              "on over the living ranks, and prague.is_leader() for rank 0's work")


def _failed_before() -> list[int]:
    """The other ranks declared failed in this job (best effort: the store may be gone)."""
    if _CONTEXT is None or _CONTEXT.world_size < 2:
        return []
    try:
        failed = Membership(_CONTEXT.store, _CONTEXT.world_size).failed()
    except Exception:  # noqa: BLE001 - the store is gone: no failure to name
        return []
    return sorted(r for r in failed if r != _CONTEXT.rank)


def report_failure(exc: BaseException, after: list[int] | None = None) -> bool:
    """Publish ``exc``'s traceback in the job store so the launcher can name the rank that failed first;
    ``after``: the ranks whose failure broke this one (its collective's peers), so that the launcher
    counts it as their consequence, not a failure of its own. Returns whether it was published.

    Best effort: the store may be what failed. Installed as ``sys.excepthook`` by :func:`init`, so an
    uncaught exception in a user's script is reported too, also one that reaches the hook after the
    script's ``finally: prague.shutdown()`` (the job's store, which the launcher keeps until the job
    ends, is still known then)."""
    ctx = _CONTEXT or _LEFT
    if ctx is None:
        return False
    text = "".join(traceback.format_exception(exc))
    try:
        report = {"time": time.time(), "traceback": text, **({"after": after} if after else {})}
        ctx.store.set(f"{ERROR_KEY}{ctx.rank}", json.dumps(report))
        steps = _HEARTBEAT.steps if _HEARTBEAT is not None else None
        if steps is not None:  # a script's steps, which its heartbeat may not have published yet
            ctx.store.set(f"{PROGRESS_KEY}{ctx.rank}", progress_text(steps))
    except Exception:  # noqa: BLE001
        return False
    return True


def context() -> DistContext:
    """The context made by :func:`init`; raises if :func:`init` has not been called."""
    if _CONTEXT is None:
        raise ConfigError("prague.init() has not been called in this process; call it first, on every rank, "
                          "before prague.prepare() or prague.wrap()")
    return _CONTEXT


GLOO_WORKER_THREAD = "pt_gloo_runloop"


def communication_threads() -> list[str]:
    """Names of this process's threads that run gloo collectives (one pair per live gloo process group;
    Linux only, empty elsewhere). They outlive :func:`shutdown` only while something still references a
    process group, such as a trainer that was not closed."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    names = []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            continue
    return sorted(n for n in names if n == GLOO_WORKER_THREAD)


_ON_SHUTDOWN: list[Callable[[], None]] = []


def on_shutdown(fn: Callable[[], None]) -> None:
    """Run ``fn`` at the start of :func:`shutdown` (what ``prague.prepare`` started ends there); the last
    registered runs first."""
    _ON_SHUTDOWN.append(fn)


def shutdown() -> None:
    """Leave the job: destroy the process group :func:`init` created (a default group the script made
    before :func:`init` is the script's, and stays) and release its threads. Safe to call twice; call it
    after closing every trainer (:meth:`prague.DistributedTrainer.close`).

    A process group lives as long as something references it, and its gloo worker threads with it; one
    still running when the interpreter finalises can abort the process at exit. So this collects
    garbage after destroying the group, and warns when worker threads survive."""
    global _CONTEXT, _HEARTBEAT, _OWNS_WORLD, _LEFT
    while _ON_SHUTDOWN:
        _ON_SHUTDOWN.pop()()
    if _HEARTBEAT is not None:
        _HEARTBEAT.leave()
        _HEARTBEAT = None
    owned, _OWNS_WORLD = _OWNS_WORLD, False
    if owned and dist.is_initialized():
        dist.destroy_process_group()
    _LEFT = _CONTEXT or _LEFT
    _CONTEXT = None
    gc.collect()
    left = communication_threads()
    if left and owned:  # with the script's own default group, its threads are the script's
        warnings.warn(
            f"{len(left)} gloo worker thread(s) still run after prague.shutdown(): a process group is still "
            "referenced (close every trainer before shutdown, and drop your own process groups); the "
            "interpreter may abort at exit", RuntimeWarning, stacklevel=2)
