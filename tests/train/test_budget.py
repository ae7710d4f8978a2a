"""The job-wide budget: parsing, the shared batch counter, equal shares, the stop agreement, and global
batch addressing (every sample once per epoch across workers of unequal speed)."""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from prague.errors import ConfigError
from prague.runtime.liveness import PROGRESS_KEY, read_progress
from prague.workload.budget import (
    Budget, EqualShares, SharedBatches, StopAgreement, claim_size, parse_budget,
)
from prague.workload.data import GlobalBatches
from prague_testing import join_all, start_thread


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)


@pytest.mark.parametrize("text, kind, amount", [("epochs:3", "epochs", 3.0), ("samples:640", "samples", 640.0),
                                                 ("seconds:2.5", "seconds", 2.5), (" epochs:0.5 ", "epochs", 0.5)])
def test_budgets_parse(text: str, kind: str, amount: float) -> None:
    assert parse_budget(text) == Budget(kind, amount)


@pytest.mark.parametrize("text", ["", "epochs", "epochs:", "steps:3", "epochs:0", "epochs:-1", "epochs:inf",
                                  "epochs:nan", "samples:1.5", "seconds:abc", "seconds:1e12"])
def test_bad_budgets_name_the_form(text: str) -> None:
    with pytest.raises(ConfigError, match="epochs:E, samples:N or seconds:T"):
        parse_budget(text)


def test_total_batches() -> None:
    assert Budget("epochs", 3).total_batches(1000, 32) == 3 * 31
    assert Budget("epochs", 1.1).total_batches(1000, 10) == 110  # no float error: 1.1 x 100 is not 111
    assert Budget("samples", 100).total_batches(1000, 32) == 4  # a partial batch counts as one
    assert Budget("seconds", 5).total_batches(1000, 32) is None
    with pytest.raises(ConfigError, match="--batch-size"):
        Budget("epochs", 1).total_batches(10, 32)


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_claims_shrink_to_one_batch_near_the_end(remaining: int, nproc: int) -> None:
    size = claim_size(remaining, nproc)
    assert 1 <= size <= 16
    assert size <= max(1, remaining // (2 * nproc))  # never more than a fair share of half what is left


def test_shared_batches_hand_every_index_to_exactly_one_worker_and_fast_workers_take_more(store: dist.TCPStore) -> None:
    """Four workers of unequal speed (one 8x slower) draw from one counter through their own store
    connections: every batch of the budget is taken exactly once, the slow worker takes fewer, and
    each worker touched the counter far fewer times than it took batches."""
    total, nproc = 400, 4
    taken: dict[int, list[int]] = {}

    def worker(rank: int) -> None:
        batches = SharedBatches(store.clone(), total, nproc)
        mine = taken.setdefault(rank, [])
        while (index := batches.next()) is not None:
            mine.append(index)
            time.sleep(0.004 if rank == 3 else 0.0005)
        assert batches.claims < len(mine) or len(mine) <= 1

    join_all([start_thread(worker, r) for r in range(nproc)], 60)
    counts = Counter(i for mine in taken.values() for i in mine)
    assert sorted(counts) == list(range(total)) and set(counts.values()) == {1}
    assert len(taken[3]) < min(len(taken[r]) for r in range(3))


def test_shared_batches_under_a_time_budget_never_end(store: dist.TCPStore) -> None:
    batches = SharedBatches(store, None, 2)
    assert [batches.next() for _ in range(40)] == list(range(40))


def test_equal_shares_deal_batches_round_robin() -> None:
    shares = [EqualShares(r, 3, 10) for r in range(3)]
    dealt = [[i for i in iter(s.next, None)] for s in shares]
    assert dealt == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]  # 10 // 3 each: the remainder (one batch) is left out
    with pytest.raises(ConfigError, match="fewer than the 4 workers"):
        EqualShares(0, 4, 3)
    endless = EqualShares(1, 2, None)
    assert [endless.next() for _ in range(3)] == [1, 3, 5]


def test_stop_agreement_stops_every_rank_after_every_step_already_started(store: dist.TCPStore) -> None:
    """Lockstep ranks (no rank more than one step ahead) under a time budget, the clock passing at a
    different step on each: every rank stops at the same count, no earlier than any step a rank
    started."""
    nproc, key = 4, (lambda r: f"{PROGRESS_KEY}{r}")
    rng = random.Random(7)
    deadline = time.monotonic() + 0.3
    done: dict[int, int] = {}
    started: dict[int, int] = {}
    step_done = [0] * nproc

    def rank(r: int) -> None:
        own = store.clone()
        agreement = StopAgreement(own, lambda: read_progress(own, range(nproc)).values())
        completed = 0
        own.set(key(r), f"{completed},0,")
        while not agreement.stop_before(completed, time.monotonic() >= deadline + r * 0.01):
            while min(step_done) < completed:  # lockstep: wait until every rank finished the previous step
                time.sleep(0.0005)
            started[r] = completed
            time.sleep(rng.uniform(0.001, 0.01))
            completed += 1
            step_done[r] = completed
            own.set(key(r), f"{completed},0,")
        done[r] = completed

    join_all([start_thread(rank, r) for r in range(nproc)], 60)
    assert len(set(done.values())) == 1, done
    assert done[0] > max(started.values())


def test_global_batches_use_every_sample_once_per_epoch_whoever_takes_them() -> None:
    n, batch = 103, 10
    x = torch.arange(n, dtype=torch.float32).reshape(n, 1)
    y = torch.arange(n) % 10
    batches = GlobalBatches(x, y, batch, seed=3)
    assert batches.batches_per_epoch == 10
    for epoch in range(2):
        seen = torch.cat([batches.batch(epoch * 10 + i)[0].flatten() for i in range(10)])
        assert len(set(seen.tolist())) == 100  # 100 distinct samples: the 3 left out differ per epoch
    again = GlobalBatches(x, y, batch, seed=3)
    assert torch.equal(again.batch(13)[0], batches.batch(13)[0])  # a pure function of (seed, index)
    assert not torch.equal(batches.epoch_order(0), batches.epoch_order(1))
    xs, ys = batches.batch(5)
    assert torch.equal(ys, y[xs.flatten().long()])  # inputs and labels stay paired
    with pytest.raises(ConfigError):
        GlobalBatches(x, y, 0)
    with pytest.raises(ConfigError):
        GlobalBatches(x, y[:5], 10)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.integers(1, 300), st.integers(1, 8))
def test_any_claim_order_covers_the_budget_once(nproc: int, total: int, seed: int) -> None:
    """Workers claiming in any interleaving (a seeded random order of calls) take every index once."""
    store = dist.HashStore()
    workers = [SharedBatches(store, total, nproc, key="claims") for _ in range(nproc)]
    rng, live, seen = random.Random(seed), list(range(nproc)), []
    while live:
        w = rng.choice(live)
        index = workers[w].next()
        if index is None:
            live.remove(w)
        else:
            seen.append(index)
    assert sorted(seen) == list(range(total))
