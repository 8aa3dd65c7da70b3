"""The prefix index: block keys, the exact per-tier index (semantics, eviction bound, memory) and clears."""

from __future__ import annotations

import gc
import os
import random
import subprocess
import sys
import textwrap
import tracemalloc
from array import array
from collections import Counter

import pytest

from kvstack.index import BlockKeyer, PrefixIndex, PrefixMatch, Tier
from kvstack.index.bits import one_bits
from kvstack.index.block_table import BlockTable, KeyQueue

NS = "tiny-llama|"

# -- keys


def _tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(150_000) for _ in range(n)]


def test_keys_one_per_full_block_and_partial_tail_ignored() -> None:
    keyer = BlockKeyer(NS, 16)
    tokens = _tokens(16 * 5 + 7)
    keys = keyer.keys(tokens)
    assert len(keys) == 5
    assert keys == keyer.keys(tokens[: 16 * 5])
    assert keyer.keys(tokens[:15]) == []
    assert keyer.keys([]) == []
    assert all(isinstance(k, int) and 0 <= k < 2**64 for k in keys)
    assert len(set(keys)) == 5


def test_keys_are_a_fixed_function_of_namespace_block_size_and_tokens() -> None:
    # Pinned values: a silent change of the key scheme would split routers of different versions.
    assert BlockKeyer("m|", 4).keys(list(range(12))) == [
        3334960651610997740,
        6701036219294058242,
        11184659583683473839,
    ]


def test_keys_do_not_depend_on_pythonhashseed() -> None:
    tokens = _tokens(1000, seed=3)
    here = BlockKeyer(NS, 16).keys(tokens)
    script = textwrap.dedent(
        f"""
        import random
        from kvstack.index import BlockKeyer
        rng = random.Random(3)
        tokens = [rng.randrange(150_000) for _ in range(1000)]
        print(BlockKeyer({NS!r}, 16).keys(tokens))
        """
    )
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True, timeout=60
        ).stdout
        assert out.strip() == str(here)


def test_block_size_and_namespace_separate_keys() -> None:
    tokens = _tokens(256)
    k16 = BlockKeyer(NS, 16).keys(tokens)
    k128 = BlockKeyer(NS, 128).keys(tokens)
    k32 = BlockKeyer(NS, 32).keys(tokens)
    assert not set(k16) & set(k128)
    assert not set(k16) & set(k32)
    other_model = BlockKeyer("other-model|", 16).keys(tokens)
    lora = BlockKeyer("tiny-llama|sql-lora", 16).keys(tokens)
    assert not set(k16) & set(other_model)
    assert not set(k16) & set(lora)
    assert BlockKeyer(NS, 16).root != BlockKeyer(NS, 128).root


def test_keys_from_chains_like_the_whole_prompt() -> None:
    keyer = BlockKeyer(NS, 16)
    tokens = _tokens(16 * 10 + 3)
    whole = keyer.keys(tokens)
    assert keyer.keys_from(None, tokens) == whole
    for cut in (1, 4, 9):
        head = keyer.keys(tokens[: 16 * cut])
        assert head == whole[:cut]
        assert keyer.keys_from(head[-1], tokens[16 * cut :]) == whole[cut:]


def test_keys_share_a_prefix_and_diverge_from_the_first_changed_block() -> None:
    keyer = BlockKeyer(NS, 16)
    a = _tokens(16 * 6)
    b = list(a)
    b[16 * 3 + 5] += 1
    ka, kb = keyer.keys(a), keyer.keys(b)
    assert ka[:3] == kb[:3]
    assert not set(ka[3:]) & set(kb[3:])


def test_keys_accept_lists_tuples_ranges_and_packed_arrays() -> None:
    keyer = BlockKeyer(NS, 8)
    tokens = _tokens(70)
    expected = keyer.keys(tokens)
    assert keyer.keys(tuple(tokens)) == expected
    assert keyer.keys(array("I", tokens)) == expected
    assert keyer.keys(range(64)) == keyer.keys(list(range(64)))


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_keys_reject_token_ids_outside_uint32(bad: int) -> None:
    with pytest.raises(ValueError, match="token ids"):
        BlockKeyer(NS, 4).keys([1, 2, 3, bad])


def test_keyer_rejects_a_block_size_below_one() -> None:
    with pytest.raises(ValueError, match="block_size"):
        BlockKeyer(NS, 0)


# -- tiers


@pytest.mark.parametrize(
    ("medium", "tier"),
    [
        (None, Tier.GPU),
        ("GPU", Tier.GPU),
        ("CPU", Tier.CPU),
        ("cpu", Tier.CPU),
        ("STORAGE", Tier.DISK),
        ("DISK", Tier.DISK),
        ("REMOTE", Tier.REMOTE),
        ("NVME_OF_THE_FUTURE", Tier.DISK),
    ],
)
def test_tier_from_medium(medium: str | None, tier: Tier) -> None:
    assert Tier.from_medium(medium) is tier


def test_tiers_are_ordered_best_first() -> None:
    assert Tier.GPU < Tier.CPU < Tier.DISK < Tier.REMOTE
    assert [t.value for t in Tier] == [0, 1, 2, 3]


# -- index semantics

KEYS = list(range(1000, 1010))  # block keys are opaque ints: small ones keep the tests readable


def _match(blocks: int, gpu: int, cpu: int, disk: int) -> PrefixMatch:
    return PrefixMatch(blocks, (gpu, cpu, disk, blocks))


def test_lookup_gives_each_locations_consecutive_prefix() -> None:
    index = PrefixIndex()
    index.store("http://a", KEYS[:6])
    index.store("http://b", KEYS[:3])
    index.store("http://b", KEYS[4:8])  # a hole at block 3: only blocks 0-2 count
    index.store("http://c", KEYS[1:5])  # no block 0: absent
    got = index.lookup(KEYS)
    assert got == {"http://a": _match(6, 6, 6, 6), "http://b": _match(3, 3, 3, 3)}
    assert got["http://a"].at(Tier.GPU) == 6
    assert index.lookup(KEYS[1:])["http://c"].blocks == 4
    assert index.lookup([]) == {}
    assert index.lookup([999]) == {}


def test_lookup_per_tier_prefixes() -> None:
    index = PrefixIndex()
    index.store("engine", KEYS[:2], Tier.GPU)
    index.store("engine", KEYS[2:4], Tier.CPU)
    index.store("engine", KEYS[4:5], Tier.DISK)
    index.store("engine", KEYS[5:6], Tier.REMOTE)
    index.store("cache://node-a", KEYS[:3], Tier.DISK)
    index.store("cache://node-a", KEYS[1:2], Tier.CPU)  # CPU copy of block 1 only: no CPU prefix
    index.store("cache://far", KEYS[:4], Tier.REMOTE)
    got = index.lookup(KEYS)
    assert got["engine"] == _match(6, 2, 4, 5)
    assert got["cache://node-a"] == _match(3, 0, 0, 3)
    assert got["cache://far"] == _match(4, 0, 0, 0)


def test_duplicate_stores_are_idempotent() -> None:
    index = PrefixIndex()
    for _ in range(3):
        index.store("a", KEYS[:4], Tier.GPU, engine_hashes=[1, 2, 3, 4])
    stats = index.stats()
    assert (stats.entries, stats.blocks, stats.engine_hashes) == (4, 4, 4)
    assert index.lookup(KEYS)["a"] == _match(4, 4, 4, 4)
    index.store("a", KEYS[:4], Tier.CPU, engine_hashes=[1, 2, 3, 4])  # another tier: still 4 entries
    assert index.stats().entries == 4


def test_a_block_held_by_many_locations_beyond_256() -> None:
    index = PrefixIndex()
    names = [f"http://10.0.{i // 250}.{i % 250}:8000" for i in range(300)]
    for i, name in enumerate(names):
        index.store(name, KEYS[: 1 + i % 10], Tier(i % 4))
    got = index.lookup(KEYS)
    assert len(got) == 300
    for i, name in enumerate(names):
        n = 1 + i % 10
        assert got[name].blocks == n
        assert got[name].blocks_by_tier == tuple(n if t >= i % 4 else 0 for t in range(4))
    assert index.stats().entries == sum(1 + i % 10 for i in range(300))


def test_removing_one_tier_keeps_the_block_held_in_another() -> None:
    index = PrefixIndex()
    index.store("a", KEYS[:3], Tier.GPU, engine_hashes=[11, 12, 13])
    index.store("a", KEYS[:3], Tier.CPU, engine_hashes=[11, 12, 13])
    assert index.remove_hashes("a", [12], Tier.GPU) == 1
    assert index.lookup(KEYS)["a"] == _match(3, 1, 3, 3)
    assert index.key_for_hash("a", 12) == KEYS[1]  # still held in CPU: its removal must still match
    assert index.stats().entries == 3
    assert index.remove_hashes("a", [12], Tier.GPU) == 0  # no longer in GPU
    assert index.remove_hashes("a", [12], Tier.CPU) == 1
    assert index.key_for_hash("a", 12) is None
    assert index.lookup(KEYS)["a"] == _match(1, 1, 1, 1)
    assert index.stats().entries == 2
    assert index.stats().unknown_removals == 1


def test_removal_with_tier_none_clears_every_tier() -> None:
    index = PrefixIndex()
    index.store("a", KEYS[:3], Tier.GPU)
    index.store("a", KEYS[:3], Tier.DISK)
    index.store("b", KEYS[:3], Tier.GPU)
    assert index.remove_keys("a", KEYS[1:2]) == 1
    assert index.lookup(KEYS) == {"a": _match(1, 1, 1, 1), "b": _match(3, 3, 3, 3)}
    assert index.stats().entries == 5


def test_a_block_removed_then_stored_again_under_a_new_engine_hash() -> None:
    index = PrefixIndex()
    index.store("a", KEYS[:2], Tier.GPU, engine_hashes=[1, 2])
    assert index.remove_hashes("a", [2], Tier.GPU) == 1
    index.store("a", KEYS[1:2], Tier.GPU, engine_hashes=[22])
    assert index.key_for_hash("a", 2) is None
    assert index.key_for_hash("a", 22) == KEYS[1]
    assert index.remove_hashes("a", [2]) == 0
    assert index.lookup(KEYS)["a"].blocks == 2
    assert index.remove_hashes("a", [22]) == 1
    assert index.lookup(KEYS)["a"].blocks == 1
    assert index.stats().engine_hashes == 1


def test_engine_hashes_are_per_location_and_may_be_bytes() -> None:
    index = PrefixIndex()
    index.store("a", KEYS[:2], Tier.GPU, engine_hashes=[b"\x01" * 32, b"\x02" * 32])
    index.store("b", KEYS[:2], Tier.GPU, engine_hashes=[b"\x01" * 32, 7])
    assert index.key_for_hash("a", b"\x02" * 32) == KEYS[1]
    assert index.key_for_hash("b", b"\x02" * 32) is None
    assert index.key_for_hash("nowhere", 7) is None
    assert index.remove_hashes("a", [b"\x01" * 32]) == 1
    assert set(index.lookup(KEYS)) == {"b"}


def test_unknown_removals_are_ignored_and_counted() -> None:
    index = PrefixIndex()
    index.store("a", KEYS[:2], Tier.GPU, engine_hashes=[1, 2])
    assert index.remove_hashes("a", [3, 4, 1]) == 1
    assert index.remove_hashes("nowhere", [1]) == 0
    assert index.remove_keys("a", [12345]) == 0
    assert index.stats().unknown_removals == 4
    assert index.stats().entries == 1


def test_store_needs_one_engine_hash_per_key() -> None:
    with pytest.raises(ValueError, match="pair up"):
        PrefixIndex().store("a", KEYS[:3], Tier.GPU, engine_hashes=[1, 2])


def test_clear_location_removes_only_that_location() -> None:
    index = PrefixIndex()
    index.store("a", KEYS[:5], Tier.GPU, engine_hashes=list(range(5)))
    index.store("a", KEYS[:2], Tier.CPU)
    index.store("b", KEYS[:3], Tier.GPU, engine_hashes=list(range(3)))
    assert index.clear_location("a") == 5
    assert index.clear_location("a") == 0
    assert index.lookup(KEYS) == {"b": _match(3, 3, 3, 3)}
    stats = index.stats()
    assert (stats.entries, stats.blocks, stats.locations, stats.engine_hashes) == (3, 3, 1, 3)
    assert index.key_for_hash("a", 1) is None
    index.store("c", KEYS[:1])  # takes the freed bit: must not inherit a's blocks
    assert index.lookup(KEYS)["c"] == _match(1, 1, 1, 1)
    assert index.locations() == ["b", "c"]


def test_clear_location_touches_only_its_own_entries() -> None:
    index = PrefixIndex(max_entries=1_000_000)
    for i in range(40):
        index.store(f"busy-{i}", list(range(i * 10_000, i * 10_000 + 10_000)))
    index.store("small", [1, 2, 3])
    assert index.clear_location("small") == 3
    assert index.stats().entries == 400_000
    assert index.lookup(list(range(10_000, 10_005))) == {"busy-1": _match(5, 5, 5, 5)}


# -- the same semantics against a brute-force model, through a random workload


def _reference_lookup(held: dict[tuple[str, int], set[int]], keys: list[int]) -> dict[str, PrefixMatch]:
    out = {}
    for loc in {loc for loc, _ in held}:
        by_tier = []
        for t in range(4):
            n = 0
            while n < len(keys) and any(x <= t for x in held.get((loc, keys[n]), ())):
                n += 1
            by_tier.append(n)
        if by_tier[3]:
            out[loc] = PrefixMatch(by_tier[3], (by_tier[0], by_tier[1], by_tier[2], by_tier[3]))
    return out


def test_random_workload_matches_a_brute_force_model() -> None:
    rng = random.Random(7)
    index = PrefixIndex(max_entries=10**9)
    chains = [[c * 1000 + i for i in range(12)] for c in range(6)]
    locations = [f"loc{i}" for i in range(5)]
    held: dict[tuple[str, int], set[int]] = {}
    epoch: dict[tuple[str, int], int] = {}  # a new engine hash after each full removal

    def engine_hash(loc: str, key: int) -> int:
        return hash((loc, key, epoch.get((loc, key), 0))) & (2**63 - 1)

    for _ in range(3000):
        op = rng.random()
        loc = rng.choice(locations)
        chain = rng.choice(chains)
        if op < 0.5:
            lo = rng.randrange(len(chain))
            keys = chain[lo : rng.randrange(lo + 1, len(chain) + 1)]
            tier = rng.choice(list(Tier))
            index.store(loc, keys, tier, engine_hashes=[engine_hash(loc, k) for k in keys])
            for k in keys:
                held.setdefault((loc, k), set()).add(tier)
        elif op < 0.85:
            keys = rng.sample(chain, 3)
            tier_or_none = rng.choice([*Tier, None])
            hashes = [engine_hash(loc, k) for k in keys]  # the current ones, before the model moves on
            expected = 0
            for k in keys:
                tiers = held.get((loc, k), set())
                hit = tiers if tier_or_none is None else tiers & {tier_or_none}
                if hit:
                    expected += 1
                    tiers -= hit
                    if not tiers:
                        del held[(loc, k)]
                        epoch[(loc, k)] = epoch.get((loc, k), 0) + 1
            if rng.random() < 0.5:
                assert index.remove_hashes(loc, hashes, tier_or_none) == expected
            else:
                assert index.remove_keys(loc, keys, tier_or_none) == expected
        elif op < 0.9:
            index.clear_location(loc)
            for lk in [lk for lk in held if lk[0] == loc]:
                del held[lk]
                epoch[lk] = epoch.get(lk, 0) + 1
        chain = rng.choice(chains)
        assert index.lookup(chain) == _reference_lookup(held, chain)
        assert index.stats().entries == len(held)
    _check_consistent(index)


# -- the bound


def test_eviction_takes_the_least_recently_used_chain_from_its_tail() -> None:
    index = PrefixIndex(max_entries=10)
    a, b, c = ([x * 100 + i for i in range(6)] for x in (1, 2, 3))
    index.store("e", a, Tier.GPU, engine_hashes=a)
    index.store("e", b, Tier.GPU, engine_hashes=b)
    assert index.lookup(a)["e"].blocks == 4  # a's last two blocks went first
    assert index.key_for_hash("e", a[5]) is None
    index.store("e", c[:2])  # a was just looked up, so b is the least recent
    assert index.lookup(a)["e"].blocks == 4
    assert index.lookup(b)["e"].blocks == 4
    stats = index.stats()
    assert (stats.entries, stats.evicted_entries, stats.evicted_blocks, stats.engine_hashes) == (10, 4, 4, 8)


def test_evicting_a_block_evicts_every_location_holding_it() -> None:
    index = PrefixIndex(max_entries=6)
    index.store("a", [1, 2], Tier.GPU, engine_hashes=[11, 12])
    index.store("b", [1, 2], Tier.CPU, engine_hashes=[21, 22])
    index.store("c", [3, 4, 5])  # 7 > 6: block 2 (least recent) goes, for a and b
    assert index.lookup([1, 2]) == {"a": _match(1, 1, 1, 1), "b": _match(1, 0, 1, 1)}
    stats = index.stats()
    assert (stats.entries, stats.evicted_entries, stats.engine_hashes) == (5, 2, 2)
    assert index.key_for_hash("a", 12) is None and index.key_for_hash("b", 22) is None


def _check_consistent(index: PrefixIndex) -> None:
    """Every mask bit is a membership and back, every engine hash maps to a member, the count adds up."""
    locations = index._locations.values()
    blocks = {**index._blocks.old, **index._blocks.young}
    assert len(blocks) == len(index._blocks)
    holders = index._holders
    assert Counter(blocks.values()) == {hid: n for hid, n in enumerate(holders._uses) if n}
    assert len(holders) == len(set(blocks.values()))
    held = 0
    for key, hid in blocks.items():
        g, c, d, r = holders.masks[hid]
        for bit in one_bits(g | c | d | r):
            assert key in index._by_bit[bit].members
            held += 1
    assert held == index.stats().entries == sum(len(loc.members) for loc in locations)
    for loc in locations:
        assert all(key in blocks for key in loc.members)
        assert all(loc.members.get(key) is not None for key in loc.by_hash.values())


def test_entries_and_hash_maps_stay_bounded_under_a_long_random_workload() -> None:
    rng = random.Random(11)
    bound = 2_000
    index = PrefixIndex(max_entries=bound)
    keyer = BlockKeyer(NS, 4)
    prefixes = [_tokens(4 * rng.randrange(1, 6), seed=s) for s in range(20)]  # shared system prompts
    locations = [f"http://engine-{i}" for i in range(16)]
    next_hash = 0
    for step in range(4_000):
        loc = rng.choice(locations)
        keys = keyer.keys(rng.choice(prefixes) + _tokens(4 * rng.randrange(1, 12), seed=1000 + step))
        op = rng.random()
        if op < 0.8:
            hashes = list(range(next_hash, next_hash + len(keys)))
            next_hash += len(keys)
            index.store(loc, keys, Tier.from_medium(rng.choice([None, "CPU", "STORAGE"])), hashes)
        elif op < 0.95:
            index.remove_hashes(loc, [rng.randrange(max(1, next_hash)) for _ in range(5)])
        elif op < 0.99:
            index.lookup(keys)
        else:
            index.clear_location(loc)
        stats = index.stats()
        assert stats.entries <= bound
        assert stats.engine_hashes <= stats.entries * 4
        assert stats.blocks <= stats.entries
        assert stats.locations <= len(locations)
        if step % 500 == 0:
            _check_consistent(index)
    _check_consistent(index)
    stats = index.stats()
    assert stats.evicted_entries > 5 * bound
    assert stats.entries > bound * 0.9
    # Every entry is still consistent: each location's own prefix of a stored prompt is what lookup says.
    keys = keyer.keys(prefixes[0] + _tokens(8, seed=99))
    index.store("http://fresh", keys, Tier.GPU)
    assert index.lookup(keys)["http://fresh"] == _match(len(keys), len(keys), len(keys), len(keys))


@pytest.mark.slow
def test_memory_stays_flat_over_repeated_fill_evict_cycles() -> None:
    index = PrefixIndex(max_entries=10_000)
    locations = [f"http://engine-{i}" for i in range(8)]
    after: list[int] = []
    key = 0
    tracemalloc.start()
    try:
        for _ in range(6):
            for _ in range(500):  # 15,000 new entries per cycle: the whole index turns over
                keys = list(range(key, key + 30))
                key += 30
                index.store(locations[key % 8], keys, Tier.GPU, engine_hashes=[k + 2**62 for k in keys])
                index.lookup(keys)
            gc.collect()
            after.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    assert index.stats().entries <= 10_000
    assert index.stats().engine_hashes <= 10_000
    full = max(after[:2])
    assert max(after[2:]) < full * 1.1, [f"{b / 1e6:.2f} MB" for b in after]
    # The per-block containers hold only ints: a full GC never walks them, however many blocks there are.
    containers = [
        *index._blocks.containers(),
        *(d for loc in index._locations.values() for d in (loc.members, loc.by_hash)),
    ]
    assert not any(gc.is_tracked(c) for c in containers if not isinstance(c, KeyQueue))


def test_a_block_keeps_its_newest_engine_hashes_only() -> None:
    index = PrefixIndex()
    for h in range(6):  # e.g. stored again and again under new hashes, never removed in between
        index.store("a", [7], Tier.GPU, engine_hashes=[100 + h])
    assert [index.key_for_hash("a", 100 + h) for h in range(6)] == [None, None, 7, 7, 7, 7]
    assert index.stats().engine_hashes == 4
    assert index.remove_hashes("a", [105]) == 1
    assert index.stats().engine_hashes == 0


def test_holder_sets_are_shared_and_freed_when_unused() -> None:
    index = PrefixIndex()
    locations = [f"l{j}" for j in range(12)]
    for tier in (Tier.GPU, Tier.CPU):  # 4,095 distinct holder sets per tier
        for k in range(1, 4096):
            for j in range(12):
                if k >> j & 1:
                    index.store(locations[j], [tier * 10_000 + k], tier)
        assert index.stats().holder_sets == 4095
        _check_consistent(index)
        index.clear_location(locations[0])
        _check_consistent(index)
        for loc in locations[1:]:
            index.clear_location(loc)
        assert index.stats().holder_sets == 0
    index.store("a", list(range(100)))
    index.store("b", list(range(50)))
    assert index.stats().holder_sets == 2  # {a, b} for blocks 0-49, {a} for 50-99
    _check_consistent(index)


# -- the two-generation LRU table under the index


def test_key_queue_is_fifo_across_compactions() -> None:
    queue = KeyQueue([2**64 - 1, 0])
    for k in range(1, 20_000):
        queue.append(k)
    got = [queue.popleft() for _ in range(15_000)]
    assert got == [2**64 - 1, 0, *range(1, 14_999)]
    queue.append(7)
    assert len(queue) == 5_002
    assert [queue.popleft() for _ in range(5_002)] == [*range(14_999, 20_000), 7]
    with pytest.raises(IndexError):
        queue.popleft()


def test_block_table_evicts_untouched_keys_first_in_entry_order() -> None:
    table: BlockTable[str] = BlockTable()
    for k in range(6):
        table.touch(k, f"v{k}")
    assert table.pop_oldest() == (0, "v0")  # first eviction: the young generation becomes old
    table.touch(1, "v1")  # touched since the swap: young again, evicted after all of old
    table.update(2, "v2'")  # a value change is not a touch
    table.promote(3)
    assert [table.pop_oldest()[0] for _ in range(5)] == [2, 4, 5, 1, 3]
    assert len(table) == 0
    with pytest.raises(KeyError):
        table.pop_oldest()


def test_block_table_order_stays_bounded_under_churn_without_eviction() -> None:
    table: BlockTable[int] = BlockTable()
    for k in range(100_000):  # store/remove churn below the bound: nothing is ever evicted
        table.touch(k, k)
        if k >= 10:
            table.delete(k - 10)
    assert len(table) == 10
    assert len(table._young_order) <= 2 * 10 + 4096 + 1
    assert [table.pop_oldest()[0] for _ in range(10)] == list(range(99_990, 100_000))


def test_store_refuses_keys_outside_64_bits_and_changes_nothing() -> None:
    index = PrefixIndex()
    for bad in ([1, -1], [2**64, 1]):
        with pytest.raises(ValueError, match="2\\*\\*64"):
            index.store("a", bad)
    assert (index.stats().entries, index.stats().blocks, index.locations()) == (0, 0, [])
