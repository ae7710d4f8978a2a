"""Device rules, tested without a GPU: which backend a job picks, where a rank's tensors live, when a
point-to-point transfer is staged through host memory, and how a step is timed on CUDA.

The rules are pure functions called here with fake inputs (GPU counts, ``cuda`` devices that need no
GPU). The staging code paths of AD-PSGD's exchange and of the parameter servers are then run in one
process over real gloo pairs with CPU tensors, the staging decision forced on, and must give exactly
what the unstaged path gives.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from prague_testing import start_thread
from prague.algorithms.adpsgd.exchange import EXCHANGE_BACKEND, STORE_PREFIX, ActiveLink, PassiveServer
from prague.algorithms.api import StepTimes
from prague.algorithms.ps import PSOptions
from prague.algorithms.ps.protocol import LAYOUT_KEY, PAIR_BACKEND, Layout, shard_bounds
from prague.algorithms.ps.runtime import ParameterServer
from prague.algorithms.ps.server import ShardState, serve_worker
from prague.jobenv import MANAGED_SERVICES, JobEnv
from prague.algorithms.ps_eager import PSEagerOptions
from prague.algorithms.ps_eager.runtime import EagerParameterServer
from prague.comm.flat import StagingBuffer, staging_device
from prague.errors import ConfigError
from prague.runtime.context import DistContext, device_for, pick_backend
from prague.train.trainer import step_clock

pytestmark = pytest.mark.timeout(120)

CPU, CUDA0, CUDA1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)


# ---------------------------------------------------------------------------------------------- pure rules


@pytest.mark.parametrize("gpus,local,expected", [
    (0, 1, "gloo"), (0, 4, "gloo"),
    (1, 1, "nccl"), (4, 4, "nccl"), (8, 4, "nccl"),
    (1, 2, "gloo"), (2, 4, "gloo"), (7, 8, "gloo"),  # never more NCCL ranks than GPUs on a machine
])
def test_auto_picks_nccl_only_with_a_gpu_per_local_rank(gpus: int, local: int, expected: str) -> None:
    assert pick_backend("auto", gpus, local) == expected


def test_explicit_backends_are_kept_or_refused_with_the_reason() -> None:
    assert pick_backend("gloo", 8, 2) == "gloo"
    assert pick_backend("nccl", 2, 2) == "nccl"
    with pytest.raises(ConfigError, match="needs CUDA"):
        pick_backend("nccl", 0, 1)
    with pytest.raises(ConfigError, match="4 ranks on 2 GPU"):
        pick_backend("nccl", 2, 4)
    with pytest.raises(ConfigError, match="'mpi'"):
        pick_backend("mpi", 1, 1)
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE"):
        pick_backend("auto", 1, 0)


def test_each_rank_uses_its_own_gpu_under_nccl_and_the_cpu_under_gloo() -> None:
    assert device_for("nccl", 3) == torch.device("cuda", 3)
    assert device_for("gloo", 3) == CPU


def test_device_cuda_shares_the_gpus_among_gloo_ranks_and_cpu_refuses_nccl() -> None:
    # --device cuda: real GPU compute with more ranks than GPUs, the ranks taking the GPUs in turn
    assert [device_for("gloo", r, "cuda", 2) for r in range(4)] == [CUDA0, CUDA1, CUDA0, CUDA1]
    assert device_for("gloo", 3, "cuda", 1) == CUDA0
    assert device_for("nccl", 1, "cuda", 2) == CUDA1
    assert device_for("gloo", 5, "cpu", 8) == CPU
    assert pick_backend("auto", 8, 2, "cpu") == "gloo" and pick_backend("auto", 8, 2, "cuda") == "nccl"
    with pytest.raises(ConfigError, match="none is visible here; use --device cpu"):
        device_for("gloo", 0, "cuda", 0)
    with pytest.raises(ConfigError, match="use --backend gloo with --device cpu"):
        device_for("nccl", 0, "cpu", 1)
    with pytest.raises(ConfigError, match="unknown device 'tpu'"):
        device_for("gloo", 0, "tpu", 1)


@pytest.mark.parametrize("backend,device,expected", [
    ("gloo", CPU, None),       # gloo sends host memory as it is
    ("gloo", CUDA0, CPU),      # ... and cannot reach device memory
    ("gloo", CUDA1, CPU),
    ("nccl", CUDA1, None),     # NCCL sends device memory as it is
    ("nccl", CPU, torch.device("cuda")),  # ... and cannot reach host memory: the current GPU
])
def test_staging_device(backend: str, device: torch.device, expected: torch.device | None) -> None:
    assert staging_device(backend, device) == expected


def test_staging_device_names_the_valid_backends() -> None:
    with pytest.raises(ConfigError, match="'mpi'.*gloo, nccl"):
        staging_device("mpi", CPU)


def test_the_point_to_point_communicators_are_gloo() -> None:
    # What the runtimes pass to staging_device: a model on CUDA is staged on the host for both.
    assert PAIR_BACKEND == EXCHANGE_BACKEND == "gloo"
    assert staging_device(PAIR_BACKEND, CUDA0) == CPU


def test_an_unstaged_buffer_is_the_tensor_itself() -> None:
    t = torch.arange(6.0)
    buf = StagingBuffer.for_backend(t, "gloo")
    assert not buf.staged and buf.wire is t and buf.outgoing() is t
    buf.land()  # a no-op
    assert torch.equal(t, torch.arange(6.0))


def test_a_staged_buffer_is_a_distinct_tensor_copied_both_ways() -> None:
    t = torch.arange(6.0)
    buf = StagingBuffer(t, CPU)  # the decision forced: what gloo does for a CUDA tensor
    assert buf.staged and buf.wire is not t and buf.wire.data_ptr() != t.data_ptr()
    assert buf.wire.shape == t.shape and buf.wire.dtype == t.dtype
    out = buf.outgoing()
    assert out is buf.wire and torch.equal(out, t)
    t.add_(100)  # the model moves on: the wire keeps what was sent
    assert torch.equal(buf.wire, torch.arange(6.0))
    buf.wire[2:4].fill_(-1.0)  # a receive into a slice of the wire
    buf.land()
    assert t.tolist() == [0.0, 1.0, -1.0, -1.0, 4.0, 5.0]


class RecordingStreams:
    """A stand-in for :class:`prague.comm.streams.CudaStreams` that logs each operation."""

    def __init__(self) -> None:
        self.log: list[tuple[str, Any]] = []
        self._marks = 0

    def mark(self) -> int:
        self._marks += 1
        self.log.append(("mark", self._marks))
        return self._marks

    def wait(self, mark: Any) -> None:
        self.log.append(("wait", mark))

    def finish(self, mark: Any) -> None:
        self.log.append(("finish", mark))

    def side(self) -> Any:
        import contextlib

        @contextlib.contextmanager
        def side() -> Any:
            self.log.append(("side", "enter"))
            yield
            self.log.append(("side", "exit"))

        return side()


def test_step_clock_waits_for_the_compute_stream_only_before_reading_the_time() -> None:
    import time

    assert step_clock(CPU) is time.perf_counter  # CPU: nothing else happens
    streams = RecordingStreams()
    clock = step_clock(CUDA1, streams=streams)
    t0 = time.perf_counter()
    assert clock() >= t0 and clock() >= t0
    # an event on the calling thread's current (compute) stream, waited for: never a device-wide
    # synchronize, which would also wait for a background average on its side stream
    assert streams.log == [("mark", 1), ("finish", 1), ("mark", 2), ("finish", 2)]


# ------------------------------------------------------------------- staging paths over real gloo pairs


def _pair(store: dist.Store, prefix: str) -> list[Any]:
    """A two-member gloo communicator built in this process (both ends, from two threads)."""
    groups: list[Any] = [None, None]

    def build(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, 2, timedelta(seconds=30))

    threads = [start_thread(build, r) for r in (0, 1)]
    for t in threads:
        t.join(60)
    return groups


@pytest.mark.parametrize("staged", [False, True])
def test_adpsgd_exchange_through_staging_buffers(staged: bool) -> None:
    stage_on = CPU if staged else None
    active_pg, passive_pg = _pair(dist.HashStore(), STORE_PREFIX)
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    master = torch.tensor([3.0, 2.0, 1.0, 0.0])
    lock = threading.Lock()
    server = PassiveServer(passive_pg, 1, master, lock, actives=(0,), stage_on=stage_on)
    link = ActiveLink(active_pg, 0, stage_on=stage_on)
    link.average(values, 1)
    assert values.tolist() == [2.0, 2.0, 2.0, 2.0]
    values.add_(torch.tensor([0.0, 2.0, 4.0, 6.0]))  # a local step, then a second averaging
    link.average(values, 1)
    link.done([1])
    server.wait_for_actives(30)
    assert values.tolist() == master.tolist() == [2.0, 3.0, 4.0, 5.0]
    assert server.served == 2 and link.initiated == 2
    assert link._wire is not None and (link._wire.wire is not values) == staged
    assert (server._incoming.wire is not server._incoming.tensor) == staged


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))  # BatchNorm: a buffer part


def _train_in_process(monkeypatch: pytest.MonkeyPatch, algorithm: type, options: Any, mode: str,
                      staged: bool, steps: int = 6) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """One worker and one shard in this process (the shard's connection served from a thread), the
    runtime's staging decision forced on or off. Returns (the worker's final state, the shard's, the
    runtime)."""
    if staged:
        monkeypatch.setattr("prague.algorithms.ps.runtime.staging_device", lambda backend, device: CPU)
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=30))
    shard: dict[str, ShardState] = {}

    def serve() -> None:
        layout = Layout.decode(store.get(LAYOUT_KEY))
        lo, hi = shard_bounds(layout.total, 1)[0]
        shard["state"] = ShardState(mode, 1, lo, hi, layout, staleness_lr=options.staleness_lr,
                                    momentum=options.ps_momentum, timeout_s=30)
        serve_worker(shard["state"], store, 0, 0, timedelta(seconds=30))

    server = start_thread(serve)
    # no shard processes (the job's services are managed): the test serves the shard itself
    ctx = DistContext(rank=0, world_size=1, local_rank=0, backend="gloo", device=CPU, store=store, timeout_s=30,
                      job=JobEnv.read({MANAGED_SERVICES: "1"}))
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    runtime = algorithm(ctx, options)
    module = runtime.setup(model, optimizer)
    torch.manual_seed(1)
    for step in range(steps):
        x = torch.randn(8, 5)
        optimizer.zero_grad()
        module(x).square().mean().backward()
        runtime.after_backward(step, StepTimes())
        runtime.apply_update(optimizer, step)
        runtime.after_step(step, StepTimes())
    wire_is_flat = runtime.state_wire.wire is runtime.flat
    runtime.close()
    server.join(30)
    assert wire_is_flat != staged
    return runtime.flat.clone(), shard["state"].values.clone(), runtime


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_ps_staged_transfers_give_the_same_training(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    options = PSOptions(ps_mode=mode)
    plain, plain_shard, _ = _train_in_process(monkeypatch, ParameterServer, options, mode, staged=False)
    staged, staged_shard, runtime = _train_in_process(monkeypatch, ParameterServer, options, mode, staged=True)
    assert runtime.push_wire.wire is not runtime.push_buf
    assert torch.equal(staged, plain) and torch.equal(staged_shard, plain_shard)
    assert torch.equal(staged, staged_shard)  # the final pull reached the model through the staging buffer
    assert not torch.equal(staged, _train_start())  # and training moved it


def _train_start() -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in [*_model().parameters(), *_model().buffers()]
                      if t.is_floating_point()])


def test_eager_ps_staged_pulls_land_in_a_host_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    final, shard_values, runtime = _train_in_process(monkeypatch, EagerParameterServer, PSEagerOptions(), "async",
                                                     staged=True)
    assert runtime.incoming.data_ptr() != runtime.flat.data_ptr() and runtime.incoming.device == CPU
    assert runtime.installs_before_forward + runtime.installs_after_backward == 5  # every pull but the last
    assert torch.equal(final, shard_values)
