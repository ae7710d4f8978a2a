"""Static group generation: a fixed, conflict-free schedule computed locally, with no round trip.

Prague/Ripples (ASPLOS 2020, arXiv 1909.08029), section on static scheduling, gives this table for 4 nodes
x 4 workers (ranks 4n..4n+3 on node n), repeating every 4 iterations:

====== ==========================================================================
iter   groups
====== ==========================================================================
4k     {0,4,8,12}, {2,3}, {6,7}, {10,11}, {14,15}; 1, 5, 9, 13 step alone
4k+1   {0,1,2,3}, {4,5,6,7}, {8,9,10,11}, {12,13,14,15}
4k+2   {1,5,9,13}, {0,3}, {4,7}, {8,11}, {12,15}; 2, 6, 10, 14 step alone
4k+3   {0,1,2,3}, {4,5,6,7}, {8,9,10,11}, {12,13,14,15}
====== ==========================================================================

The rule, for N nodes x W workers per node (local rank l = rank mod W):

* Odd iterations: every node averages within itself (one group per node).
* Even iterations t: the representative local rank is ``rep = (t // 2) mod min(2, W)`` (0 at 4k, 1 at
  4k+2). The N representatives form one inter-node group. The other local ranks of each node, taken in
  cyclic order after the representative (rep+1, rep+2, ..., rep+W-1 mod W), are paired from the end of
  that list: (rep+W-1, rep+W-2), (rep+W-3, rep+W-4), ...; when W-1 is odd, rep+1 is left over and takes
  a local step.

Every iteration's groups are therefore disjoint and cover all ranks, so executing them can never
conflict. ``seq = iteration * size + min(members)``: the same for all members and globally ordered by
iteration. Every rank must run the same number of iterations (a rank that stops early leaves its
partners waiting), which is also what the paper assumes.
"""

from __future__ import annotations

from prague.errors import ConfigError
from prague.groups.api import Answer, GeneratorConfig, Group, Observer, Topology
from prague.groups.base import PolicyBase


def _static_members(iteration: int, rank: int, topology: Topology) -> tuple[int, ...]:
    wpn = topology.workers_per_node
    node, local = divmod(rank, wpn)
    base = node * wpn
    if iteration % 2 == 1:
        return tuple(topology.ranks_of(node))
    rep = (iteration // 2) % min(2, wpn)
    if local == rep:
        return tuple(n * wpn + rep for n in range(topology.nodes))
    order = [(rep + j) % wpn for j in range(1, wpn)]
    from_end = len(order) - 1 - order.index(local)
    partner_from_end = from_end ^ 1  # pairs are positions (0, 1), (2, 3), ... counted from the end
    if partner_from_end >= len(order):
        return (rank,)
    partner = base + order[len(order) - 1 - partner_from_end]
    return (min(rank, partner), max(rank, partner))


def static_group(iteration: int, rank: int, topology: Topology) -> Group:
    """The group ``rank`` runs at ``iteration`` under the static schedule (pure; any rank may call it)."""
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise ConfigError(f"iteration must be an integer >= 0, got {iteration!r}")
    topology.check_rank(rank)
    members = _static_members(iteration, rank, topology)
    return Group(iteration * topology.size + members[0], members)


def static_schedule(iteration: int, topology: Topology) -> list[Group]:
    """All groups of one iteration, in ``seq`` order (disjoint, covering every rank)."""
    groups = {static_group(iteration, rank, topology) for rank in range(topology.size)}
    return sorted(groups, key=lambda g: g.seq)


class StaticGenerator(PolicyBase):
    """The static schedule behind the policy interface, so the simulator can drive it like the others.

    A worker's k-th request (k = 0, 1, ...) is answered at once with ``static_group(k, worker, ...)``.
    ``group_size`` is ignored: the topology fixes the group sizes.
    """

    def __init__(self, config: GeneratorConfig, *, observer: Observer | None = None) -> None:
        super().__init__(config, observer=observer)

    def request(self, worker: int, now_s: float, iteration: int | None = None) -> list[Answer]:
        self._check_worker(worker)
        group = static_group(self.counts[worker], worker, self.config.topo)  # by request: members must agree
        self._note_request(worker, iteration)
        if worker == group.members[0]:  # count and report each group once, when its lowest rank asks
            self._new_batch()
            self._record(group, worker, "static")
        return [(worker, group)]

    def finish(self, worker: int, now_s: float) -> list[Answer]:
        self._check_worker(worker)
        self._mark_finished(worker)
        return []
