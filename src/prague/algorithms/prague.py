"""``prague``: local SGD steps, then Partial All-Reduce with a group chosen by the Group Generator.

Prague (Luo, Lin, Zhuo, Qian, "Prague: High-Performance Heterogeneity-Aware Asynchronous Decentralized
Training", ASPLOS 2020; arXiv 1909.08029, also "Ripples"). Each iteration a worker takes a local optimizer
step (its optimizer state stays local), asks the Group Generator which group it belongs to next, and
averages its parameters with that group's members only (:func:`prague.comm.preduce.preduce`). Slow
workers hold back only the few workers they meet, not the whole job.

Generators (``--generator``): ``static`` (a conflict-free schedule computed locally, no round trip),
``smart`` (the paper's: random divisions under a threshold rule, through a group buffer), ``random``
(one random group per request: the naive baseline) and ``ready`` (groups formed only from workers
already waiting at the service). The service runs as its own process: started by ``prague run``'s
launcher, or under torchrun by rank 0, which publishes its address through the rendezvous store; or
given explicitly with ``--gg-address`` (a ``prague gg serve`` started by the user).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from prague.algorithms.api import Algorithm, JobResources, StepTimes
from prague.comm.flat import bind_flat
from prague.comm.preduce import GroupCommunicators, preduce
from prague.errors import CommError, ConfigError, unknown_choice
from prague.groups import GENERATORS, Group, Topology, static_group
from prague.runtime.launcher import ServiceSpec

GG_ADDRESS_KEY = "prague/gg/address"
GG_TOKEN_KEY = "prague/gg/token"
TOKEN_ENV = "PRAGUE_GG_TOKEN"
MANAGED_ENV = "PRAGUE_MANAGED_GG"


@dataclass(frozen=True)
class PragueOptions:
    generator: str = field(default="ready", metadata={"help": "group generator: static, smart, random, ready"})
    group_size: int = field(default=3, metadata={"help": "workers per group (smart, random, ready; dssync's k)"})
    delta_c: int = field(default=4, metadata={"help": "smart's threshold: join only if c_w > c_i - delta_c"})
    nodes: int = field(default=1, metadata={"help": "topology: nodes (nproc must be a multiple)"})
    window_ms: float = field(default=50.0, metadata={"help": "ready: how long a request waits for partners"})
    gg_address: str = field(default="", metadata={"help": "host:port of a running `prague gg serve` (token from $PRAGUE_GG_TOKEN)"})
    gg_timeout_s: float = field(default=300.0, metadata={"help": "timeout of one group generator call"})
    comm_cache: int = field(default=64, metadata={"help": "members-only communicators kept (LRU)"})
    gg_seed: int = field(default=0, metadata={"help": "seed of the group generator (0: the run's --seed)"})

    def __post_init__(self) -> None:
        if self.generator not in GENERATORS:
            raise unknown_choice("group generator", self.generator, GENERATORS)
        if self.group_size < 2:
            raise ConfigError(f"--group-size must be >= 2, got {self.group_size}")
        if self.delta_c < 1:
            raise ConfigError(f"--delta-c must be >= 1, got {self.delta_c}")
        if self.nodes < 1:
            raise ConfigError(f"--nodes must be >= 1, got {self.nodes}")
        if not self.window_ms > 0:
            raise ConfigError(f"--window-ms must be > 0, got {self.window_ms}")
        if not self.gg_timeout_s > 0:
            raise ConfigError(f"--gg-timeout-s must be > 0, got {self.gg_timeout_s}")
        if self.comm_cache < 1:
            raise ConfigError(f"--comm-cache must be >= 1, got {self.comm_cache}")

    def topology(self, nproc: int) -> Topology:
        if nproc % self.nodes:
            raise ConfigError(f"--nproc {nproc} is not a multiple of --nodes {self.nodes}; use a divisor of {nproc}")
        return Topology(self.nodes, nproc // self.nodes)


def gg_argv(options: PragueOptions, nproc: int, seed: int, ready_file: Path) -> list[str]:
    """The command that runs this job's Group Generator service (token from ``$PRAGUE_GG_TOKEN``)."""
    return [
        sys.executable, "-m", "prague.groups.service", "--host", "127.0.0.1", "--port", "0",
        "--nproc", str(nproc), "--generator", options.generator, "--nodes", str(options.nodes),
        "--group-size", str(options.group_size), "--delta-c", str(options.delta_c),
        "--window-s", str(options.window_ms / 1000.0), "--seed", str(seed), "--ready-file", str(ready_file),
    ]


def uses_service(options: PragueOptions) -> bool:
    return options.generator != "static" and not options.gg_address


class Prague(Algorithm):
    """Local step, then P-Reduce over the group the generator names; see the module docstring."""

    name = "prague"
    Options = PragueOptions
    variant_field = "generator"

    @classmethod
    def job_resources(cls, options: PragueOptions, nproc: int, out_dir: Path, seed: int) -> JobResources:
        options.topology(nproc)
        if not uses_service(options):
            return JobResources()
        ready = out_dir / "gg.address"
        spec = ServiceSpec("group-generator", gg_argv(options, nproc, options.gg_seed or seed, ready), ready_file=ready,
                           publish_key=GG_ADDRESS_KEY)
        return JobResources(services=(spec,), env={TOKEN_ENV: secrets.token_hex(16), MANAGED_ENV: "1"})

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> nn.Module:
        self.topology = self.options.topology(self.ctx.world_size)
        self.flat = bind_flat(model)
        self.comms = GroupCommunicators(self.ctx, capacity=self.options.comm_cache)
        self._own_service: subprocess.Popen[bytes] | None = None
        self.client: Any = None
        self.groups_run = 0
        self.local_steps = 0
        self.member_total = 0
        self.gg_stats: dict[str, Any] = {}
        self._rank0_runs_service = uses_service(self.options) and os.environ.get(MANAGED_ENV) != "1"
        if self.options.generator != "static":
            self.client = self._connect()
        return model

    def _connect(self) -> Any:
        from prague.groups.client import GroupGeneratorClient

        store, opts = self.ctx.store, self.options
        if opts.gg_address:
            token = os.environ.get(TOKEN_ENV, "")
            address = opts.gg_address
        elif os.environ.get(MANAGED_ENV) == "1":
            token = os.environ[TOKEN_ENV]
            address = store.get(GG_ADDRESS_KEY).decode()
        elif self.ctx.is_main:  # torchrun: no launcher, so rank 0 runs the service
            token = secrets.token_hex(16)
            address = self._start_own_service(token)
            store.set(GG_TOKEN_KEY, token)
            store.set(GG_ADDRESS_KEY, address)
        else:
            token = store.get(GG_TOKEN_KEY).decode()
            address = store.get(GG_ADDRESS_KEY).decode()
        return GroupGeneratorClient(address, token, timeout_s=opts.gg_timeout_s)

    def _start_own_service(self, token: str) -> str:
        ready = Path(tempfile.mkdtemp(prefix="prague-gg-")) / "address"
        argv = gg_argv(self.options, self.ctx.world_size, self.options.gg_seed, ready)
        self._own_service = subprocess.Popen(argv, env={**os.environ, TOKEN_ENV: token})
        deadline = time.monotonic() + 60
        while not ready.exists():
            if self._own_service.poll() is not None or time.monotonic() > deadline:
                raise CommError(f"the group generator service did not start (command: {' '.join(argv)})")
            time.sleep(0.05)
        return ready.read_text().strip()

    def _run(self, group: Group) -> None:
        if self.ctx.rank not in group.members:
            raise CommError(f"group generator sent rank {self.ctx.rank} a group it is not in: {group}")
        self.groups_run += 1
        self.member_total += group.size
        if group.is_local:
            self.local_steps += 1
            return
        preduce(self.flat, group.members, self.comms)

    def after_step(self, step: int, times: StepTimes) -> None:
        t0 = time.perf_counter()
        if self.client is None:
            group = static_group(step, self.ctx.rank, self.topology)
        else:
            group = self.client.get_group(self.ctx.rank, step)
        times.wait_s += time.perf_counter() - t0  # the generator's answer: RPC plus waiting for partners
        self._run(group)

    def close(self) -> None:
        """Run the groups this worker is still committed to, then leave. Every rank calls it."""
        if self.client is not None:
            if self.ctx.is_main:
                self.gg_stats = self.client.stats()
            for group in self.client.finish(self.ctx.rank):
                self._run(group)
            if self._rank0_runs_service:
                dist.barrier()  # every rank has finished with the service
                if self._own_service is not None:
                    self.client.shutdown()
                    self._own_service.wait(timeout=30)
            self.client.close()
            self.client = None
        self.comms.close()

    def stats(self) -> dict[str, Any]:
        s = self.comms.stats
        return {
            "generator": self.options.generator,
            "group_size": self.options.group_size,
            "groups_run": self.groups_run,
            "local_steps": self.local_steps,
            "mean_group_size": self.member_total / self.groups_run if self.groups_run else 0.0,
            "preduces": s.reduces,
            "communicators_created": s.created,
            "communicator_create_s": s.create_s,
            "communicators_evicted": s.evicted,
            "generator_stats": self.gg_stats,
        }
