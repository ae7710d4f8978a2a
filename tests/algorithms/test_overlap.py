"""Delayed averaging on a background thread: corrections of a group cancel, order is kept, failures surface."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prague.algorithms.prague.overlap import BackgroundAverager
from prague.groups import Group
from prague_testing import join_all, start_thread


class ThreadGroups:
    """In-process stand-in for P-Reduce: the members of a (seq, members) group meet and average."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._meetings: dict[int, tuple[threading.Barrier, dict[int, torch.Tensor]]] = {}

    def runner(self, rank: int) -> Callable[[Group, torch.Tensor], None]:
        def run(group: Group, buf: torch.Tensor) -> None:
            if group.is_local:
                return
            with self._lock:
                barrier, bufs = self._meetings.setdefault(group.seq, (threading.Barrier(group.size), {}))
                bufs[rank] = buf
            barrier.wait(timeout=10)
            mean = torch.stack([bufs[m] for m in group.members]).mean(dim=0)
            barrier.wait(timeout=10)  # everyone has read before anyone writes
            buf.copy_(mean)

        return run


def _schedule(n: int, rounds: int, seed: int) -> list[list[Group]]:
    """Per worker, its groups in a global order (random disjoint groups per round)."""
    gen = torch.Generator().manual_seed(seed)
    per_worker: list[list[Group]] = [[] for _ in range(n)]
    seq = 0
    for _ in range(rounds):
        perm = torch.randperm(n, generator=gen).tolist()
        size = int(torch.randint(1, n + 1, (1,), generator=gen))
        for i in range(0, n, size):
            members = tuple(sorted(perm[i : i + size]))
            for m in members:
                per_worker[m].append(Group(seq, members))
            seq += 1
    return per_worker


@settings(max_examples=15, deadline=None)
@given(st.integers(2, 5), st.integers(1, 6), st.integers(0, 2**16))
def test_corrections_of_a_group_cancel_so_the_mean_moves_only_by_local_updates(n: int, rounds: int, seed: int) -> None:
    groups = ThreadGroups()
    schedule = _schedule(n, rounds, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x0 = [torch.randn(6, generator=gen, dtype=torch.float64) for _ in range(n)]
    updates = [[torch.randn(6, generator=gen, dtype=torch.float64) for _ in range(len(schedule[r]))]
               for r in range(n)]

    def worker(rank: int) -> torch.Tensor:
        mine = schedule[rank]
        avg = BackgroundAverager(lambda i: mine[i], groups.runner(rank))
        x = x0[rank].clone()
        for upd in updates[rank]:
            x.add_(upd)  # the local step
            avg.submit(x.clone())
            for done in avg.take_ready():
                x.add_(done.correction)
        for done in avg.drain():
            x.add_(done.correction)
        avg.close()
        assert avg.join(10)
        return x

    threads = [start_thread(worker, r) for r in range(n)]
    join_all(threads, 30)
    final = {r: t.result for r, t in enumerate(threads)}
    expected = sum(x0) + sum(sum(u) for u in updates if u)
    assert torch.allclose(sum(final.values()), expected, atol=1e-10)


def test_a_group_in_flight_averages_the_snapshot_not_the_later_values() -> None:
    groups = ThreadGroups()
    g = Group(0, (0, 1))

    def worker(rank: int, start: float) -> torch.Tensor:
        avg = BackgroundAverager(lambda i: g, groups.runner(rank))
        x = torch.full((3,), start, dtype=torch.float64)
        avg.submit(x.clone())
        x.add_(10.0)  # a local step taken while the group runs
        x.add_(avg.take_oldest(timeout_s=10).correction)
        avg.close()
        return x

    ts = [start_thread(worker, 0, 0.0), start_thread(worker, 1, 4.0)]
    join_all(ts, 20)
    results = {r: t.result for r, t in enumerate(ts)}
    # Average of the snapshots is 2; each keeps its own later local step (+10) on top of it.
    assert torch.equal(results[0], torch.full((3,), 12.0, dtype=torch.float64))
    assert torch.equal(results[1], torch.full((3,), 12.0, dtype=torch.float64))


def test_requests_run_in_submission_order() -> None:
    asked: list[int] = []

    def next_group(i: int) -> Group:
        asked.append(i)
        return Group(i, (0,))

    avg = BackgroundAverager(next_group, lambda group, buf: None)
    for _ in range(5):
        avg.submit(torch.zeros(2))
    done = avg.drain()
    avg.close()
    assert [d.index for d in done] == [0, 1, 2, 3, 4] == asked
    assert all(torch.equal(d.correction, torch.zeros(2)) for d in done)
    assert avg.in_flight == 0


def test_a_failure_on_the_thread_is_raised_on_the_workers_thread() -> None:
    def failing(group: Group, buf: torch.Tensor) -> None:
        raise RuntimeError("peer 3 is gone")

    avg = BackgroundAverager(lambda i: Group(i, (0, 3)), failing)
    avg.submit(torch.zeros(2))
    with pytest.raises(RuntimeError, match="peer 3 is gone"):
        avg.take_oldest(timeout_s=10)
    with pytest.raises(RuntimeError, match="peer 3 is gone"):
        avg.submit(torch.zeros(2))
    avg.close()
    assert avg.join(10)
