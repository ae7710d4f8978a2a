"""``lossy``'s decisions, pure: how the gradient is cut into chunks, in which order they go, when a step
stops sending, which chunks every rank drops, and what is carried to the next step.

Shared by the runtime (:mod:`.runtime`) and the simulator model (:mod:`.sim`), so a simulated step
makes the runtime's choices. No torch, no clock (times come in as arguments), no I/O.

* :func:`plan_chunks`: contiguous slices of the flat gradient (forward order of the parameters), at
  most ``chunk_elements`` long and at least :data:`MIN_CHUNKS_PER_STREAM` per stream (fewer for a
  gradient too small to cut that finely).
* :func:`priority_order`: the order chunks are sent in; every rank computes it from values all ranks
  share (the last *applied* gradient, identical everywhere), never from its own gradient, so every
  stream runs the same collectives in the same order on every rank.
* :func:`required_count` and :func:`stop_points`: the agreement. At its deadline every rank stops
  starting chunks and proposes how many it has started on each stream; the stop of a stream is the
  largest proposal (a chunk one rank has entered must be completed by all) or the count that keeps the
  dropped share within ``max_loss``, whichever is larger. Every rank applies the same rule to the same
  proposals, so all agree on one mask.
* :class:`Deadline`: when a step stops starting chunks, from the measured rate of its recent steps.
* :class:`Steps`: one step's control flow over these, in order (plan the order and the streams' queues,
  set the deadline, settle the agreed stops: what is dropped, its share, the chunks' ages and the
  deadline's next rate), with the bookkeeping every step leaves; the runtime and the simulator both
  drive it, the first with real streams and a real agreement, the second with simulated ones.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

#: Chunks a stream has in flight at once: while one crosses the hosts, the next is reduced inside its host.
IN_FLIGHT = 2
#: Each stream gets at least this many chunks, so a small model can still drop part of its gradient.
MIN_CHUNKS_PER_STREAM = 4


@dataclass(frozen=True)
class ChunkPlan:
    """Chunk ``c`` is ``[starts[c], starts[c] + sizes[c])`` of the flat gradient of ``total`` elements;
    ``tiers[c]`` is its layer tier: 0 for the slices the next forward pass needs first."""

    starts: tuple[int, ...]
    sizes: tuple[int, ...]
    tiers: tuple[int, ...]
    total: int

    @property
    def count(self) -> int:
        return len(self.sizes)


def plan_chunks(total: int, chunk_elements: int, streams: int, tiers: int, min_elements: int = 1) -> ChunkPlan:
    """Cut ``total`` elements into contiguous chunks of equal size (give or take one element): at most
    ``chunk_elements`` each, at least ``MIN_CHUNKS_PER_STREAM x streams`` of them unless that would
    make chunks smaller than ``min_elements`` (a small gradient is bound by the collectives' latency,
    not its bytes: more chunks only add round trips), and at least one. Chunk ``c`` of ``C`` is in
    tier ``c x tiers // C``: the flat gradient is in the parameters' order, which is the order the
    forward pass uses them."""
    if total < 0 or chunk_elements < 1 or streams < 1 or tiers < 1 or min_elements < 1:
        raise ValueError(f"plan_chunks needs total >= 0 and chunk_elements, streams, tiers, min_elements >= 1; got "
                         f"{total}, {chunk_elements}, {streams}, {tiers}, {min_elements}")
    if total == 0:
        return ChunkPlan((), (), (), 0)
    count = max(math.ceil(total / chunk_elements), min(max(1, total // min_elements), MIN_CHUNKS_PER_STREAM * streams))
    base, extra = divmod(total, count)
    sizes = tuple(base + 1 if c < extra else base for c in range(count))
    starts = tuple(itertools.accumulate(sizes, initial=0))[:-1]
    return ChunkPlan(starts, sizes, tuple(c * tiers // count for c in range(count)), total)


def priority_order(plan: ChunkPlan, magnitudes: Sequence[float], dropped_age: Sequence[int]) -> list[int]:
    """The chunks in the order they are sent: first those dropped in earlier steps (longest first, so
    none is starved), then by layer tier (what the next forward pass needs first), then by the mean
    magnitude of the last gradient applied in the chunk (largest first; DLCP's magnitude priority),
    then by position. ``magnitudes`` and ``dropped_age`` must be the same on every rank."""
    return sorted(range(plan.count), key=lambda c: (-dropped_age[c], plan.tiers[c], -magnitudes[c], c))


def stream_queues(order: Sequence[int], streams: int) -> list[list[int]]:
    """Chunk ``order[i]`` goes to stream ``i mod streams``: each stream's chunks, in order."""
    return [list(order[s::streams]) for s in range(streams)]


def required_count(plan: ChunkPlan, order: Sequence[int], max_loss: float) -> int:
    """The fewest chunks, taken in ``order``, whose elements leave at most ``max_loss`` of the total
    unsent."""
    allowed = max_loss * plan.total
    left = plan.total
    for i, c in enumerate(order):
        if left <= allowed:
            return i
        left -= plan.sizes[c]
    return len(order)


def stop_points(proposals: Sequence[Sequence[int]], required: int, queue_lengths: Sequence[int]) -> list[int]:
    """How many chunks each stream completes this step, from every rank's ``proposals`` (chunks it had
    started on each stream when it stopped) and the ``required`` count in priority order: per stream
    the largest proposal, at least the stream's share of the required prefix, at most its queue."""
    streams = len(queue_lengths)
    stops = []
    for s in range(streams):
        needed = max(0, -(-(required - s) // streams))  # chunks of stream s among the first `required`
        proposed = max((p[s] for p in proposals), default=0)
        stops.append(min(queue_lengths[s], max(needed, proposed)))
    return stops


def dropped_chunks(queues: Sequence[Sequence[int]], stops: Sequence[int]) -> list[int]:
    """The chunks no stream sends this step, sorted."""
    return sorted(c for q, stop in zip(queues, stops) for c in q[stop:])


def dropped_share(plan: ChunkPlan, dropped: Sequence[int]) -> float:
    """The share of the gradient's elements in ``dropped``."""
    return sum(plan.sizes[c] for c in dropped) / plan.total if plan.total else 0.0


def next_ages(ages: Sequence[int], dropped: Sequence[int]) -> list[int]:
    """Each chunk's count of consecutive steps dropped, after this step."""
    gone = set(dropped)
    return [age + 1 if c in gone else 0 for c, age in enumerate(ages)]


def deadline_elements(plan: ChunkPlan, order: Sequence[int], queues: Sequence[Sequence[int]],
                      in_flight: int = IN_FLIGHT) -> int:
    """The elements a step moves after its first chunk (``order[0]``) until the last ``in_flight``
    chunks of every stream (the most a stream has in flight) have started: the deadline stops
    *starting* chunks, and what has started must complete, so those must start by the deadline for
    the step to end on time."""
    if not order:
        return 0
    last = {c for q in queues for c in q[-in_flight:]} - {order[0]}
    return plan.total - plan.sizes[order[0]] - sum(plan.sizes[c] for c in last)


class Deadline:
    """When a step stops starting chunks: ``slack`` x the time :func:`deadline_elements` take at the
    ``quantile`` of the rates of the last ``window`` steps (0.5: the median; higher: a faster step's
    pace, so more steps stop early). The clock starts when the step's first chunk has completed, a
    moment every rank reaches together (no rank completes a collective before all have entered it), so
    a rank that arrived late does not start its wait earlier than the others.

    ``observe`` one step's rate: elements moved after the first chunk, and the seconds that took.
    ``budget_s`` is None until ``warmup`` steps were observed: those send everything."""

    def __init__(self, slack: float, quantile: float = 0.5, window: int = 16, warmup: int = 3) -> None:
        if not slack > 0 or not 0 <= quantile <= 1 or window < 1 or warmup < 1:
            raise ValueError(f"Deadline needs slack > 0, quantile in [0, 1], window >= 1, warmup >= 1; got {slack}, "
                             f"{quantile}, {window}, {warmup}")
        self.slack = slack
        self.quantile = quantile
        self.warmup = warmup
        self._rates: deque[float] = deque(maxlen=window)
        self.observed = 0

    def observe(self, elements: int, seconds: float) -> None:
        if elements <= 0 or seconds <= 0:
            return
        self._rates.append(elements / seconds)
        self.observed += 1

    def rate(self) -> float:
        """The reference rate: the ``quantile`` of the recent rates (linear between neighbours)."""
        rates = sorted(self._rates)
        at = self.quantile * (len(rates) - 1)
        low = math.floor(at)
        high = min(low + 1, len(rates) - 1)
        return rates[low] + (rates[high] - rates[low]) * (at - low)

    def budget_s(self, elements: int) -> float | None:
        if self.observed < self.warmup or not self._rates:
            return None
        return self.slack * max(0, elements) / self.rate()


@dataclass(frozen=True)
class StepPlan:
    """One step's plan: the chunks in the order they go, each stream's queue, and the queues' lengths."""

    order: list[int]
    queues: list[list[int]]

    @property
    def lengths(self) -> list[int]:
        return [len(q) for q in self.queues]


@dataclass(frozen=True)
class Settled:
    """What one step dropped (its chunks, in the queues' order) and the share of the gradient that is."""

    dropped: list[int]
    share: float


class Steps:
    """``lossy``'s control flow, one step after another, and what it leaves behind (see the module
    docstring): :meth:`plan` (the order from the shared magnitudes and the chunks' ages, the queues),
    :meth:`budget_s` (when the step stops starting chunks, None during warm-up; each one kept in
    :attr:`deadlines_s`), :meth:`required` and :meth:`settle` (after every rank agreed on the stops:
    what is dropped, the deadline's rate from the elements moved after the first chunk, the ages, the
    share kept in :attr:`shares`). Pure: times come in as arguments."""

    def __init__(self, plan: ChunkPlan, streams: int, max_loss: float, deadline: Deadline) -> None:
        self.chunks, self.streams, self.max_loss, self.deadline = plan, streams, max_loss, deadline
        self.ages = [0] * plan.count
        self.shares: list[float] = []
        self.deadlines_s: list[float] = []

    def plan(self, magnitudes: Sequence[float]) -> StepPlan:
        order = priority_order(self.chunks, magnitudes, self.ages)
        return StepPlan(order, stream_queues(order, self.streams))

    def budget_s(self, step: StepPlan, in_flight: int) -> float | None:
        budget = self.deadline.budget_s(deadline_elements(self.chunks, step.order, step.queues, in_flight))
        if budget is not None:
            self.deadlines_s.append(budget)
        return budget

    def required(self, step: StepPlan) -> int:
        """How many chunks, in order, must go for the dropped share to stay within ``max_loss``."""
        return required_count(self.chunks, step.order, self.max_loss)

    def settle(self, step: StepPlan, stops: Sequence[int], after_first_s: float) -> Settled:
        """The step's agreed ``stops`` (per stream) took ``after_first_s`` seconds after its first chunk:
        its dropped chunks and share; the deadline observes the rate, the dropped chunks age."""
        dropped = dropped_chunks(step.queues, stops)
        plan = self.chunks
        self.deadline.observe(plan.total - plan.sizes[step.order[0]] - sum(plan.sizes[c] for c in dropped),
                              after_first_s)
        self.ages = next_ages(self.ages, dropped)
        share = dropped_share(plan, dropped)
        self.shares.append(share)
        return Settled(dropped, share)


@dataclass(frozen=True)
class Hierarchy:
    """Which ranks share a host, and the two-level path a chunk of each stream takes with ``--hierarchy
    hosts``: reduced inside its host, all-reduced over a ring of one rank per host (each host's
    *leader* for that stream), then broadcast inside the host. Over H hosts the inter-host links then
    carry 2(H-1)/H of a chunk's bytes in 2(H-1) ring steps, where one ring over all n ranks carries
    2(n-1)/n in 2(n-1) steps, each waiting in the links' queues.

    ``hosts`` lists each host's ranks, ascending, hosts ordered by their lowest rank. Stream ``s``'s
    leader on a host is its ``s mod len(ranks)``-th rank, so the streams spread the inter-host rings
    (and the reduce work) over every rank of a host."""

    hosts: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, host_of_rank: Sequence[object]) -> Hierarchy:
        """From each rank's host label (anything comparable for equality), in rank order."""
        groups: dict[object, list[int]] = {}
        for rank, label in enumerate(host_of_rank):
            groups.setdefault(label, []).append(rank)
        return cls(tuple(tuple(ranks) for ranks in groups.values()))

    @property
    def two_level(self) -> bool:
        """Whether the two levels differ from one ring: more than one host, and some host with more than
        one rank."""
        return len(self.hosts) > 1 and any(len(ranks) > 1 for ranks in self.hosts)

    def host_of(self, rank: int) -> int:
        for h, ranks in enumerate(self.hosts):
            if rank in ranks:
                return h
        raise ValueError(f"rank {rank} is on no host of {self.hosts}")

    def leader(self, host: int, stream: int) -> int:
        ranks = self.hosts[host]
        return ranks[stream % len(ranks)]

    def leaders(self, stream: int) -> tuple[int, ...]:
        """Stream ``stream``'s inter-host ring: one rank per host, in host order."""
        return tuple(self.leader(h, stream) for h in range(len(self.hosts)))
