"""Where a ``prague`` worker gets its next group: computed locally (``static``) or asked of the Group
Generator service, which this module also finds (or, under torchrun, starts from rank 0).

The service is its own process: started by ``prague run``'s launcher (see
:meth:`prague.algorithms.prague.runtime.Prague.job_resources`), or under torchrun by rank 0, which
publishes its address and token through the rendezvous store; or given explicitly with
``--gg-address`` (a ``prague gg serve`` the user started, token from ``$PRAGUE_GG_TOKEN``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from prague.algorithms.prague import PragueOptions
from prague.groups import Group, Topology, static_group
from prague.runtime.context import DistContext
from prague.runtime.liveness import Membership
from prague.runtime.services import ServiceSpec, start_service, stop_process

GG_ADDRESS_KEY = "prague/gg/address"
GG_TOKEN_KEY = "prague/gg/token"
TOKEN_ENV = "PRAGUE_GG_TOKEN"
MANAGED_ENV = "PRAGUE_MANAGED_GG"


def gg_argv(options: PragueOptions, nproc: int, seed: int, ready_file: Path) -> list[str]:
    """The command that runs this job's Group Generator service (token from ``$PRAGUE_GG_TOKEN``)."""
    return [
        sys.executable, "-m", "prague.groups.service", "--host", "127.0.0.1", "--port", "0",
        "--nproc", str(nproc), "--generator", options.generator, "--nodes", str(options.nodes),
        "--group-size", str(options.group_size), "--delta-c", str(options.delta_c),
        "--window-s", str(options.window_s), "--seed", str(seed), "--ready-file", str(ready_file),
    ]


def gg_service(options: PragueOptions, nproc: int, ready_file: Path) -> ServiceSpec:
    """The service the launcher (or rank 0) starts for this job."""
    return ServiceSpec("group-generator", gg_argv(options, nproc, options.gg_seed, ready_file),
                       ready_file=ready_file, publish_key=GG_ADDRESS_KEY)


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
                 trace: Path | None = None, membership: Membership | None = None) -> None:
        from prague.groups.client import GroupGeneratorClient  # grpc: only for methods that use the service

        self.ctx = ctx
        self._proc: subprocess.Popen[bytes] | None = None
        # Under torchrun one rank's service serves every rank: nobody may stop it before all are done.
        self._shared = options.uses_service and os.environ.get(MANAGED_ENV) != "1"
        store = ctx.store
        if options.gg_address:
            token, address = os.environ.get(TOKEN_ENV, ""), options.gg_address
        elif not self._shared:  # started by our launcher
            token, address = os.environ[TOKEN_ENV], store.get(GG_ADDRESS_KEY).decode()
        elif ctx.is_main:
            token = secrets.token_hex(16)
            address = self._start_service(options, token, resources)
            store.set(GG_TOKEN_KEY, token)
            store.set(GG_ADDRESS_KEY, address)
        else:
            token, address = store.get(GG_TOKEN_KEY).decode(), store.get(GG_ADDRESS_KEY).decode()
        self.client = GroupGeneratorClient(address, token, timeout_s=options.gg_timeout_s)
        resources.callback(self.client.close)
        if trace is not None:
            self.client.trace(str(Path(trace).resolve()))
        self._service_stats: dict[str, Any] = {}
        self.membership = membership
        self._excluded: set[int] = set()

    def _start_service(self, options: PragueOptions, token: str, resources: contextlib.ExitStack) -> str:
        folder = Path(tempfile.mkdtemp(prefix="prague-gg-"))
        resources.callback(shutil.rmtree, folder, ignore_errors=True)
        spec = gg_service(options, self.ctx.world_size, folder / "address")
        proc, address = start_service(dataclasses.replace(spec, env={TOKEN_ENV: token}))
        resources.callback(stop_process, proc, 0.0)  # kills it unless leave() already stopped it
        self._proc = proc
        return address

    def next_group(self, rank: int, step: int) -> Group:
        self.exclude_failed()
        return self.client.get_group(rank, step)

    def exclude_failed(self) -> None:
        """The service groups a failed worker no more once any survivor says so (one store request per
        call when nothing changed; every survivor says it, the service keeps the first)."""
        if self.membership is None:
            return
        for rank in sorted(set(self.membership.failed()) - self._excluded):
            self.client.exclude(rank)
            self._excluded.add(rank)

    def finish(self, rank: int) -> list[Group]:
        self.exclude_failed()
        if self.ctx.is_main:
            self._service_stats = dict(self.client.stats())
        return self.client.finish(rank)

    def leave(self) -> None:
        """After this rank ran its last groups. Collective under torchrun (a barrier on every rank),
        so that rank 0 stops the service it started only once every rank is done with it."""
        if not self._shared:
            return
        dist.barrier()
        if self._proc is not None:
            self.client.shutdown()
            stop_process(self._proc, grace_s=30.0)

    def stats(self) -> dict[str, Any]:
        return self._service_stats
