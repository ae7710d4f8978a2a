"""The Group Generator's interface: groups, topology, configuration and the policy protocol.

The Group Generator (GG) of Prague/Ripples (Luo et al., "Prague: High-Performance Heterogeneity-Aware
Asynchronous Decentralized Training", ASPLOS 2020, arXiv 1909.08029) tells every worker, once per
iteration, which group it runs its Partial All-Reduce (P-Reduce) with. Each policy here is a small, pure
state machine: no sockets, threads, sleeping or wall clock. Time comes in as ``now_s`` (any monotonic
clock, in seconds) and randomness from a ``random.Random`` seeded by :attr:`GeneratorConfig.seed`, so the
gRPC service (:mod:`prague.groups.service`) and the discrete-event simulator drive the very same objects.

Contract shared by every policy (see :class:`GroupPolicy`):

* A worker calls ``request(worker, now_s)`` once per iteration, and never again before it has received
  the answer to that request.
* Every answer is a :class:`Group`. All members of a group receive the same ``(seq, members)``; each
  worker receives its groups in strictly increasing ``seq``. A worker executes its groups in the order
  received and a group executes once all its members reached it; because every worker follows one
  global order, this can never deadlock.
* A worker that will request no more groups calls ``finish(worker, now_s)``. Its answers are the groups
  it was already committed to and must still execute (in order) before it exits; no new group will
  name it. Without ``finish`` a buffered policy (smart, random) may put a departed worker in a group and
  its partners would wait forever.
* ``poll(now_s)`` must be called at ``next_deadline()`` (if not ``None``); it returns answers that became
  determined because time passed (the ``ready`` policy's window).
* A worker that failed is ``exclude``-d (by anyone): as ``finish``, also while a request of its waits,
  and the groups it was committed to are dropped for it; members handed one of those skip it.
* An unknown or finished worker id raises :class:`~prague.errors.ConfigError`; the policy's state is
  unchanged by a call that raises.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from prague.errors import ConfigError, unknown_choice
from prague.groups.group import Answer, Group, PolicyCounters, check_worker_id, is_int

__all__ = ["THRESHOLDS", "DEFAULT_THRESHOLD", "Answer", "Group", "PolicyCounters", "check_worker_id", "Topology",
           "check_levels", "GeneratorConfig", "Formation", "Observer", "GroupPolicy"]

#: The smart generator's threshold rules (``GeneratorConfig.threshold``; :mod:`prague.groups.smart`).
THRESHOLDS = ("steps", "time")
#: The default rule: ``"time"``, measured level with the paper's ``"steps"`` or ahead of it in every cell run
#: (blocking workers, MNIST, 8 workers: a persistent 4x straggler on one machine and on 4 emulated hosts, and
#: random slowdowns; docs/benchmarks.md, "The smart generator's threshold in time").
DEFAULT_THRESHOLD = "time"

@dataclass(frozen=True)
class Topology:
    """``nodes`` machines with ``workers_per_node`` workers each; rank r is on node r // workers_per_node."""

    nodes: int
    workers_per_node: int

    def __post_init__(self) -> None:
        if not is_int(self.nodes) or self.nodes < 1:
            raise ConfigError(f"topology nodes must be an integer >= 1, got {self.nodes!r}")
        if not is_int(self.workers_per_node) or self.workers_per_node < 1:
            raise ConfigError(
                f"topology workers_per_node must be an integer >= 1, got {self.workers_per_node!r}"
            )

    @classmethod
    def flat(cls, nproc: int) -> Topology:
        """All ``nproc`` workers on one node."""
        return cls(nodes=1, workers_per_node=nproc)

    @property
    def size(self) -> int:
        return self.nodes * self.workers_per_node

    def check_rank(self, rank: int) -> None:
        if not is_int(rank) or not 0 <= rank < self.size:
            raise ConfigError(
                f"rank {rank!r} is outside this topology of {self.nodes} nodes x "
                f"{self.workers_per_node} workers (valid: 0..{self.size - 1})"
            )

    def node_of(self, rank: int) -> int:
        self.check_rank(rank)
        return rank // self.workers_per_node

    def local_rank(self, rank: int) -> int:
        self.check_rank(rank)
        return rank % self.workers_per_node

    def ranks_of(self, node: int) -> range:
        if not is_int(node) or not 0 <= node < self.nodes:
            raise ConfigError(f"node {node!r} is outside 0..{self.nodes - 1}")
        return range(node * self.workers_per_node, (node + 1) * self.workers_per_node)


def check_levels(levels: int, topology: Topology, flag: str = "levels") -> None:
    """Two levels (``levels`` 2) need groups of a node and groups across nodes: several nodes of 2 workers or more.
    ConfigError, naming ``flag`` and the fix, where ``topology`` has not."""
    if levels == 2 and (topology.nodes < 2 or topology.workers_per_node < 2):
        raise ConfigError(f"{flag} 2 alternates groups inside a node and across nodes, but the topology is "
                          f"{topology.nodes} node(s) x {topology.workers_per_node} worker(s): give several nodes of "
                          f"2 workers or more (--nodes or --hosts), or {flag} 1")


@dataclass(frozen=True)
class GeneratorConfig:
    """Settings shared by all Group Generator policies, validated when built.

    ``topology`` defaults to one node holding all ``nproc`` workers. ``group_size`` is S, the size of
    the groups smart, random and ready form (static follows the topology instead); a value above
    ``nproc`` is capped at ``nproc`` (a group cannot hold more workers than the job). ``delta_c`` is the
    smart policy's threshold: worker w may join a division triggered by i only if
    ``c_w > c_i - delta_c`` (c = steps done, as each request reports: after step k, k + 1; a request that
    reports none counts one step); ``threshold`` (smart only) ``"steps"`` is that rule, ``"time"`` (the
    default, :data:`DEFAULT_THRESHOLD`) weighs the lag by each worker's measured time per step (see
    :mod:`prague.groups.smart`). ``window_s`` is how long the ready policy lets
    its oldest waiting request wait for partners before it forms a smaller group; 0 makes it adaptive
    (:data:`prague.groups.ready.ADAPTIVE_SHARE` of the median time between a worker's requests). ``avoid_repeats``
    (ready only): when every pair among the S waiting workers met within the last round of groups,
    hold them (at most until the window closes) for one more arrival, so that the choice among S + 1
    can prefer partners that have not met recently (see :mod:`prague.groups.ready`). ``adapt_size`` (ready
    only): the group size follows how late the averages come back, between 2 and ``group_size`` (see
    :mod:`prague.groups.ready`). ``levels`` (ready only): 1, groups of whoever waits; 2, groups across nodes
    of two nodes or more, and groups inside a node on a worker's every other request (see :mod:`prague.groups.ready`).
    """

    nproc: int
    topology: Topology | None = None
    group_size: int = 3
    delta_c: int = 4
    seed: int = 0
    window_s: float = 0.05
    avoid_repeats: bool = True
    adapt_size: bool = False
    levels: int = 1
    threshold: str = DEFAULT_THRESHOLD

    def __post_init__(self) -> None:
        if not is_int(self.nproc) or self.nproc < 1:
            raise ConfigError(f"nproc must be an integer >= 1, got {self.nproc!r}")
        topology = self.topology if self.topology is not None else Topology.flat(self.nproc)
        if not isinstance(topology, Topology):
            raise ConfigError(f"topology must be a Topology, got {topology!r}")
        if topology.size != self.nproc:
            raise ConfigError(
                f"topology {topology.nodes} nodes x {topology.workers_per_node} workers holds "
                f"{topology.size} ranks but nproc is {self.nproc}; make nodes * workers_per_node == nproc"
            )
        object.__setattr__(self, "topology", topology)
        if not is_int(self.group_size) or self.group_size < 1:
            raise ConfigError(f"group_size must be an integer >= 1, got {self.group_size!r}")
        object.__setattr__(self, "group_size", min(self.group_size, self.nproc))
        if not is_int(self.delta_c) or self.delta_c < 1:
            raise ConfigError(f"delta_c must be an integer >= 1, got {self.delta_c!r}")
        if not is_int(self.seed):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")
        if (
            isinstance(self.window_s, bool)
            or not isinstance(self.window_s, (int, float))
            or not math.isfinite(self.window_s)
            or self.window_s < 0
        ):
            raise ConfigError(f"window_s must be a finite number of seconds >= 0 (0: adaptive), got {self.window_s!r}")
        if not isinstance(self.avoid_repeats, bool):
            raise ConfigError(f"avoid_repeats must be True or False, got {self.avoid_repeats!r}")
        if not isinstance(self.adapt_size, bool):
            raise ConfigError(f"adapt_size must be True or False, got {self.adapt_size!r}")
        if self.threshold not in THRESHOLDS:
            raise unknown_choice("threshold", self.threshold, THRESHOLDS)
        if self.levels not in (1, 2) or isinstance(self.levels, bool):
            raise ConfigError(f"levels must be 1 or 2, got {self.levels!r}")
        check_levels(self.levels, topology)

    @property
    def topo(self) -> Topology:
        """The topology, never ``None`` (filled in at construction)."""
        assert self.topology is not None  # set in __post_init__, not user input
        return self.topology


@dataclass(frozen=True)
class Formation:
    """What an observer learns each time a policy forms a group (for tests, tracing and the simulator).

    ``requester`` is the worker whose call formed it (``None`` when a window expired); ``counts`` are
    all workers' progress at that moment (steps, as their requests reported them: what smart's threshold
    compares); ``batch`` numbers the call that formed it (all groups
    of one smart division share a batch); ``kind`` says how it was formed (``intra``, ``inter``,
    ``random``, ``ready``, ``window``, ``static``); ``conflict`` is True when some member was already
    committed to an earlier group it has not yet been handed (random policy).
    """

    group: Group
    requester: int | None
    counts: tuple[int, ...]
    batch: int
    kind: str
    conflict: bool = False


Observer = Callable[[Formation], None]


@runtime_checkable
class GroupPolicy(Protocol):
    """What the service and the simulator call; see the module docstring for the contract."""

    config: GeneratorConfig

    def request(self, worker: int, now_s: float, iteration: int | None = None) -> list[Answer]:
        """Register that ``worker`` asks for its next group, after its step ``iteration`` (None: one step
        after its previous request); return every answer determined by this call."""
        ...

    def finish(self, worker: int, now_s: float) -> list[Answer]:
        """``worker`` requests no more; answers include the groups it must still execute, in order."""
        ...

    def exclude(self, worker: int, now_s: float) -> list[Answer]:
        """``worker`` failed: as :meth:`finish`, also while it waits for an answer, and without answers
        for it (it will execute nothing); returns the answers this settles for the others. Idempotent."""
        ...

    def poll(self, now_s: float) -> list[Answer]:
        """Return answers determined by time passing (call at :meth:`next_deadline`)."""
        ...

    def next_deadline(self) -> float | None:
        """When :meth:`poll` must next be called, or ``None`` if no timer is pending."""
        ...

    def stats(self) -> dict[str, float | int]:
        """Counters: requests, groups formed, mean group size and policy-specific ones."""
        ...
