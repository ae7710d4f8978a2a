"""Cross traffic on the emulated hosts' links: ``--cross-traffic bursts:P:MB``.

Every :data:`PERIOD_S` (100 ms) each link carries, in each direction, a burst of MB megabytes with
probability P, drawn from a generator seeded by (seed, host, direction), so two runs with the same seed
load their links alike. The bursts are TCP streams, so they queue in the links' token buckets beside
the training traffic and share the rate with it the way competing jobs on a real switch do: the
tail latency of a transfer then comes from real queues, not from a formula.

One service process (``python -m prague.net.traffic``), started by the launcher in its own namespace:
per host, a thread joins the host's namespace to run a sink (inbound bursts) and a source (outbound
bursts, to a sink behind the bridge); a thread in the launcher's namespace sends the inbound bursts.
``setns(2)`` moves only the calling thread, so one process serves every host. Every thread is a
:class:`~prague.runtime.background.FunctionWork`'s; a stream that breaks ends the service with an error. It writes its ready
file once every connection is up, and runs until it is stopped. Pure parts (:func:`parse_cross_traffic`,
:func:`burst_plan`) are shared with the simulator.
"""

from __future__ import annotations

import argparse
import random
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prague.errors import CommError, ConfigError
from prague.runtime.background import FunctionWork

PERIOD_S = 0.1
PORT = 47_000  # the sinks' port, inside each namespace and on the bridge
_CHUNK = 1 << 20


@dataclass(frozen=True)
class CrossTraffic:
    """Bursts of ``megabytes`` MB with probability ``probability`` per link, direction and period."""

    probability: float
    megabytes: float

    @property
    def text(self) -> str:
        return f"bursts:{self.probability:g}:{self.megabytes:g}"


def parse_cross_traffic(text: str) -> CrossTraffic:
    """``"bursts:0.3:20"`` -> CrossTraffic(0.3, 20.0); ConfigError naming the form otherwise."""
    match = re.fullmatch(r"bursts:([0-9.eE+-]+):([0-9.eE+-]+)", (text or "").strip())
    try:
        p, mb = (float(match.group(1)), float(match.group(2))) if match else (None, None)
    except ValueError:
        p = mb = None
    if p is None or mb is None or not 0 <= p <= 1 or not 0 < mb <= 1024:
        raise ConfigError(f"--cross-traffic {text!r} is not valid; write bursts:P:MB with a probability P in "
                          "[0, 1] and a burst size MB in (0, 1024], like bursts:0.3:20")
    return CrossTraffic(p, mb)


def burst_plan(seed: int, host: int, direction: str, periods: int, probability: float) -> list[bool]:
    """Whether each of the first ``periods`` periods carries a burst on ``host``'s link in ``direction``
    (``"in"`` or ``"out"``); the same on every run with the same seed. Pure."""
    rng = random.Random(f"cross-traffic/{seed}/{host}/{direction}")
    return [rng.random() < probability for _ in range(periods)]


def _sink(listener: socket.socket) -> None:
    """Read and drop whatever arrives on every accepted connection (one work per connection)."""
    def drain(conn: socket.socket) -> None:
        with conn:
            while conn.recv(_CHUNK):
                pass

    while True:
        conn, _ = listener.accept()
        FunctionWork("cross-traffic sink's connection", "traffic-drain", _on(drain, conn))


def _on(body: Callable[[socket.socket], None], conn: socket.socket) -> Callable[[int], None]:
    """``body(conn)`` as a work's body (which takes the thread's index)."""
    return lambda _index: body(conn)


def _listen(address: str) -> socket.socket:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((address, PORT))
    listener.listen(64)
    FunctionWork(f"cross-traffic sink on {address}", "traffic-sink", lambda _: _sink(listener))
    return listener


def _source(conn: socket.socket, traffic: CrossTraffic, seed: int, host: int, direction: str) -> None:
    """Send a burst at each period the seeded draw says so; a burst that takes longer than a period
    delays the next ones (the link is saturated then, as a real one would be)."""
    rng = random.Random(f"cross-traffic/{seed}/{host}/{direction}")  # the draws of burst_plan
    payload = bytes(_CHUNK)
    size = int(traffic.megabytes * 1e6)
    start = time.monotonic()
    period = 0
    while True:
        if rng.random() < traffic.probability:
            left = size
            while left > 0:
                left -= conn.send(memoryview(payload)[:min(left, _CHUNK)])
        period += 1
        delay = start + period * PERIOD_S - time.monotonic()
        if delay > 0:
            time.sleep(delay)


def serve(namespaces: list[str], addresses: list[str], bridge_address: str, traffic: CrossTraffic, seed: int,
          ready_file: Path) -> None:
    """Run the sinks and sources of every host (see the module docstring); returns only when a stream
    failed, raising its error."""
    from prague.io import atomic_write_text
    from prague.net.hosts import enter_namespace

    _listen(bridge_address)
    connected: list[tuple[socket.socket, int, str]] = []
    lock = threading.Lock()

    def host_side(h: int) -> None:
        enter_namespace(namespaces[h])  # this thread only
        _listen(addresses[h])
        out = socket.create_connection((bridge_address, PORT), timeout=10)
        with lock:
            connected.append((out, h, "out"))

    setup = FunctionWork("cross traffic's set-up", "traffic-setup", host_side, threads=len(namespaces))
    try:
        ended = setup.wait_ended(30)
    except CommError as exc:
        raise SystemExit(f"cross traffic: could not set up every host: {exc.__cause__ or exc}") from None
    if not ended or len(connected) != len(namespaces):
        raise SystemExit("cross traffic: could not set up every host: timed out after 30 s")
    for h, address in enumerate(addresses):
        connected.append((socket.create_connection((address, PORT), timeout=10), h, "in"))
    for conn, _, _ in connected:
        conn.settimeout(None)

    def send(i: int) -> None:
        conn, host, direction = connected[i]
        _source(conn, traffic, seed, host, direction)

    sources = FunctionWork("cross-traffic sources", "traffic-source", send, threads=len(connected))
    atomic_write_text(ready_file, f"{len(connected)} streams\n")
    sources.wait_ended()  # never, but for a stream that breaks: its error is raised here


def main(argv: list[str] | None = None) -> int:
    from prague.runtime.parent import set_parent_death_signal

    set_parent_death_signal()
    parser = argparse.ArgumentParser(prog="python -m prague.net.traffic", description=__doc__.splitlines()[0])
    parser.add_argument("--namespaces", required=True, help="comma-separated namespaces, one per host")
    parser.add_argument("--addresses", required=True, help="comma-separated host addresses, one per namespace")
    parser.add_argument("--bridge", required=True, help="the bridge's address")
    parser.add_argument("--traffic", required=True, help="bursts:P:MB")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ready-file", type=Path, required=True)
    args = parser.parse_args(argv)
    namespaces, addresses = args.namespaces.split(","), args.addresses.split(",")
    if len(namespaces) != len(addresses):
        parser.error("--namespaces and --addresses must have the same number of entries")
    try:
        serve(namespaces, addresses, args.bridge, parse_cross_traffic(args.traffic), args.seed, args.ready_file)
    except ConfigError as exc:
        sys.stderr.write(f"prague.net.traffic: error: {exc}\n")
        return 2
    except CommError as exc:
        sys.stderr.write(f"prague.net.traffic: a stream failed: {exc.__cause__ or exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
