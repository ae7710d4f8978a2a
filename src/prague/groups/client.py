"""Client of the Group Generator service (:mod:`prague.groups.service`), used by each worker.

One client per worker process; it is thread-safe (gRPC channels are), so a benchmark may share one.
Failures: a call that gets no answer within ``timeout_s`` raises :class:`~prague.errors.CommError`
naming the address and the timeout; a request the server rejects (wrong token, unknown worker id,
inconsistent iteration) raises :class:`~prague.errors.ConfigError` with the server's message; any other
RPC failure raises ``CommError``. ``get_group`` may safely be retried with the same iteration: the server
returns the same group.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import TypeVar

import grpc

from prague.errors import CommError, ConfigError
from prague.groups import gg_pb2 as pb
from prague.groups import gg_pb2_grpc as pb_grpc
from prague.groups.api import Group

_Reply = TypeVar("_Reply")
_REJECTED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED)


class GroupGeneratorClient:
    """Talks to one Group Generator at ``address`` (``host:port``) with the job's ``token``.

    ``timeout_s`` bounds every call, including the time ``get_group`` waits for partners under the
    ready policy and the time to connect (calls wait for the server to come up, within the timeout).
    """

    def __init__(self, address: str, token: str, timeout_s: float = 60.0) -> None:
        if not isinstance(address, str) or not address:
            raise ConfigError(f"group generator address must be 'host:port', got {address!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (
            math.isfinite(timeout_s) and timeout_s > 0
        ):
            raise ConfigError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
        self.address = address
        self.timeout_s = float(timeout_s)
        self._token = token
        self._channel = grpc.insecure_channel(address)
        self._stub = pb_grpc.GroupGeneratorStub(self._channel)  # type: ignore[no-untyped-call]

    def _call(self, what: str, method: Callable[..., _Reply], request: Callable[[], object]) -> _Reply:
        try:
            message = request()
        except (TypeError, ValueError) as error:  # e.g. a worker id outside int32
            raise ConfigError(f"cannot send {what} to the group generator: {error}") from None
        try:
            return method(message, timeout=self.timeout_s, wait_for_ready=True)
        except grpc.RpcError as error:
            code = error.code()
            details = error.details()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise CommError(
                    f"group generator at {self.address} did not answer {what} within timeout_s="
                    f"{self.timeout_s:g}; check that it is running and reachable, or raise the timeout"
                ) from None
            if code in _REJECTED:
                raise ConfigError(f"group generator at {self.address} rejected {what}: {details}") from None
            raise CommError(
                f"group generator at {self.address} failed {what}: {code.name}: {details}"
            ) from None

    def get_group(self, worker: int, iteration: int) -> Group:
        """The group ``worker`` runs after step ``iteration``; blocks until the server has decided it."""
        reply = self._call(
            f"GetGroup(worker={worker}, iteration={iteration})",
            self._stub.GetGroup,
            lambda: pb.GroupRequest(token=self._token, worker=worker, iteration=iteration),
        )
        return Group(reply.seq, tuple(reply.members))

    def finish(self, worker: int) -> list[Group]:
        """``worker`` asks for no more groups; returns those it must still execute, in order."""
        reply = self._call(
            f"Finish(worker={worker})",
            self._stub.Finish,
            lambda: pb.FinishRequest(token=self._token, worker=worker),
        )
        return [Group(g.seq, tuple(g.members)) for g in reply.groups]

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
        self._channel.close()

    def __enter__(self) -> GroupGeneratorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
