"""The communicator cache's policy (pure): LRU order, bounded size, and a group's set-up decision."""

from __future__ import annotations

import copy
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prague.comm.cache import HASH_ONCE_OVER, CommunicatorCache, group_needs_setup
from prague.comm.keys import HashedMembers
from prague.errors import ConfigError


def test_least_recently_used_is_evicted_first() -> None:
    cache = CommunicatorCache[str](2)
    assert cache.put((0, 1), "a") == []
    assert cache.put((0, 2), "b") == []
    assert cache.get((0, 1)) == "a"  # (0, 2) is now the least recently used
    assert cache.put((0, 3), "c") == ["b"]
    assert cache.keys() == [(0, 1), (0, 3)]
    assert cache.get((0, 2)) is None
    assert cache.pop((0, 1)) == "a" and cache.pop((0, 1)) is None
    assert cache.clear() == ["c"] and len(cache) == 0


def test_replacing_an_entry_evicts_nothing() -> None:
    cache = CommunicatorCache[str](1)
    cache.put((0, 1), "old")
    assert cache.put((0, 1), "new") == []
    assert cache.get((0, 1)) == "new"


@pytest.mark.parametrize("capacity", [0, -3])
def test_capacity_below_one_is_refused(capacity: int) -> None:
    with pytest.raises(ConfigError, match="capacity must be >= 1"):
        CommunicatorCache[str](capacity)


def test_a_group_builds_when_any_member_lacks_the_set() -> None:
    caches = [CommunicatorCache[bool](1) for _ in range(3)]
    assert group_needs_setup((caches[m] for m in (0, 1)), (0, 1)) == (True, 0)
    assert group_needs_setup((caches[m] for m in (0, 1)), (0, 1)) == (False, 0)
    # Rank 1 evicts (0, 1) for (1, 2); rank 0 still holds it, but the pair must rebuild on both.
    assert group_needs_setup((caches[m] for m in (1, 2)), (1, 2)) == (True, 1)
    assert group_needs_setup((caches[m] for m in (0, 1)), (0, 1)) == (True, 1)
    assert all(len(c) <= 1 for c in caches)


groups = st.lists(st.sampled_from([(0, 1), (0, 2), (1, 2), (0, 1, 2), (2, 3), (0, 3), (1, 3)]), max_size=40)


@given(groups, st.integers(1, 4))
def test_after_a_group_every_member_holds_it_and_sizes_stay_bounded(schedule: list[tuple[int, ...]], cap: int) -> None:
    caches = [CommunicatorCache[bool](cap) for _ in range(4)]
    for group in schedule:
        held_by_all = all(group in caches[m] for m in group)
        missing, _ = group_needs_setup((caches[m] for m in group), group)
        assert missing == (not held_by_all)
        assert all(caches[m].keys()[-1] == group for m in group)
        assert all(len(c) <= cap for c in caches)


@given(st.lists(st.sampled_from([(0, 1), (0, 2), (1, 2), (0, 1, 2), (2, 3)]), max_size=30), st.integers(1, 3))
def test_use_is_get_then_put_on_a_miss(schedule: list[tuple[int, ...]], cap: int) -> None:
    """``use`` (the simulator's one call) leaves the cache as ``get``, then ``put`` when missing, would."""
    used, reference = CommunicatorCache[bool](cap), CommunicatorCache[bool](cap)
    for members in schedule:
        hit = reference.get(members) is not None
        expected = None if hit else len(reference.put(members, True))
        assert used.use(members, True) == expected
        assert used.keys() == reference.keys()


def test_a_large_group_is_one_key_with_its_plain_tuple() -> None:
    """A member set over the hash-once size is wrapped once for all its members' caches: it is the same key as
    the plain tuple (hit, eviction, order), and it pickles and copies as one."""
    n = HASH_ONCE_OVER + 5
    everyone = tuple(range(n))
    caches = [CommunicatorCache[bool](2) for _ in range(n)]
    assert group_needs_setup(iter(caches), everyone) == (True, 0)
    assert all(everyone in c for c in caches)
    assert group_needs_setup(iter(caches), tuple(range(n))) == (False, 0)  # an equal tuple: the same key
    assert group_needs_setup((caches[m] for m in (0, 1)), (0, 1)) == (True, 0)
    assert group_needs_setup((caches[m] for m in (0, 2)), (0, 2)) == (True, 1)  # rank 0's full cache evicts `everyone`
    assert everyone not in caches[0] and everyone in caches[1] and everyone in caches[2]
    assert group_needs_setup(iter(caches), everyone) == (True, 1)  # rank 0 lacks it again, and evicts (0, 1)
    assert caches[0].keys() == [(0, 2), everyone]
    key = caches[5].keys()[-1]
    assert isinstance(key, HashedMembers) and key == everyone and hash(key) == hash(everyone) == hash(key)
    assert type(pickle.loads(pickle.dumps(key))) is tuple and pickle.loads(pickle.dumps(key)) == everyone
    assert type(copy.copy(key)) is tuple and copy.deepcopy(key) == everyone
