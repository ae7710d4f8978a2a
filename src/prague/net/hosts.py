"""Emulated hosts on one machine: Linux network namespaces joined to a bridge by shaped veth links.

``prague run --hosts H --link-rate RATE`` places the workers in H network namespaces (ranks in
contiguous blocks: with 8 workers on 4 hosts, ranks 0-1 on host 0, ...). Each namespace has one veth
link to a bridge in the launcher's namespace; the link is shaped in both directions with a token
bucket (``tc`` ``tbf``: netem is not available everywhere), so traffic between hosts queues on real
links while traffic inside a host stays on that namespace's loopback (a worker's own address is
local to its namespace). The launcher's store and the services it starts (the Group Generator, the
parameter-server shards) live in the launcher's namespace and are reached through the bridge, like a
machine of their own on the same switch.

Names carry the launcher's pid (namespaces ``prague-PID-I``, bridge ``prbPID``, links ``prvPIDxI``),
so :func:`remove_stale` can tell what a launcher that died without cleaning up (SIGKILL) left
behind: every :meth:`EmulatedHosts.up` first removes the namespaces and links whose owner is gone.
:meth:`EmulatedHosts.down` is idempotent. Creating namespaces needs CAP_NET_ADMIN and CAP_SYS_ADMIN
and the ``ip`` and ``tc`` commands (:func:`missing_privileges`).

A worker joins its namespace first thing (:func:`enter_from_env`, ``setns(2)``), before it opens a
socket; gloo then binds to the namespace's link (``GLOO_SOCKET_IFNAME``).
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from prague import jobenv
from prague.errors import ConfigError

#: Inside every namespace, the host's end of its link.
INNER_IF = "eth0"
NETNS_DIR = "/var/run/netns"
_CLONE_NEWNET = 0x40000000
_CAP_NET_ADMIN, _CAP_SYS_ADMIN = 12, 21
_NS_RE = re.compile(r"^prague-(\d+)-(\d+)$")
_LINK_RE = re.compile(r"^pr[bv](\d+)(x\d+)?$")
#: The subnets tried, 10.213.K.0/24: the bridge is .1, host I is .(I + 2).
_SUBNET = "10.213.{}."
MAX_HOSTS = 200
DEFAULT_LINK_RATE = "1gbit"

_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
          "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9}


def parse_rate(text: str) -> int:
    """``"1gbit"`` -> 1_000_000_000 (bits per second); tc's units: bit, kbit, mbit, gbit, tbit (bits)
    and bps, kbps, mbps, gbps (bytes). Raises ConfigError naming the forms."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*", text or "")
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ConfigError(f"--link-rate {text!r} is not a rate; write a number and a unit like 1gbit, 100mbit or "
                          f"50mbps (units: {', '.join(_UNITS)})")
    bits = int(float(match.group(1)) * _UNITS[unit])
    if not 8_000 <= bits <= 10**12:
        raise ConfigError(f"--link-rate {text!r} is out of range; give 8kbit to 1tbit")
    return bits


def host_of(rank: int, nproc: int, hosts: int) -> int:
    """The host of ``rank`` (contiguous blocks of ``nproc // hosts`` ranks)."""
    return rank // (nproc // hosts)


def check_layout(nproc: int, hosts: int) -> None:
    """Raise ConfigError unless ``hosts`` hosts can each hold the same number of the ``nproc`` workers."""
    if not 1 <= hosts <= MAX_HOSTS:
        raise ConfigError(f"--hosts must be in 1..{MAX_HOSTS}, got {hosts}")
    if nproc % hosts:
        raise ConfigError(f"--nproc {nproc} is not a multiple of --hosts {hosts}; every host runs the same number "
                          "of workers")


def missing_privileges() -> str | None:
    """Why this process cannot build emulated hosts, or None if it can."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the `{tool}` command (iproute2) is not installed"
    try:
        status = open("/proc/self/status").read()
    except OSError:
        return "this is not Linux (no /proc/self/status)"
    capabilities = int(re.search(r"^CapEff:\s*([0-9a-f]+)", status, re.M).group(1), 16)  # type: ignore[union-attr]
    lacking = [name for name, bit in (("CAP_NET_ADMIN", _CAP_NET_ADMIN), ("CAP_SYS_ADMIN", _CAP_SYS_ADMIN))
               if not capabilities >> bit & 1]
    if lacking:
        return f"this process lacks {' and '.join(lacking)}"
    return None


def check_privileges() -> None:
    """Raise ConfigError (one line) unless emulated hosts can be built here."""
    reason = missing_privileges()
    if reason is not None:
        raise ConfigError(f"--hosts needs network namespaces, but {reason}; run as root (or with CAP_NET_ADMIN and "
                          "CAP_SYS_ADMIN), or drop --hosts")


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise ConfigError(f"emulated hosts: `{' '.join(argv)}` failed: {done.stderr.strip() or done.returncode}")
    return done


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def remove_stale() -> list[str]:
    """Remove the namespaces and links of launchers that no longer run; returns their names."""
    removed: list[str] = []
    if shutil.which("ip") is None:
        return removed
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split(" ")[0]
        match = _NS_RE.match(name)
        if match and not _alive(int(match.group(1))):
            _run("ip", "netns", "delete", name, check=False)
            removed.append(name)
    for line in _run("ip", "-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(": ")
        if len(parts) < 2:
            continue
        name = parts[1].split("@")[0]
        match = _LINK_RE.match(name)
        if match and not _alive(int(match.group(1))):
            _run("ip", "link", "delete", name, check=False)
            removed.append(name)
    return removed


def _free_subnet() -> str:
    used = _run("ip", "-4", "-o", "addr", "show", check=False).stdout
    for k in range(1, 255):
        prefix = _SUBNET.format(k)
        if f" {prefix}" not in used:
            return prefix
    raise ConfigError("emulated hosts: no free 10.213.K.0/24 subnet left; remove stale prb* bridges")


@dataclass
class EmulatedHosts:
    """H namespaces, each linked to one bridge at ``rate_bits`` per second each way (see the module
    docstring). A context manager: ``with EmulatedHosts(4, parse_rate("1gbit")) as net: ...``."""

    hosts: int
    rate_bits: int
    owner: int = field(default_factory=os.getpid)
    prefix: str = ""  # 10.213.K. once up

    @property
    def bridge(self) -> str:
        return f"prb{self.owner}"

    def namespace(self, host: int) -> str:
        return f"prague-{self.owner}-{host}"

    def link(self, host: int) -> str:
        return f"prv{self.owner}x{host}"

    @property
    def bridge_address(self) -> str:
        return f"{self.prefix}1"

    def address(self, host: int) -> str:
        return f"{self.prefix}{host + 2}"

    def up(self) -> EmulatedHosts:
        """Build the hosts (after removing what dead launchers left); on any failure, remove what this
        call built and raise."""
        check_privileges()
        remove_stale()
        self.down()
        self.prefix = _free_subnet()
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for h in range(self.hosts):
                self._add_host(h)
        except BaseException:
            self.down()
            raise
        return self

    def _add_host(self, h: int) -> None:
        ns, outer, inner = self.namespace(h), self.link(h), f"prn{self.owner}x{h}"
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
        _run("ip", "link", "set", inner, "netns", ns)
        _run("ip", "-n", ns, "link", "set", inner, "name", INNER_IF)
        _run("ip", "-n", ns, "addr", "add", f"{self.address(h)}/24", "dev", INNER_IF)
        _run("ip", "-n", ns, "link", "set", INNER_IF, "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "link", "set", outer, "master", self.bridge)
        _run("ip", "link", "set", outer, "up")
        self.shape(outer)  # into the host
        self.shape(INNER_IF, ns)  # out of the host

    def shape(self, dev: str, ns: str | None = None) -> None:
        """A token bucket of :attr:`rate_bits` on ``dev``'s egress (in namespace ``ns``)."""
        burst = max(self.rate_bits // 8 // 250, 128 * 1024)  # >= one 64 KiB GSO segment, ~4 ms of the rate
        where = ("-n", ns) if ns else ()
        _run("tc", *where, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{self.rate_bits}bit",
             "burst", str(burst), "latency", "100ms")

    def down(self) -> None:
        """Remove this instance's namespaces and bridge (their links go with them); idempotent."""
        if shutil.which("ip") is None:
            return
        for h in range(self.hosts):
            _run("ip", "netns", "delete", self.namespace(h), check=False)
            _run("ip", "link", "delete", self.link(h), check=False)
        _run("ip", "link", "delete", self.bridge, check=False)

    def leftovers(self) -> list[str]:
        """Namespaces and links of this instance that exist now (empty after :meth:`down`)."""
        names = {line.split(" ")[0] for line in _run("ip", "netns", "list", check=False).stdout.splitlines()}
        links = _run("ip", "-o", "link", "show", check=False).stdout
        found = [self.namespace(h) for h in range(self.hosts) if self.namespace(h) in names]
        found += [n for n in [self.bridge, *map(self.link, range(self.hosts))] if f": {n}:" in links
                  or f": {n}@" in links]
        return found

    def worker_env(self, rank: int, nproc: int) -> dict[str, str]:
        """What worker ``rank`` needs: its namespace, and gloo bound to the host's link."""
        return {jobenv.NETNS: self.namespace(host_of(rank, nproc, self.hosts)), "GLOO_SOCKET_IFNAME": INNER_IF}

    def service_env(self) -> dict[str, str]:
        """What a service in the launcher's namespace needs: gloo bound to the bridge."""
        return {"GLOO_SOCKET_IFNAME": self.bridge}

    def torchrun(self, worker_args: Sequence[str], *, per_host: int, job: str, port: int = 29431,
                 timeout_s: float = 150.0, torchrun_args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None) -> list[tuple[int | None, str]]:
        """Run one torchrun per host, as on separate machines (``--nnodes`` = the hosts, c10d rendezvous at
        host 0's address; since every namespace has the same hostname, ``is_host`` tells torchrun which
        host holds the store and ``--local-addr`` gives each its address), each running ``prague worker
        WORKER_ARGS`` in ``per_host`` processes. Returns each host's exit code and output (stdout and
        stderr); what is still running at ``timeout_s`` is killed (its code is then negative)."""
        procs = []
        for host in range(self.hosts):
            argv = ["ip", "netns", "exec", self.namespace(host), sys.executable, "-m", "torch.distributed.run",
                    "--nnodes", str(self.hosts), "--nproc-per-node", str(per_host), "--node-rank", str(host),
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.address(0)}:{port}", "--rdzv-id", job,
                    "--rdzv-conf", f"is_host={int(host == 0)}", "--local-addr", self.address(host), *torchrun_args,
                    "-m", "prague", "worker", *worker_args]
            procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          env=jobenv.child({"GLOO_SOCKET_IFNAME": INNER_IF, **(env or {})}),
                                          start_new_session=True))
        deadline = time.monotonic() + timeout_s
        results: list[tuple[int | None, str]] = []
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for p in procs:
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGKILL)
                out, _ = proc.communicate()
            results.append((proc.returncode, out))
        return results

    def __enter__(self) -> EmulatedHosts:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()


def enter_namespace(name: str) -> None:
    """Move this process into network namespace ``name`` (before it opens any socket)."""
    path = os.path.join(NETNS_DIR, name)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise ConfigError(f"network namespace {name!r} does not exist ({exc.strerror}); it is made by "
                          "`prague run --hosts`") from None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise ConfigError(f"cannot join network namespace {name!r}: {os.strerror(err)}")
    finally:
        os.close(fd)


def enter_from_env() -> None:
    """Join the namespace the launcher named in :data:`prague.jobenv.NETNS`, if any."""
    name = jobenv.current().netns
    if name:
        enter_namespace(name)
