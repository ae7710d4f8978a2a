"""The ready Group Generator (ours, beyond Prague/Ripples, ASPLOS 2020, arXiv 1909.08029).

The paper's generators fix a group before its members are ready, so the group waits for its slowest
member. Here no group is fixed before all its members are waiting at the GG:

* A request waits. As soon as S workers (the requester included) are waiting, a group of S is formed
  at once from them.
* If fewer than S are waiting when ``window_s`` has passed since the oldest waiting request, the group
  is whoever is waiting (one worker alone takes a local step). The same happens at once when every
  worker that has not finished is already waiting: nobody else can come.
* Mixing. The GG keeps a recency matrix: for every pair of workers, the ``seq`` of the last group they
  were both in. When more than S are waiting it starts from the oldest waiter and adds partners one at a
  time, drawn at random with weight ``min(s, H) ** 2``, where s is the number of groups formed since
  the candidate last met any member chosen so far (never met: no limit) and ``H = ceil(nproc / S)`` is
  about one round of groups (at one of several shards, a round of its part's: ``ceil(ceil(nproc / shards) / S)``).
  A partner met in the previous group has weight 1 against ``H ** 2`` for a stranger or anyone not met for a
  round. A meeting older than H groups therefore weighs as none, and the matrix drops it: it holds the pairs of
  the last H groups at most, however long the job.
* Why a hold is needed: requests arrive one at a time and a group forms as soon as S wait, so without
  more there are never more than S waiting and the preference never gets a choice. With
  ``avoid_repeats`` (default on), when every pair among the S waiting workers met within the last H
  groups (the group would mostly repeat recent averaging) and another worker could still arrive, the
  GG holds them until the next arrival (then it chooses S of the S + 1 as above) or until the window
  closes (then it forms the repeat). A hold therefore costs at most ``window_s``. Measured in the event
  simulation of ``tests/groups/test_policies.py`` (16 workers, S = 2, the paper's slowdowns): groups
  re-pairing recent partners fall from about 8% to 3%, throughput from 0.84 to 0.83 of the no-wait
  limit.

The window. A fixed ``window_s``, or with ``window_s = 0`` one that follows the job: the policy keeps, for
every worker, a moving average of the time between its requests (its iteration as the generator sees
it) and sets the window to :data:`ADAPTIVE_SHARE` of the median of those, within
[:data:`MIN_WINDOW_S`, :data:`MAX_WINDOW_S`] (:data:`FIRST_WINDOW_S` until some worker has asked twice),
taken again each time ``1 / MEDIAN_EVERY`` of the workers have asked (at every request up to
:data:`MEDIAN_EVERY` workers), by a linear-time selection (``numpy.partition``): the cost of a request does not
grow with the job. At a shard of a sharded generator a worker's requests come in runs, one per epoch it is served
there; the time from its last request of one run to its first of the next, more than :data:`MAX_GAP` steps later,
is not an interval of its (counted, it drew the shard's window up by half at 2,048 workers in 8 shards).
This is meant for overlapped workers (``prague --overlap on``): their request waits on a background
thread while the next iteration computes, so waiting up to half an iteration costs nothing and gives
slower workers time to arrive; a blocking worker would pay the window itself, so ``prague`` passes a
fixed window when overlap is off.

The group size, ``adapt_size``. Over a window of :data:`ADAPT_EVERY` requests, the policy takes the mean number of
steps a worker advanced between two of its requests (each request says after which step it comes). An
overlapped worker whose average is still out when its next step ends takes that step locally and asks later, so
a mean above :data:`SHRINK_AT` says that a third of the steps or more go without an average: their averages come
back late, and a smaller group, whose members each send and receive less, finishes sooner. The size then falls by
one (not below 2); a mean under :data:`GROW_AT` raises it by one again (not above ``group_size``). A gap counts as
:data:`MAX_GAP` steps at most; at a shard of a sharded generator (``sharded``) a longer one is not counted, as it
may be a worker that asked other shards in between.
A restarted service measures again from ``group_size``. Measured on the transformer on 4 congested emulated hosts
(docs/benchmarks.md): groups of 3 left 73% of the steps without an average and reached the target 0.89x as fast
as ``localsgd``; with ``adapt_size`` the generator came down to pairs in every run, about half of the steps went
without an average, and it reached the target 1.28x [1.17, 1.39] as fast (5 seeds; pairs set by hand: 1.31-1.37x).

Two levels, ``levels = 2`` (Prague/Ripples' alternation of groups inside a node and across nodes, made a rule of
the ``ready`` generator; the hierarchy of Lin et al., "Don't Use Large Mini-Batches, Use Local SGD", ICLR 2020,
without its fixed periods). Across nodes: S waiting form a group only once they are of two nodes or more, and the
group prefers partners of nodes not yet in it (drawn by the same weights among them, any worker once no other node
waits). Inside a node: a worker's second, fourth, ... request to the generator forms a group of its node at once
when ``min(S, the node's workers still active)`` of them wait, itself included (its node-mates' requests of either
kind); else it waits like any other, for a group across nodes, the window or a node-mate's next such request. On
nodes of a slow network, the averages inside a node mix its replicas nearly for free, and fewer cross it. A worker
whose node-mates have all finished takes such a step alone, at once.

Groups still get one global ``seq``; a worker is in at most one unexecuted group at a time, so the
order is trivially consistent and nothing can deadlock. ``finish`` never hands out groups to the
finishing worker (it is not waiting), but may complete a group for the others.
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from collections.abc import Iterable
from itertools import combinations

import numpy as np

from prague.errors import ConfigError
from prague.groups.api import Answer, GeneratorConfig, Observer
from prague.groups.base import PolicyBase


#: The adaptive window's share of the median time between a worker's requests.
ADAPTIVE_SHARE = 0.5
#: The adaptive window before any worker has asked twice, and its bounds.
FIRST_WINDOW_S = 0.05
MIN_WINDOW_S = 0.001
MAX_WINDOW_S = 5.0
#: Weight of the newest interval in a worker's moving average.
_EWMA = 0.3
#: The median of the workers' intervals is taken again after ``1 / MEDIAN_EVERY`` of them asked.
MEDIAN_EVERY = 16
#: ``adapt_size``: requests per decision, and the mean steps between a worker's requests above which the group
#: size falls by one, under which it rises by one; a gap counts as ``MAX_GAP`` at most (at a shard: a longer one
#: is not counted).
ADAPT_EVERY = 32
SHRINK_AT = 1.5
GROW_AT = 1.15
MAX_GAP = 8
#: The counter of each kind of group :meth:`ReadyGenerator._take` forms.
_COUNTED_AS = {"ready": "full_groups", "window": "window_groups", "all_here": "all_here_groups", "node": "node_groups"}


class ReadyGenerator(PolicyBase):
    """Groups formed only from workers already waiting, preferring partners that have not met recently."""

    def __init__(self, config: GeneratorConfig, *, observer: Observer | None = None, shards: int = 1) -> None:
        """``shards``: this generator is one of that many shards of the job (:mod:`prague.groups.shards`), each
        serving about ``nproc / shards`` workers at a time."""
        super().__init__(config, observer=observer)
        if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
            raise ConfigError(f"shards must be an integer >= 1, got {shards!r}")
        self._sharded = shards > 1
        self._waiting: dict[int, float] = {}  # worker -> time of its request, in arrival order
        # Sparse recency matrix: the pair a < b, as the int a * nproc + b (:meth:`_pair`: no tuple to make, hash and
        # free, and no object for the cycle collector) -> seq.
        self._last_met: dict[int, int] = {}
        # The pairs set, oldest first, as two ints each, seq then pair: an entry older than the horizon weighs as
        # one never set, so it is dropped, and the matrix holds at most the pairs of the last horizon groups
        # whatever the job's length.
        self._met_order: deque[int] = deque()
        # About one round of groups among the workers this generator serves: at a shard, its part's round (a
        # shard forms a group from its own part only, and its part is drawn again every few rounds).
        part = -(-config.nproc // shards)
        self._horizon = -(-part // config.group_size)
        # Per worker of the job (a shard's requests come from any of them over a run), side by side in one array of
        # raw doubles: when its last request came (``2 w``) and the moving average of the time between its requests
        # (``2 w + 1``), NaN for none yet. A request touches one cache line of it and makes no float object: at
        # 16,384 workers in 64 shards, per-worker floats and dict entries made anew as workers moved between
        # shards grew a run's memory, and the cost of every request with it. The workers measured, in the order
        # they were first measured: numpy gathers their averages and selects the median in linear time.
        self._timing = array("d", [math.nan]) * (2 * config.nproc)
        self._measured = array("q")
        self._since_median = 0  # intervals measured since the median was last taken
        self._last_arrival = float("-inf")
        self._in_order = True  # requests so far came in time order: the oldest waiting is the first
        self._window_s = config.window_s if config.window_s > 0 else FIRST_WINDOW_S
        self._size = config.group_size  # the size groups are formed at (adapt_size moves it)
        self._gaps = 0.0  # adapt_size: the steps between requests summed over the window, and its requests
        self._gapped = 0
        self.counters.extra.update(
            full_groups=0, window_groups=0, all_here_groups=0, window_expiries=0, holds=0, total_wait_s=0.0,
            window_s=self._window_s,
        )
        if config.adapt_size:
            self.counters.extra.update(group_size=self._size, size_changes=0)
        self._levels = config.levels == 2
        self._wpn = config.topo.workers_per_node
        # read at every request: kept here, where the compiled build reads them without a lookup by name
        self._adapt_size, self._adaptive_window = config.adapt_size, config.window_s == 0
        self._avoid_repeats = config.avoid_repeats
        if self._levels:
            self.counters.extra.update(node_groups=0)

    # -- protocol -----------------------------------------------------------------------------------
    def request(self, worker: int, now_s: float, iteration: int | None = None) -> list[Answer]:
        self._check_worker(worker)
        if worker in self._waiting:
            raise ConfigError(
                f"worker {worker} is already waiting for its group; request once per iteration and "
                "wait for the answer"
            )
        before, asked = self.progress[worker], self.counts[worker]
        self._note_request(worker, iteration)
        advanced = self.progress[worker] - before
        if self._adapt_size and iteration is not None and asked:
            self._adapt(advanced)
        if now_s < self._last_arrival:
            self._in_order = False
        else:
            self._last_arrival = now_s
        self._waiting[worker] = now_s
        if self._adaptive_window:
            self._measure(worker, now_s, advanced)
        return self._settle(worker, now_s)

    def finish(self, worker: int, now_s: float) -> list[Answer]:
        self._check_worker(worker)
        return self._finished(worker, now_s, marked=False)

    def _finished(self, worker: int, now_s: float, marked: bool) -> list[Answer]:
        """A finish of a worker not waiting; ``marked``: its shared flag is set already (:meth:`share_finished`)."""
        if worker in self._waiting:
            raise ConfigError(f"worker {worker} is waiting for a group; call finish after receiving it")
        if marked:
            self.active_count -= 1
            self._active = None
        else:
            self._mark_finished(worker)
        return self._settle(None, now_s)

    def finish_many(self, finishes: list[tuple[int, float]], marked: bool = False, start: int = 0) -> list[Answer]:
        """``finish(worker, now_s)`` for each of ``finishes[start:]`` in order, the answers together. With nobody
        waiting a finish only marks its worker (it cannot form a group), so then each costs a few list writes.

        ``marked``: the workers' finished flags are set already (:meth:`share_finished`: the shard told first set
        them), so a finish only counts. While fewer than a group wait here and someone not waiting is still active
        after the whole batch, no finish of it can form a group (:meth:`_settle` forms groups from fewer than a
        group only once everyone active waits), so the batch costs a few additions, whatever its length."""
        waiting = self._waiting
        if marked:
            k = len(finishes) - start
            if len(waiting) < self._size and self.active_count - k > len(waiting):
                for w in waiting:
                    if self.finished[w]:
                        raise ConfigError(f"worker {w} is waiting for a group; call finish after receiving it")
                self.active_count -= k
                self._active = None
                self._batch += k  # as _settle counts one batch a finish
                return []
            return [a for worker, now_s in finishes[start:] for a in self._finished(worker, now_s, marked=True)]
        if waiting:
            return [a for worker, now_s in finishes[start:] for a in self.finish(worker, now_s)]
        for worker, _ in finishes[start:]:
            self._check_worker(worker)
            self._mark_finished(worker)
            self._new_batch()
        return []

    def _withdraw(self, worker: int) -> None:
        self._waiting.pop(worker, None)

    def share_finished(self, flags: list[bool]) -> None:
        """Read and set the workers' finished flags in ``flags``, a list that the other shards of one process
        share (:class:`~prague.groups.shards.ShardedGenerator`), rather than in a list of this shard's own over
        every worker of the job. Each shard is told of every finish before it is asked anything, so the shared
        flags are the ones it would hold; the first shard told of a finish sets the flag, the others are told
        with :meth:`finish_many` ``marked`` or :meth:`exclude_marked`. Before any worker finished."""
        if len(flags) != self.config.nproc or any(flags) or any(self.finished):
            raise ConfigError(f"shared finished flags must be {self.config.nproc} flags, all unset, given before any "
                              "worker finished")
        self.finished = flags

    def exclude_marked(self, worker: int, now_s: float) -> list[Answer]:
        """:meth:`exclude` of a worker whose shared flag another shard set already (:meth:`share_finished`)."""
        self._withdraw(worker)
        return [(w, g) for w, g in self._finished(worker, now_s, marked=True) if w != worker]

    def next_deadline(self) -> float | None:
        if not self._waiting:
            return None
        return self._waiting[self._oldest()] + self._window_s

    def _oldest(self) -> int:
        """The worker waiting longest (the first to arrive, unless requests came out of time order)."""
        waiting = self._waiting
        if self._in_order:
            return next(iter(waiting))
        return min(waiting, key=waiting.__getitem__)

    def poll(self, now_s: float) -> list[Answer]:
        deadline = self.next_deadline()
        if deadline is None or now_s < deadline:
            return []
        self._new_batch()
        self.counters.extra["window_expiries"] += 1
        answers: list[Answer] = []
        while self._waiting:
            answers += self._take(min(self._size, len(self._waiting)), None, "window", now_s)
        return answers

    @property
    def window_s(self) -> float:
        """The window now: ``config.window_s``, or the adaptive one (see the module docstring)."""
        return self._window_s

    def _measure(self, worker: int, now_s: float, steps: int) -> None:
        """Count the time since ``worker``'s previous request here in its moving average; ``steps``: the steps it
        advanced in between. At a shard a gap of more than :data:`MAX_GAP` steps is not an interval: the worker
        was served by other shards in between (it only starts the next one)."""
        timing, at = self._timing, 2 * worker
        last = timing[at]
        timing[at] = now_s
        if last != last or (steps > MAX_GAP and self._sharded):  # NaN: its first request here
            return
        gap = max(0.0, now_s - last)
        average = timing[at + 1]
        if average != average:  # its first interval
            timing[at + 1] = gap
            self._measured.append(worker)
        else:
            timing[at + 1] = (1 - _EWMA) * average + _EWMA * gap
        # The median is taken again once 1 / MEDIAN_EVERY of the workers measured have asked since: at
        # every request of a job of up to MEDIAN_EVERY workers; in a larger one, whose median a few
        # requests barely move, one selection every n / MEDIAN_EVERY requests (about MEDIAN_EVERY linear
        # passes over n values spread over n requests: a constant cost a request).
        self._since_median += 1
        measured = len(self._measured)
        if self._since_median * MEDIAN_EVERY < measured:
            return
        self._since_median = 0
        # As statistics.median: the middle value, or the mean of the two middle ones (the same float).
        low, high = (measured - 1) // 2, measured // 2
        averages = np.frombuffer(self._timing)[1::2][np.frombuffer(self._measured, dtype=np.int64)]
        known = np.partition(averages, (low, high))
        middle = float(known[high]) if low == high else (float(known[low]) + float(known[high])) / 2
        self._window_s = min(MAX_WINDOW_S, max(MIN_WINDOW_S, ADAPTIVE_SHARE * middle))
        self.counters.extra["window_s"] = self._window_s

    @property
    def group_size(self) -> int:
        """The size groups are formed at now: ``config.group_size``, or with ``adapt_size`` where the late averages
        moved it (see the module docstring)."""
        return self._size

    def _adapt(self, gap: int) -> None:
        """Count one request ``gap`` steps after the worker's previous one; every :data:`ADAPT_EVERY` requests
        counted, move the size by one if their mean says so."""
        if gap <= 0 or (gap > MAX_GAP and self._sharded):
            return
        gap = min(gap, MAX_GAP)
        self._gaps += gap
        self._gapped += 1
        if self._gapped < ADAPT_EVERY:
            return
        mean = self._gaps / self._gapped
        self._gaps, self._gapped = 0.0, 0
        size = self._size
        if mean > SHRINK_AT and size > 2:
            size -= 1
        elif mean < GROW_AT and size < self.config.group_size:
            size += 1
        if size != self._size:
            self._size = size
            extra = self.counters.extra
            extra["group_size"] = size
            extra["size_changes"] += 1

    def waiting(self) -> list[int]:
        """Workers waiting for a group, oldest first."""
        return list(self._waiting)

    @property
    def waiting_count(self) -> int:
        """How many workers wait for a group."""
        return len(self._waiting)

    def last_met(self, a: int, b: int) -> int | None:
        """``seq`` of the last group holding both ``a`` and ``b`` (None if they never met, or not within the
        last round of groups, the horizon H of the module docstring, beyond which meetings no longer count)."""
        return self._last_met.get(self._pair(a, b))

    def _pair(self, a: int, b: int) -> int:
        """The recency matrix's key of the pair ``a``, ``b``."""
        return a * self.nproc + b if a < b else b * self.nproc + a

    def stats(self) -> dict[str, float | int]:
        out = super().stats()
        members = self.counters.members
        out["mean_wait_s"] = out.pop("total_wait_s") / members if members else 0.0
        return out

    # -- forming groups -----------------------------------------------------------------------------
    def _settle(self, requester: int | None, now_s: float) -> list[Answer]:
        """Form what the waiting allow: with ``levels = 2`` first a group of the requester's node
        (:meth:`_node_group`); then full groups while enough wait (with two levels, of two nodes or more), unless
        the last full group would repeat a meeting of the last round while someone is still to come; once every
        active worker waits, groups of whoever is left."""
        size, waiting = self._size, self._waiting
        idle = self.active_count - len(waiting)
        self._new_batch()
        answers = self._node_group(requester, now_s) if self._levels else []
        wpn = self._wpn
        while len(waiting) >= size and (not self._levels or size < 2 or len({w // wpn for w in waiting}) > 1):
            if len(waiting) == size and idle > 0 and self._avoid_repeats and self._is_repeat(waiting):
                self.counters.extra["holds"] += 1
                break
            answers += self._take(size, requester, "ready", now_s)
        if idle == 0:
            while waiting:
                answers += self._take(min(size, len(waiting)), requester, "all_here", now_s)
        return answers

    def _node_group(self, requester: int | None, now_s: float) -> list[Answer]:
        """``levels = 2``: a group of the requester's node if this is its second, fourth... request and enough of
        the node wait. It forms only on a request (a finish forms groups only once everyone active waits, as with
        one level, so a shard told of it late decides the same: :mod:`prague.groups.shards`)."""
        if requester is None or self.counts[requester] % 2:  # counted already: only its 2nd, 4th... request
            return []
        wpn = self._wpn
        node = requester // wpn
        mates = [w for w in self._waiting if w // wpn == node]
        active = sum(not self.finished[w] for w in self.config.topo.ranks_of(node))
        if len(mates) < min(self._size, active):
            return []
        return self._take(min(self._size, len(mates)), requester, "node", now_s, mates)

    def _is_repeat(self, pool: Iterable[int]) -> bool:
        """True when every pair of the workers of ``pool`` met within the last round of groups."""
        waiting = sorted(pool)
        if len(waiting) < 2:
            return False
        floor = self._next_seq - self._horizon
        last_met, n = self._last_met, self.nproc
        for i, a in enumerate(waiting):
            for b in waiting[i + 1:]:
                if last_met.get(a * n + b, floor - 1) < floor:  # a < b: sorted
                    return False
        return True

    def _weight(self, candidate: int, chosen: list[int]) -> int:
        horizon, pair = self._horizon, self._pair
        staleness = min(self._next_seq - self._last_met.get(pair(candidate, m), -horizon) for m in chosen)
        return min(staleness, horizon) ** 2

    def _take(self, k: int, requester: int | None, kind: str, now_s: float, pool: list[int] | None = None
              ) -> list[Answer]:
        """Form one group of ``k`` waiting workers: the oldest plus k - 1 partners, preferring strangers; with
        ``pool`` (a node's waiting, in arrival order) from it; with ``levels = 2`` a full group (``ready``) prefers
        partners of nodes not yet in it."""
        waiting = self._waiting
        if pool is None:
            anchor = self._oldest()
            candidates = [w for w in waiting if w != anchor]
        else:
            anchor = pool[0] if self._in_order else min(pool, key=waiting.__getitem__)
            candidates = [w for w in pool if w != anchor]
        chosen = [anchor]
        if k - 1 >= len(candidates):
            chosen += candidates
        elif not self._levels or kind != "ready":
            for _ in range(k - 1):
                weights = [self._weight(c, chosen) for c in candidates]
                chosen.append(candidates.pop(self.rng.choices(range(len(candidates)), weights)[0]))
        else:
            wpn = self._wpn
            for _ in range(k - 1):
                nodes = {c // wpn for c in chosen}
                other = [i for i, c in enumerate(candidates) if c // wpn not in nodes] or list(range(len(candidates)))
                weights = [self._weight(candidates[i], chosen) for i in other]
                chosen.append(candidates.pop(other[self.rng.choices(range(len(other)), weights)[0]]))
        group = self._form(chosen, requester, kind)
        extra = self.counters.extra
        extra[_COUNTED_AS[kind]] += 1
        waited = extra["total_wait_s"]
        for m in group.members:
            waited += now_s - waiting.pop(m)
        extra["total_wait_s"] = waited
        last_met, order, seq, n = self._last_met, self._met_order, group.seq, self.nproc
        for a, b in combinations(group.members, 2):  # sorted members: a < b
            last_met[a * n + b] = seq
            order.append(seq)
            order.append(a * n + b)
        floor = self._next_seq - self._horizon  # older meetings weigh as none (_weight, _is_repeat)
        while order and order[0] < floor:
            old = order.popleft()
            pair = order.popleft()
            if last_met[pair] == old:
                del last_met[pair]
        return [(m, group) for m in group.members]
