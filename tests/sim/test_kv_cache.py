"""The simulator's block pool: prefix hits, eviction order, events and usage, as in vLLM's block pool."""

from __future__ import annotations

import random

from kvstack.kvevents.codec import AllBlocksCleared, BlockRemoved, BlockStored
from kvstack.sim.kv_cache import KVCache, chain_block_hashes


def _store(kv: KVCache, tokens: list[int]) -> list:
    """Allocate, cache and free a request's full blocks, as a finished request would."""
    hashes = kv.block_hashes(tokens)
    hit = kv.longest_cached_prefix(hashes, len(tokens) - 1)
    kv.touch(hit)
    fresh = kv.allocate(-(-len(tokens) // kv.block_size) - len(hit))
    assert fresh is not None
    blocks = hit + fresh
    kv.cache_full_blocks(blocks, hashes, tokens, len(hit), len(tokens) // kv.block_size)
    kv.free(reversed(blocks))
    return blocks


def test_hashes_are_chained_and_seeded() -> None:
    a = chain_block_hashes(list(range(64)), 16, seed=0)
    b = chain_block_hashes(list(range(64)), 16, seed=1)
    assert len(a) == 4 and len(set(a)) == 4
    assert a != b
    # A block's hash depends on everything before it.
    c = chain_block_hashes([99, *range(1, 64)], 16, seed=0)
    assert all(x != y for x, y in zip(a, c, strict=True))
    # Extending keeps the prefix.
    assert chain_block_hashes(list(range(80)), 16, seed=0)[:4] == a


def test_prefix_hit_is_capped_below_prompt_length() -> None:
    kv = KVCache(32, 16)
    tokens = list(range(64))
    _store(kv, tokens)
    hashes = kv.block_hashes(tokens)
    # vLLM recomputes the last token, so a 64-token prompt hits at most 48 tokens.
    assert len(kv.longest_cached_prefix(hashes, len(tokens) - 1)) == 3
    assert len(kv.longest_cached_prefix([*hashes, 123], 65 - 1)) == 4


def test_events_stored_then_removed_on_eviction() -> None:
    kv = KVCache(5, 4)  # 4 usable blocks
    kv.take_events()
    _store(kv, list(range(8)))
    events = kv.take_events()
    assert len(events) == 1 and isinstance(events[0], BlockStored)
    stored = events[0]
    assert stored.parent_block_hash is None
    assert stored.token_ids == list(range(8))
    assert len(stored.block_hashes) == 2 and stored.block_size == 4
    # Fill the pool with other blocks: the cached ones are evicted, tail block first.
    _store(kv, list(range(100, 116)))
    events = kv.take_events()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert [r.block_hashes[0] for r in removed] == list(reversed(stored.block_hashes))
    assert all(len(r.block_hashes) == 1 for r in removed)


def test_continuation_event_names_parent() -> None:
    kv = KVCache(16, 4)
    _store(kv, list(range(8)))
    first = kv.take_events()[0]
    assert isinstance(first, BlockStored)
    _store(kv, list(range(13)))
    second = kv.take_events()[0]
    assert isinstance(second, BlockStored)
    assert second.parent_block_hash == first.block_hashes[-1]
    assert second.token_ids == list(range(8, 12))


def test_usage_counts_referenced_blocks_only() -> None:
    kv = KVCache(11, 4)
    assert kv.usage() == 0.0
    blocks = kv.allocate(5)
    assert blocks is not None
    assert kv.usage() == 0.5
    kv.free(blocks)
    assert kv.usage() == 0.0
    assert kv.allocate(11) is None


def test_reset_clears_and_is_refused_while_blocks_are_held() -> None:
    kv = KVCache(8, 4)
    _store(kv, list(range(8)))
    held = kv.allocate(1)
    assert held is not None
    assert kv.reset() is False
    kv.free(held)
    kv.take_events()
    assert kv.reset() is True
    assert kv.take_events() == [AllBlocksCleared()]
    assert kv.longest_cached_prefix(kv.block_hashes(list(range(8))), 7) == []


def test_random_workload_keeps_invariants() -> None:
    rng = random.Random(7)
    kv = KVCache(40, 8)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(8, 120))] for _ in range(12)]
    live: dict[int | bytes, int] = {}  # engine hash -> number of physical copies, rebuilt from events
    for _ in range(400):
        tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(0, 30))]
        if -(-len(tokens) // kv.block_size) > kv.num_blocks - 1:
            continue
        _store(kv, tokens)
        for ev in kv.take_events():
            if isinstance(ev, BlockStored):
                for h in ev.block_hashes:
                    live[h] = live.get(h, 0) + 1
            elif isinstance(ev, BlockRemoved):
                live[ev.block_hashes[0]] -= 1
        assert kv.num_free_blocks == kv.num_blocks - 1
    # Whatever the index rebuilt from events holds is exactly what the pool holds.
    assert {h for h, n in live.items() if n > 0} == set(kv._cached)
