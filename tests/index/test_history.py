"""The approximate (routing-history) index: consecutive prefixes, TTL, per-location bound, forget."""

from __future__ import annotations

import gc
from array import array
from typing import Any

import pytest

from kvstack.index import HistoryIndex

KEYS = list(range(500, 520))


def test_lookup_gives_consecutive_prefix_per_location() -> None:
    history = HistoryIndex()
    history.record("http://a:8000", KEYS[:8], now=0.0)
    history.record("http://b:8000", KEYS[:3], now=0.0)
    history.record("http://b:8000", KEYS[4:10], now=0.0)  # hole at block 3
    history.record("http://c:8000", KEYS[1:10], now=0.0)  # never sent block 0: absent
    assert history.lookup(KEYS, now=1.0) == {"http://a:8000": 8, "http://b:8000": 3}
    assert history.lookup([], now=1.0) == {}
    assert history.lookup([1], now=1.0) == {}
    assert history.stats().entries == 8 + 3 + 6 + 9


def test_entries_expire_after_the_ttl_and_are_purged() -> None:
    history = HistoryIndex(ttl_s=10.0)
    history.record("a", KEYS[:4], now=100.0)
    history.record("a", KEYS[:2], now=105.0)  # re-sent: blocks 0-1 refreshed
    history.record("b", KEYS[:4], now=105.0)
    assert history.lookup(KEYS, now=109.9) == {"a": 4, "b": 4}
    assert history.lookup(KEYS, now=110.0) == {"a": 2, "b": 4}  # a's blocks 2-3 are 10 s old
    stats = history.stats()
    assert (stats.entries, stats.expired) == (6, 2)
    assert history.lookup(KEYS, now=115.0) == {}
    stats = history.stats()
    assert (stats.entries, stats.blocks, stats.locations, stats.expired) == (0, 0, 0, 8)
    assert history.locations() == []


def test_purge_without_lookups() -> None:
    history = HistoryIndex(ttl_s=10.0)
    for i in range(10):
        history.record(f"loc{i}", KEYS, now=float(i))
    assert history.purge(now=15.5) == 6 * len(KEYS)
    assert history.locations() == [f"loc{i}" for i in range(6, 10)]
    assert history.stats().entries == 4 * len(KEYS)


def test_each_location_keeps_its_most_recent_blocks_up_to_the_bound() -> None:
    history = HistoryIndex(max_blocks_per_location=10)
    p1, p2 = KEYS[:6], [900 + i for i in range(6)]
    history.record("a", p1, now=0.0)
    history.record("a", p2, now=1.0)  # 12 > 10: p1's last two blocks go first
    history.record("b", p1, now=1.0)  # b has its own bound
    assert history.lookup(p1, now=2.0) == {"a": 4, "b": 6}
    assert history.lookup(p2, now=2.0) == {"a": 6}
    history.record("a", p1[:4], now=3.0)  # re-sending refreshes: now p2's tail is the oldest
    history.record("a", [950, 951], now=3.0)
    assert history.lookup(p2, now=4.0) == {"a": 4}
    assert history.lookup(p1, now=4.0) == {"a": 4, "b": 6}
    stats = history.stats()
    assert (stats.entries, stats.evicted) == (16, 4)


def test_forget_drops_one_location_and_frees_its_bit() -> None:
    history = HistoryIndex()
    history.record("a", KEYS[:5], now=0.0)
    history.record("b", KEYS[:3], now=0.0)
    assert history.forget("a") == 5
    assert history.forget("a") == 0
    assert history.lookup(KEYS, now=1.0) == {"b": 3}
    history.record("c", KEYS[:1], now=1.0)  # reuses a's bit: must not inherit its blocks
    assert history.lookup(KEYS, now=1.0) == {"b": 3, "c": 1}
    assert history.stats().entries == 4


def test_many_locations() -> None:
    history = HistoryIndex()
    for i in range(300):
        history.record(f"loc{i}", KEYS[: 1 + i % 20], now=0.0)
    got = history.lookup(KEYS, now=0.0)
    assert len(got) == 300
    assert all(got[f"loc{i}"] == 1 + i % 20 for i in range(300))


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"max_blocks_per_location": 0}, "max_blocks"), ({"ttl_s": 0}, "ttl")]
)
def test_bad_bounds_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        HistoryIndex(**kwargs)


def test_resending_the_same_blocks_keeps_memory_bounded() -> None:
    history = HistoryIndex(max_blocks_per_location=1_000, ttl_s=1e9)
    keys = list(range(100))
    for t in range(2_000):  # the same prompt again and again: only the send times change
        history.record("a", keys, now=float(t))
    loc = history._locations["a"]
    assert len(loc.sent) == 100
    assert len(loc._keys) - loc._head <= 2 * 100 + 4096 + 100
    assert history.lookup(keys, now=2_000.0) == {"a": 100}
    assert history.stats().entries == 100


def test_history_containers_are_invisible_to_the_garbage_collector() -> None:
    history = HistoryIndex()
    for i in range(8):
        history.record(f"loc{i}", list(range(i, i + 500)), now=1.0)
    loc = history._locations["loc0"]
    assert not gc.is_tracked(history._masks) and not gc.is_tracked(loc.sent)  # dicts of ints and floats
    assert isinstance(loc._keys, array) and isinstance(loc._times, array)  # no references to walk
