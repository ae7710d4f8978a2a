"""The smart Group Generator of Prague/Ripples (ASPLOS 2020, arXiv 1909.08029, section on smart GG).

The GG counts each worker's iterations c_w (each request says after which step it asks: a worker that
averages in the background asks only when it submits an average, so counting requests would measure
averages, not how far behind it is). When worker i asks and its FIFO (group buffer) is empty, the
GG draws one random *division*, a partition of all eligible workers into groups of size S, and appends
each group to the FIFO of every member, in one global sequence. Divisions alternate between
*intra-node* (groups inside a node) and *inter-node* (groups spanning nodes, one worker per node where
possible), so a model mixes quickly inside a machine and still spreads across machines. The answer to i
is the head of its FIFO.

Eligible for the division triggered by i: i itself, and every worker w that has not finished with
``c_w > c_i - delta_c`` (the threshold rule: a fast requester never pulls a far-behind worker into its
group, because that group would wait for the straggler and a slow worker's FIFO would grow without
bound).

The threshold in time (``threshold = "time"``, ours). Counting steps treats a step of every worker as the
same time; under persistent heterogeneity it is not: a worker 4x slower, d steps behind, needs 4d of the
requester's steps to reach the group, and the group waits for it. The GG keeps, for every worker, a moving
average of its time per step (the time between two of its requests over the steps they advanced), and makes
w eligible when it catches up within ``delta_c`` of the requester's steps at its own pace:
``(c_i - c_w) * t_w < delta_c * t_i``. With equal step times that is the step rule; a worker whose time is not
measured yet (it asked once) is judged by the step rule.

Remainders: the eligible workers are cut into groups of S in a random order; a last group of one joins
the group before it (size S + 1), a larger remainder stays a smaller group. In an intra-node division a
node with a single eligible worker gives it to a pool that is cut the same way, so nobody steps alone
while another lone worker could average with it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from prague.errors import unknown_choice
from prague.groups.api import Answer, GeneratorConfig, Observer, Topology
from prague.groups.base import BufferedPolicy

DIVISION_KINDS = ("intra", "inter")
#: ``threshold = "time"``: weight of the newest measurement in a worker's moving average of its time per step.
STEP_EWMA = 0.3


def chunk(workers: Sequence[int], size: int) -> list[list[int]]:
    """Cut ``workers`` in order into groups of ``size``; a last group of one joins the one before it."""
    groups = [list(workers[i : i + size]) for i in range(0, len(workers), size)]
    if size > 1 and len(groups) >= 2 and len(groups[-1]) == 1:
        groups[-2].extend(groups.pop())
    return groups


def _by_node(workers: Sequence[int], topology: Topology, rng: random.Random) -> list[list[int]]:
    by_node: dict[int, list[int]] = {}
    for w in workers:
        by_node.setdefault(topology.node_of(w), []).append(w)
    lists = [by_node[node] for node in sorted(by_node)]
    for ws in lists:
        rng.shuffle(ws)
    return lists


def intra_node_division(workers: Sequence[int], size: int, topology: Topology,
                        rng: random.Random) -> list[list[int]]:
    """Random groups of ``size`` inside each node; lone workers of different nodes are pooled."""
    groups: list[list[int]] = []
    lone: list[int] = []
    for ws in _by_node(workers, topology, rng):
        if len(ws) == 1:
            lone.extend(ws)
        else:
            groups.extend(chunk(ws, size))
    rng.shuffle(lone)
    groups.extend(chunk(lone, size))
    return groups


def inter_node_division(workers: Sequence[int], size: int, topology: Topology,
                        rng: random.Random) -> list[list[int]]:
    """Random groups of ``size`` spanning nodes: workers are dealt node by node, round-robin."""
    lists = _by_node(workers, topology, rng)
    rng.shuffle(lists)
    dealt = [ws[col] for col in range(max(map(len, lists), default=0)) for ws in lists if col < len(ws)]
    return chunk(dealt, size)


def divide(workers: Sequence[int], size: int, topology: Topology, kind: str,
           rng: random.Random) -> list[list[int]]:
    """One random division (partition) of ``workers`` into groups of about ``size``, of ``kind``."""
    if kind == "intra":
        return intra_node_division(workers, size, topology, rng)
    if kind == "inter":
        return inter_node_division(workers, size, topology, rng)
    raise unknown_choice("division kind", kind, DIVISION_KINDS)


class SmartGenerator(BufferedPolicy):
    """The paper's smart GG: threshold-filtered random divisions, alternating intra and inter node."""

    def __init__(self, config: GeneratorConfig, *, observer: Observer | None = None) -> None:
        super().__init__(config, observer=observer)
        self.divisions = 0
        self.counters.extra.update(divisions=0, excluded_by_threshold=0)
        self._by_time = config.threshold == "time"
        # threshold "time": each worker's last request (time, steps done then) and moving time per step (0: unknown)
        self._last: list[tuple[float, int] | None] = [None] * config.nproc
        self._step_s = [0.0] * config.nproc

    def request(self, worker: int, now_s: float, iteration: int | None = None) -> list[Answer]:
        if self._by_time:
            self._check_worker(worker)
            self._time_step(worker, now_s, iteration)
        return super().request(worker, now_s, iteration)

    def _time_step(self, worker: int, now_s: float, iteration: int | None) -> None:
        """Fold the time since ``worker``'s last request, over the steps it advanced, into its time per step."""
        steps = self._progress_after(worker, iteration)
        last, self._last[worker] = self._last[worker], (now_s, steps)
        if last is None or steps <= last[1] or now_s <= last[0]:
            return
        per_step = (now_s - last[0]) / (steps - last[1])
        known = self._step_s[worker]
        self._step_s[worker] = per_step if known == 0.0 else (1 - STEP_EWMA) * known + STEP_EWMA * per_step

    def step_time(self, worker: int) -> float | None:
        """``worker``'s moving time per step as the GG measured it (``threshold = "time"``); None until it is."""
        known = self._step_s[worker]
        return known if known > 0.0 else None

    def eligible(self, requester: int) -> list[int]:
        """Workers a division triggered now by ``requester`` may include (the threshold rule)."""
        progress, delta = self.progress, self.config.delta_c
        mine = progress[requester]
        floor = mine - delta
        if not self._by_time or self._step_s[requester] == 0.0:
            return [w for w in self.active() if w == requester or progress[w] > floor]
        budget, step_s = delta * self._step_s[requester], self._step_s
        return [w for w in self.active()
                if w == requester or progress[w] >= mine
                or ((mine - progress[w]) * step_s[w] < budget if step_s[w] > 0.0 else progress[w] > floor)]

    def _fill(self, requester: int) -> None:
        eligible = self.eligible(requester)
        kind = DIVISION_KINDS[self.divisions % 2]
        self.divisions += 1
        extra = self.counters.extra
        extra["divisions"] = self.divisions
        extra["excluded_by_threshold"] += len(self.active()) - len(eligible)
        for members in divide(eligible, self.config.group_size, self.config.topo, kind, self.rng):
            self._commit(members, requester, kind)
