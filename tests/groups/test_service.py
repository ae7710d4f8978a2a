"""The Group Generator service over real gRPC on 127.0.0.1 (ports from the OS).

Worker threads ask for groups and execute them with blocking semantics (a barrier per group), so a
wrong answer shows up as a mismatch or a broken barrier rather than a hang. Every test runs under a hard
timeout; the subprocess test kills its child on the way out.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

import prague
from prague.errors import CommError, ConfigError
from prague.groups import GeneratorConfig, Group, Topology, make_generator
from prague.groups import gg_pb2 as pb
from prague.groups.client import GroupGeneratorClient
from prague.groups.service import GroupGeneratorServer, SignalFlag, main

pytestmark = pytest.mark.timeout(60)

TOKEN = "test-token"
StartServer = Callable[..., GroupGeneratorServer]


@pytest.fixture
def start_server() -> Iterator[StartServer]:
    servers: list[GroupGeneratorServer] = []

    def start(name: str, **config: object) -> GroupGeneratorServer:
        policy = make_generator(name, GeneratorConfig(**config))  # type: ignore[arg-type]
        server = GroupGeneratorServer(policy, TOKEN)
        server.start("127.0.0.1", 0)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(grace_s=0.0)


class Execution:
    """Runs groups with blocking semantics: a group completes once all its members reached it."""

    def __init__(self, timeout_s: float = 20.0) -> None:
        self._lock = threading.Lock()
        self._barriers: dict[int, threading.Barrier] = {}
        self.groups: dict[int, Group] = {}
        self.receivers: dict[int, list[int]] = defaultdict(list)
        self.timeout_s = timeout_s

    def run(self, worker: int, group: Group) -> None:
        assert worker in group.members, (worker, group)
        with self._lock:
            assert self.groups.setdefault(group.seq, group) == group, (group, self.groups[group.seq])
            self.receivers[group.seq].append(worker)
            barrier = self._barriers.setdefault(group.seq, threading.Barrier(group.size))
        barrier.wait(self.timeout_s)  # BrokenBarrierError: a member never came


def run_workers(address: str, nproc: int, iterations: list[int], seed: int = 0, *, stream: bool = True) -> Execution:
    """One thread and one client per worker (``stream``: GroupStream, else unary GetGroup); re-raises the
    first worker's exception."""
    execution = Execution()
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        rng = random.Random(seed * 1000 + w)
        try:
            with GroupGeneratorClient(address, TOKEN, timeout_s=20.0, stream=stream) as client:
                last = -1
                for it in range(iterations[w]):
                    time.sleep(rng.random() * 0.002 * (1 + w % 3))  # uneven speeds, shuffled arrivals
                    group = client.get_group(w, it)
                    assert group.seq > last
                    last = group.seq
                    execution.run(w, group)
                for group in client.finish(w):
                    assert group.seq > last
                    last = group.seq
                    execution.run(w, group)
        except BaseException as error:  # noqa: BLE001 - re-raised in the main thread
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(nproc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40.0)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "worker threads hung"
    for seq, group in execution.groups.items():
        assert sorted(execution.receivers[seq]) == list(group.members), (group, execution.receivers[seq])
    return execution


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
@pytest.mark.parametrize("name", ["smart", "ready", "random", "static"])
def test_concurrent_clients_get_consistent_groups(name: str, stream: bool, start_server: StartServer) -> None:
    server = start_server(name, nproc=8, topology=Topology(2, 4), group_size=3, window_s=0.05, seed=1)
    iterations = [25] * 8 if name == "static" else [20 + 2 * w for w in range(8)]
    execution = run_workers(server.address, 8, iterations, stream=stream)
    with GroupGeneratorClient(server.address, TOKEN, timeout_s=5.0) as client:
        stats = client.stats()
    assert stats["requests"] == sum(iterations)
    assert stats["finished_workers"] == 8 and stats["waiting_rpcs"] == 0
    assert len(execution.groups) == stats["groups"] or name == "static"


def test_wrong_token_rejected_then_serves(start_server: StartServer) -> None:
    server = start_server("smart", nproc=2, group_size=2)
    with GroupGeneratorClient(server.address, "not-the-token", timeout_s=5.0) as bad:
        with pytest.raises(ConfigError, match="rejected GetGroup.*wrong or missing token"):
            bad.get_group(0, 0)
        with pytest.raises(ConfigError, match="wrong or missing token"):
            bad.shutdown()
    with GroupGeneratorClient(server.address, TOKEN, timeout_s=5.0) as good:
        assert good.get_group(0, 0).members == (0, 1)
        assert good.stats()["requests"] == 1
    assert not server.shutdown_requested.is_set()


def test_unknown_worker_and_bad_iterations_rejected_then_serves(start_server: StartServer) -> None:
    server = start_server("smart", nproc=4, group_size=2)
    with GroupGeneratorClient(server.address, TOKEN, timeout_s=5.0) as client:
        with pytest.raises(ConfigError, match=r"unknown worker id 4; .*workers 0\.\.3"):
            client.get_group(4, 0)
        with pytest.raises(ConfigError, match="unknown worker id -1"):
            client.get_group(-1, 0)
        with pytest.raises(ConfigError, match="outside int32|out of range|cannot send"):
            client.get_group(2**40, 0)
        with pytest.raises(ConfigError, match="iteration must be >= 0, got -3"):
            client.get_group(0, -3)
        first = client.get_group(0, 5)
        assert client.get_group(0, 5) == first  # a retry gets the same group
        with pytest.raises(ConfigError, match="iteration 4 after iteration 5"):
            client.get_group(0, 4)
        assert client.get_group(1, 0).members in {(0, 1), (1, 2), (1, 3)}
        assert client.stats()["requests"] == 2


def test_malformed_message_rejected_then_serves(start_server: StartServer) -> None:
    server = start_server("smart", nproc=2, group_size=2)
    with grpc.insecure_channel(server.address) as channel:
        raw = channel.unary_unary("/prague.groups.GroupGenerator/GetGroup")  # bytes in, bytes out
        for junk in (b"\x0a\xff\xff\xff", b"\x12\x80", b"\xff" * 7):
            with pytest.raises(grpc.RpcError) as info:
                raw(junk, timeout=5.0)
            assert info.value.code() != grpc.StatusCode.OK
        unknown = channel.unary_unary("/prague.groups.GroupGenerator/NoSuchMethod")
        with pytest.raises(grpc.RpcError) as info:
            unknown(b"", timeout=5.0)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with GroupGeneratorClient(server.address, TOKEN, timeout_s=5.0) as client:
        assert client.get_group(1, 0).members == (0, 1)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_timeout_names_address_and_retry_gets_same_group(stream: bool, start_server: StartServer) -> None:
    server = start_server("ready", nproc=3, group_size=2, window_s=30.0)
    with GroupGeneratorClient(server.address, TOKEN, timeout_s=0.3, stream=stream) as impatient:
        with pytest.raises(CommError, match=rf"{server.address}.*timeout_s=0.3"):
            impatient.get_group(0, 0)  # nobody else is waiting: the ready policy holds it
    with GroupGeneratorClient(server.address, TOKEN, timeout_s=5.0) as client:
        group = client.get_group(1, 0)  # forms {0, 1}: worker 0's request is still registered
        assert group.members == (0, 1)
        assert client.get_group(0, 0) == group  # the retry picks up the answer kept for it
        assert client.finish(2) == []
        with pytest.raises(ConfigError, match="worker 2 already called finish"):
            client.get_group(2, 0)
        assert client.finish(2) == []  # finishing twice is harmless


def test_unreachable_server_times_out() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    with GroupGeneratorClient(address, TOKEN, timeout_s=0.3) as client:
        with pytest.raises(CommError, match=rf"at {address} did not answer .* within timeout_s=0.3"):
            client.get_group(0, 0)


def _start_subprocess(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    ready_file = tmp_path / "gg.addr"
    src = str(Path(prague.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "prague.groups.service", "--host", "127.0.0.1", "--port", "0",
         "--token", TOKEN, "--ready-file", str(ready_file), *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 30.0
    while not ready_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out = proc.communicate(timeout=10)[0].decode(errors="replace")
            pytest.fail(f"group generator subprocess did not start (exit {proc.returncode}):\n{out}")
        time.sleep(0.05)
    return proc, ready_file.read_text().strip()


def _stop(proc: subprocess.Popen[bytes]) -> str:
    if proc.poll() is None:
        proc.kill()
    return proc.communicate(timeout=10)[0].decode(errors="replace")


def test_subprocess_serves_until_shutdown_rpc(tmp_path: Path) -> None:
    proc, address = _start_subprocess(tmp_path, "--nproc", "4", "--generator", "ready", "--group-size", "2")
    try:
        assert address.startswith("127.0.0.1:") and int(address.rsplit(":", 1)[1]) > 0
        run_workers(address, 4, [10, 10, 10, 10])
        with GroupGeneratorClient(address, TOKEN, timeout_s=5.0) as client:
            assert client.stats()["requests"] == 40
            client.shutdown()
        assert proc.wait(timeout=15) == 0
    finally:
        out = _stop(proc)
    assert proc.returncode == 0, out


def test_subprocess_stops_on_sigterm(tmp_path: Path) -> None:
    proc, address = _start_subprocess(tmp_path, "--nproc", "2")
    try:
        with GroupGeneratorClient(address, TOKEN, timeout_s=5.0) as client:
            assert client.get_group(0, 0).members == (0, 1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        _stop(proc)


def test_the_signal_handler_returns_while_the_shutdown_event_is_held() -> None:
    """The handler runs in the main thread between two bytecodes, which may be inside the shutdown event's own
    wait with its lock held (a Shutdown RPC set the event a moment before the launcher's SIGTERM came): it
    must return there, and the serving loop then stops on its note. (It used to set the event itself and
    wait for that lock forever: the launcher killed the service after its 5 s grace.)"""
    server = GroupGeneratorServer(make_generator("ready", GeneratorConfig(nproc=2)), TOKEN)
    handler = SignalFlag()
    with server.shutdown_requested._cond:  # the lock Event.wait holds as it wakes  # type: ignore[attr-defined]
        caller = threading.Thread(target=handler, args=(signal.SIGTERM, None), daemon=True)
        caller.start()
        caller.join(2.0)
        assert not caller.is_alive(), "the handler waited for the shutdown event's lock"
    assert handler.signum == signal.SIGTERM


def test_main_rejects_bad_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--nproc", "6", "--nodes", "4", "--token", TOKEN]) == 2
    assert "error: --nproc 6 must be a multiple of --nodes 4" in capsys.readouterr().err
    assert main(["--nproc", "4", "--token", TOKEN, "--generator", "clever"]) == 2
    err = capsys.readouterr().err
    assert "unknown group generator 'clever'; valid choices: random, ready, smart, static" in err
    assert main(["--nproc", "4", "--token", ""]) == 2
    assert "non-empty token" in capsys.readouterr().err


def test_server_needs_token() -> None:
    with pytest.raises(ConfigError, match="non-empty token"):
        GroupGeneratorServer(make_generator("smart", GeneratorConfig(nproc=2)), "")


# -- the stream path (GroupStream: one bidirectional stream per worker) -----------------------------------
STREAM = "/prague.groups.GroupGenerator/GroupStream"


def _raw_stream(channel: grpc.Channel, *requests: pb.GroupRequest) -> list[pb.GroupReply]:
    """Send ``requests`` on one GroupStream and collect the replies (raises grpc.RpcError on failure)."""
    call = channel.stream_stream(STREAM, request_serializer=pb.GroupRequest.SerializeToString,
                                 response_deserializer=pb.GroupReply.FromString)
    return list(call(iter(requests), timeout=5.0))


@pytest.mark.parametrize("name", ["smart", "ready"])
def test_many_stream_clients_get_consistent_groups(name: str, start_server: StartServer) -> None:
    nproc = 32
    server = start_server(name, nproc=nproc, topology=Topology(4, 8), group_size=4, window_s=0.02, seed=3)
    iterations = [8 + w % 5 for w in range(nproc)]
    execution = run_workers(server.address, nproc, iterations, seed=2)
    stats = server.core.stats()
    assert stats["requests"] == sum(iterations)
    assert stats["finished_workers"] == nproc and stats["waiting_rpcs"] == 0
    assert len(execution.groups) == stats["groups"]


def test_one_client_streams_for_many_workers(start_server: StartServer) -> None:
    server = start_server("smart", nproc=4, group_size=2, seed=1)
    with GroupGeneratorClient(server.address, TOKEN, timeout_s=5.0) as client:
        groups = [client.get_group(w, it) for it in range(3) for w in range(4)]
        assert all(w in g.members for w, g in zip([0, 1, 2, 3] * 3, groups))
        assert client.get_group(3, 2) == groups[-1]  # a retry on the same stream gets the same group
        assert client.stats()["requests"] == 12


def test_stream_disconnect_mid_request_keeps_the_answer(start_server: StartServer) -> None:
    server = start_server("ready", nproc=3, group_size=2, window_s=30.0)
    leaver = GroupGeneratorClient(server.address, TOKEN, timeout_s=20.0)
    outcome: list[BaseException | Group] = []

    def ask() -> None:
        try:
            outcome.append(leaver.get_group(0, 0))
        except BaseException as error:  # noqa: BLE001 - checked below
            outcome.append(error)

    waiting = threading.Thread(target=ask, daemon=True)
    waiting.start()
    deadline = time.monotonic() + 10.0
    while server.core.stats()["waiting_rpcs"] < 1:  # worker 0's request is registered and waits
        assert time.monotonic() < deadline, "worker 0's request never reached the service"
        time.sleep(0.01)
    leaver.close()  # the stream goes away while its request waits for a partner
    waiting.join(10.0)
    assert not waiting.is_alive()
    assert isinstance(outcome[0], CommError) and "was closed while GetGroup(worker=0, iteration=0)" in str(outcome[0])
    with GroupGeneratorClient(server.address, TOKEN, timeout_s=5.0) as client:
        group = client.get_group(1, 0)  # forms {0, 1}: worker 0's request is still registered
        assert group.members == (0, 1)
    with GroupGeneratorClient(server.address, TOKEN, timeout_s=5.0) as back:
        assert back.get_group(0, 0) == group  # a new stream picks up the answer kept for worker 0
    stats = server.core.stats()
    assert stats["requests"] == 2 and stats["waiting_rpcs"] == 0  # the retry asked the policy nothing


def test_stream_token_checked(start_server: StartServer) -> None:
    server = start_server("smart", nproc=2, group_size=2)
    with GroupGeneratorClient(server.address, "not-the-token", timeout_s=5.0) as bad:
        with pytest.raises(ConfigError, match="rejected GetGroup.*wrong or missing token"):
            bad.get_group(0, 0)
        with pytest.raises(ConfigError, match="wrong or missing token"):  # a new stream, checked again
            bad.get_group(0, 0)
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as info:  # the first request must carry the token
            _raw_stream(channel, pb.GroupRequest(worker=0, iteration=0))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:  # a later one may leave it out, but not get it wrong
            _raw_stream(channel, pb.GroupRequest(token=TOKEN, worker=0, iteration=0),
                        pb.GroupRequest(worker=0, iteration=1),
                        pb.GroupRequest(token="wrong", worker=0, iteration=2))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert server.core.stats()["requests"] == 2  # the rejected requests changed nothing
    assert not server.shutdown_requested.is_set()


def test_stream_bad_messages_rejected_then_serves(start_server: StartServer) -> None:
    server = start_server("smart", nproc=4, group_size=2)
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            _raw_stream(channel, pb.GroupRequest(token=TOKEN, worker=0, iteration=0),
                        pb.GroupRequest(worker=1, iteration=1))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "this stream belongs to worker 0, got a request for worker 1" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            _raw_stream(channel, pb.GroupRequest(token=TOKEN, worker=7, iteration=0))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "unknown worker id 7" in info.value.details()
        raw = channel.stream_stream(STREAM)  # bytes in, bytes out
        for junk in (b"\x0a\xff\xff\xff", b"\x12\x80", b"\xff" * 7):
            with pytest.raises(grpc.RpcError) as info:
                list(raw(iter([junk]), timeout=5.0))
            assert info.value.code() != grpc.StatusCode.OK
    with GroupGeneratorClient(server.address, TOKEN, timeout_s=5.0) as client:
        with pytest.raises(ConfigError, match=r"unknown worker id 4; .*workers 0\.\.3"):
            client.get_group(4, 0)
        with pytest.raises(ConfigError, match="iteration must be >= 0, got -3"):
            client.get_group(1, -3)
        with pytest.raises(ConfigError, match="outside int32|out of range|cannot send"):
            client.get_group(2**40, 0)
        assert client.get_group(1, 0).members in {(0, 1), (1, 2), (1, 3)}
        assert client.get_group(1, 1).members
        with pytest.raises(ConfigError, match="iteration 0 after iteration 1"):
            client.get_group(1, 0)
        assert client.get_group(1, 2).members  # the stream was reopened after the rejection
