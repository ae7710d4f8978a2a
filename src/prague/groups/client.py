"""Client of the Group Generator service (:mod:`prague.groups.service`), used by each worker.

One client per worker process; it is thread-safe, so a benchmark or a test may share one among threads
(each worker id then gets its own stream). By default ``get_group`` goes over one long-lived
bidirectional ``GroupStream`` per worker id, opened on first use on an asyncio channel (a request and
its reply are one message each way); one event-loop thread per process runs every client's streams; ``stream=False`` uses the
unary ``GetGroup`` instead. The other calls are unary.

Failures: a call that gets no answer within ``timeout_s`` raises :class:`~prague.errors.CommError`
naming the address and the timeout; a request the server rejects (wrong token, unknown worker id,
inconsistent iteration) raises :class:`~prague.errors.ConfigError` with the server's message; any other
RPC failure raises ``CommError``. A failed or timed-out ``get_group`` drops that worker's stream (the next
call opens a new one). ``get_group`` may safely be retried with the same iteration: the server returns
the same group.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from prague.errors import CommError, ConfigError
from prague.groups import gg_pb2 as pb
from prague.groups import gg_pb2_grpc as pb_grpc
from prague.groups.aio import shared_loop
from prague.groups.api import Group

_Reply = TypeVar("_Reply")
_REJECTED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED)


class GroupGeneratorClient:
    """Talks to one Group Generator at ``address`` (``host:port``) with the job's ``token``.

    ``timeout_s`` bounds every call, including the time ``get_group`` waits for partners under the
    ready policy and the time to connect (calls wait for the server to come up, within the timeout).
    ``stream`` (default True): ``get_group`` uses one ``GroupStream`` per worker id; False: unary calls.
    ``wait_for_ready`` (default True): a call to a server that is not up waits for it (within the
    timeout); False: it fails at once with ``CommError`` (for a caller that finds a restarted server's
    new address itself).
    """

    def __init__(self, address: str, token: str, timeout_s: float = 60.0, *, stream: bool = True,
                 wait_for_ready: bool = True) -> None:
        if not isinstance(address, str) or not address:
            raise ConfigError(f"group generator address must be 'host:port', got {address!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (
            math.isfinite(timeout_s) and timeout_s > 0
        ):
            raise ConfigError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
        self.address = address
        self.timeout_s = float(timeout_s)
        self.stream = bool(stream)
        self.wait_for_ready = bool(wait_for_ready)
        self._token = token
        self._channel = grpc.insecure_channel(address)
        self._stub = pb_grpc.GroupGeneratorStub(self._channel)  # type: ignore[no-untyped-call]
        self._streams: _Streams | None = None
        self._streams_lock = threading.Lock()
        self._closed = False

    def _error(self, what: str, error: grpc.RpcError) -> Exception:
        """The exception ``what`` raises for a failed RPC (see the module docstring)."""
        code = error.code()
        details = error.details()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return self._timeout(what)
        if code in _REJECTED:
            return ConfigError(f"group generator at {self.address} rejected {what}: {details}")
        return CommError(f"group generator at {self.address} failed {what}: {code.name}: {details}")

    def _timeout(self, what: str) -> CommError:
        return CommError(
            f"group generator at {self.address} did not answer {what} within timeout_s="
            f"{self.timeout_s:g}; check that it is running and reachable, or raise the timeout"
        )

    def _call(self, what: str, method: Callable[..., _Reply], request: Callable[[], object]) -> _Reply:
        try:
            message = request()
        except (TypeError, ValueError) as error:  # e.g. a worker id outside int32
            raise ConfigError(f"cannot send {what} to the group generator: {error}") from None
        try:
            return method(message, timeout=self.timeout_s, wait_for_ready=self.wait_for_ready)
        except grpc.RpcError as error:
            raise self._error(what, error) from None

    def get_group(self, worker: int, iteration: int) -> Group:
        """The group ``worker`` runs after step ``iteration``; blocks until the server has decided it."""
        what = f"GetGroup(worker={worker}, iteration={iteration})"
        if not self.stream:
            reply = self._call(
                what, self._stub.GetGroup,
                lambda: pb.GroupRequest(token=self._token, worker=worker, iteration=iteration),
            )
            return Group(reply.seq, tuple(reply.members))
        try:
            pb.GroupRequest(worker=worker, iteration=iteration)
        except (TypeError, ValueError) as error:
            raise ConfigError(f"cannot send {what} to the group generator: {error}") from None
        streams = self._open_streams()
        try:
            seq, members = streams.ask(worker, iteration, self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise self._timeout(what) from None
        except concurrent.futures.CancelledError:
            raise CommError(f"the client of the group generator at {self.address} was closed while "
                            f"{what} waited") from None
        except grpc.RpcError as error:
            raise self._error(what, error) from None
        except asyncio.InvalidStateError:  # the stream had ended (its server went away) before this request
            raise CommError(f"group generator at {self.address} failed {what}: its stream had ended") from None
        return Group(seq, members)

    def _open_streams(self) -> _Streams:
        with self._streams_lock:
            if self._closed:
                raise CommError(f"the client of the group generator at {self.address} is closed")
            if self._streams is None:
                self._streams = _Streams(self.address, self._token, self.wait_for_ready)
            return self._streams

    def finish(self, worker: int) -> list[Group]:
        """``worker`` asks for no more groups; returns those it must still execute, in order."""
        reply = self._call(
            f"Finish(worker={worker})",
            self._stub.Finish,
            lambda: pb.FinishRequest(token=self._token, worker=worker),
        )
        return [Group(g.seq, tuple(g.members)) for g in reply.groups]

    def exclude(self, worker: int) -> None:
        """Tell the service that ``worker`` failed: it groups it no more (idempotent)."""
        self._call(f"Exclude(worker={worker})", self._stub.Exclude,
                   lambda: pb.ExcludeRequest(token=self._token, worker=worker))

    def stats(self) -> dict[str, float | int]:
        """The policy's counters and the server's (waiting RPCs, finished workers)."""
        reply = self._call("Stats()", self._stub.Stats, lambda: pb.StatsRequest(token=self._token))
        out: dict[str, float | int] = json.loads(reply.json)
        return out

    def trace(self, path: str) -> None:
        """Ask the server to write every call of its policy to ``path`` (a file on the server's machine)
        from now on; idempotent for the same path. Rejected (ConfigError) if it traces elsewhere or
        cannot write there."""
        self._call(f"Trace({path!r})", self._stub.Trace, lambda: pb.TraceRequest(token=self._token, path=path))

    def shutdown(self) -> None:
        """Ask the server to stop (its ``serve`` call returns)."""
        self._call("Shutdown()", self._stub.Shutdown, lambda: pb.ShutdownRequest(token=self._token))

    def close(self) -> None:
        """Close the streams and the channels; idempotent."""
        with self._streams_lock:
            self._closed = True
            streams, self._streams = self._streams, None
        if streams is not None:
            streams.close()
        self._channel.close()

    def __enter__(self) -> GroupGeneratorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Streams:
    """One ``GroupStream`` per worker id on a ``grpc.aio`` channel of its own, driven by the process's
    event loop for gRPC (:func:`prague.groups.aio.shared_loop`); :meth:`ask` is called from any thread."""

    def __init__(self, address: str, token: str, wait_for_ready: bool = True) -> None:
        self._token = token
        self._wait_for_ready = wait_for_ready
        self._loop = shared_loop()
        self._calls: dict[int, Any] = {}  # worker -> its open stream (a grpc.aio StreamStreamCall)
        self._locks: dict[int, asyncio.Lock] = {}
        self._asking: set[asyncio.Task[Any]] = set()  # requests in flight, cancelled by close()
        self._channel: grpc.aio.Channel = asyncio.run_coroutine_threadsafe(
            self._connect(address), self._loop).result(30.0)
        self._stub = pb_grpc.GroupGeneratorStub(self._channel)  # type: ignore[no-untyped-call]

    @staticmethod
    async def _connect(address: str) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(address)

    def ask(self, worker: int, iteration: int, timeout_s: float) -> tuple[int, tuple[int, ...]]:
        """(seq, members) for ``worker`` after ``iteration``. Raises ``grpc.RpcError`` for a failed
        stream, ``concurrent.futures.TimeoutError`` after ``timeout_s``; either way the stream is
        dropped (cancelled), and the next call opens a new one."""
        future = asyncio.run_coroutine_threadsafe(self._ask(worker, iteration), self._loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    async def _ask(self, worker: int, iteration: int) -> tuple[int, tuple[int, ...]]:
        task = asyncio.current_task()
        assert task is not None
        self._asking.add(task)
        try:
            return await self._ask_on_stream(worker, iteration)
        finally:
            self._asking.discard(task)

    async def _ask_on_stream(self, worker: int, iteration: int) -> tuple[int, tuple[int, ...]]:
        lock = self._locks.get(worker)
        if lock is None:
            lock = self._locks[worker] = asyncio.Lock()
        async with lock:  # one request at a time per stream
            call = self._calls.get(worker)
            token = ""
            if call is None:
                call = self._calls[worker] = self._stub.GroupStream(wait_for_ready=self._wait_for_ready)
                token = self._token  # the first request authorizes the stream
            try:
                await call.write(pb.GroupRequest(token=token, worker=worker, iteration=iteration))
                reply = await call.read()
                if reply is grpc.aio.EOF:  # the server ended the stream without an error status
                    code = await call.code()
                    raise grpc.aio.AioRpcError(
                        grpc.StatusCode.UNAVAILABLE if code == grpc.StatusCode.OK else code,
                        grpc.aio.Metadata(), grpc.aio.Metadata(),
                        f"the stream ended without a reply ({await call.details() or code.name})")
            except BaseException:
                self._calls.pop(worker, None)
                call.cancel()
                raise
            return reply.seq, tuple(reply.members)

    def close(self) -> None:
        async def close() -> None:
            asking = list(self._asking)
            for task in asking:  # their callers get CancelledError, their streams are cancelled
                task.cancel()
            await asyncio.gather(*asking, return_exceptions=True)
            for call in self._calls.values():
                call.cancel()
            self._calls.clear()
            await self._channel.close()

        try:
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(5.0)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass
