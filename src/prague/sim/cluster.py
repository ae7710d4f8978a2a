"""The simulated cluster: compute-time distribution, alpha-beta links, Group Generator and PS costs.

A :class:`Cluster` is the whole cost model's input, validated when built. It comes from a preset
(:data:`PRESETS`), a TOML file (:func:`load_cluster`), and flags that override single fields
(:func:`Cluster.replace_fields`). The topology (nodes x workers per node) is *not* part of it: it comes
from ``--nproc`` and ``--nodes`` like in the runtime, so one cluster file serves every job size.

TOML layout (every key optional; units are in the key names)::

    name = "my-gpu-cluster"
    base = "paper"            # optional: start from a preset; keys below override it

    [compute]                 # per-iteration compute of one worker: forward, backward, optimizer step
    time_ms = 45.0
    overhead_ms = 0.0         # per-iteration time that slowdowns do not scale (framework work)
    distribution = "normal"   # constant | uniform | normal | lognormal
    cv = 0.03                 # coefficient of variation of the per-iteration draw
    speeds = [1.0, 1.0, 0.5]  # optional per-rank time multipliers, cycled over the ranks
    backward_share = 0.667    # share of time_ms that is backward, which DDP's all-reduce hides behind

    [links.intra]             # between two workers of one node
    latency_us = 10.0
    bandwidth_gbps = 80.0     # gigabits per second
    [links.inter]             # between nodes (the node's network card is shared by its workers)
    latency_us = 20.0
    bandwidth_gbps = 40.0

    [allreduce]
    ring_factor = 1.0         # the all-reduce's time over the alpha-beta ring's (1: the ideal ring)

    [preduce]
    setup_ms = 0.0            # building a communicator for a member set not in the cache
                              # (the cache's size is the method's --comm-cache, as in the runtime)

    [gg]
    rtt_us = 500.0            # one Group Generator RPC round trip, network and (un)marshalling
    service_us = 110.0        # time the GG's single thread spends per request (its queue's service time)

    [ps]
    server_bandwidth_gbps = 40.0   # one server shard's network card (incast: all pushes queue on it)
    server_latency_us = 20.0
    apply_ms = 0.0                 # server time to apply one push (per shard)
    full_duplex = true             # receiving and sending overlap (false: one queue, as on one machine)

    [network]
    contention = true         # concurrent groups on one node share its fabric and network card
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same API from the tomli backport
    import tomli as tomllib

from prague.errors import ConfigError, unknown_choice

DISTRIBUTIONS = ("constant", "uniform", "normal", "lognormal")
# The Group Generator service as measured by benchmarks/group_generator.py (grpc.aio server, one
# GroupStream per worker, smart policy, 2-core machine shared with the client processes): its event-loop
# thread, the one that serialises requests, spent 104-117 us of CPU per request (the whole process
# 120-190 us: gRPC's own threads run beside it); one worker's round trip through GroupGeneratorClient
# was about 0.6 ms, of which the service's 0.11 ms. Before the streaming service (unary GetGroup on a
# thread pool) the process spent 360-680 us per request. One service thus saturates at
# iteration_s / 110 us workers (Cluster.gg_saturation_workers): 545 at a 60 ms iteration.
GG_SERVICE_S = 110e-6
GG_RTT_S = 500e-6
GBIT = 1e9 / 8.0  # bytes per second in one gigabit per second
# Backward's share of forward + backward: backward computes the gradients of both the activations and the
# weights, about twice forward's work (the usual rule of thumb for convolutional and dense layers).
BACKWARD_SHARE = 2.0 / 3.0


def _positive(name: str, value: object, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"cluster {name} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"cluster {name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Link:
    """A point-to-point link in the alpha-beta model: a message of m bytes takes ``latency_s + m / bandwidth``."""

    latency_s: float
    bandwidth_bytes_per_s: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "latency_s", _positive("link latency_s", self.latency_s, allow_zero=True))
        object.__setattr__(self, "bandwidth_bytes_per_s",
                           _positive("link bandwidth_bytes_per_s", self.bandwidth_bytes_per_s))

    @classmethod
    def of(cls, latency_us: float, bandwidth_gbps: float) -> Link:
        """A link from the units people quote: microseconds and gigabits per second."""
        return cls(latency_us * 1e-6, bandwidth_gbps * GBIT)

    def transfer_s(self, size_bytes: float) -> float:
        return self.latency_s + size_bytes / self.bandwidth_bytes_per_s

    def describe(self) -> dict[str, float]:
        return {"latency_us": self.latency_s * 1e6, "bandwidth_gbps": self.bandwidth_bytes_per_s / GBIT}


@dataclass(frozen=True)
class Cluster:
    """Everything the cost model needs besides the topology and the model size; see the module docstring.

    ``compute_s`` is the nominal per-iteration compute time. Iteration k of worker r takes
    ``(compute_s * speeds[r % len(speeds)] * slowdown(r, k) + compute_overhead_s) * jitter``: the
    scenario's slowdown scales the nominal time, as the runtime's emulated compute does (its sleep is
    stretched, the framework's own work is not), and the jitter (mean 1, coefficient of variation
    ``compute_cv``, distribution ``compute_dist``) applies to the whole.

    ``backward_share`` of the nominal part (``compute_s * speeds[r] * jitter``) is backward, at the end of
    the compute: what DDP's bucketed all-reduce overlaps with (:func:`prague.sim.costs.exposed_allreduce_s`).
    The scenario's extra time is not in it (the runtime sleeps it before forward), nor is the overhead.
    ``allreduce_ring_factor`` scales the alpha-beta ring time of the all-reduces of ``allreduce``,
    ``eager-sgd``, ``lossy``, ``localsgd`` and ``diloco`` (the collective's measured distance from the ideal
    ring; calibration fits it). ``restart_s``: what a restart from a checkpoint costs a method that cannot
    go on without a failed worker (every process started again, the rendezvous, the checkpoint read; an
    assumption, :mod:`prague.sim.restarts`).
    """

    name: str = "custom"
    compute_s: float = 0.1
    compute_overhead_s: float = 0.0
    compute_dist: str = "constant"
    compute_cv: float = 0.0
    speeds: tuple[float, ...] = ()
    intra: Link = field(default_factory=lambda: Link.of(10.0, 80.0))
    inter: Link = field(default_factory=lambda: Link.of(20.0, 40.0))
    backward_share: float = BACKWARD_SHARE
    allreduce_ring_factor: float = 1.0
    preduce_setup_s: float = 0.0
    gg_rtt_s: float = GG_RTT_S
    gg_service_s: float = GG_SERVICE_S
    server: Link | None = None
    ps_apply_s: float = 0.0
    ps_full_duplex: bool = True
    contention: bool = True
    restart_s: float = 20.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"cluster name must be a non-empty string, got {self.name!r}")
        object.__setattr__(self, "compute_s", _positive("compute time_ms", self.compute_s, allow_zero=True))
        if self.compute_dist not in DISTRIBUTIONS:
            raise unknown_choice("compute distribution", self.compute_dist, DISTRIBUTIONS)
        cv = _positive("compute cv", self.compute_cv, allow_zero=True)
        if self.compute_dist == "uniform" and cv > 1 / math.sqrt(3):
            raise ConfigError(f"a uniform compute distribution has cv <= 0.577 (times stay >= 0), got {cv!r}")
        object.__setattr__(self, "compute_cv", cv)
        speeds = tuple(_positive("compute speeds[]", s) for s in self.speeds)
        object.__setattr__(self, "speeds", speeds)
        for name in ("intra", "inter"):
            if not isinstance(getattr(self, name), Link):
                raise ConfigError(f"cluster {name} must be a Link, got {getattr(self, name)!r}")
        if self.server is not None and not isinstance(self.server, Link):
            raise ConfigError(f"cluster server must be a Link or None, got {self.server!r}")
        share = _positive("compute backward_share", self.backward_share, allow_zero=True)
        if share > 1:
            raise ConfigError(f"cluster compute backward_share is a share of the compute time, between 0 and 1, "
                              f"got {share!r}")
        object.__setattr__(self, "backward_share", share)
        object.__setattr__(self, "allreduce_ring_factor",
                           _positive("allreduce ring_factor", self.allreduce_ring_factor, allow_zero=True))
        for name in ("compute_overhead_s", "preduce_setup_s", "gg_rtt_s", "gg_service_s", "ps_apply_s", "restart_s"):
            object.__setattr__(self, name, _positive(name, getattr(self, name), allow_zero=True))
        if not isinstance(self.ps_full_duplex, bool):
            raise ConfigError(f"cluster ps full_duplex must be true or false, got {self.ps_full_duplex!r}")
        if not isinstance(self.contention, bool):
            raise ConfigError(f"cluster network contention must be true or false, got {self.contention!r}")

    def speed(self, rank: int) -> float:
        return self.speeds[rank % len(self.speeds)] if self.speeds else 1.0

    def server_link(self, nodes: int) -> Link:
        """The PS server's link: as given, else the inter-node link (the intra one on a single node)."""
        if self.server is not None:
            return self.server
        return self.inter if nodes > 1 else self.intra

    def iteration_floor_s(self) -> float:
        """The shortest iteration a worker of the ``prague`` method can have: nominal compute plus its
        overhead plus one Group Generator call (round trip and service), no P-Reduce."""
        return self.compute_s + self.compute_overhead_s + self.gg_rtt_s + self.gg_service_s

    def gg_saturation_workers(self, iteration_s: float | None = None) -> float | None:
        """The worker count at which one Group Generator is busy all the time: each worker asks once per
        iteration, so n workers send ``n / iteration_s`` requests per second, and one service thread
        answers ``1 / gg_service_s``. Saturated when ``n >= iteration_s / gg_service_s``; beyond that
        requests queue and iterations stretch. ``iteration_s`` defaults to :meth:`iteration_floor_s`
        (a lower bound of n: real iterations, with P-Reduce, are longer). None without service time."""
        if self.gg_service_s <= 0:
            return None
        return (self.iteration_floor_s() if iteration_s is None else iteration_s) / self.gg_service_s

    def replace_fields(self, **changes: Any) -> Cluster:
        """A copy with the given fields replaced (``None`` values are ignored), validated again."""
        changes = {k: v for k, v in changes.items() if v is not None}
        return dataclasses.replace(self, **changes) if changes else self

    def describe(self) -> dict[str, Any]:
        """The cluster as plain JSON values, in the TOML file's units (for records and reports)."""
        return {
            "name": self.name,
            "compute_ms": self.compute_s * 1e3,
            "compute_overhead_ms": self.compute_overhead_s * 1e3,
            "compute_distribution": self.compute_dist,
            "compute_cv": self.compute_cv,
            "speeds": list(self.speeds),
            "intra": self.intra.describe(),
            "inter": self.inter.describe(),
            "server": None if self.server is None else self.server.describe(),
            "backward_share": self.backward_share,
            "allreduce_ring_factor": self.allreduce_ring_factor,
            "preduce_setup_ms": self.preduce_setup_s * 1e3,
            "gg_rtt_us": self.gg_rtt_s * 1e6,
            "gg_service_us": self.gg_service_s * 1e6,
            # One service's capacity, and the workers that fill it at the shortest iteration.
            "gg_capacity_requests_per_s": None if self.gg_service_s <= 0 else 1.0 / self.gg_service_s,
            "gg_saturation_workers": self.gg_saturation_workers(),
            "ps_apply_ms": self.ps_apply_s * 1e3,
            "ps_full_duplex": self.ps_full_duplex,
            "contention": self.contention,
        }


# The paper's setting (Prague, ASPLOS 2020, section 7): 4 nodes x 4 GPUs (GTX 1080 Ti) joined by
# 56 Gb/s FDR InfiniBand; ResNet-18 on CIFAR-10. Our stated assumptions, not the paper's measurements:
# 60 ms per iteration (forward + backward + step at batch 128 on one 1080 Ti), 3% jitter; intra-node
# PCIe 3.0 peer-to-peer at 64 Gb/s (8 GB/s) and 10 us per step; inter-node 45 Gb/s achievable of the
# 56 and 25 us per step (NCCL over IB verbs); the four workers of a node share its network card.
# All-reduce is DDP's, overlapped with backward (BACKWARD_SHARE of the compute): of ResNet-18's two
# 25 MB buckets the first hides behind backward. The paper's 1.2x for static Prague over All-Reduce
# needs an all-reduce that backward does not hide: simulated (benchmarks/simulator.py --paper, 150
# steps), static Prague is 1.15x homogeneous allreduce with the overlap, 1.32x with backward_share = 0.
# The GG's gRPC round trip and service are our service's, as measured (GG_RTT_S, GG_SERVICE_S); a NCCL
# communicator for a new member set 2 ms.
PAPER = Cluster(
    name="paper-4x4-1080ti",
    compute_s=0.060,
    compute_dist="normal",
    compute_cv=0.03,
    intra=Link.of(10.0, 64.0),
    inter=Link.of(25.0, 45.0),
    preduce_setup_s=0.002,
    gg_rtt_s=GG_RTT_S,
    gg_service_s=GG_SERVICE_S,
)

# One machine of this project (gloo on loopback, 2 cores): the starting point calibration refines. No
# backward to hide the all-reduce behind: benchmarks here run emulated compute, whose wait is in forward
# (backward only fills the gradients), and with real compute two cores leave gloo no room beside backward.
LOCAL = Cluster(
    name="local-loopback",
    compute_s=0.1,
    backward_share=0.0,
    intra=Link.of(100.0, 8.0),
    inter=Link.of(100.0, 8.0),
    preduce_setup_s=0.008,
    gg_rtt_s=GG_RTT_S,
    gg_service_s=GG_SERVICE_S,
    ps_full_duplex=False,
)

PRESETS: dict[str, Cluster] = {"paper": PAPER, "local": LOCAL}


def _section(data: dict[str, Any], key: str, source: str) -> dict[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: [{key}] must be a table, got {value!r}")
    return value


def _link(table: dict[str, Any], base: Link, where: str, source: str) -> Link:
    unknown = set(table) - {"latency_us", "bandwidth_gbps"}
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {sorted(unknown)} in [{where}]; valid: latency_us, bandwidth_gbps")
    latency_s = base.latency_s
    if "latency_us" in table:
        latency_s = _positive(f"{where}.latency_us", table["latency_us"], allow_zero=True) * 1e-6
    bandwidth = base.bandwidth_bytes_per_s
    if "bandwidth_gbps" in table:
        bandwidth = _positive(f"{where}.bandwidth_gbps", table["bandwidth_gbps"]) * GBIT
    return Link(latency_s, bandwidth)


_KEYS = {
    "": {"name", "compute", "links", "allreduce", "preduce", "gg", "ps", "network"},
    "compute": {"time_ms", "overhead_ms", "distribution", "cv", "speeds", "backward_share"},
    "links": {"intra", "inter"},
    "allreduce": {"ring_factor"},
    "preduce": {"setup_ms"},
    "gg": {"rtt_us", "service_us"},
    "ps": {"server_bandwidth_gbps", "server_latency_us", "apply_ms", "full_duplex"},
    "network": {"contention"},
}


def cluster_from_dict(data: dict[str, Any], base: Cluster = Cluster(), source: str = "cluster") -> Cluster:
    """Build a cluster from the TOML layout of the module docstring; missing keys keep ``base``'s values."""
    if "exposed_fraction" in _section(data, "allreduce", source):
        raise ConfigError(f"{source}: [allreduce] exposed_fraction is no longer a cluster key: the simulator plays "
                          "out DDP's buckets against backward ([compute] backward_share, default "
                          f"{BACKWARD_SHARE:.3g}; the method option --bucket-cap-mb), and [allreduce] ring_factor "
                          "scales the ring's time; remove the key")
    if "cache" in _section(data, "preduce", source):
        raise ConfigError(f"{source}: [preduce] cache is no longer a cluster key: the communicator cache's size is "
                          "the method option --comm-cache, in the simulator as in the runtime; remove the key")
    for section, keys in _KEYS.items():
        table = data if not section else _section(data, section, source)
        unknown = set(table) - keys
        if unknown:
            where = f"[{section}]" if section else "the top level"
            raise ConfigError(f"{source}: unknown key(s) {sorted(unknown)} at {where}; valid: {sorted(keys)}")
    compute = _section(data, "compute", source)
    links = _section(data, "links", source)
    allreduce = _section(data, "allreduce", source)
    preduce = _section(data, "preduce", source)
    gg = _section(data, "gg", source)
    ps = _section(data, "ps", source)
    network = _section(data, "network", source)
    server = base.server
    if ps.get("server_bandwidth_gbps") is not None or ps.get("server_latency_us") is not None:
        ref = server or base.inter
        server = _link({k.removeprefix("server_"): v for k, v in ps.items() if k.startswith("server_")},
                       ref, "ps.server", source)

    def scaled(table: dict[str, Any], key: str, default_s: float, unit: float) -> float:
        value = table.get(key)
        return default_s if value is None else _positive(key, value, allow_zero=True) * unit

    name, speeds = data.get("name", base.name), compute.get("speeds", base.speeds)
    if not isinstance(name, str):
        raise ConfigError(f"{source}: name must be a string, got {name!r}")
    if not isinstance(speeds, (list, tuple)):
        raise ConfigError(f"{source}: [compute] speeds must be a list of numbers, e.g. [1.0, 0.5], got {speeds!r}")
    try:
        return Cluster(
            name=name,
            compute_s=scaled(compute, "time_ms", base.compute_s, 1e-3),
            compute_overhead_s=scaled(compute, "overhead_ms", base.compute_overhead_s, 1e-3),
            compute_dist=compute.get("distribution", base.compute_dist),
            compute_cv=compute.get("cv", base.compute_cv),
            speeds=tuple(speeds),
            backward_share=compute.get("backward_share", base.backward_share),
            intra=_link(_section(links, "intra", source), base.intra, "links.intra", source),
            inter=_link(_section(links, "inter", source), base.inter, "links.inter", source),
            allreduce_ring_factor=allreduce.get("ring_factor", base.allreduce_ring_factor),
            preduce_setup_s=scaled(preduce, "setup_ms", base.preduce_setup_s, 1e-3),
            gg_rtt_s=scaled(gg, "rtt_us", base.gg_rtt_s, 1e-6),
            gg_service_s=scaled(gg, "service_us", base.gg_service_s, 1e-6),
            server=server,
            ps_apply_s=scaled(ps, "apply_ms", base.ps_apply_s, 1e-3),
            ps_full_duplex=ps.get("full_duplex", base.ps_full_duplex),
            contention=network.get("contention", base.contention),
        )
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def load_cluster(spec: str | Path) -> Cluster:
    """A preset name (``paper``, ``local``) or the path of a TOML file (see the module docstring).

    A file may start from a preset with a top-level ``base = "paper"``; keys it leaves out keep that
    preset's values (without ``base``, the defaults of :class:`Cluster`). Raises ConfigError naming the
    file and the bad key.
    """
    text = str(spec)
    if text in PRESETS:
        return PRESETS[text]
    path = Path(text)
    if not path.is_file():
        raise ConfigError(
            f"cluster {text!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a TOML file; "
            "pass a preset name or the path of a cluster file"
        )
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read cluster file {text!r}: {exc}") from None
    base_name = data.pop("base", None)
    if base_name is not None and (not isinstance(base_name, str) or base_name not in PRESETS):
        raise unknown_choice(f"base preset in cluster file {text!r}", base_name, PRESETS)
    base = PRESETS[base_name] if base_name is not None else Cluster()
    return cluster_from_dict(data, base, source=f"cluster file {text!r}")
