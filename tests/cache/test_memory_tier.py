"""The memory tier: zero-copy read-only views, LRU eviction, pinning, views that outlive eviction, and a
budget never exceeded with memory flat over a long random workload."""

from __future__ import annotations

import os
import random
from array import array

import pytest

from kvstack.cache.tiers import MemoryTier
from support.cache import PAGE, key, payload


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def test_memory_round_trip_zero_copy_read_only_views() -> None:
    tier = MemoryTier(1 << 20)
    data = payload(1, 10_000)
    assert tier.put_sync(key(1), data)
    view = tier.get_sync(key(1))
    assert isinstance(view, memoryview) and view.readonly and bytes(view) == data
    assert tier.get_sync(key(2)) is None
    # Any C-contiguous buffer is stored by its bytes; an empty payload is a valid chunk.
    assert tier.put_sync(key(3), array("H", [1, 2, 3]))  # type: ignore[arg-type]  # any buffer is stored
    assert bytes(tier.get_sync(key(3)) or b"") == array("H", [1, 2, 3]).tobytes()
    assert tier.put_sync(key(4), b"") and tier.get_sync(key(4)) == b""
    stats = tier.stats()
    assert (stats.hits, stats.misses, stats.writes, stats.entries) == (3, 1, 3, 3)
    assert stats.bytes == 3 * PAGE + PAGE + PAGE  # page-rounded; the empty chunk counts a page too
    assert tier.delete_sync(key(1)) and not tier.delete_sync(key(1))


def test_memory_lru_evicts_least_recently_used_and_drops_oversize() -> None:
    tier = MemoryTier(3 * PAGE)
    for i in range(3):
        assert tier.put_sync(key(i), payload(i, PAGE))
    assert tier.get_sync(key(0)) is not None  # 0 is now the most recent: 1 goes first
    assert tier.put_sync(key(3), payload(3, PAGE))
    assert tier.contains_sync([key(0)]) == 1 and tier.contains_sync([key(1)]) == 0
    assert tier.contains_sync([key(2), key(3), key(0), key(1)]) == 3
    assert tier.stats().evictions == 1
    assert not tier.put_sync(key(9), payload(9, 3 * PAGE + 1))
    assert tier.stats().write_drops == 1 and tier.stats().bytes == 3 * PAGE


def test_memory_empty_payloads_count_a_page_each_in_the_budget() -> None:
    tier = MemoryTier(8 * PAGE)
    for i in range(1000):
        assert tier.put_sync(key(i), b"")
    stats = tier.stats()
    assert stats.entries == 8 and stats.bytes == 8 * PAGE and stats.evictions == 992
    got = tier.get_sync(key(999))
    assert got is not None and got.nbytes == 0 and got.readonly


def test_memory_pinned_entries_are_never_evicted() -> None:
    tier = MemoryTier(2 * PAGE)
    tier.put_sync(key(0), payload(0, PAGE))
    tier.put_sync(key(1), payload(1, PAGE))
    with tier.pinned(key(0)) as view0, tier.pinned(key(1)) as view1:
        assert view0 is not None and view1 is not None
        assert not tier.put_sync(key(2), payload(2, PAGE))  # no room: everything is pinned
        assert tier.stats().write_drops == 1
        assert bytes(view0) == payload(0, PAGE)
    with pytest.raises(ValueError):  # released on exit: a kept reference cannot read freed memory
        bytes(view0)
    with tier.pinned(key(0)):
        assert tier.put_sync(key(2), payload(2, PAGE))  # evicts 1, not the pinned 0
    assert tier.contains_sync([key(0), key(2)]) == 2 and tier.contains_sync([key(1)]) == 0
    with tier.pinned(key(9)) as missing:
        assert missing is None


def test_memory_views_outlive_eviction_unchanged_and_count_in_the_budget() -> None:
    tier = MemoryTier(2 * PAGE)
    tier.put_sync(key(0), payload(0, PAGE))
    view = tier.get_sync(key(0))
    assert view is not None
    tier.put_sync(key(1), payload(1, PAGE))
    tier.put_sync(key(2), payload(2, PAGE))  # evicts 0; its mapping is held for the view, not reused
    assert tier.contains_sync([key(0)]) == 0
    assert tier.held_bytes == PAGE
    assert bytes(view) == payload(0, PAGE)
    # 0's held page still counts: 1 and 2 cannot both stay.
    stats = tier.stats()
    assert stats.bytes is not None and stats.bytes <= 2 * PAGE and stats.entries == 1
    del view
    assert tier.put_sync(key(3), payload(3, PAGE))  # the held page is reclaimed first
    assert tier.held_bytes == 0 and tier.stats().entries == 2


def test_memory_budget_never_exceeded_and_memory_flat_over_a_long_random_workload() -> None:
    budget = 32 << 20
    rng = random.Random(5)
    sizes = [rng.choice([64 << 10, 256 << 10, 1 << 20, 2 << 20]) + rng.randrange(PAGE) for _ in range(16)]
    blobs = [os.urandom(size) for size in sizes]
    before = rss_bytes()
    tier = MemoryTier(budget)
    readers: list[memoryview] = []
    samples: list[int] = []
    for step in range(5000):
        k = key(rng.randrange(200))
        op = rng.random()
        if op < 0.55:
            blob = blobs[rng.randrange(len(blobs))]
            if tier.put_sync(k, blob):
                view = tier.peek(k)
                assert view is not None and len(view) == len(blob) and view[-64:] == blob[-64:]
        elif op < 0.8:
            view = tier.get_sync(k)
            if view is not None and rng.random() < 0.3:
                readers.append(view)  # a reader that holds on for a while
        elif op < 0.9:
            with tier.pinned(k) as view:
                if view is not None:
                    tier.put_sync(key(rng.randrange(200)), blobs[0])
                    assert len(view) in sizes
        else:
            tier.delete_sync(k)
        if len(readers) > 4:
            readers.pop(0)
        assert (tier.stats().bytes or 0) <= budget
        if step % 100 == 0:
            samples.append(rss_bytes())
    readers.clear()
    view = None
    # Memory: within budget plus interpreter noise, and flat from the first quarter to the end.
    slack = 12 << 20
    assert max(samples) - before <= budget + slack
    assert samples[-1] - samples[len(samples) // 4] <= slack
    assert tier.stats().evictions > 100
    tier.clear_sync()
    tier.put_sync(key(0), b"x")  # reclaims what the last readers held
    assert rss_bytes() - before <= slack  # every mapping went back to the OS: nothing fragmented
