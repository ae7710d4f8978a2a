"""The Group Generator service: one gRPC server runs one policy for all workers of a job.

The policy (:mod:`prague.groups`) is pure and single-threaded; this module is the edge that adds I/O:

* :class:`GroupGeneratorCore` is the one place decisions are made: one lock around the policy, the
  idempotency and ordering checks, the trace. A request whose answer is not determined yet (the ready
  policy waiting for partners) stays registered there until the policy delivers it;
* a timer thread calls ``policy.poll`` at ``policy.next_deadline()``; time is ``time.monotonic()``
  since the server was built;
* the server is asynchronous (``grpc.aio``, on the process's event loop in a thread of its own,
  :mod:`prague.groups.aio`): each RPC is a coroutine and a waiting request awaits a future that the
  core resolves, so no thread is held per worker. Workers ask over one bidirectional ``GroupStream``
  each (the client's default: a request and its reply are one message each way on an open HTTP/2
  stream; ``benchmarks/group_generator.py`` measured a quarter to a third of a unary call's server
  CPU); the unary ``GetGroup`` has the same semantics;
* every request carries the job's shared token, compared in constant time (on a stream: its first
  request, and any later one that repeats it). A wrong token gets ``UNAUTHENTICATED``; an unknown
  worker id, an inconsistent request or a message that does not parse gets ``INVALID_ARGUMENT`` (on a
  stream, that ends the stream); one larger than gRPC's limit (4 MiB) gets ``RESOURCE_EXHAUSTED`` from
  gRPC itself. None of these changes the policy's state, and the server keeps serving;
* ``GetGroup`` is idempotent per (worker, iteration): a client that timed out or lost its stream may
  ask again and gets the same group (a buffered policy must never lose a group, or its partners would
  wait forever);
* when asked (``--trace FILE``, or the ``Trace`` RPC, which every worker of a ``--log-decisions`` run
  sends before its first request), every call of the policy is written to a file as it is made, in
  lock order, with the time it was given and its answers (:class:`prague.groups.trace.PolicyCall`), so
  the run's groups can be replayed through a fresh policy (:func:`prague.groups.trace.replay`).

Run it standalone (the CLI's ``prague gg serve`` calls :func:`serve`)::

    PYTHONPATH=src python -m prague.groups.service --host 127.0.0.1 --port 0 --nproc 8 \\
        --token SECRET --generator smart --ready-file /tmp/gg.addr
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hmac
import json
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent import futures
from pathlib import Path
from types import FrameType
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from prague import jobenv
from prague.errors import CommError, ConfigError, one_line
from prague.io import JsonLines, atomic_write_text
from prague.groups import GENERATORS, make_generator
from prague.groups import gg_pb2 as pb
from prague.groups.aio import shared_loop
from prague.groups import gg_pb2_grpc as pb_grpc
from prague.groups.api import THRESHOLDS, Answer, GeneratorConfig, Group, GroupPolicy, Topology, check_worker_id
from prague.groups.shards import ShardView
from prague.groups.trace import PolicyCall, call_policy
from prague.runtime.background import FunctionWork
from prague.runtime.parent import set_parent_death_signal

_WAKE_S = 0.25  # how often a blocked GetGroup checks that its client is still there


def format_address(host: str, port: int) -> str:
    """``host:port``, with brackets around an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class _Stopping(Exception):
    pass


@dataclasses.dataclass(frozen=True)
class Held:
    """The last group a worker got from a Group Generator (before a restart): asked after ``iteration``,
    and whether the worker has called finish since (``group`` is then the last it must run)."""

    iteration: int
    group: Group | None
    finished: bool = False

    def to_dict(self) -> dict[str, object]:
        return {"iteration": self.iteration, "seq": None if self.group is None else self.group.seq,
                "members": None if self.group is None else list(self.group.members), "finished": self.finished}

    @classmethod
    def from_dict(cls, data: object) -> Held:
        """Raises ConfigError naming what is wrong."""
        try:
            assert isinstance(data, dict)
            seq, members = data.get("seq"), data.get("members")
            group = None if seq is None else Group(int(seq), tuple(int(m) for m in members))  # type: ignore[union-attr]
            return cls(int(data["iteration"]), group, bool(data.get("finished", False)))
        except (AssertionError, KeyError, TypeError, ValueError) as error:
            raise ConfigError(f"not a held-group record: {data!r} ({error})") from None


def restore_state(held: dict[int, Held], excluded: set[int]) -> dict[str, object]:
    """The JSON a restarted generator reads (``--restore FILE``)."""
    return {"held": {str(w): h.to_dict() for w, h in sorted(held.items())}, "excluded": sorted(excluded)}


def parse_restore_state(data: object, nproc: int) -> tuple[dict[int, Held], set[int]]:
    """(held groups by worker, excluded workers) from :func:`restore_state`'s JSON; ConfigError if malformed."""
    if not isinstance(data, dict) or not isinstance(data.get("held"), dict) or not isinstance(data.get("excluded"), list):
        raise ConfigError("a restore file holds {'held': {worker: record}, 'excluded': [workers]}")
    held: dict[int, Held] = {}
    for key, record in data["held"].items():
        try:
            worker = int(key)
        except ValueError:
            raise ConfigError(f"restore file: worker id {key!r} is not an integer") from None
        check_worker_id(worker, nproc)
        held[worker] = Held.from_dict(record)
        group = held[worker].group
        if group is not None and (worker not in group.members or any(not 0 <= m < nproc for m in group.members)):
            raise ConfigError(f"restore file: worker {worker}'s group {group} is not a group of it in a job of {nproc}")
    excluded = set()
    for worker in data["excluded"]:
        if isinstance(worker, bool) or not isinstance(worker, int):
            raise ConfigError(f"restore file: excluded worker {worker!r} is not an integer")
        check_worker_id(worker, nproc)
        excluded.add(worker)
    return held, excluded


class GroupGeneratorCore:
    """The thread-safe state machine between RPC handlers and the policy (no gRPC in here).

    Every public method may be called from any thread. ``ConfigError`` means the request was rejected
    and nothing changed.
    """

    def __init__(self, policy: GroupPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self._clock = clock
        self._t0 = clock()
        self._lock = threading.Lock()
        self._timer_cond = threading.Condition(self._lock)
        self._worker_cond = [threading.Condition(self._lock) for _ in range(policy.config.nproc)]
        self._delivered: dict[int, Group] = {}  # worker -> answer not yet picked up by its RPC
        self._pending: dict[int, int] = {}  # worker -> iteration it is waiting for
        self._last: dict[int, tuple[int, Group]] = {}  # worker -> (iteration, group) last answered
        self._finished: dict[int, list[Group]] = {}
        self._excluded: set[int] = set()
        self._owed: dict[int, list[Group]] = {}  # worker -> groups an earlier instance committed it to
        self._wakers: dict[int, list[Callable[[], None]]] = {}  # worker -> callbacks of waiting requests
        self._trace: JsonLines | None = None
        self._stopping = False
        self._timer = FunctionWork("group generator's timer", "gg-timer", self._timer_loop, wake=self._wake_timer,
                                   start=False)
        self._timer.start()  # once self._timer is set: its failure path uses it

    def now_s(self) -> float:
        return self._clock() - self._t0

    def trace_to(self, path: Path) -> None:
        """Write every policy call from now on to ``path`` (emptied first), one JSON line each.

        Idempotent for the same path. Raises ConfigError, changing nothing, if another path is being
        traced to or ``path`` cannot be written."""
        path = Path(path)
        with self._lock:
            if self._trace is not None:
                if self._trace.path == path:
                    return
                raise ConfigError(f"the group generator already writes its trace to {str(self._trace.path)!r}, "
                                  f"not {str(path)!r}; one trace per service")
            try:
                self._trace = JsonLines(path)
            except (OSError, ValueError) as error:  # ValueError: a NUL in the path
                raise ConfigError(f"the group generator cannot write its trace to {str(path)!r}: {error}") from None

    def restore(self, held: dict[int, Held], excluded: set[int]) -> None:
        """Continue where an earlier instance of this service stopped (it died; the launcher started this
        one), from what the workers published: the last group each got (:class:`Held`) and the failed
        workers. A group some member got is owed to every other member that had not got it yet (its
        last held group is an earlier one): they get it first, so members that already wait for it are
        met; new groups are numbered after every held one. Call before serving."""
        nproc = self.policy.config.nproc
        groups = {h.group.seq: h.group for h in held.values() if h.group is not None}
        policy = self.policy
        continue_after = getattr(policy, "continue_after", None)
        if continue_after is not None:
            continue_after(max(groups, default=-1), [held[w].iteration + 1 if w in held else 0 for w in range(nproc)])
        with self._lock:
            for worker in range(nproc):
                mine = held.get(worker)
                if worker in excluded or (mine is not None and mine.finished):
                    continue
                after = mine.group.seq if mine is not None and mine.group is not None else -1
                self._owed[worker] = [groups[s] for s in sorted(groups) if s > after and worker in groups[s].members]
                if mine is not None and mine.group is not None:
                    self._last[worker] = (mine.iteration, mine.group)  # a retry of that iteration: the same group
            now = self.now_s()
            for worker in sorted(w for w, h in held.items() if h.finished and w not in excluded):
                self._deliver([(w, g) for w, g in self._call("finish", worker, now) if w != worker])
                self._finished[worker] = []
        for worker in sorted(excluded):
            self.exclude(worker)

    def _call(self, call: str, worker: int | None, now_s: float, iteration: int | None = None) -> list[Answer]:
        """Call the policy (lock held), writing the call to the trace if there is one."""
        answers = call_policy(self.policy, call, worker, now_s, iteration)
        if self._trace is not None:
            self._trace.write(PolicyCall(call, worker, now_s, tuple(answers), iteration).to_dict())
        return answers

    def _deliver(self, answers: list[Answer]) -> None:
        for worker, group in answers:
            self._delivered[worker] = group
            self._worker_cond[worker].notify_all()
            for wake in self._wakers.pop(worker, ()):
                wake()
        self._timer_cond.notify()  # the next deadline may have moved

    def _register(self, worker: int, iteration: int) -> Group | None:
        """Lock held: check the request and, if new, hand it to the policy. Returns the group if it is
        already known (a retry of the last answered iteration)."""
        check_worker_id(worker, self.policy.config.nproc)
        if iteration < 0:
            raise ConfigError(f"iteration must be >= 0, got {iteration}")
        last = self._last.get(worker)
        if last is not None and last[0] == iteration:
            return last[1]
        pending = self._pending.get(worker)
        if pending is None:
            if last is not None and iteration < last[0]:
                raise ConfigError(
                    f"worker {worker} asked for iteration {iteration} after iteration {last[0]}; "
                    "iterations must increase"
                )
            owed = self._owed.get(worker)
            answers = [(worker, owed.pop(0))] if owed else self._call("request", worker, self.now_s(), iteration)
            self._pending[worker] = iteration
            self._deliver(answers)
        elif pending != iteration:
            raise ConfigError(
                f"worker {worker} asked for iteration {iteration} while its request for iteration "
                f"{pending} is still waiting; wait for that answer first"
            )
        return None

    def _pickup(self, worker: int, iteration: int) -> Group | None:
        """Lock held, request registered: its group if determined (the first pickup records it)."""
        group = self._delivered.pop(worker, None)
        if group is not None:
            del self._pending[worker]
            self._last[worker] = (iteration, group)
            return group
        last = self._last.get(worker)
        if last is not None and last[0] == iteration:  # a concurrent retry picked it up
            return last[1]
        if self._stopping:
            self._timer.raise_if_failed()  # the policy failed on the timer's thread
            raise _Stopping
        return None

    def get_group(
        self, worker: int, iteration: int, is_active: Callable[[], bool] = lambda: True
    ) -> Group | None:
        """The group ``worker`` runs after ``iteration``; blocks until determined.

        Returns ``None`` if ``is_active()`` turns false while waiting (the client went away; its answer
        is kept for a retry). Raises ``ConfigError`` for a bad request, ``_Stopping`` on shutdown.
        """
        with self._lock:
            group = self._register(worker, iteration)
            cond = self._worker_cond[worker]
            while group is None:
                group = self._pickup(worker, iteration)
                if group is None:
                    if not is_active():
                        return None
                    cond.wait(_WAKE_S)
            return group

    def request(self, worker: int, iteration: int, wake: Callable[[], None]) -> Group | None:
        """:meth:`get_group` without blocking, for an event loop: the group if determined now; else
        ``None``, and ``wake()`` is called once (from whichever thread delivers it, lock held, so it must
        only schedule work) when it may be; then call ``request`` again with the same arguments. A
        caller that stops waiting calls :meth:`forget` with the same ``wake``; the request stays
        registered, its answer kept for a retry. Raises like :meth:`get_group`."""
        with self._lock:
            group = self._register(worker, iteration)
            if group is None:
                group = self._pickup(worker, iteration)
            if group is None:
                self._wakers.setdefault(worker, []).append(wake)
            return group

    def forget(self, worker: int, wake: Callable[[], None]) -> None:
        """Drop a ``wake`` registered by :meth:`request` (its caller stopped waiting)."""
        with self._lock:
            wakers = self._wakers.get(worker)
            if wakers is not None and wake in wakers:
                wakers.remove(wake)

    def finish(self, worker: int) -> list[Group]:
        """``worker`` leaves; returns the groups it must still execute, in order. Idempotent."""
        check_worker_id(worker, self.policy.config.nproc)
        with self._lock:
            if worker in self._finished:
                return self._finished[worker]
            if worker in self._pending:
                raise ConfigError(
                    f"worker {worker} still waits for its group of iteration {self._pending[worker]}; "
                    "call finish after receiving it"
                )
            answers = self._call("finish", worker, self.now_s())
            own = self._owed.pop(worker, []) + [g for w, g in answers if w == worker]
            self._deliver([(w, g) for w, g in answers if w != worker])
            self._finished[worker] = own
            return own

    def exclude(self, worker: int) -> None:
        """``worker`` failed: drop it from the policy (see :meth:`GroupPolicy.exclude`), forget its waiting
        request and deliver what that settles for the others. Idempotent."""
        check_worker_id(worker, self.policy.config.nproc)
        with self._lock:
            if worker in self._finished:
                return
            answers = self._call("exclude", worker, self.now_s())
            self._owed.pop(worker, None)
            self._pending.pop(worker, None)
            self._delivered.pop(worker, None)
            self._wakers.pop(worker, None)
            self._finished[worker] = []
            self._excluded.add(worker)
            self._deliver([(w, g) for w, g in answers if w != worker])

    def stats(self) -> dict[str, float | int]:
        with self._lock:
            out = dict(self.policy.stats())
            out["excluded_workers"] = len(self._excluded)
            out["waiting_rpcs"] = len(self._pending)
            out["finished_workers"] = len(self._finished)
            return out

    def stop(self) -> None:
        with self._lock:
            self._end_waits()
        self._timer.join(5.0)
        with self._lock:
            if self._trace is not None:
                self._trace.close()
                self._trace = None

    def _wake_timer(self) -> None:
        with self._lock:
            self._timer_cond.notify_all()

    def _timer_loop(self, _index: int = 0) -> None:
        """The timer's thread: poll the policy at each of its deadlines. A policy that raises here ends
        the service (every waiting request fails with the error, see :meth:`_pickup`)."""
        try:
            self._poll_at_deadlines()
        except BaseException as exc:
            self._timer.fail(exc)  # before the waiters wake, so that they see it
            with self._lock:
                self._end_waits()
            raise

    def _end_waits(self) -> None:
        """Lock held: stop, and wake every waiting request and the timer."""
        self._stopping = True
        self._timer_cond.notify_all()
        for cond in self._worker_cond:
            cond.notify_all()
        wakers, self._wakers = self._wakers, {}
        for wake in (w for ws in wakers.values() for w in ws):
            wake()

    def _poll_at_deadlines(self) -> None:
        with self._lock:
            while not self._stopping:
                deadline = self.policy.next_deadline()
                now = self.now_s()
                if deadline is None:
                    self._timer_cond.wait()
                elif now < deadline:
                    self._timer_cond.wait(deadline - now)
                else:
                    answers = self._call("poll", None, now)
                    self._deliver(answers)
                    if not answers and self.policy.next_deadline() == deadline:
                        self._timer_cond.wait(0.001)  # a policy that did not advance: do not spin


class _Malformed:
    """A request whose bytes do not parse as its message; its handler rejects it (INVALID_ARGUMENT)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _parser(message: Any) -> Callable[[bytes], object]:
    """The request deserializer of ``message``: the message, or :class:`_Malformed` saying why not."""

    def parse(data: bytes) -> object:
        try:
            return message.FromString(data)
        except DecodeError as error:
            return _Malformed(f"the request is not a {message.DESCRIPTOR.full_name} ({error}); send the "
                              "messages of prague/groups/gg.proto")

    return parse


async def _reject_malformed(request: object, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, _Malformed):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)


def _checked(behaviour: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """A unary handler that rejects a malformed request before ``behaviour`` sees it."""

    async def handle(request: object, context: grpc.aio.ServicerContext) -> Any:
        await _reject_malformed(request, context)
        return await behaviour(request, context)

    return handle


def _add_servicer(servicer: _Servicer, server: grpc.aio.Server) -> None:
    """Register ``servicer``'s RPCs as the generated ``add_GroupGeneratorServicer_to_server`` does, except
    that a request that does not parse reaches its handler as :class:`_Malformed` and is rejected with
    INVALID_ARGUMENT: gRPC's own deserializer would fail the call as UNKNOWN and log a traceback."""
    service = pb.DESCRIPTOR.services_by_name["GroupGenerator"]
    handlers = {}
    for method in service.methods:
        request, reply = getattr(pb, method.input_type.name), getattr(pb, method.output_type.name)
        behaviour = getattr(servicer, method.name)
        codecs = {"request_deserializer": _parser(request), "response_serializer": reply.SerializeToString}
        if method.client_streaming and method.server_streaming:  # GroupStream checks each request it reads
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(behaviour, **codecs)
        elif not (method.client_streaming or method.server_streaming):
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(_checked(behaviour), **codecs)
        else:
            raise TypeError(f"{method.full_name}: no handler for a half-streaming RPC")
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


class _Servicer(pb_grpc.GroupGeneratorServicer):
    """The RPC handlers, coroutines on the server's event loop. Policy calls go through the core (its
    lock); a request whose group is not determined yet waits on an asyncio future that the core's
    ``wake`` resolves, so a waiting worker holds no thread."""

    def __init__(self, core: GroupGeneratorCore, token: str, shutdown: threading.Event) -> None:
        self._core = core
        self._token = token.encode()
        self._shutdown = shutdown

    def _token_ok(self, token: str) -> bool:
        return hmac.compare_digest(token.encode(), self._token)

    async def _authorize(self, token: str, context: grpc.aio.ServicerContext) -> None:
        if not self._token_ok(token):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "wrong or missing token; pass the token the group generator was started with")

    async def _group(self, worker: int, iteration: int, context: grpc.aio.ServicerContext) -> pb.GroupReply:
        """The reply to one request (GetGroup's semantics), or the RPC aborted with the reason."""
        loop = asyncio.get_running_loop()
        while True:
            ready: asyncio.Future[None] = loop.create_future()

            def wake(ready: asyncio.Future[None] = ready) -> None:
                try:
                    loop.call_soon_threadsafe(_resolve, ready)
                except RuntimeError:  # the loop is closed: the server is gone
                    pass

            try:
                group = self._core.request(worker, iteration, wake)
            except ConfigError as error:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
            except _Stopping:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the group generator is shutting down")
            except CommError as error:  # its policy failed on the timer's thread
                await context.abort(grpc.StatusCode.INTERNAL, str(error))
            if group is not None:
                return pb.GroupReply(seq=group.seq, members=group.members)
            try:
                await ready
            except asyncio.CancelledError:  # the client went away: its answer is kept for a retry
                self._core.forget(worker, wake)
                raise

    async def GetGroup(self, request: pb.GroupRequest, context: grpc.aio.ServicerContext) -> pb.GroupReply:
        await self._authorize(request.token, context)
        return await self._group(request.worker, request.iteration, context)

    async def GroupStream(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        first = await context.read()
        if first is grpc.aio.EOF:
            return
        await _reject_malformed(first, context)
        await self._authorize(first.token, context)
        worker = first.worker
        request = first
        while True:
            if request.worker != worker:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"this stream belongs to worker {worker}, got a request for worker {request.worker}; "
                    "open one stream per worker",
                )
            if request is not first and request.token:  # later requests may leave the token out
                await self._authorize(request.token, context)
            await context.write(await self._group(worker, request.iteration, context))
            request = await context.read()
            if request is grpc.aio.EOF:
                return
            await _reject_malformed(request, context)

    async def Finish(self, request: pb.FinishRequest, context: grpc.aio.ServicerContext) -> pb.FinishReply:
        await self._authorize(request.token, context)
        try:
            groups = self._core.finish(request.worker)
        except ConfigError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        return pb.FinishReply(groups=[pb.GroupReply(seq=g.seq, members=g.members) for g in groups])

    async def Exclude(self, request: pb.ExcludeRequest, context: grpc.aio.ServicerContext) -> pb.ExcludeReply:
        await self._authorize(request.token, context)
        try:
            self._core.exclude(request.worker)
        except ConfigError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        return pb.ExcludeReply()

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsReply:
        await self._authorize(request.token, context)
        return pb.StatsReply(json=json.dumps(self._core.stats(), sort_keys=True))

    async def Shutdown(self, request: pb.ShutdownRequest, context: grpc.aio.ServicerContext) -> pb.ShutdownReply:
        await self._authorize(request.token, context)
        self._shutdown.set()
        return pb.ShutdownReply()

    async def Trace(self, request: pb.TraceRequest, context: grpc.aio.ServicerContext) -> pb.TraceReply:
        await self._authorize(request.token, context)
        if not request.path:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Trace needs the path of the file to write")
        try:
            self._core.trace_to(Path(request.path))
        except ConfigError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        return pb.TraceReply()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class GroupGeneratorServer:
    """A gRPC server around one policy. Call :meth:`start`, then :meth:`stop` (or use ``with``).

    The server is asynchronous (``grpc.aio``, on the process's loop :func:`prague.groups.aio.shared_loop`):
    every RPC, including a ``GetGroup`` or a stream waiting for partners, is a coroutine, so thousands
    of workers cost no threads. Policy calls stay behind the core's lock, shared with the timer thread. ``max_workers``
    is accepted for compatibility and ignored (blocked calls no longer hold a thread).
    """

    def __init__(self, policy: GroupPolicy, token: str, *, max_workers: int | None = None) -> None:
        if not isinstance(token, str) or not token:
            raise ConfigError("the group generator needs a non-empty token shared with the workers")
        self.policy = policy
        self.core = GroupGeneratorCore(policy)
        self.shutdown_requested = threading.Event()
        self._servicer = _Servicer(self.core, token, self.shutdown_requested)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: grpc.aio.Server | None = None
        self._address: str | None = None
        self._stopped = False

    def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Bind ``host:port`` (0: a free port chosen by the OS), start serving, return the bound port."""
        if self._loop is not None:
            raise CommError("the group generator server is already started; build a new one")
        wanted = format_address(host, port)
        self._loop = shared_loop()
        bound = asyncio.run_coroutine_threadsafe(self._start(wanted), self._loop).result(60.0)
        self._address = format_address(host, bound)
        return bound

    async def _start(self, wanted: str) -> int:
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        _add_servicer(self._servicer, server)
        try:
            bound = int(server.add_insecure_port(wanted))
        except RuntimeError as error:
            raise CommError(f"group generator could not bind {wanted}: {error}") from None
        if bound == 0:
            raise CommError(f"group generator could not bind {wanted}; pick another host or port")
        await server.start()
        self._server = server
        return bound

    @property
    def address(self) -> str:
        """``host:port`` the server listens on (after :meth:`start`)."""
        if self._address is None:
            raise CommError("the group generator server is not started; call start() first")
        return self._address

    def wait_for_shutdown(self, timeout_s: float | None = None) -> bool:
        """Block until a Shutdown RPC (or :meth:`request_shutdown`); False if ``timeout_s`` passed first."""
        return self.shutdown_requested.wait(timeout_s)

    def request_shutdown(self) -> None:
        self.shutdown_requested.set()

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving; waiting GetGroup calls and streams fail with UNAVAILABLE. Safe to call twice."""
        self.shutdown_requested.set()
        self.core.stop()
        if self._stopped:
            return
        self._stopped = True
        loop, server = self._loop, self._server
        if loop is not None and server is not None:
            try:
                asyncio.run_coroutine_threadsafe(server.stop(grace_s), loop).result(grace_s + 5.0)
            except (TimeoutError, futures.TimeoutError):
                pass

    def __enter__(self) -> GroupGeneratorServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


#: How often :func:`serve` looks at :class:`SignalFlag` while it waits for a Shutdown RPC.
_SIGNAL_POLL_S = 0.1


class SignalFlag:
    """The signal handler of :func:`serve`: it notes the signal and nothing more, and the serving loop looks at
    the note. A handler runs in the main thread between two of its bytecodes, which may be inside the
    shutdown event's own wait with that event's lock held (a Shutdown RPC set it a moment before): setting the
    event from the handler would then wait for that lock forever, and the service would hang until killed."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum


def serve(
    config: GeneratorConfig,
    host: str,
    port: int,
    token: str,
    ready_file: Path | None,
    *,
    generator: str = "smart",
    trace: Path | None = None,
    restore: Path | None = None,
    shard: tuple[int, int] = (0, 1),
) -> None:
    """Run the service until a Shutdown RPC, SIGTERM or SIGINT; for ``prague gg serve``.

    Once listening, writes ``host:port`` (the bound port) to ``ready_file`` atomically, if given, so a
    launcher can wait for the file and read the address. With ``trace``, every policy call is written
    there from the start. With ``restore`` (a file of :func:`restore_state`'s JSON), it continues
    where an earlier instance stopped (:meth:`GroupGeneratorCore.restore`). Signal handlers are
    installed only when called from the main thread. ``shard`` (s, n): this service is shard s of n of the
    job's ``ready`` generator (:class:`~prague.groups.shards.ShardView`).
    """
    policy: GroupPolicy
    if shard[1] > 1:
        if generator != "ready":
            raise ConfigError(f"--shards {shard[1]} needs --generator ready, not {generator!r}")
        policy = ShardView(config, *shard)
    else:
        policy = make_generator(generator, config)
    server = GroupGeneratorServer(policy, token)
    if restore is not None:
        try:
            data = json.loads(Path(restore).read_text())
        except (OSError, ValueError) as error:
            raise ConfigError(f"cannot read the restore file {str(restore)!r}: {error}") from None
        server.core.restore(*parse_restore_state(data, config.nproc))
    previous: dict[signal.Signals, object] = {}
    try:
        if trace is not None:
            server.core.trace_to(trace)
        server.start(host, port)
        signalled = SignalFlag()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, signalled)
        if ready_file is not None:
            atomic_write_text(Path(ready_file), server.address + "\n")
        while signalled.signum is None and not server.wait_for_shutdown(_SIGNAL_POLL_S):
            pass
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]


def main(argv: Sequence[str] | None = None, prog: str = "python -m prague.groups.service") -> int:
    """``python -m prague.groups.service``: the same as ``prague gg serve``."""
    parser = argparse.ArgumentParser(prog=prog, description="Run the prague Group Generator service.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: a free port chosen by the OS")
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("--token", default=jobenv.current().gg_token or "",
                        help=f"shared secret (default: ${jobenv.GG_TOKEN})")
    parser.add_argument("--generator", default="smart", help=f"one of {', '.join(sorted(GENERATORS))}")
    parser.add_argument("--nodes", type=int, default=1)
    defaults = {f.name: f.default for f in dataclasses.fields(GeneratorConfig)}
    parser.add_argument("--group-size", type=int, default=defaults["group_size"])
    parser.add_argument("--delta-c", type=int, default=defaults["delta_c"])
    parser.add_argument("--window-s", type=float, default=defaults["window_s"],
                        help="ready: how long a request waits for partners (0: adaptive, half the median time "
                             "between a worker's requests)")
    parser.add_argument("--adapt-size", choices=("on", "off"), default="off",
                        help="ready: on: the group size follows how late the averages come back, between 2 and "
                             "--group-size")
    parser.add_argument("--levels", type=int, choices=(1, 2), default=defaults["levels"],
                        help="ready: 2: groups across nodes of two nodes or more, and inside a node on a "
                             "worker's every other request")
    parser.add_argument("--threshold", choices=THRESHOLDS, default=defaults["threshold"],
                        help="smart: steps (join only if c_w > c_i - delta_c) or time (the lag weighed by each "
                             "worker's measured time per step)")
    parser.add_argument("--seed", type=int, default=defaults["seed"])
    parser.add_argument("--ready-file", type=Path, default=None)
    parser.add_argument("--restore", type=Path, default=None,
                        help="continue an earlier instance of this job's service from this file (what the "
                             "launcher writes when it restarts a dead one)")
    parser.add_argument("--trace", type=Path, default=None,
                        help="write every call of the policy (time, answers) to this file, one JSON line each")
    parser.add_argument("--shard", type=int, default=0, help="with --shards: which shard this service is")
    parser.add_argument("--shards", type=int, default=1,
                        help="the job's ready generator runs as this many services, one per shard")
    args = parser.parse_args(argv)
    set_parent_death_signal()  # started by a launcher (or rank 0): never outlive it
    try:
        if not 0 <= args.port <= 65535:
            raise ConfigError(f"--port must be in 0..65535 (0: a free port chosen by the OS), got {args.port}")
        if args.nodes < 1 or args.nproc % args.nodes:
            raise ConfigError(f"--nproc {args.nproc} must be a multiple of --nodes {args.nodes}")
        config = GeneratorConfig(
            nproc=args.nproc,
            topology=Topology(args.nodes, args.nproc // args.nodes),
            group_size=args.group_size,
            delta_c=args.delta_c,
            seed=args.seed,
            window_s=args.window_s,
            adapt_size=args.adapt_size == "on",
            levels=args.levels,
            threshold=args.threshold,
        )
        if args.shards < 1:
            raise ConfigError(f"--shards must be >= 1, got {args.shards}")
        serve(config, args.host, args.port, args.token, args.ready_file, generator=args.generator, trace=args.trace,
              restore=args.restore, shard=(args.shard, args.shards))
    except ConfigError as error:
        print(f"error: {one_line(error)}", file=sys.stderr)
        return 2
    except CommError as error:  # cannot bind --host/--port
        print(f"error: {one_line(error)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
