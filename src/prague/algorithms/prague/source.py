"""Where a ``prague`` worker gets its next group: computed locally (``static[-blind]``) or asked of the Group
Generator service, which this module also finds (or, under torchrun, starts from rank 0).

The service is its own process: started by ``prague run``'s launcher (see
:meth:`prague.algorithms.prague.runtime.Prague.job_resources`), or under torchrun by rank 0, which
publishes its address and token through the rendezvous store; or given explicitly with
``--gg-address`` (a ``prague gg serve`` the user started, token from ``$PRAGUE_GG_TOKEN``).

A service a rank started is hosted by that rank's process (it dies with it). When the host rank is
declared failed (:mod:`prague.runtime.liveness`), the survivors agree in the store on a new host, the
lowest living rank (the first survivor to find the host gone names it; the others read its choice),
which starts the service again from the workers' published groups (:func:`restore_args`) and
publishes its address; the others find it there (:meth:`ServiceSource._retrying`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import secrets
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from prague import jobenv
from prague.jobenv import JobEnv
from prague.algorithms.prague import PragueOptions
from prague.groups import Group, Topology, static_group
from prague.groups.api import DEFAULT_THRESHOLD
from prague.runtime.context import DistContext, on_shutdown, service_host
from prague.errors import CommError
from prague.io import atomic_write_json
from prague.runtime.background import PeriodicWork
from prague.runtime.liveness import Membership, mark_done, read_keys, wait_settled
from prague.runtime.services import (
    ServiceKeeper, ServiceSpec, restarted, services_file_from_env, services_managed,
)

GG_ADDRESS_KEY = "prague/gg/address"
GG_TOKEN_KEY = "prague/gg/token"
HELD_KEY = "prague/gg/held/"  # + rank: the last group the worker got (a restarted service starts from these)
RESTART_WAIT_S = 30.0  # how long a worker waits for a restarted service before giving up


def gg_argv(options: PragueOptions, nproc: int, seed: int, ready_file: Path, host: str = "127.0.0.1",
            shard: tuple[int, int] = (0, 1)) -> list[str]:
    """The command that runs this job's Group Generator service on ``host`` (token from ``$PRAGUE_GG_TOKEN``):
    the base policy with the generator's topology (``smart-blind``: ``--generator smart --nodes 1``);
    ``shard`` (s, n): shard s of n (``--gg-shards``)."""
    return [
        sys.executable, "-m", "prague.groups.service", "--host", host, "--port", "0",
        "--nproc", str(nproc), "--generator", options.base_generator, "--nodes", str(options.topology(nproc).nodes),
        "--group-size", str(options.group_size), "--delta-c", str(options.delta_c),
        "--window-s", str(options.window_s), "--seed", str(seed), "--ready-file", str(ready_file),
        *(["--adapt-size", "on"] if options.adapt_size == "on" else []),
        *(["--levels", "2"] if options.levels == 2 else []),
        *(["--threshold", options.threshold] if options.threshold != DEFAULT_THRESHOLD else []),
        *(["--shard", str(shard[0]), "--shards", str(shard[1])] if shard[1] > 1 else []),
    ]


def shard_key(key: str, shard: tuple[int, int]) -> str:
    """``key`` for shard s of n: itself for one service, ``key/shardS`` for several."""
    return key if shard[1] == 1 else f"{key.rstrip('/')}/shard{shard[0]}" + ("/" if key.endswith("/") else "")


def gg_service(options: PragueOptions, nproc: int, ready_file: Path, host: str = "127.0.0.1",
               shard: tuple[int, int] = (0, 1)) -> ServiceSpec:
    """The service the launcher (or rank 0) starts for this job, listening on ``host`` (``shard``: shard s
    of n); restartable (:func:`restore_args`)."""
    held = shard_key(HELD_KEY, shard)
    return ServiceSpec("group-generator" if shard[1] == 1 else f"group-generator-{shard[0]}",
                       gg_argv(options, nproc, options.gg_seed, ready_file, host, shard),
                       ready_file=ready_file, publish_key=shard_key(GG_ADDRESS_KEY, shard),
                       restore=lambda store: restore_args(store, nproc, ready_file.parent, held))


def gg_services(options: PragueOptions, nproc: int, out_dir: Path, host: str = "127.0.0.1") -> list[ServiceSpec]:
    """Every Group Generator service of a job the launcher starts: one, or one per shard (``--gg-shards``),
    each writing its address to its own file in ``out_dir``."""
    count = options.shard_count(options.topology(nproc))
    if count == 1:
        return [gg_service(options, nproc, out_dir / "gg.address", host)]
    return [gg_service(options, nproc, out_dir / f"gg-{s}.address", host, (s, count)) for s in range(count)]


def restore_args(store: dist.Store, nproc: int, folder: Path, held_key: str = HELD_KEY) -> list[str]:
    """Arguments that make a new Group Generator continue the job's: the last group every worker
    published (``HELD_KEY``) and the failed workers, written to a file in ``folder``. Waits a moment
    first, so a worker that got an answer just before the old instance died has published it."""
    from prague.groups.service import Held, restore_state

    time.sleep(0.5)
    held = {r: Held.from_dict(json.loads(v)) for r, v in read_keys(store, held_key, range(nproc)).items()}
    excluded = set(Membership(store, nproc).failed())
    path = folder / f"gg-restore-{time.monotonic_ns()}.json"
    atomic_write_json(path, restore_state(held, excluded))
    return ["--restore", str(path)]



def _launcher_token(job: JobEnv) -> str:
    """The token of the Group Generator a job owner (launcher, rank 0's guard) started for this job (from
    ``job``, the worker's environment)."""
    token = job.gg_token
    if token is None:
        raise CommError(f"${jobenv.GG_TOKEN} is not set, yet the job's owner started its Group Generator; start "
                        "the workers with `prague launch`, `prague run` or `prague guard`")
    return token


class ServiceWatch(PeriodicWork):
    """The rank that hosts the Group Generator (rank 0 under torchrun, or the rank that took over): every
    0.5 s its keeper starts the service again if it died before every rank left (and publishes the new
    address); ends once ``leaving`` is set."""

    def __init__(self, keeper: ServiceKeeper, leaving: threading.Event) -> None:
        super().__init__("Group Generator watch", "prague-gg-watch", 0.5)
        self.keeper, self.leaving = keeper, leaving
        self.start()

    def tick(self) -> bool:
        if self.leaving.is_set():
            return False
        for name, code, _ in self.keeper.watch():
            sys.stderr.write(f"prague: warning: the {name} exited (code {code}) and cannot be started again\n")
        return True

class GroupSource(Protocol):
    """Gives one worker its groups, in the global order."""

    def next_group(self, rank: int, step: int) -> Group: ...

    def finish(self, rank: int) -> list[Group]:
        """The groups this worker is still committed to, after its last step."""
        ...

    def leave(self) -> None:
        """After the committed groups ran; collective where the source says so."""
        ...

    def exclude_failed(self) -> None:
        """Tell whoever forms the groups about workers declared failed since the last call."""
        ...

    def stats(self) -> dict[str, Any]: ...


class StaticSource:
    """The paper's static schedule, computed by each worker itself: no round trip, no service."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology

    def next_group(self, rank: int, step: int) -> Group:
        return static_group(step, rank, self.topology)

    def finish(self, rank: int) -> list[Group]:
        return []

    def leave(self) -> None:
        pass

    def exclude_failed(self) -> None:
        pass  # a fixed schedule: members skip the groups of a failed worker

    def stats(self) -> dict[str, Any]:
        return {}


class ServiceSource:
    """Asks the Group Generator service, over gRPC. Under torchrun, rank 0 starts the service and every
    other rank waits for its address in the store; everything acquired (the client, a service this
    rank started, its folder) is registered on ``resources``.

    With ``trace`` (a run that logs decisions), every rank asks the service to write its trace there
    before its own first request, so the first of these asks precedes every call of the policy and the
    trace holds them all (a path on the service's machine: the run's own service runs beside rank 0).
    """

    def __init__(self, ctx: DistContext, options: PragueOptions, resources: contextlib.ExitStack,
                 trace: Path | None = None, membership: Membership | None = None,
                 shard: tuple[int, int] = (0, 1), *, namespace: str) -> None:
        """``shard`` (s, n): this source asks shard s of the job's n Group Generator services
        (:class:`ShardedSource` holds one per shard). ``namespace``: the method's store-key namespace
        (:attr:`prague.algorithms.api.Algorithm.namespace`)."""
        from prague.groups.aio import pause_shared_loop
        from prague.groups.client import GroupGeneratorClient  # grpc: only for methods that use the service

        on_shutdown(pause_shared_loop)  # prague.shutdown(): after the method closed its channels, the loop's thread
        self.ctx = ctx
        self._keeper: ServiceKeeper | None = None  # the service this rank started (under torchrun, rank 0)
        self._leaving = threading.Event()  # set once this rank is closing: its service is not restarted then
        self._watch: ServiceWatch | None = None
        # Under torchrun one rank's service serves every rank: nobody may stop it before all are done.
        self._shared = options.uses_service and not services_managed(ctx.job)
        store = ctx.store
        self._store = ctx.private_store()  # the averager thread asks too: never on the loop's connection
        # A service rank 0 starts is one of possibly several in the job (a script may prepare the method
        # more than once): its keys are under the method's namespace (each shard's under its own key).
        # The launcher's service is the job's only one.
        instance = f"{namespace}/gg" if self._shared else None
        self._shard = shard
        self._address_key = shard_key(GG_ADDRESS_KEY if instance is None else f"{GG_ADDRESS_KEY}/{instance}", shard)
        self._held_key = shard_key(HELD_KEY, shard)
        self._host_key = f"{self._address_key}/host"  # the rank whose process runs the service
        self._host = 0
        self._left_key = f"prague/gg/left/{instance}/"  # + rank: done with the service (leave)
        token_key = GG_TOKEN_KEY if instance is None else f"{GG_TOKEN_KEY}/{instance}"
        if options.gg_address:
            token, address = ctx.job.gg_token or "", options.gg_address
        elif not self._shared:  # started by our launcher
            token, address = _launcher_token(ctx.job), store.get(self._address_key).decode()
        elif ctx.is_main:
            token = secrets.token_hex(16)
            store.set(token_key, token)
            store.set(self._host_key, "0")
            address = self._start_service(options, token, resources)  # published under the address key
        else:
            token, address = store.get(token_key).decode(), store.get(self._address_key).decode()
        self._token, self._timeout_s = token, options.gg_timeout_s
        self._options, self._resources = options, resources  # a new host starts the service with these
        self._restartable = not options.gg_address  # a service the user started is the user's to restart
        # A service this job restarts is found through the store, not by waiting at a dead address.
        self.client = GroupGeneratorClient(address, token, timeout_s=options.gg_timeout_s,
                                           wait_for_ready=not self._restartable)
        resources.callback(lambda: self.client.close())  # the client of the moment: a restart replaces it
        self._service_stats: dict[str, Any] = {}
        self.membership = membership
        self._excluded: set[int] = set()
        if trace is not None:
            path = str(Path(trace).resolve())
            self._retrying(lambda c: c.trace(path))
        resources.callback(self._leaving.set)  # after a failure too: no restart once this rank is closing

    def _start_service(self, options: PragueOptions, token: str, resources: contextlib.ExitStack,
                       restore: bool = False) -> str:
        """Start the job's service on this rank (``restore``: continuing the job's groups, on a new
        host), publish its address, and watch it (started again if it dies before everyone left)."""
        folder = Path(tempfile.mkdtemp(prefix="prague-gg-"))
        resources.callback(shutil.rmtree, folder, ignore_errors=True)
        spec = dataclasses.replace(gg_service(options, self.ctx.world_size, folder / "address", service_host(self.ctx.job),
                                              self._shard),
                                   env={jobenv.GG_TOKEN: token}, publish_key=self._address_key)
        self._keeper = ServiceKeeper(self._store, [restarted(spec, self._store) if restore else spec],
                                     services_file=services_file_from_env(self.ctx.job))
        self._keeper.start()
        resources.callback(lambda: self._keeper.stop(0.0) if self._keeper else None)  # unless leave() stopped it
        self._watch = ServiceWatch(self._keeper, self._leaving)
        return str(self._keeper.records[0]["address"])

    def _take_over_if_host_failed(self) -> None:
        """The service's host rank was declared failed: agree on the lowest living rank as the new host
        (one compare-and-set in the store: the first survivor's choice stands) and, on that rank,
        start the service again from the workers' state."""
        if not self._shared or self.membership is None:
            return
        failed = self.membership.failed()
        if self._host not in failed:
            return
        live = [r for r in range(self.ctx.world_size) if r not in failed]
        if not live:
            return
        # the key's value after the swap: ours, or the host another survivor named first (a failed one
        # too, if the key moved on while we looked: the next look moves it again)
        agreed = int(self._store.compare_set(self._host_key, str(self._host), str(live[0])).decode())
        old, self._host = self._host, agreed
        if agreed == self.ctx.rank and self._keeper is None:
            sys.stderr.write(f"prague: warning: rank {self.ctx.rank} starts the Group Generator again: its host, "
                             f"rank {old}, failed\n")
            sys.stderr.flush()
            self._start_service(self._options, self._token, self._resources, restore=True)

    def _retrying(self, call: Any) -> Any:
        """``call(client)``; if the service does not answer, retry with backoff for up to
        :data:`RESTART_WAIT_S`, each time connecting first to the address in the store if the launcher
        (or rank 0) published a restarted service's there. Safe: a retried ``get_group`` of the same
        iteration gets one answer."""
        try:
            return call(self.client)
        except CommError:
            if not self._restartable:
                raise
        from prague.groups.client import GroupGeneratorClient

        deadline, pause = time.monotonic() + RESTART_WAIT_S, 0.05
        while True:
            time.sleep(pause)
            pause = min(2 * pause, 1.0)
            self._take_over_if_host_failed()
            address = self._store.get(self._address_key).decode()
            if address != self.client.address:
                old, self.client = self.client, GroupGeneratorClient(address, self._token, timeout_s=self._timeout_s,
                                                                     wait_for_ready=False)
                old.close()
            try:
                return call(self.client)
            except CommError:
                if time.monotonic() > deadline:
                    raise

    def _hold(self, rank: int, held: Any) -> None:
        self._store.set(f"{self._held_key}{rank}", json.dumps(held.to_dict()))

    def next_group(self, rank: int, step: int) -> Group:
        from prague.groups.service import Held

        self.exclude_failed()
        group: Group = self._retrying(lambda c: c.get_group(rank, step))
        if self._restartable:
            self._hold(rank, Held(step, group))
        return group

    def exclude_failed(self) -> None:
        """The service groups a failed worker no more once any survivor says so (one store request per
        call when nothing changed; every survivor says it, the service keeps the first)."""
        if self.membership is None:
            return
        for rank in sorted(set(self.membership.failed()) - self._excluded):
            self._retrying(lambda c: c.exclude(rank))
            self._excluded.add(rank)

    def finish(self, rank: int) -> list[Group]:
        from prague.groups.service import Held

        self.exclude_failed()
        if self.ctx.is_main:
            self._service_stats = dict(self._retrying(lambda c: c.stats()))
        groups: list[Group] = self._retrying(lambda c: c.finish(rank))
        if self._restartable:
            self._hold(rank, Held(-1, groups[-1] if groups else None, finished=True))
        return groups

    def leave(self) -> None:
        """After this rank ran its last groups. Collective under torchrun, so that rank 0 stops the
        service it started only once every rank is done with it: through the store over the ranks not
        declared failed when the job tracks failures (a guard under torchrun), else a barrier."""
        if not self._shared:
            return
        if self.membership is not None:
            mark_done(self._store, self.ctx.rank, self._left_key)
            wait_settled(self._store, self.membership, self.ctx.timeout_s, self._left_key)
        else:
            dist.barrier()
        if self._keeper is not None:
            self._leaving.set()
            if self._watch is not None:
                self._watch.shutdown(failed=False, timeout_s=5.0)
            with contextlib.suppress(CommError):  # it may go before its reply does: stop makes sure
                self.client.shutdown()
            self._keeper.stop(grace_s=30.0)
            self._keeper = None

    def stats(self) -> dict[str, Any]:
        return self._service_stats


class ShardedSource:
    """The Group Generator in shards (``--gg-shards``): one :class:`ServiceSource` per shard, each request
    sent to the shard that serves this worker at this step (:class:`~prague.groups.shards.ShardPlan`, the
    rule the simulator routes by); ``finish``, failures and ``leave`` go to every shard."""

    def __init__(self, ctx: DistContext, options: PragueOptions, resources: contextlib.ExitStack,
                 topology: Topology, trace: Path | None = None, membership: Membership | None = None, *,
                 namespace: str) -> None:
        from prague.groups.shards import ShardPlan

        count = options.shard_count(topology)
        self.plan = ShardPlan(topology, count, options.gg_epoch_steps, options.gg_seed)
        self.sources = [ServiceSource(ctx, options, resources, membership=membership, shard=(s, count), namespace=namespace,
                                      trace=None if trace is None else trace.with_name(f"{trace.stem}-{s}{trace.suffix}"))
                        for s in range(count)]

    def next_group(self, rank: int, step: int) -> Group:
        return self.sources[self.plan.shard_of(rank, step)].next_group(rank, step)

    def finish(self, rank: int) -> list[Group]:
        return [g for source in self.sources for g in source.finish(rank)]

    def leave(self) -> None:
        for source in self.sources:
            source.leave()

    def exclude_failed(self) -> None:
        for source in self.sources:
            source.exclude_failed()

    def stats(self) -> dict[str, Any]:
        from prague.groups.shards import merged_stats

        per = [source.stats() for source in self.sources]
        if not any(per):
            return {}
        return merged_stats(per, [int(p.get("groups", 0) * p.get("mean_group_size", 0.0)) for p in per])
