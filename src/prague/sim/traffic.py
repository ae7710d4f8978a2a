"""Cross traffic in simulated time: the seeded bursts of ``--cross-traffic bursts:P:MB`` on every node's link.

The bursts are the runtime's own (:func:`prague.net.traffic.burst_plan`, seeded by (seed, node,
direction)): every :data:`~prague.net.traffic.PERIOD_S` each node's link carries, in each direction
(``"out"``: from the node, ``"in"``: to it), a burst of MB megabytes with probability P. As in the
traffic service, one connection per link direction sends them one after the other, so a burst drawn
while the previous one still runs starts when it ends (a link loaded beyond its rate stays busy). A
burst occupies its link direction for ``MB / rate`` seconds, the link's full rate: how much the
training traffic it shares the link with slows the burst itself is not modelled, which keeps the bursts
independent of the method (one seed, the same bursts for every method) and computable ahead of time.

While a burst occupies a link direction it is one more TCP flow there, and TCP shares a link roughly
fairly per flow: a transfer of ``f`` flows that had a share ``s`` of the link (``1/k`` among k
concurrent transfers, :class:`prague.sim.costs.Fabric`; the other transfers' flows taken as ``f`` each)
gets ``s f / (f + s)`` of it while the burst lasts (one flow alone: half the link). A transfer that
crosses several link directions (a ring crosses each of its nodes' links both ways) moves at the pace of
its slowest, so it is slowed while any of them carries a burst. Only links between nodes carry bursts:
traffic inside a node stays on its loopback, as on emulated hosts.

Deterministic: the bursts depend only on (seed, node, direction), and a transfer's delay only on its
start, its size and the bursts.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from heapq import heapify, heappop, heappush

from prague.net.traffic import PERIOD_S, CrossTraffic, burst_plan
from prague.sim.cluster import Link

DIRECTIONS = ("out", "in")
_FIRST_PERIODS = 64  # periods drawn at first per link direction; doubled whenever time runs past them


class _LinkBursts:
    """The busy intervals of one link direction, drawn lazily: complete for every time before ``horizon_s``."""

    __slots__ = ("node", "direction", "periods", "starts", "ends")

    def __init__(self, node: int, direction: str) -> None:
        self.node, self.direction = node, direction
        self.periods = 0
        self.starts: list[float] = []  # burst k occupies [starts[k], ends[k]); both ascending
        self.ends: list[float] = []

    @property
    def horizon_s(self) -> float:
        return self.periods * PERIOD_S

    def extend(self, traffic: CrossTraffic, seed: int, burst_s: float, until_s: float) -> None:
        """Draw periods (a prefix-stable plan, doubled) until the horizon passes ``until_s``."""
        periods = max(_FIRST_PERIODS, self.periods)
        while periods * PERIOD_S <= until_s:
            periods *= 2
        if periods <= self.periods:
            return
        starts, ends = [], []
        free_at = 0.0
        for k, burst in enumerate(burst_plan(seed, self.node, self.direction, periods, traffic.probability)):
            if burst:
                start = max(k * PERIOD_S, free_at)  # behind the previous burst on the same connection
                free_at = start + burst_s
                starts.append(start)
                ends.append(free_at)
        self.periods, self.starts, self.ends = periods, starts, ends

    def state(self, t: float) -> tuple[bool, float]:
        """(busy at ``t``, the next time that changes); ``t`` must be before the horizon. A burst drawn
        after the horizon starts after it and after every burst drawn before it, so nothing unknown can
        change the state before the returned time."""
        i = bisect_right(self.ends, t)  # the first burst still running or to come
        if i < len(self.ends):
            return (True, self.ends[i]) if self.starts[i] <= t else (False, self.starts[i])
        return False, self.horizon_s


class Bursts:
    """Every node link's bursts (see the module docstring); :meth:`delay_s` is what a transfer loses to them."""

    def __init__(self, traffic: CrossTraffic, seed: int, link: Link) -> None:
        self.traffic = traffic
        self.seed = seed
        self.burst_s = traffic.megabytes * 1e6 / link.bandwidth_bytes_per_s
        self._links: dict[tuple[int, str], _LinkBursts] = {}
        self.delayed_s = 0.0  # total delay charged to transfers (the run's report)
        self.delayed = 0  # transfers that met a burst

    def _state(self, crossing: tuple[int, str], t: float) -> tuple[bool, float]:
        bursts = self._links.get(crossing)
        if bursts is None:
            bursts = self._links[crossing] = _LinkBursts(*crossing)
        if t >= bursts.horizon_s:
            bursts.extend(self.traffic, self.seed, self.burst_s, t)
        return bursts.state(t)

    def busy(self, node: int, direction: str, t: float) -> bool:
        """Whether a burst occupies ``node``'s link in ``direction`` at time ``t``."""
        return self._state((node, direction), t)[0]

    def delay_s(self, crossings: Iterable[tuple[int, str]], start_s: float, work_s: float, flows: int = 1,
                share: float = 1.0) -> float:
        """How much later than ``start_s + work_s`` a transfer ends that needs ``work_s`` seconds at its
        ``share`` of the link, with ``flows`` flows, across the link directions ``crossings`` ((node,
        ``"out"`` or ``"in"``) pairs); exactly 0.0 when it meets no burst."""
        crossings = tuple(crossings)
        if not crossings or work_s <= 0.0 or self.traffic.probability == 0.0:
            return 0.0
        slow = flows / (flows + share)  # its pace while a burst shares a link it crosses
        # Each crossing's state and when it next changes, the soonest change first: one look per change.
        flags: list[bool] = []
        changes: list[tuple[float, int]] = []
        for i, crossing in enumerate(crossings):
            b, until = self._state(crossing, start_s)
            flags.append(b)
            changes.append((until, i))
        heapify(changes)
        busy = sum(flags)  # crossings a burst occupies now
        t, left, slowed = start_s, work_s, False
        while True:
            change = changes[0][0]
            rate = slow if busy else 1.0
            if t + left / rate <= change:
                end = t + left / rate
                break
            left -= (change - t) * rate
            slowed = slowed or busy > 0
            t = change
            while changes[0][0] <= t:
                _, i = heappop(changes)
                b, until = self._state(crossings[i], t)
                busy += b - flags[i]
                flags[i] = b
                heappush(changes, (until, i))
        if not (slowed or busy > 0):
            return 0.0
        delay = end - start_s - work_s
        self.delayed_s += delay
        self.delayed += 1
        return delay

    def report(self) -> dict[str, float | int | str]:
        """The run's cross traffic, for the record's ``sim`` block."""
        return {"traffic": self.traffic.text, "burst_ms": self.burst_s * 1e3, "transfers_delayed": self.delayed,
                "delay_s": self.delayed_s}


def node_crossings(nodes: Iterable[int]) -> tuple[tuple[int, str], ...]:
    """The link directions a transfer among ``nodes`` crosses: each node's link, both ways (a ring ordered
    by node enters and leaves each node once; a pair crosses both links both ways)."""
    return tuple((node, d) for node in nodes for d in DIRECTIONS)
