"""The tiered store: the longest prefix across tiers, promotion, reads that stop at a corrupt or missing
chunk, bounded write queues to the lower tiers, and clears that race puts and writes in flight."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvstack.cache import ChunkKey, TieredStore
from kvstack.cache.tiers import DiskTier, MemoryTier, Payload
from support.cache import chunk_path, key, payload


class GatedTier(MemoryTier):
    """A memory tier whose writes wait for a gate: a slow lower tier."""

    def __init__(self, name: str) -> None:
        super().__init__(1 << 30, name=name)
        self.gate = asyncio.Event()

    async def put_many(self, items: Sequence[tuple[ChunkKey, Payload]]) -> int:
        await self.gate.wait()
        return await super().put_many(items)


async def test_store_lookup_is_the_longest_consecutive_prefix_across_tiers(tmp_path: Path) -> None:
    memory, disk = MemoryTier(1 << 20), DiskTier(tmp_path, 1 << 20)
    store = TieredStore([memory, disk])
    await store.start()
    keys = [key(i) for i in range(6)]
    memory.put_sync(keys[0], b"0")
    memory.put_sync(keys[2], b"2")
    await disk.put(keys[1], b"1")
    await disk.put(keys[2], b"2")
    await disk.put(keys[3], b"3")
    await disk.put(keys[5], b"5")  # after a hole: not part of the prefix
    # Each run is attributed to the highest tier holding its first chunk (2 is in both).
    assert await store.lookup(keys) == (4, ["memory", "disk", "disk", "disk"])
    assert await store.lookup(keys[4:]) == (0, [])
    assert await store.lookup([]) == (0, [])
    got = await store.get(keys)
    assert [bytes(g) for g in got] == [b"0", b"1", b"2", b"3"]
    # Lower-tier hits were promoted: memory now serves the whole prefix.
    assert memory.contains_sync(keys) == 4 and store.stats().promotions == 2
    assert await store.lookup(keys) == (4, ["memory"] * 4)
    await store.stop()


async def test_store_get_stops_at_a_corrupt_chunk(tmp_path: Path) -> None:
    memory, disk = MemoryTier(1 << 20), DiskTier(tmp_path, 1 << 20)
    store = TieredStore([memory, disk])
    await store.start()
    keys = [key(i) for i in range(3)]
    for i, k in enumerate(keys):
        await disk.put(k, payload(i, 300))
    path = chunk_path(tmp_path, keys[1])
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(raw)
    assert (await store.lookup(keys))[0] == 3  # the index cannot know before reading
    got = await store.get(keys)
    assert [bytes(g) for g in got] == [payload(0, 300)]
    assert (await store.lookup(keys))[0] == 1 and disk.stats().corrupt == 1
    await store.stop()


async def test_store_put_writes_memory_now_and_lower_tiers_through_the_queue(tmp_path: Path) -> None:
    memory, disk = MemoryTier(1 << 20), DiskTier(tmp_path, 1 << 20)
    store = TieredStore([memory, disk], write_queue_size=16)
    await store.start()
    keys = [key(i) for i in range(5)]
    data = [bytearray(payload(i, 1000)) for i in range(5)]
    assert store.put(keys, data) == 5
    for buf in data:
        buf[:] = bytes(len(buf))  # the caller reuses its buffers: stored chunks must not change
    assert memory.contains_sync(keys) == 5
    await store.flush()
    assert await disk.contains(keys) == 5
    assert [bytes(g or b"") for g in await disk.get_many(keys)] == [payload(i, 1000) for i in range(5)]
    await store.stop()
    assert memory.stats().entries == 0  # stop closed the tiers


async def test_store_full_write_queue_drops_and_counts_without_blocking() -> None:
    memory, slow = MemoryTier(1 << 20), GatedTier("slow")
    store = TieredStore([memory, slow], write_queue_size=2, write_batch=1)
    await store.start()
    keys = [key(i) for i in range(10)]
    started = time.perf_counter()
    assert store.put(keys, [payload(i, 100) for i in range(10)]) == 10
    assert time.perf_counter() - started < 0.5
    stats = store.stats()
    assert stats.queue_drops == {"slow": 8} and stats.queued == {"slow": 2}
    await asyncio.sleep(0)  # the writer takes one and waits at the gate; one more fits now
    assert store.put([key(10)], [b"x"]) == 1 and store.stats().queue_drops == {"slow": 8}
    slow.gate.set()
    await store.flush()
    assert slow.stats().entries == 3 and await slow.contains([key(0), key(1)]) == 2
    assert store.memory.contains_sync(keys) == 10
    await store.stop()


class CountingTier(MemoryTier):
    """A lower tier that counts how it is asked (a stand-in for one that needs I/O: no index)."""

    def __init__(self, name: str) -> None:
        super().__init__(1 << 30, name=name)
        self.asked: list[str] = []
        self.clear_gate = asyncio.Event()
        self.clear_gate.set()

    # A memory tier acting as one that needs I/O: it declines to answer inline (None), as any Tier may.
    def contains_now(self, keys: Sequence[bytes]) -> int | None:  # type: ignore[override]  # see above
        return None

    async def contains(self, keys: Sequence[bytes]) -> int:
        self.asked.append("contains")
        return await super().contains(keys)

    async def contains_each(self, keys: Sequence[bytes]) -> list[bool]:
        self.asked.append(f"contains_each {len(keys)}")
        return [self.contains_sync((k,)) == 1 for k in keys]

    async def clear(self) -> None:
        await self.clear_gate.wait()
        await super().clear()


async def test_store_exists_asks_each_tier_about_all_its_keys_at_once() -> None:
    memory, shared = MemoryTier(1 << 20), CountingTier("shared")
    store = TieredStore([memory, shared])
    await store.start()
    keys = [key(i) for i in range(500)]
    memory.put_sync(keys[0], b"m")
    for i in (3, 499):
        await shared.put(keys[i], b"s")
    present = await store.exists(keys)
    assert [i for i, hit in enumerate(present) if hit] == [0, 3, 499]
    # One call for the 499 keys memory lacks (a Redis tier makes it one pipeline), not one per key.
    assert shared.asked == ["contains_each 499"]
    await store.stop()


async def test_store_get_reads_nothing_after_a_chunk_no_tier_holds(tmp_path: Path) -> None:
    memory, disk = MemoryTier(1 << 20), DiskTier(tmp_path, 1 << 20)
    store = TieredStore([memory, disk])
    await store.start()
    keys = [key(i) for i in range(12)]
    for i in range(1, 12):
        await disk.put(keys[i], payload(i, 300))
    memory.put_sync(keys[5], payload(5, 300))
    # Chunk 0 is nowhere (evicted between a lookup and this get): nothing after it can be served.
    assert await store.get(keys) == []
    assert disk.stats().hits == 0 and store.stats().promotions == 0
    # A gap further on: the chunks before it are read, the ones after it are not.
    await disk.put(keys[0], payload(0, 300))
    await disk.delete(keys[8])
    got = await store.get(keys)
    assert [bytes(g) for g in got] == [payload(i, 300) for i in range(8)]
    assert disk.stats().hits == 7  # 0-4, 6, 7: not 9-11; 5 came from memory
    await store.stop()


async def test_store_clear_keeps_puts_made_meanwhile_in_memory_and_out_of_the_lower_tiers() -> None:
    memory, shared = MemoryTier(1 << 20), CountingTier("shared")
    store = TieredStore([memory, shared])
    await store.start()
    old = [key(i) for i in range(4)]
    store.put(old, [payload(i, 100) for i in range(4)])
    await store.flush()
    shared.clear_gate.clear()  # the lower tier takes its time to empty
    emptied: list[int] = []
    clearing = asyncio.create_task(store.clear(on_empty=lambda: emptied.append(memory.stats().entries or 0)))
    await asyncio.sleep(0.05)
    assert emptied == [0] and not clearing.done()
    late = key(100)
    assert store.put([late], [b"late"]) == 1
    assert store.stats().queue_drops == {"shared": 1}  # the tier being emptied does not get it
    shared.clear_gate.set()
    await clearing
    await store.flush()
    assert await store.lookup([late]) == (1, ["memory"])
    assert await shared.contains_each([late, *old]) == [False] * 5
    assert await store.lookup(old) == (0, [])
    # After the clear, puts reach the lower tiers again.
    store.put([key(101)], [b"after"])
    await store.flush()
    assert await shared.contains([key(101)]) == 1
    await store.stop()


async def test_store_clear_lets_writes_in_flight_land_first_then_removes_them() -> None:
    memory, slow = MemoryTier(1 << 20), GatedTier("slow")
    store = TieredStore([memory, slow], write_batch=2)
    await store.start()
    keys = [key(i) for i in range(6)]
    store.put(keys, [payload(i, 100) for i in range(6)])
    await asyncio.sleep(0)  # the writer holds a batch of 2 at the gate; 4 are queued
    clearing = asyncio.create_task(store.clear())
    await asyncio.sleep(0.05)
    assert not clearing.done() and store.stats().queued == {"slow": 0}
    slow.gate.set()  # the batch in flight lands, then the tier is emptied
    await clearing
    assert slow.stats().writes == 2 and slow.stats().entries == 0
    assert await store.lookup(keys) == (0, [])
    await store.stop()


async def test_store_rejects_a_store_without_memory_first(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="MemoryTier first"):
        TieredStore([DiskTier(tmp_path, 1)])
    with pytest.raises(ValueError, match="unique"):
        TieredStore([MemoryTier(1), MemoryTier(1)])
