"""Fuzz of the Group Generator service over raw gRPC, while well-behaved workers train beside it.

A real service process (``python -m prague.groups.service``) serves four worker threads that ask for
groups and execute them with blocking semantics (a barrier per group, :class:`test_service.Execution`).
Meanwhile hypothesis sends it bad calls: bytes that are no message, messages cut or spliced, messages
over gRPC's size limit, wrong tokens (Shutdown and Exclude included), unknown or negative worker ids,
negative iterations, trace paths it cannot write, streams that switch worker, and replays of requests
the workers made. Each must fail with the status that names the problem (INVALID_ARGUMENT,
UNAUTHENTICATED, RESOURCE_EXHAUSTED: never UNKNOWN, which is an exception escaping a handler), or, for
a replay, get exactly the group the worker got. Afterwards the workers' groups are consistent, the
policy saw exactly their requests, and the process is alive and logged no traceback.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from prague.groups import Group
from prague.groups import gg_pb2 as pb
from prague.groups.client import GroupGeneratorClient
from prague.groups.service import main
from prague_testing import start_thread
from test_service import TOKEN, Execution, _start_subprocess, _stop

pytestmark = pytest.mark.timeout(180)

NPROC = 4
EXAMPLES = int(os.environ.get("PRAGUE_FUZZ_EXAMPLES", "300"))  # per generator: about 4 s each on 2 cores
SERVICE = "/prague.groups.GroupGenerator/"
REQUESTS = {"GetGroup": pb.GroupRequest, "GroupStream": pb.GroupRequest, "Finish": pb.FinishRequest,
            "Exclude": pb.ExcludeRequest, "Stats": pb.StatsRequest, "Shutdown": pb.ShutdownRequest,
            "Trace": pb.TraceRequest}
OVERSIZED = b"\x0a\x80\x80\x80\x02" + bytes(4 << 20)  # a 4 MiB token: over gRPC's default limit
Code = grpc.StatusCode
REJECTED = frozenset({Code.INVALID_ARGUMENT, Code.UNAUTHENTICATED})


@dataclass(frozen=True)
class Call:
    """One fuzzed call: ``method`` with ``payloads`` (several on a stream) and the status codes it may end
    with. A replay repeats the recorded request at ``replay`` (modulo their number) instead, then on a
    stream sends ``then``: a request for another worker (``switch``), one with a wrong token, or none."""

    method: str
    payloads: tuple[bytes, ...]
    expected: frozenset[grpc.StatusCode]
    replay: int | None = None
    then: str = "none"


class Workers:
    """Four worker threads, each with its own client, asking for groups until :meth:`stop`, then
    finishing; every (worker, iteration, group) they got is in :attr:`asked` for the fuzz to replay."""

    def __init__(self, address: str) -> None:
        self.execution = Execution(timeout_s=30.0)
        self.asked: list[tuple[int, int, Group]] = []
        self.requests = [0] * NPROC
        self._stop = threading.Event()
        self._threads = [start_thread(self._work, address, w, name=f"worker-{w}") for w in range(NPROC)]

    def _work(self, address: str, worker: int) -> None:
        rng = random.Random(worker)
        with GroupGeneratorClient(address, TOKEN, timeout_s=30.0) as client:
            last = -1
            while not self._stop.is_set() or self.requests[worker] < 5:
                time.sleep(rng.random() * 0.004)  # uneven speeds; leave the cores some room
                iteration = self.requests[worker]
                group = client.get_group(worker, iteration)
                self.requests[worker] += 1
                assert worker in group.members and group.seq > last, (worker, group, last)
                last = group.seq
                self.asked.append((worker, iteration, group))
                self.execution.run(worker, group)
            for group in client.finish(worker):
                assert worker in group.members and group.seq > last, (worker, group, last)
                last = group.seq
                self.execution.run(worker, group)

    def wait_for_first(self, timeout_s: float) -> None:
        """Until some worker has got a group (a replay needs one to replay)."""
        limit = time.monotonic() + timeout_s
        while not self.asked:
            assert time.monotonic() < limit, f"no worker got a group within {timeout_s:g} s"
            time.sleep(0.01)

    def stop(self) -> None:
        """Let every worker finish; re-raise a worker's failure."""
        self._stop.set()
        for thread in self._threads:
            thread.join(60.0)


def _message(method: str, **fields: object) -> bytes:
    data: bytes = REQUESTS[method](**fields).SerializeToString()
    return data


WORKER = st.integers(-(2**31), 2**31 - 1)
ITERATION = st.integers(-(2**63), 2**63 - 1)
WRONG_TOKEN = st.one_of(st.text(max_size=40), st.sampled_from(["", TOKEN[:-1], TOKEN + " ", TOKEN.upper()]))
UNKNOWN_WORKER = st.one_of(st.integers(-(2**31), -1), st.integers(NPROC, 2**31 - 1))
# Paths no one can write, root included (a trace's folder is created if missing).
BAD_TRACE_PATHS = st.sampled_from(["", "/", "/dev/null/trace.jsonl", "trace\x00.jsonl", "/proc/no/trace.jsonl"])


@st.composite
def wrong_token(draw: st.DrawFn) -> Call:
    """A well-formed message of any call (Shutdown and Exclude too) with a token that is not the job's."""
    method = draw(st.sampled_from(sorted(REQUESTS)))
    fields: dict[str, object] = {"token": draw(WRONG_TOKEN)}
    if method in ("GetGroup", "GroupStream", "Finish", "Exclude"):
        fields["worker"] = draw(WORKER)
    if method in ("GetGroup", "GroupStream"):
        fields["iteration"] = draw(ITERATION)
    if method == "Trace":
        fields["path"] = draw(st.text(max_size=20))
    return Call(method, (_message(method, **fields),), frozenset({Code.UNAUTHENTICATED}))


@st.composite
def garbage(draw: st.DrawFn) -> Call:
    """Bytes that are mostly no message at all, or a wrong-token message cut short or spliced with junk
    (never one that could carry the job's token)."""
    method = draw(st.sampled_from(sorted(REQUESTS)))
    count = draw(st.integers(1, 3)) if method == "GroupStream" else 1
    payloads = []
    for _ in range(count):
        if draw(st.booleans()):
            payloads.append(draw(st.binary(max_size=48)))
        else:
            valid = draw(wrong_token()).payloads[0]
            cut = draw(st.integers(0, len(valid)))
            payloads.append(valid[:cut] + draw(st.binary(max_size=6)) + valid[cut + draw(st.integers(0, 4)):])
    return Call(method, tuple(payloads), REJECTED)


@st.composite
def bad_values(draw: st.DrawFn) -> Call:
    """The job's token with a value the service must refuse: an unknown worker, a negative iteration, a
    trace path it cannot write."""
    method = draw(st.sampled_from(["GetGroup", "GroupStream", "Finish", "Exclude", "Trace"]))
    if method == "Trace":
        return Call(method, (_message(method, token=TOKEN, path=draw(BAD_TRACE_PATHS)),),
                    frozenset({Code.INVALID_ARGUMENT}))
    if method in ("GetGroup", "GroupStream") and draw(st.booleans()):
        fields = {"worker": draw(st.integers(0, NPROC - 1)), "iteration": draw(st.integers(-(2**63), -1))}
    else:
        fields = {"worker": draw(UNKNOWN_WORKER), "iteration": draw(st.integers(0, 2**63 - 1))}
    if method in ("Finish", "Exclude"):
        fields.pop("iteration")
    return Call(method, (_message(method, token=TOKEN, **fields),), frozenset({Code.INVALID_ARGUMENT}))


@st.composite
def replays(draw: st.DrawFn) -> Call:
    """A request some worker made, sent again (GetGroup, or a stream that then switches to another worker
    or repeats a wrong token): the worker's own group, or INVALID_ARGUMENT once its iteration is past."""
    index = draw(st.integers(0, 10**6))
    if draw(st.booleans()):
        return Call("GetGroup", (), REJECTED | {Code.OK}, replay=index)
    then = draw(st.sampled_from(["switch", "token", "none"]))
    expected = {"switch": {Code.INVALID_ARGUMENT}, "token": REJECTED, "none": REJECTED | {Code.OK}}[then]
    return Call("GroupStream", (), frozenset(expected), replay=index, then=then)


OVERSIZE = st.sampled_from(sorted(REQUESTS)).map(lambda m: Call(m, (OVERSIZED,), frozenset({Code.RESOURCE_EXHAUSTED})))
STATS = st.just(Call("Stats", (_message("Stats", token=TOKEN),), frozenset({Code.OK})))
CALLS = st.one_of(wrong_token(), garbage(), bad_values(), replays(), OVERSIZE, STATS)


def _send(channel: grpc.Channel, call: Call, workers: Workers) -> tuple[grpc.StatusCode, list[bytes], Group | None]:
    """Make ``call`` (a replay: build it from the recorded request); (final status, replies, the group the
    replayed request got)."""
    payloads, group = list(call.payloads), None
    if call.replay is not None:
        worker, iteration, group = workers.asked[call.replay % len(workers.asked)]
        payloads = [_message(call.method, token=TOKEN, worker=worker, iteration=iteration)]
        if call.then == "switch":
            payloads.append(_message(call.method, worker=(worker + 1) % NPROC, iteration=iteration + 1))
        elif call.then == "token":
            payloads.append(_message(call.method, token="not-" + TOKEN, worker=worker, iteration=iteration + 1))
    replies: list[bytes] = []
    try:
        if call.method == "GroupStream":
            for reply in channel.stream_stream(SERVICE + call.method)(iter(payloads), timeout=20.0):
                replies.append(reply)
        else:
            replies.append(channel.unary_unary(SERVICE + call.method)(payloads[0], timeout=20.0))
    except grpc.RpcError as error:
        return error.code(), replies, group
    return Code.OK, replies, group


@pytest.fixture(params=["smart", "ready"])
def service(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    proc, address = _start_subprocess(tmp_path, "--nproc", str(NPROC), "--generator", request.param,
                                      "--group-size", "2", "--window-s", "0.02")
    try:
        yield address, proc
    finally:
        _stop(proc)


def test_bad_calls_get_clear_statuses_while_workers_get_correct_groups(
        service: tuple[str, subprocess.Popen[bytes]]) -> None:
    address, proc = service
    workers = Workers(address)
    with grpc.insecure_channel(address) as channel:

        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(call=CALLS)
        def fuzz(call: Call) -> None:
            code, replies, group = _send(channel, call, workers)
            assert code in call.expected, (call.method, call.payloads[:1], code, call.expected)
            event(f"status {code.name}")  # --hypothesis-show-statistics tells how many of each
            if group is not None:  # a replay: any reply is the group that request got
                assert all(pb.GroupReply.FromString(r) == pb.GroupReply(seq=group.seq, members=group.members)
                           for r in replies), (group, replies)
            if code == Code.OK and call.method == "Stats":
                assert "requests" in json.loads(pb.StatsReply.FromString(replies[0]).json)

        try:
            workers.wait_for_first(30.0)  # else a first replay would have nothing to replay
            fuzz()
        finally:
            workers.stop()
    assert proc.poll() is None, "the service died"
    seen = set()
    for seq, group in workers.execution.groups.items():
        # --group-size 2; smart gives a lone eligible worker (one its threshold left without a pair) to the
        # group before it: 3 at most
        assert group.members == tuple(sorted(set(group.members))) and 1 <= group.size <= 3, group
        assert all(0 <= m < NPROC for m in group.members), group
        receivers = workers.execution.receivers[seq]
        assert sorted(receivers) == list(group.members), (group, receivers)
        seen.update(group.members)
    assert seen == set(range(NPROC)) and min(workers.requests) >= 5, workers.requests
    with GroupGeneratorClient(address, TOKEN, timeout_s=10.0) as client:
        stats = client.stats()
        assert stats["requests"] == sum(workers.requests)  # replays and rejected calls reached no policy
        assert stats["finished_workers"] == NPROC and stats["excluded_workers"] == 0 and stats["waiting_rpcs"] == 0
        client.shutdown()
    assert proc.wait(timeout=15) == 0
    log = _stop(proc)
    assert "Traceback" not in log and "Unexpected" not in log, log[-3000:]


def test_serve_rejects_a_port_out_of_range_and_an_unusable_host(capsys: pytest.CaptureFixture[str]) -> None:
    """`gg serve --port 99999` served on port 34463 (gRPC wrapped it); a host it cannot bind was a traceback."""
    assert main(["--nproc", "2", "--token", TOKEN, "--port", "99999"]) == 2
    assert "--port must be in 0..65535" in capsys.readouterr().err
    assert main(["--nproc", "2", "--token", TOKEN, "--host", "no.such.host.invalid"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: group generator could not bind no.such.host.invalid:0") and "Traceback" not in err
