"""P-Reduce across real ranks: exact group means, a bounded communicator cache, and failures that stay local.

Every test starts real worker processes joined the way ``prague launch`` joins them: the test process
hosts the job's ``TCPStore`` (port from the OS) and each rank calls ``prague.init`` with
``TORCHELASTIC_USE_AGENT_STORE=True``. Ranks are forked from a forkserver that has imported torch once
(8 fresh interpreters importing torch would take most of the time budget on 2 cores); each is a clean
process, as with ``spawn``. :func:`run_ranks` puts the ranks under a hard deadline, kills whatever is
left whatever happens, and fails the test with the failing rank's traceback.

Exactness: a member's input to each P-Reduce is a fresh seeded integer-valued tensor, so the members' sum
is exact in any order and the mean is rounded once, on the ranks as in the parent: results are compared
with ``torch.equal``, not a tolerance. (Carrying averaged values from group to group would bring in
thirds, whose sums depend on the order in which gloo adds them.)
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import random
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

import prague
from prague.comm.cache import CommunicatorCache, group_needs_setup
from prague.comm.preduce import GroupCommunicators, preduce
from prague.errors import CommError
from prague.runtime.context import DistContext

pytestmark = pytest.mark.timeout(120)

JOB_TIMEOUT_S = 40.0  # the job's store and default group; every test deadline below is shorter
_MP = mp.get_context("forkserver")
_MP.set_forkserver_preload(["torch", "torch.distributed", "prague", "prague.comm.preduce"])


# ---------------------------------------------------------------------------------------------------
# Harness


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple[Any, ...],
               results: Any) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        ctx = prague.init(backend="gloo", timeout_s=JOB_TIMEOUT_S)
        # Plain pickle copies tensors; the queue's pickler would share them through this process,
        # which may be gone by the time the test reads them.
        results.put((rank, None, pickle.dumps(fn(ctx, *args))))
    except BaseException:  # noqa: BLE001 - everything goes back to the test, which fails with it
        results.put((rank, traceback.format_exc(), None))
    finally:
        prague.shutdown()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, deadline_s: float = 60.0,
              may_exit: frozenset[int] = frozenset()) -> dict[int, Any]:
    """Run ``fn(ctx, *args)`` on ``world_size`` ranks; return each rank's result.

    Ranks in ``may_exit`` are allowed to end (with code 0) without a result: a test that kills a peer.
    The test fails with the tracebacks of the ranks that raised (in the order they reported), or names
    the ranks still missing after ``deadline_s`` (or 2 s after the first failure: its peers may be
    stuck waiting for it). Every child is killed and reaped before this returns or raises.
    """
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=JOB_TIMEOUT_S))
    results = _MP.Queue()
    procs = [_MP.Process(target=_rank_main, args=(fn, r, world_size, store.port, args, results), daemon=True)
             for r in range(world_size)]
    outs: dict[int, Any] = {}
    errors: list[tuple[int, str]] = []
    try:
        for p in procs:
            p.start()
        deadline, waited = time.monotonic() + deadline_s, f"within {deadline_s:g} s"
        while pending := [r for r in range(world_size) if r not in outs and all(r != e for e, _ in errors)]:
            all_exited = not any(procs[r].is_alive() for r in pending)
            try:  # once every pending rank has exited, a last report may still be in the pipe
                rank, tb, out = results.get(timeout=0.5 if all_exited else 0.1)
            except queue.Empty:
                if all_exited:
                    errors.extend((r, f"exited with code {procs[r].exitcode} without a result") for r in pending
                                  if not (r in may_exit and procs[r].exitcode == 0))
                    break
                if time.monotonic() > deadline:
                    state = ", ".join(f"{r} ({'running' if procs[r].is_alive() else f'exit code {procs[r].exitcode}'})"
                                      for r in pending)
                    errors.append((-1, f"no result {waited} from ranks {state}"))
                    break
                continue
            if tb is None:
                outs[rank] = pickle.loads(out)
                continue
            errors.append((rank, tb))
            if time.monotonic() + 2.0 < deadline:
                deadline, waited = time.monotonic() + 2.0, f"within 2 s of rank {rank}'s failure"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        results.close()
    if errors:
        pytest.fail("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in errors), pytrace=False)
    return outs


# ---------------------------------------------------------------------------------------------------
# Shared by the ranks and the parent: inputs and the expected outcome


def member_input(rank: int, step: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Integer-valued input of ``rank`` to the group at ``step`` (exact sums in float32 and float64)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(-1000, 1000, (numel,), generator=g).to(dtype)


def initial_buffer(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return member_input(rank, -1, numel, dtype)


def expected_snapshots(schedule: list[tuple[int, ...]], world_size: int, numel: int,
                       dtype: torch.dtype) -> list[list[torch.Tensor]]:
    """Each rank's buffer after each step: the members' mean, or unchanged for a non-member."""
    state = [initial_buffer(r, numel, dtype) for r in range(world_size)]
    snaps: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
    for step, members in enumerate(schedule):
        total = sum((member_input(r, step, numel, dtype) for r in members), torch.zeros(numel, dtype=dtype))
        for r in members:
            state[r] = total / len(members)
        for r in range(world_size):
            snaps[r].append(state[r].clone())
    return snaps


def run_schedule(ctx: DistContext, comms: GroupCommunicators, schedule: list[tuple[int, ...]], numel: int,
                 dtype: torch.dtype, max_skew_s: float = 0.0, seed: int = 0) -> list[torch.Tensor]:
    """This rank's part of ``schedule`` in its global order; optional random sleeps skew arrival order."""
    rng = random.Random(seed * 1000 + ctx.rank)
    buf = initial_buffer(ctx.rank, numel, dtype)
    snaps = []
    for step, members in enumerate(schedule):
        if ctx.rank in members:
            if max_skew_s and rng.random() < 0.5:
                time.sleep(rng.uniform(0.0, max_skew_s))
            buf.copy_(member_input(ctx.rank, step, numel, dtype))
            preduce(buf, members, comms)
        snaps.append(buf.clone())
    return snaps


def assert_snapshots(outs: dict[int, dict[str, Any]], schedule: list[tuple[int, ...]], numel: int,
                     dtype: torch.dtype) -> None:
    expected = expected_snapshots(schedule, len(outs), numel, dtype)
    for rank, out in sorted(outs.items()):
        for step, (got, want) in enumerate(zip(out["snaps"], expected[rank], strict=True)):
            assert torch.equal(got, want), (
                f"rank {rank} after step {step} (group {schedule[step]}): max error {(got - want).abs().max()}")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# ---------------------------------------------------------------------------------------------------
# (a) random groups in one global order, created in skewed orders


def _random_groups_rank(ctx: DistContext, schedule: list[tuple[int, ...]], numel: int,
                        transport: str) -> dict[str, Any]:
    comms = GroupCommunicators(ctx, capacity=16, timeout_s=30, transport=transport, namespace="test/1")
    comms.start()
    snaps = run_schedule(ctx, comms, schedule, numel, torch.float64, max_skew_s=0.05, seed=7)
    stats = comms.stats
    comms.close()
    return {"snaps": snaps, "created": stats.created, "reduces": stats.reduces, "failed": stats.failed}


@pytest.mark.parametrize("transport", ["groups", "world"])
def test_random_groups_give_exact_means_and_leave_non_members_alone(transport: str) -> None:
    """Both transports: members-only communicators, and point-to-point exchanges on the world
    communicator (NCCL's default, run here over gloo), which must build no communicator at all."""
    world, numel = 8, 4096
    rng = random.Random(12)
    pool = sorted({tuple(sorted(rng.sample(range(world), rng.randint(2, 4)))) for _ in range(12)})
    schedule = [rng.choice(pool) for _ in range(30)]  # repeats: cached communicators are reused
    assert set().union(*schedule) == set(range(world)) and {len(g) for g in schedule} == {2, 3, 4}
    outs = run_ranks(_random_groups_rank, world, schedule, numel, transport)

    assert_snapshots(outs, schedule, numel, torch.float64)
    for rank, out in outs.items():
        mine = [g for g in schedule if rank in g]
        assert out["reduces"] == len(mine)
        if transport == "groups":
            assert out["created"] == len(set(mine)), "no eviction or failure happened, so each set is built once"
        else:
            assert out["created"] == 0
        assert out["failed"] == 0


# ---------------------------------------------------------------------------------------------------
# (b) a bounded cache whose members evict different sets


# Rank 0 is in three sets and must evict with capacity 2; ranks 1-3 are in two sets each and never
# evict. So rank 0 keeps dropping {0, 1}, {0, 2}, {0, 3} while the peer still holds it: the next use
# must rebuild on both sides, not pair a fresh communicator with a stale one.
_EVICTION_SCHEDULE = [(0, 1), (0, 2), (0, 3), (1, 2, 3), (0, 1), (1, 2, 3), (0, 2), (0, 3), (0, 1), (0, 2),
                      (1, 2, 3), (0, 3), (0, 1)]


def _eviction_rank(ctx: DistContext, numel: int) -> dict[str, Any]:
    comms = GroupCommunicators(ctx, capacity=2, timeout_s=20, namespace="test/2")
    warm = GroupCommunicators(ctx, capacity=1, timeout_s=20, namespace="test/3")  # load gloo's lazy parts before counting fds
    if ctx.rank in (0, 1):
        preduce(torch.zeros(4), (0, 1), warm)
    warm.close()
    fds_before = open_fds()
    snaps = run_schedule(ctx, comms, _EVICTION_SCHEDULE, numel, torch.float32)
    fds_held = open_fds() - fds_before
    s = comms.stats
    comms.close()
    return {"snaps": snaps, "created": s.created, "evicted": s.evicted, "failed": s.failed,
            "reduces": s.reduces, "fds_held": fds_held, "fds_after_close": open_fds() - fds_before}


def test_cache_is_bounded_and_eviction_on_one_member_rebuilds_on_all() -> None:
    numel = 1000
    outs = run_ranks(_eviction_rank, 4, numel)

    assert_snapshots(outs, _EVICTION_SCHEDULE, numel, torch.float32)
    # The simulator's model of the cache (the same pure policy) predicts every rank's builds and evictions.
    caches = [CommunicatorCache[bool](2) for _ in range(4)]
    created, evicted = [0] * 4, 0
    for group in _EVICTION_SCHEDULE:
        missing, dropped = group_needs_setup((caches[m] for m in group), group)
        evicted += dropped
        for m in group:
            created[m] += missing
    assert [outs[r]["created"] for r in range(4)] == created
    assert sum(outs[r]["evicted"] for r in range(4)) == evicted
    r0 = outs[0]
    uses0 = [g for g in _EVICTION_SCHEDULE if 0 in g]
    assert r0["evicted"] > 0 and r0["created"] == len(uses0), "rank 0 cycles through 3 sets in 2 slots: every use rebuilds"
    assert r0["created"] - r0["evicted"] <= 2
    for rank in (1, 2, 3):
        assert outs[rank]["evicted"] == 0, "two sets fit in two slots"
        assert outs[rank]["created"] > 2, f"rank {rank} must rebuild the pair rank 0 evicted"
    assert all(out["failed"] == 0 for out in outs.values())
    # Evicted groups are shut down, not left holding sockets: 4-5 rebuilt pairs would hold 20 or more.
    assert r0["fds_held"] <= 2 * 8, r0
    assert all(out["fds_after_close"] <= 2 for out in outs.values()), outs


# ---------------------------------------------------------------------------------------------------
# (c) a peer that dies, a peer that is late: the survivor gets CommError and goes on with others


FAIL_TIMEOUT_S = 3.0
# The test orders its steps through the store, so that no rank waits on a peer still busy failing
# (which would take longer than the short timeout and fail for the wrong reason).
GAVE_UP_KEY = "test/rank2-gave-up"
DONE_KEY = "test/rank3-failed"
AGAIN_KEY = "test/pair-2-3-works-again"


def _failure_rank(ctx: DistContext, numel: int) -> dict[str, Any]:
    comms = GroupCommunicators(ctx, capacity=4, timeout_s=FAIL_TIMEOUT_S, namespace="test/4")
    rank = ctx.rank
    out: dict[str, Any] = {}
    buf = torch.full((numel,), float(rank))

    def expect_comm_error(members: tuple[int, ...]) -> None:
        with pytest.raises(CommError, match=r"ranks \[" + ", ".join(map(str, members)) + r"\]"):
            preduce(buf, members, comms)

    if rank in (0, 1):
        preduce(buf, (0, 1), comms)  # built, cached, works
        out["first"] = buf.clone()
    if rank == 1:  # dies between the handshake and the collective of its next group
        comms.get((0, 1))
        os._exit(0)
    if rank == 0:
        expect_comm_error((0, 1))
        out["failed_after_dead_peer"] = comms.stats.failed
    if rank == 2:  # rank 3 is late: the handshake times out
        expect_comm_error((2, 3))
        ctx.store.set(GAVE_UP_KEY, "1")
    if rank == 3:  # arrives after rank 2 gave up: its own creation times out, so both count the use
        ctx.store.wait([GAVE_UP_KEY])
        expect_comm_error((2, 3))
        ctx.store.set(DONE_KEY, "1")
    if rank in (0, 2):  # the survivors work with a new peer
        ctx.store.wait([GAVE_UP_KEY])
        buf.fill_(float(10 * rank))
        preduce(buf, (0, 2), comms)
        out["new_peer"] = buf.clone()
    if rank in (2, 3):  # and the pair whose member was late works again once both have seen the failure
        ctx.store.wait([DONE_KEY])
        buf.fill_(float(rank))
        preduce(buf, (2, 3), comms)
        out["again"] = buf.clone()
        ctx.store.set(AGAIN_KEY, "1")
    if rank in (0, 2, 3):
        ctx.store.wait([AGAIN_KEY])
        buf.fill_(float(rank))
        preduce(buf, (0, 2, 3), comms)
        out["last"] = buf.clone()
    out["failed"] = comms.stats.failed
    comms.close()
    return out


def test_failed_group_raises_comm_error_and_later_groups_work() -> None:
    numel = 256
    # Each survivor must see its failure within its short timeout, not the job's: three failures in turn
    # (about 3 x FAIL_TIMEOUT_S) fit in the deadline, one wait for the job's timeout does not.
    outs = run_ranks(_failure_rank, 4, numel, may_exit=frozenset({1}), deadline_s=JOB_TIMEOUT_S - 10)

    assert 1 not in outs
    full = lambda v: torch.full((numel,), v)  # noqa: E731
    assert torch.equal(outs[0]["first"], full(0.5))
    # Each survivor saw exactly one failure.
    assert outs[0]["failed_after_dead_peer"] == 1
    assert [outs[r]["failed"] for r in (0, 2, 3)] == [1, 1, 1]
    assert torch.equal(outs[0]["new_peer"], full(10.0)) and torch.equal(outs[2]["new_peer"], full(10.0))
    assert torch.equal(outs[2]["again"], full(2.5)) and torch.equal(outs[3]["again"], full(2.5))
    for r in (0, 2, 3):
        assert torch.equal(outs[r]["last"], full(5 / 3)), r


def _blocked_handshake_rank(ctx: DistContext) -> str:
    """Rank 0 enters a group's handshake on a background thread, which blocks until rank 1 arrives;
    rank 1 arrives only after it has read a key that rank 0's main thread writes meanwhile through
    the job's store. If the handshake waited on the same store client, that write would queue behind
    the wait and the two ranks would wait for each other until the timeout."""
    comms = GroupCommunicators(ctx, capacity=2, timeout_s=20, namespace="test/5")
    try:
        if ctx.rank == 0:
            box: dict[str, Any] = {}
            worker = threading.Thread(target=lambda: box.setdefault("pg", comms.get((0, 1))), daemon=True)
            worker.start()
            time.sleep(0.5)  # the thread is inside the handshake's wait by now (rank 1 is not there yet)
            ctx.store.set("test/main-thread", "free")
            worker.join(30)
            assert "pg" in box, "the handshake never completed"
        else:
            ctx.store.wait(["test/main-thread"], timedelta(seconds=20))
            comms.get((0, 1))
        return ctx.store.get("test/main-thread").decode()
    finally:
        comms.close()


def test_a_handshake_waiting_for_a_peer_does_not_hold_up_the_job_store() -> None:
    outs = run_ranks(_blocked_handshake_rank, 2, deadline_s=60)
    assert outs == {0: "free", 1: "free"}


# ---------------------------------------------------------------------------------------------------
# (d) communicators built while the job runs reuse their rendezvous connection


_REBUILD_SCHEDULE = [(0, 1), (1, 2), (0, 2), (0, 1, 2), (0, 1), (1, 2), (0, 2)]


def _rebuild_rank(ctx: DistContext) -> dict[str, int]:
    """Build communicators through a 2-slot cache (so most uses rebuild), with a membership (the
    rendezvous runs on a thread of its own); count the store connections opened meanwhile."""
    from prague.runtime.liveness import Membership

    comms = GroupCommunicators(ctx, capacity=2, timeout_s=20, membership=Membership(ctx.private_store(), 3),
                               namespace="test/10")
    opened = 0
    original = DistContext.private_store

    def counting(self: DistContext) -> dist.Store:
        nonlocal opened
        opened += 1
        return original(self)

    DistContext.private_store = counting  # type: ignore[method-assign]
    try:
        buf = torch.zeros(8)
        for members in _REBUILD_SCHEDULE:
            if ctx.rank in members:
                buf.fill_(float(ctx.rank))
                preduce(buf, members, comms)
                assert torch.equal(buf, torch.full((8,), sum(members) / len(members)))
        return {"opened": opened, "created": comms.stats.created}
    finally:
        DistContext.private_store = original  # type: ignore[method-assign]
        comms.close()


def test_rebuilt_communicators_reuse_one_rendezvous_connection() -> None:
    # A store connection opened while the job runs can pause the store for every client for seconds;
    # one per rendezvous (each build) made every worker of a prague run stall 5 s at a time.
    outs = run_ranks(_rebuild_rank, 3, deadline_s=60)
    for rank, out in outs.items():
        assert out["created"] >= 3, (rank, out)
        assert out["opened"] == 1, (rank, out)


def _float_world_rank(ctx: DistContext) -> torch.Tensor:
    comms = GroupCommunicators(ctx, timeout_s=20, transport="world", namespace="test/6")
    comms.start()
    buf = torch.randn(1000, generator=torch.Generator().manual_seed(ctx.rank), dtype=torch.float32) / 3
    preduce(buf, (0, 1, 2), comms)
    comms.close()
    return buf


def test_world_transport_gives_every_member_the_same_bits() -> None:
    # Thirds of random floats: the sum depends on the order of the additions, which every member keeps.
    outs = run_ranks(_float_world_rank, 3, deadline_s=60)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
    inputs = [torch.randn(1000, generator=torch.Generator().manual_seed(r), dtype=torch.float32) / 3 for r in range(3)]
    assert torch.allclose(outs[0], sum(inputs, torch.zeros(1000)) / 3, atol=1e-6)


# ---------------------------------------------------------------------------------------------------
# (e) prague --share-momentum: the optimizer's momentum travels with the parameters


def _momentum_rank(ctx: DistContext, share: str) -> dict[str, list[torch.Tensor]]:
    from torch import nn
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = prague.wrap(model, opt, algorithm="prague:static", group_size=2, overlap="off", share_momentum=share)
    gen = torch.Generator().manual_seed(10 + ctx.rank)  # each rank its own data: different gradients
    try:
        for _ in range(4):  # static with two ranks: local, group, local, group
            x, y = torch.randn(8, 5, generator=gen), torch.randint(0, 2, (8,), generator=gen)
            trainer.step(lambda m: F.cross_entropy(m(x), y))
    finally:
        trainer.close()
    return {"params": [p.detach().clone() for p in model.parameters()],
            "momentum": [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]}


@pytest.mark.parametrize("share", ["on", "off"])
def test_shared_momentum_is_averaged_with_the_parameters(share: str) -> None:
    # Two ranks, static and blocking: the last step ends with a group of both, so the parameters agree;
    # the momentum buffers agree only when they travel with them.
    outs = run_ranks(_momentum_rank, 2, share, deadline_s=60)
    assert all(torch.equal(a, b) for a, b in zip(outs[0]["params"], outs[1]["params"]))
    same = all(torch.equal(a, b) for a, b in zip(outs[0]["momentum"], outs[1]["momentum"]))
    assert same == (share == "on")


# ---------------------------------------------------------------------------------------------------
# (f) survivors settle a collective that a freezing peer completed on some members and broke on others


def _half_done_rank(ctx: DistContext, transport: str) -> dict[str, Any]:
    """Ranks 0-2 reduce one group. Rank 2 completes the collective and freezes before it settles (it
    is declared failed, as a hung worker is); rank 1's collective breaks, rank 0's completes. Then ranks
    0, 1 and 3 reduce a group of the three of them."""
    from prague.comm import surviving
    from prague.runtime.liveness import Failure, declare_failure

    groups = surviving.LiveGroups(ctx, capacity=4, transport=transport, namespace="test/7")
    rank = ctx.rank
    buf = torch.full((64,), float(3 * rank))
    out: dict[str, Any] = {}
    if rank == 2:
        def freeze(members: tuple[int, ...], ok: bool) -> bool:
            declare_failure(ctx.store, Failure(2, 0, "hang"))
            os._exit(0)

        groups.comms.settle = freeze  # type: ignore[method-assign]
    if rank == 1:
        real, broken = surviving.preduce, []

        def breaks_once(buffer: torch.Tensor, members: tuple[int, ...], comms: GroupCommunicators) -> None:
            real(buffer, members, comms)
            if not broken:
                broken.append(members)
                raise CommError(f"P-Reduce over ranks {list(members)} failed on rank 1: connection reset")

        surviving.preduce = breaks_once  # type: ignore[assignment]
    if rank < 3:
        out["first"] = groups.reduce((0, 1, 2), buf)
        out["after_first"] = buf.clone()
    buf.fill_(float(3 * rank))
    out["second"] = groups.reduce((0, 1, 3), buf)
    out["after_second"] = buf.clone()
    out["shrunk"] = groups.shrunk
    groups.close()
    return out


@pytest.mark.parametrize("transport", ["groups", "world"])
def test_a_collective_half_done_by_a_freezing_peer_is_retried_by_every_survivor(transport: str) -> None:
    # Without settling, rank 0 kept the 3-way mean and went on to the next group while rank 1 retried
    # the pair (0, 1) and waited there for rank 0: each waited for the other until the job's timeout.
    outs = run_ranks(_half_done_rank, 4, transport, may_exit=frozenset({2}), deadline_s=40)
    full = lambda v: torch.full((64,), v)  # noqa: E731
    for r in (0, 1):
        assert outs[r]["first"] == (0, 1), r  # both retried without rank 2
        assert torch.equal(outs[r]["after_first"], full(1.5)), r  # the mean of 0 and 3, not of 0, 3 and 6
        assert outs[r]["shrunk"] == 1, r
    for r in (0, 1, 3):
        assert outs[r]["second"] == (0, 1, 3)
        assert torch.equal(outs[r]["after_second"], full(4.0)), r


# ---------------------------------------------------------------------------------------------------
# Compressed P-Reduce (8-bit codes, error feedback)


_COMPRESSED_GROUPS = ((0, 1, 2), (0, 2), (0, 1, 2))


def _compressed_rank(ctx: DistContext, transport: str, numel: int) -> dict[str, Any]:
    from prague.comm.compress import ErrorFeedback
    from prague.comm.preduce import preduce_compressed

    comms = GroupCommunicators(ctx, capacity=4, transport=transport, namespace="test/8")
    comms.start()
    feedback = ErrorFeedback()
    gen = torch.Generator().manual_seed(100 + ctx.rank)
    rounds = []
    for members in _COMPRESSED_GROUPS:
        values = torch.randn(numel, generator=gen) * (1 + ctx.rank)
        if ctx.rank not in members:
            continue
        residual = feedback.residual.clone() if feedback.residual is not None else torch.zeros(numel)
        before = values.clone()
        preduce_compressed(values, members, comms, feedback)
        assert feedback.sent is not None
        sent = feedback.sent.clone()
        feedback.commit()
        rounds.append({"members": members, "before": before, "after": values, "residual_in": residual,
                       "sent": sent, "residual_out": feedback.residual.clone()})
    comms.close()
    return {"rounds": rounds, "reduces": comms.stats.reduces}


@pytest.mark.parametrize("transport", ["groups", "world"])
def test_compressed_groups_keep_their_mean_and_carry_what_the_codes_left_out(transport: str) -> None:
    from prague.comm.compress import decode, encode

    numel = 1000  # four blocks, the last one partial
    outs = run_ranks(_compressed_rank, 3, transport, numel, deadline_s=60)
    taken = {r: iter(outs[r]["rounds"]) for r in range(3)}  # each rank's rounds, in the order it joined them
    for members in _COMPRESSED_GROUPS:
        rounds = {r: next(taken[r]) for r in members}
        for r, x in rounds.items():
            carried = x["before"] + x["residual_in"]
            # what the member sent is the code of its values plus its residual ...
            expected_sent = decode(encode(carried), numel, torch.empty(numel))
            assert torch.equal(x["sent"], expected_sent)
            # ... and what the code left out is its residual now: carried, not lost
            torch.testing.assert_close(x["residual_out"], carried - x["sent"], rtol=0, atol=1e-6)
            assert x["residual_out"].abs().max() > 0
        mean_sent = sum(x["sent"] for x in rounds.values()) / len(members)
        for r, x in rounds.items():
            torch.testing.assert_close(x["after"], x["before"] + mean_sent - x["sent"], rtol=0, atol=1e-5)
        # the group's mean of the values is what it was
        before = sum(x["before"] for x in rounds.values())
        after = sum(x["after"] for x in rounds.values())
        torch.testing.assert_close(after, before, rtol=0, atol=1e-4)
        # every member moved to the same average of what was sent, plus its own untransmitted part
        common = [x["after"] - (x["before"] - x["sent"]) for x in rounds.values()]
        for c in common[1:]:
            torch.testing.assert_close(c, common[0], rtol=0, atol=1e-6)
    assert outs[1]["reduces"] == 2 and outs[0]["reduces"] == 3


# ---------------------------------------------------------------------------------------------------
# Weighted P-Reduce (prague --average-by samples)


def _weighted_rank(ctx: DistContext, transport: str) -> dict[str, Any]:
    from prague.comm.preduce import preduce_weighted

    comms = GroupCommunicators(ctx, capacity=4, transport=transport, namespace="test/9")
    comms.start()
    values = torch.arange(6, dtype=torch.float32) * (ctx.rank + 1)  # rank r holds (r + 1) * [0..5]
    work = torch.empty(7)
    out = {}
    for members, weights in (((0, 1, 2), {0: 1.0, 1: 2.0, 2: 5.0}), ((1, 2), {1: 3.0, 2: 1.0})):
        if ctx.rank in members:
            buf = values.clone()
            preduce_weighted(buf, members, comms, weights[ctx.rank], work)
            out[members] = buf
    comms.close()
    return out


@pytest.mark.parametrize("transport", ["groups", "world"])
def test_weighted_groups_give_every_member_the_weighted_mean(transport: str) -> None:
    outs = run_ranks(_weighted_rank, 3, transport, deadline_s=60)
    base = torch.arange(6, dtype=torch.float32)
    # (1*1 + 2*2 + 5*3) / 8 = 2.5 and (3*2 + 1*3) / 4 = 2.25 times [0..5], on every member
    for members, factor in (((0, 1, 2), 2.5), ((1, 2), 2.25)):
        for r in members:
            torch.testing.assert_close(outs[r][members], base * factor, rtol=0, atol=1e-6)
