"""Delayed averaging on a background thread: corrections of a group cancel, snapshots taken with averages
out catch up on them, order is kept, failures surface."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prague.algorithms.prague.overlap import Averaged, BackgroundAverager, Backlog
from prague.groups import Group
from prague_testing import join_all, start_thread


class ThreadGroups:
    """In-process stand-in for P-Reduce: the members of a (seq, members) group meet and average."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._meetings: dict[int, tuple[threading.Barrier, dict[int, torch.Tensor]]] = {}

    def runner(self, rank: int, failing: frozenset[int] = frozenset()) -> Callable[[Group, torch.Tensor], bool]:
        """Rank ``rank``'s P-Reduce; the groups whose ``seq`` is in ``failing`` meet but report failure."""

        def run(group: Group, buf: torch.Tensor) -> bool:
            if group.is_local:
                return True
            with self._lock:
                barrier, bufs = self._meetings.setdefault(group.seq, (threading.Barrier(group.size), {}))
                bufs[rank] = buf
            barrier.wait(timeout=10)
            mean = torch.stack([bufs[m] for m in group.members]).mean(dim=0)
            barrier.wait(timeout=10)  # everyone has read before anyone writes
            if group.seq in failing:
                return False
            buf.copy_(mean)
            return True

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


def _blocking(x0: list[torch.Tensor], schedule: list[list[Group]]) -> list[torch.Tensor]:
    """What blocking P-Reduce gives: each group, in the global order, averages its members' values."""
    x = [v.clone() for v in x0]
    for group in sorted({g for mine in schedule for g in mine}, key=lambda g: g.seq):
        mean = torch.stack([x[m] for m in group.members]).mean(dim=0)
        for m in group.members:
            x[m] = mean.clone()
    return x


def _apply(avg: BackgroundAverager, x: torch.Tensor, done: Averaged) -> None:
    """As the runtime does: add the correction, then hand the buffers back for later snapshots."""
    x.add_(done.correction)
    avg.recycle(done)


def _run_workers(x0: list[torch.Tensor], updates: list[list[torch.Tensor]], schedule: list[list[Group]],
                 max_in_flight: int, failing: frozenset[int] = frozenset()) -> list[torch.Tensor]:
    """Each worker, on its own thread: per request a local update, then (with ``max_in_flight`` averages
    out) it takes them all, then submits a snapshot; it takes the rest at the end. Taking a whole
    batch at once makes what each snapshot lacks the same whatever the threads' timing: the
    corrections of the requests before it in its batch."""
    groups = ThreadGroups()

    def worker(rank: int) -> torch.Tensor:
        mine = schedule[rank]
        avg = BackgroundAverager(lambda i: mine[i], groups.runner(rank, failing))
        x = x0[rank].clone()
        for update in updates[rank]:
            x.add_(update)  # the local step
            if avg.in_flight >= max_in_flight:
                for done in avg.drain():
                    _apply(avg, x, done)
            avg.submit(x)
        for done in avg.drain():
            _apply(avg, x, done)
        avg.close()
        assert avg.join(10)
        return x

    threads = [start_thread(worker, r) for r in range(len(x0))]
    join_all(threads, 30)
    return [t.result for t in threads]


@settings(max_examples=20, deadline=None)
@given(st.integers(2, 5), st.integers(1, 6), st.integers(1, 4), st.integers(0, 2**16))
def test_corrections_of_a_group_cancel_so_the_mean_moves_only_by_local_updates(
        n: int, rounds: int, max_in_flight: int, seed: int) -> None:
    schedule = _schedule(n, rounds, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x0 = [torch.randn(6, generator=gen, dtype=torch.float64) for _ in range(n)]
    updates = [[torch.randn(6, generator=gen, dtype=torch.float64) for _ in range(len(schedule[r]))]
               for r in range(n)]
    final = _run_workers(x0, updates, schedule, max_in_flight)
    expected = sum(x0) + sum(sum(u) for u in updates if u)
    assert torch.allclose(sum(final), expected, atol=1e-10)


@settings(max_examples=20, deadline=None)
@given(st.integers(2, 5), st.integers(1, 6), st.integers(1, 4), st.integers(0, 2**16))
def test_without_local_updates_any_number_in_flight_ends_where_blocking_averaging_does(
        n: int, rounds: int, max_in_flight: int, seed: int) -> None:
    schedule = _schedule(n, rounds, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x0 = [torch.randn(6, generator=gen, dtype=torch.float64) for _ in range(n)]
    zeros = [[torch.zeros(6, dtype=torch.float64)] * len(schedule[r]) for r in range(n)]
    final = _run_workers(x0, zeros, schedule, max_in_flight)
    for got, want in zip(final, _blocking(x0, schedule)):
        assert torch.allclose(got, want, atol=1e-10)


@pytest.mark.parametrize("max_in_flight", [1, 2, 3])
def test_two_workers_with_averages_out_meet_at_their_mean(max_in_flight: int) -> None:
    """Two workers at 0 and 4, always grouped together, no local updates: they end at 2 and 2 whatever
    the number in flight (snapshots lacking the earlier corrections gave 4 and 0 with two, 6 and -2 with
    three)."""
    pair = [Group(seq, (0, 1)) for seq in range(max_in_flight)]  # all out at once
    x0 = [torch.zeros(3, dtype=torch.float64), torch.full((3,), 4.0, dtype=torch.float64)]
    zeros = [[torch.zeros(3, dtype=torch.float64)] * max_in_flight] * 2
    final = _run_workers(x0, zeros, [pair, pair], max_in_flight)
    assert all(torch.equal(x, torch.full((3,), 2.0, dtype=torch.float64)) for x in final)


def test_groups_of_one_and_failed_groups_correct_nothing_but_still_count_as_lacked() -> None:
    """Three requests out at once: the first averages, the second is a group of one (or fails), the
    third averages again. The third's snapshot lacked the first's correction, which it adds before
    averaging; the second's is zero."""
    x0 = [torch.zeros(2, dtype=torch.float64), torch.full((2,), 4.0, dtype=torch.float64)]
    zeros = [[torch.zeros(2, dtype=torch.float64)] * 3] * 2
    alone = [[Group(0, (0, 1)), Group(10 + r, (r,)), Group(2, (0, 1))] for r in range(2)]
    failed = [[Group(0, (0, 1)), Group(1, (0, 1)), Group(2, (0, 1))]] * 2
    for schedule, failing in ((alone, frozenset()), (failed, frozenset({1}))):
        final = _run_workers(x0, zeros, schedule, max_in_flight=3, failing=failing)
        assert all(torch.equal(x, torch.full((2,), 2.0, dtype=torch.float64)) for x in final)


def test_the_backlog_adds_what_a_snapshot_lacks_and_forgets_what_it_holds() -> None:
    backlog = Backlog()
    c = [torch.full((1,), 10.0 ** k) for k in range(4)]
    assert torch.equal(backlog.catch_up(torch.zeros(1), taken=0), torch.zeros(1))  # request 0: nothing before it
    backlog.finished(0, c[0])
    assert torch.equal(backlog.catch_up(torch.zeros(1), taken=0), c[0])  # request 1 lacks 0's
    backlog.finished(1, None)  # a group of one
    assert torch.equal(backlog.catch_up(torch.zeros(1), taken=1), torch.zeros(1))  # request 2 holds 0's
    backlog.finished(2, c[2])
    assert torch.equal(backlog.catch_up(torch.zeros(1), taken=1), c[2])  # request 3 lacks 1's (zero) and 2's
    backlog.finished(3, c[3])
    assert torch.equal(backlog.catch_up(torch.zeros(1), taken=2), c[2] + c[3])


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


class OrderedStreams:
    """Stands in for CUDA streams: logs, per thread, marks, waits, finishes and the side stream, so the
    order the averager puts them in can be checked on the CPU."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, int | None]] = []
        self._marks = 0
        self._lock = threading.Lock()
        self.on_side = threading.local()

    def _note(self, what: str, mark: int | None) -> None:
        with self._lock:
            self.log.append((threading.current_thread().name, what, mark))

    def mark(self) -> int:
        with self._lock:
            self._marks += 1
            mark = self._marks
        self._note("mark", mark)
        return mark

    def wait(self, mark: object) -> None:
        assert getattr(self.on_side, "active", False), "the side stream waits, not the compute stream"
        self._note("wait", mark)  # type: ignore[arg-type]

    def finish(self, mark: object) -> None:
        self._note("finish", mark)  # type: ignore[arg-type]

    def side(self) -> object:
        import contextlib

        @contextlib.contextmanager
        def side() -> object:
            self.on_side.active = True
            try:
                yield
            finally:
                self.on_side.active = False

        return side()


def test_on_a_device_with_streams_the_average_waits_for_the_snapshot_and_is_done_before_it_is_handed_over() -> None:
    streams = OrderedStreams()
    reduced: list[int] = []

    def run(group: Group, buf: torch.Tensor) -> bool:
        assert getattr(streams.on_side, "active", False), "collectives run on the side stream"
        reduced.append(group.seq)
        buf.add_(1.0)
        return True

    avg = BackgroundAverager(lambda i: Group(i, (0, 1)), run, name="averager", streams=streams)
    x = torch.zeros(2)
    for _ in range(3):
        avg.submit(x)
        done = avg.take_oldest(timeout_s=10)
        # handed over only after the side stream finished: its finish is logged already
        assert streams.log[-1][:2] == ("averager", "finish")
        x.add_(done.correction)
        avg.recycle(done)
    avg.close()
    assert avg.join(10) and reduced == [0, 1, 2]
    main = threading.current_thread().name
    # Per request: submit marks the compute stream right after copying the snapshot; the thread's side
    # stream waits for that mark, then marks its own end and waits for it on the CPU before handing over.
    expected = []
    for request in range(3):
        copied, end = 2 * request + 1, 2 * request + 2
        expected += [(main, "mark", copied), ("averager", "wait", copied), ("averager", "mark", end),
                     ("averager", "finish", end)]
    assert streams.log == expected
    assert torch.equal(x, torch.full((2,), 3.0))
