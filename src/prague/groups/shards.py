"""Several Group Generator shards for one job: the ``ready`` generator scaled out.

One generator serves about 1 / (cost per request) requests a second (about 110 us of CPU each: some 9,000
a second, so about 1,000 workers at 100 ms steps). Shards divide the job instead:

* **Parts by node.** An *epoch* is ``epoch_steps`` steps of a worker (a request after step k belongs to
  epoch ``k // epoch_steps``). In each epoch the nodes are put in an order drawn from ``(seed, epoch)``
  and cut into ``shards`` blocks of consecutive nodes, as even as whole nodes allow; shard s serves the
  workers of block s. A node's workers always share a shard, so groups inside a node stay possible.
* **Groups inside a part.** Each shard runs its own :class:`~prague.groups.ready.ReadyGenerator` and
  groups whoever of its part is waiting, as one generator does for a whole job.
* **Mixing across parts, with no extra round trip.** The blocks are drawn again every epoch, so a worker's
  partners of the next epoch come from other parts: every worker (and every shard) computes who serves
  whom from the seed alone, so a worker simply sends its first request of a new epoch to its new shard.
  Over a few epochs any two workers' models are connected through chains of groups, as in gossip
  averaging over a changing graph (Boyd et al., "Randomized gossip algorithms", 2006).
* **Why only ``ready``.** A ``ready`` group holds only workers already waiting at its shard, so nobody is
  ever committed to a group of a shard it has left: moving between shards can never deadlock. The
  generators that fix groups ahead of time (``smart``, ``random``) would leave such commitments behind.

Groups keep one global ``seq``: a shard's own numbers ``k`` become ``k * shards + s``, unique across
shards. A worker finishing or failed is reported to every shard (each may hold it as not yet arrived).
In one process (:class:`ShardedGenerator`, the simulator's) a finish reaches a shard when that shard is next
called, unless it would form a group there at once: the shard then decides exactly as if told at once. A
finish then makes one shard call, not one per shard; the other shards take the finishes they missed as a
batch, a few list writes each where nobody waits.
The shards' decisions are the same objects in the service and in the simulator; only who calls them
differs. In one process the shards also share one list of the workers' finished flags (each shard is told of a
finish before it is asked anything, so it reads the flags it would hold): the first shard told sets a flag, the
others only count the finish.
"""

from __future__ import annotations

import math
import random
from array import array
from typing import Any

from prague.errors import ConfigError
from prague.groups.api import Answer, GeneratorConfig, Group, Observer, PolicyCounters, Topology, check_worker_id
from prague.groups.ready import ReadyGenerator

#: ``--gg-shards 0`` (auto): one shard for about this many workers. At 100 ms steps and about 110 us a
#: request, one shard of 256 workers is about 30% busy, leaving room for slower steps' bursts.
WORKERS_PER_SHARD = 256
#: ``--gg-epoch-steps``' default: the parts are drawn again every this many steps of a worker.
EPOCH_STEPS = 10
#: Node orders kept (epochs of workers at different steps are asked for in turn).
_ORDERS_KEPT = 64


def auto_shards(nproc: int, nodes: int) -> int:
    """The shards ``--gg-shards 0`` gives a job of ``nproc`` workers on ``nodes`` nodes: one per
    :data:`WORKERS_PER_SHARD` workers, at most one per node."""
    return max(1, min(nodes, math.ceil(nproc / WORKERS_PER_SHARD)))


class ShardPlan:
    """Which shard serves which worker in which epoch (see the module docstring); pure."""

    def __init__(self, topology: Topology, shards: int, epoch_steps: int = EPOCH_STEPS, seed: int = 0) -> None:
        if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
            raise ConfigError(f"--gg-shards must be an integer >= 1 (0: auto), got {shards!r}")
        if shards > topology.nodes:
            raise ConfigError(f"--gg-shards {shards} is more than the job's {topology.nodes} node(s): a shard serves "
                              f"whole nodes; use at most {topology.nodes}, or more --nodes")
        if not isinstance(epoch_steps, int) or isinstance(epoch_steps, bool) or epoch_steps < 1:
            raise ConfigError(f"--gg-epoch-steps must be an integer >= 1, got {epoch_steps!r}")
        self.topology, self.shards, self.epoch_steps, self.seed = topology, shards, epoch_steps, seed
        self._wpn = topology.workers_per_node  # read at every request
        self._orders: dict[int, list[int]] = {}  # epoch -> shard of each node

    def epoch(self, iteration: int) -> int:
        """The epoch of a request made after step ``iteration``."""
        return max(0, iteration) // self.epoch_steps

    def _shard_of_node(self, epoch: int) -> list[int]:
        table = self._orders.get(epoch)
        if table is None:  # kept: the newest epochs asked for (workers at different steps ask in turn)
            nodes = self.topology.nodes
            order = list(range(nodes))
            if self.shards > 1:
                random.Random(f"prague-shards/{self.seed}/{epoch}").shuffle(order)
            table = [0] * nodes
            for position, node in enumerate(order):
                table[node] = position * self.shards // nodes
            self._orders[epoch] = table
            if len(self._orders) > _ORDERS_KEPT:
                del self._orders[min(self._orders)]
        return table

    def shard_of(self, worker: int, iteration: int) -> int:
        """The shard that serves ``worker``'s request after step ``iteration``."""
        if self.shards == 1:
            return 0
        return self._shard_of_node(self.epoch(iteration))[worker // self._wpn]

    def members(self, shard: int, epoch: int) -> list[int]:
        """The workers shard ``shard`` serves in ``epoch``, in rank order."""
        table, wpn = self._shard_of_node(epoch), self.topology.workers_per_node
        return [w for node, s in enumerate(table) if s == shard for w in range(node * wpn, (node + 1) * wpn)]


class ShardView:
    """One shard as its service runs it: a :class:`ReadyGenerator` with the shard's seed (:func:`shard_config`)
    whose groups carry the job's global ``seq`` (``k * shards + shard``); a
    :class:`~prague.groups.GroupPolicy` over the job's ranks. :class:`ShardedGenerator` holds one per shard."""

    def __init__(self, config: GeneratorConfig, shard: int, shards: int, *, observer: Observer | None = None) -> None:
        if not 0 <= shard < shards:
            raise ConfigError(f"--shard {shard} is outside 0..{shards - 1} (--shards {shards})")
        self.config, self.shard, self.count = config, shard, shards
        self.policy = ReadyGenerator(shard_config(config, shard), observer=observer, shards=shards)

    def _global(self, answers: list[Answer]) -> list[Answer]:
        if self.count == 1 or not answers:
            return answers
        renamed: dict[int, Group] = {}  # one group object per group, as every member gets the same one
        out = []
        for w, g in answers:
            group = renamed.get(g.seq)
            if group is None:
                group = renamed[g.seq] = Group.formed(g.seq * self.count + self.shard, g.members)
            out.append((w, group))
        return out

    def request(self, worker: int, now_s: float, iteration: int | None = None) -> list[Answer]:
        return self._global(self.policy.request(worker, now_s, iteration))

    def finish(self, worker: int, now_s: float) -> list[Answer]:
        return self._global(self.policy.finish(worker, now_s))

    def finish_many(self, finishes: list[tuple[int, float]], marked: bool = False, start: int = 0) -> list[Answer]:
        """:meth:`finish` for each of ``finishes[start:]``, in order (``marked``: their shared flags are set already,
        :meth:`ReadyGenerator.finish_many <prague.groups.ready.ReadyGenerator.finish_many>`)."""
        return self._global(self.policy.finish_many(finishes, marked, start))

    def exclude(self, worker: int, now_s: float) -> list[Answer]:
        return self._global(self.policy.exclude(worker, now_s))

    def exclude_marked(self, worker: int, now_s: float) -> list[Answer]:
        """:meth:`exclude` of a worker whose shared finished flag another shard set already."""
        return self._global(self.policy.exclude_marked(worker, now_s))

    def poll(self, now_s: float) -> list[Answer]:
        return self._global(self.policy.poll(now_s))

    def next_deadline(self) -> float | None:
        return self.policy.next_deadline()

    @property
    def waiting_count(self) -> int:
        """How many workers wait at this shard."""
        return self.policy.waiting_count

    def continue_after(self, seq: int, counts: list[int]) -> None:
        """A restarted shard: number its groups after the global ``seq`` an earlier instance handed out."""
        self.policy.continue_after(seq // self.count, counts)

    def stats(self) -> dict[str, float | int]:
        return self.policy.stats()

    @property
    def counters(self) -> PolicyCounters:
        return self.policy.counters


class ShardedGenerator:
    """``plan.shards`` shards (:class:`ShardView`) behind one :class:`~prague.groups.GroupPolicy`.

    :meth:`route` says which shard a request goes to (the simulator queues it there; a worker's client
    sends it there, :class:`~prague.algorithms.prague.source.ShardedSource`); :meth:`request` asks that
    shard. ``config`` is the job's: each shard gets it whole (the ids are the job's ranks) with its own seed."""

    def __init__(self, config: GeneratorConfig, plan: ShardPlan, *, observer: Observer | None = None) -> None:
        if plan.topology.size != config.nproc:
            raise ConfigError(f"the shard plan covers {plan.topology.size} workers but the job has {config.nproc}")
        self.config, self.plan = config, plan
        self.shards = [ShardView(config, s, plan.shards, observer=observer) for s in range(plan.shards)]
        # The workers' finished flags, one list for every shard: each shard's own over every worker of the job
        # would be shards x nproc flags (at 65,536 workers in 256 shards, 134 MB read at scattered places),
        # and telling each shard of each finish would cost shards x nproc writes.
        self._finished = [False] * config.nproc
        for shard in self.shards:
            shard.policy.share_finished(self._finished)
        self._asked = array("q", bytes(8 * config.nproc))  # requests per worker: the step of a request that names none
        self._last_shard = array("q", [-1]) * config.nproc  # the shard of each worker's latest request (-1: none)
        # Finishes not yet told to every shard: the job's, in order, and how many each shard was told. A shard
        # is told (:meth:`_tell`) before anything else is asked of it, so it sees its calls in their order.
        self._finishes: list[tuple[int, float]] = []
        self._told = [0] * plan.shards
        self._active = config.nproc  # workers that have neither finished nor been excluded
        self._waiting = 0  # workers waiting, over every shard
        #: The shards the latest call may have changed (those whose deadline may have moved).
        self.touched: list[int] = []

    def _tell(self, s: int) -> list[Answer]:
        """Tell shard ``s`` of every finish it has not heard of, in order; the groups that formed."""
        shard, told, finishes = self.shards[s], self._told[s], self._finishes
        if told == len(finishes):
            return []
        answers = shard.finish_many(finishes, marked=True, start=told)  # the shard told first set their flags
        self._told[s] = len(finishes)
        self._waiting -= len(answers)  # each worker answered was waiting
        return answers

    def _shard(self, s: int) -> ShardView:
        """Shard ``s``, told of every finish so far. Telling it later than a finish happened changes nothing,
        as :meth:`finish` leaves for later only the finishes that form no group at the shard: its waiting
        workers are the same as then, since nothing else was asked of it in between, so each finish meets
        the state it would have met."""
        if self._told[s] != len(self._finishes) and self._tell(s):
            raise RuntimeError(f"shard {s} formed groups on a finish it was told of late")
        return self.shards[s]

    def route(self, worker: int, iteration: int | None = None) -> int:
        """The shard that serves ``worker``'s next request (after step ``iteration``)."""
        return self.plan.shard_of(worker, self._asked[worker] if iteration is None else iteration)

    def request(self, worker: int, now_s: float, iteration: int | None = None) -> list[Answer]:
        s = self.route(worker, iteration)
        answers = self._shard(s).request(worker, now_s, iteration)
        self._waiting += 1 - len(answers)  # the requester waits, and each worker answered waited
        self._asked[worker] += 1
        self._last_shard[worker] = s
        self.touched = [s]
        return answers

    def finish(self, worker: int, now_s: float) -> list[Answer]:
        """Tell every shard that ``worker`` finished. The shard of its latest request is told now (it refuses a
        worker still waiting there, or one that finished already), and so is a shard where every worker still
        active is now waiting (the only case where a finish forms groups: :class:`ReadyGenerator` groups
        whoever waits once nobody else can come); the others are told when next asked (:meth:`_shard`)."""
        check_worker_id(worker, self.config.nproc)
        home = self._last_shard[worker]
        if home < 0:
            home = self.route(worker)
        got = {home: self._shard(home).finish(worker, now_s)}
        self._waiting -= len(got[home])
        self._finishes.append((worker, now_s))
        self._told[home] = len(self._finishes)
        self._active -= 1
        if 0 < self._active <= self._waiting:  # everyone active waits somewhere: at one shard, maybe
            for s, shard in enumerate(self.shards):
                if s != home and shard.waiting_count == self._active:
                    got[s] = self._tell(s)
        self.touched = sorted(got)
        return [a for s in self.touched for a in got[s]]

    def exclude(self, worker: int, now_s: float) -> list[Answer]:
        check_worker_id(worker, self.config.nproc)
        shards = [self._shard(s) for s in range(len(self.shards))]
        self.touched = list(range(len(self.shards)))
        if self._finished[worker]:  # finished or excluded already: nothing changes anywhere
            return []
        self._active -= 1
        answers = []
        for s, shard in enumerate(shards):  # the first sets the shared flag, the others count it
            before = shard.waiting_count
            answers += shard.exclude(worker, now_s) if s == 0 else shard.exclude_marked(worker, now_s)
            self._waiting += shard.waiting_count - before
        return answers

    def poll(self, now_s: float) -> list[Answer]:
        answers = [a for s in range(len(self.shards)) for a in self.poll_shard(s, now_s)]
        self.touched = list(range(len(self.shards)))
        return answers

    def poll_shard(self, shard: int, now_s: float) -> list[Answer]:
        """Poll one shard (its own timer: :meth:`shard_deadline`)."""
        answers = self._shard(shard).poll(now_s)
        self._waiting -= len(answers)
        self.touched = [shard]
        return answers

    def next_deadline(self) -> float | None:
        deadlines = [d for d in (s.next_deadline() for s in self.shards) if d is not None]
        return min(deadlines) if deadlines else None

    def shard_deadline(self, shard: int) -> float | None:
        return self.shards[shard].next_deadline()

    def stats(self) -> dict[str, float | int]:
        shards = [self._shard(s) for s in range(len(self.shards))]  # a finish can count a hold
        return merged_stats([s.stats() for s in shards], [s.counters.members for s in shards])


def merged_stats(per: list[dict[str, Any]], members: list[int]) -> dict[str, float | int]:
    """One generator's counters from its shards' (``members``: each shard's group members, to weigh
    its mean wait)."""
    out: dict[str, float | int] = {}
    for key in ("requests", "groups", "local_steps", "full_groups", "window_groups", "all_here_groups",
                "window_expiries", "holds"):
        out[key] = sum(int(p.get(key, 0)) for p in per)
    total = sum(members)
    out["mean_group_size"] = total / out["groups"] if out["groups"] else 0.0
    waited = sum(float(p.get("mean_wait_s", 0.0)) * m for p, m in zip(per, members))
    out["mean_wait_s"] = waited / total if total else 0.0
    out["shards"] = len(per)
    out["max_shard_requests"] = max((int(p.get("requests", 0)) for p in per), default=0)
    if any("node_groups" in p for p in per):  # levels 2
        out["node_groups"] = sum(int(p.get("node_groups", 0)) for p in per)
    if any("size_changes" in p for p in per):  # adapt_size: the changes summed, the sizes now from smallest to largest
        out["size_changes"] = sum(int(p.get("size_changes", 0)) for p in per)
        out["group_size"] = min(int(p["group_size"]) for p in per)
        out["max_group_size"] = max(int(p["group_size"]) for p in per)
    return out


def shard_config(config: GeneratorConfig, shard: int) -> GeneratorConfig:
    """Shard ``shard``'s settings: the job's, with a seed of its own (shard 0 keeps the job's)."""
    return GeneratorConfig(nproc=config.nproc, topology=config.topology, group_size=config.group_size,
                           delta_c=config.delta_c, seed=config.seed + 1_000_003 * shard, window_s=config.window_s,
                           avoid_repeats=config.avoid_repeats, adapt_size=config.adapt_size,
                           levels=config.levels)
