"""The disk tier: layout and stats, shards, views that outlive deletes, batched thread jobs, fsync
policies, failed writes, the LRU budget, a restart's rebuilt index, and chunk notes kept across restarts."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvstack.cache import ChunkKey
from kvstack.cache.tiers import DiskTier, FsyncPolicy
from kvstack.cache.tiers.record import HEADER_BYTES
from support.cache import chunk_path, counting_jobs, files, key, payload


async def test_disk_round_trip_layout_and_stats(disk: DiskTier) -> None:
    data = payload(1, 5000)
    assert await disk.put(key(1), data)
    assert bytes(await disk.get(key(1)) or b"") == data
    assert await disk.get(key(2)) is None
    path = chunk_path(disk.root, key(1))
    assert path.stat().st_size == HEADER_BYTES + len(data)
    assert await disk.put_many([(key(i), payload(i, 100)) for i in range(2, 5)]) == 3
    assert await disk.contains([key(1), key(2), key(3), key(9), key(4)]) == 3
    got = await disk.get_many([key(4), key(9), key(2)])
    assert [None if g is None else bytes(g) for g in got] == [payload(4, 100), None, payload(2, 100)]
    assert await disk.delete(key(1)) and not path.exists() and not await disk.delete(key(1))
    stats = disk.stats()
    assert (stats.hits, stats.misses, stats.writes, stats.entries) == (3, 2, 4, 3)
    assert stats.bytes == 3 * (HEADER_BYTES + 100)
    await disk.clear()
    assert disk.stats().entries == 0 and not files(disk.root, "*.kv")


async def test_disk_start_creates_all_256_shards_and_writes_never_mkdir(disk: DiskTier) -> None:
    shards = sorted(p.name for p in disk.root.iterdir())
    assert shards == [f"{n:02x}" for n in range(256)]
    assert await disk.put_many([(key(i), payload(i, 100)) for i in range(50)]) == 50
    assert sorted(p.name for p in disk.root.iterdir()) == shards  # nothing new, not even nested
    assert all(p.parent.parent == disk.root for p in files(disk.root, "*.kv"))


async def test_disk_returned_views_outlive_delete_rewrite_and_eviction(tmp_path: Path) -> None:
    file_bytes = HEADER_BYTES + 3000
    tier = DiskTier(tmp_path, 2 * file_bytes)
    await tier.start()
    await tier.put(key(1), payload(1, 3000))
    first = await tier.get(key(1))
    assert isinstance(first, memoryview) and first.readonly
    await tier.delete(key(1))
    await tier.put(key(1), payload(9, 3000))  # same key, new content, new file
    second = await tier.get(key(1))
    await tier.put_many([(key(2), payload(2, 3000)), (key(3), payload(3, 3000))])  # evicts key 1
    assert not chunk_path(tmp_path, key(1)).exists()
    assert bytes(first) == payload(1, 3000) and bytes(second or b"") == payload(9, 3000)
    await tier.close()


async def test_disk_batches_use_one_job_or_at_most_io_threads_jobs_of_min_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvstack.cache.tiers import disk as disk_module

    tier = DiskTier(tmp_path, 1 << 20, io_threads=3, inline_read_bytes=0)  # every read in the threads
    await tier.start()
    jobs = counting_jobs(tier)
    file_bytes = HEADER_BYTES + 200
    # Small batches are one job each (a hop costs more than their I/O).
    assert await tier.put_many([(key(i), payload(i, 200)) for i in range(10)]) == 10
    assert jobs[0] == 1
    got = await tier.get_many([key(i) for i in (9, 20, 0, 5, 9)])
    assert jobs[0] == 2
    assert [None if g is None else bytes(g) for g in got] == [
        payload(9, 200),
        None,
        payload(0, 200),
        payload(5, 200),
        payload(9, 200),
    ]
    assert await tier.get_many([key(20)]) == [None] and jobs[0] == 2  # nothing indexed: no job
    # Batches are split into jobs[0] of at least _MIN_JOB_BYTES, never more than io_threads.
    monkeypatch.setattr(disk_module, "_MIN_JOB_BYTES", file_bytes)
    assert await tier.put_many([(key(i), payload(i, 200)) for i in range(30, 40)]) == 10
    assert jobs[0] == 2 + 3
    got = await tier.get_many([key(i) for i in (9, 20, 0, 5, 9)])  # 3 files: 3 jobs[0] of one
    assert jobs[0] == 5 + 3 and [g is not None for g in got] == [True, False, True, True, True]
    monkeypatch.setattr(disk_module, "_MIN_JOB_BYTES", 2 * file_bytes)
    assert len(await tier.get_many([key(i) for i in (0, 5, 9)])) == 3 and jobs[0] == 8 + 1
    assert await tier.put_many([(key(i), payload(i, 200)) for i in range(40, 44)]) == 4 and jobs[0] == 9 + 2
    await tier.close()


@pytest.mark.parametrize("fsync", ["never", "data", "always"])
async def test_disk_fsync_policies_write_the_same_files(tmp_path: Path, fsync: FsyncPolicy) -> None:
    tier = DiskTier(tmp_path, 1 << 20, fsync=fsync, io_threads=2)
    await tier.start()
    assert await tier.put(key(1), payload(1, 3000))
    assert bytes(await tier.get(key(1)) or b"") == payload(1, 3000)
    # A batch: every file written, synced and renamed; nothing temporary left behind.
    assert await tier.put_many([(key(i), payload(i, 2000 + i)) for i in range(2, 12)]) == 10
    got = await tier.get_many([key(i) for i in range(1, 12)])
    assert [bytes(g or b"") for g in got] == [payload(1, 3000), *(payload(i, 2000 + i) for i in range(2, 12))]
    assert not files(tmp_path, "*.tmp") and len(files(tmp_path, "*.kv")) == 11
    await tier.close()
    with pytest.raises(ValueError, match="fsync"):
        DiskTier(tmp_path, 1, fsync="sometimes")  # type: ignore[arg-type]  # not a policy, on purpose


async def test_disk_a_failed_write_in_a_batch_drops_only_that_chunk(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20, fsync="data", io_threads=1)
    await tier.start()
    chunk_path(tmp_path, key(3)).mkdir()  # chunk 3's file cannot be renamed into place
    assert await tier.put_many([(key(i), payload(i, 500)) for i in range(2, 6)]) == 3
    assert await tier.contains([key(2)]) == 1 and await tier.contains([key(3)]) == 0
    assert await tier.contains([key(4), key(5)]) == 2
    stats = tier.stats()
    assert stats.errors == 1 and stats.write_drops == 1 and stats.entries == 3
    assert not files(tmp_path, "*.tmp")
    await tier.close()


async def test_disk_lru_budget_deletes_files(tmp_path: Path) -> None:
    file_bytes = HEADER_BYTES + 1000
    tier = DiskTier(tmp_path, 3 * file_bytes)
    await tier.start()
    for i in range(3):
        await tier.put(key(i), payload(i, 1000))
    assert await tier.get(key(0)) is not None  # 1 is now the oldest
    await tier.put(key(3), payload(3, 1000))
    assert not chunk_path(tmp_path, key(1)).exists()
    assert await tier.contains([key(0), key(2), key(3)]) == 3 and await tier.contains([key(1)]) == 0
    assert tier.stats().evictions == 1 and tier.stats().bytes == 3 * file_bytes
    assert not await tier.put(key(9), payload(9, 3 * file_bytes))  # larger than the budget
    assert len(files(tmp_path, "*.kv")) == 3
    await tier.close()


async def test_disk_restart_rebuilds_the_index_in_lru_order(tmp_path: Path) -> None:
    file_bytes = HEADER_BYTES + 500
    tier = DiskTier(tmp_path, 10 * file_bytes)
    await tier.start()
    for i in range(4):
        await tier.put(key(i), payload(i, 500))
    await tier.close()
    # Recency survives in mtimes: make 2 the oldest, then 0, 3, 1.
    for age, i in enumerate([1, 3, 0, 2]):
        os.utime(chunk_path(tmp_path, key(i)), ns=(time.time_ns(), 10**18 - age * 10**9))
    again = DiskTier(tmp_path, 4 * file_bytes)
    await again.start()
    assert again.stats().entries == 4 and again.stats().bytes == 4 * file_bytes
    assert bytes(await again.get(key(3)) or b"") == payload(3, 500)  # a hit makes 3 the newest again
    await again.put(key(4), payload(4, 500))
    await again.put(key(5), payload(5, 500))
    assert await again.contains([key(2)]) == 0 and await again.contains([key(0)]) == 0
    assert await again.contains([key(1), key(3), key(4), key(5)]) == 4
    await again.close()
    # A smaller budget at start evicts down to it.
    small = DiskTier(tmp_path, 2 * file_bytes)
    await small.start()
    assert small.stats().entries == 2 and len(files(tmp_path, "*.kv")) == 2
    await small.close()


class NotingListener:
    """A tier listener that annotates chunks and records what it hears."""

    def __init__(self, notes: dict[ChunkKey, bytes]) -> None:
        self.notes = notes
        self.restored_items: list[tuple[ChunkKey, bytes]] = []
        self.done = 0

    def stored(self, tier: object, keys: Sequence[ChunkKey]) -> None:
        pass

    def removed(self, tier: object, keys: Sequence[ChunkKey]) -> None:
        pass

    def annotation(self, key: ChunkKey) -> bytes | None:
        return self.notes.get(key)

    def restored(self, tier: object, items: Sequence[tuple[ChunkKey, bytes]], done: bool) -> None:
        self.restored_items += items
        self.done += done


async def test_disk_keeps_each_chunks_note_and_hands_it_back_after_a_restart(tmp_path: Path) -> None:
    notes = {key(i): b"note %d" % i * (i + 1) for i in (1, 2)}
    tier = DiskTier(tmp_path, 1 << 20)
    await tier.start()
    tier.listener = NotingListener(notes)
    assert await tier.put_many([(key(i), payload(i, 3000)) for i in (1, 2, 3)]) == 3  # 3 has no note
    assert tier.stats().bytes == sum(HEADER_BYTES + 3000 + len(n) + 16 for n in notes.values()) + (
        HEADER_BYTES + 3000
    )
    assert bytes(await tier.get(key(1)) or b"") == payload(1, 3000)  # the note is not part of the payload
    await tier.close()

    again = DiskTier(tmp_path, 1 << 20)
    await again.start()
    assert again.stats().entries == 3
    listener = NotingListener({})
    again.listener = listener
    assert await again.announce_held() == 2
    assert sorted(listener.restored_items) == sorted(notes.items()) and listener.done == 1
    got = await again.get_many([key(i) for i in (1, 2, 3)])
    assert [bytes(g or b"") for g in got] == [payload(i, 3000) for i in (1, 2, 3)]
    # A flipped note byte: the chunk is still served (its payload verifies) but no longer announced.
    path = chunk_path(tmp_path, key(2))
    raw = bytearray(path.read_bytes())
    raw[HEADER_BYTES + 3000] ^= 0x01
    path.write_bytes(raw)
    listener.restored_items.clear()
    assert await again.announce_held() == 1 and [k for k, _ in listener.restored_items] == [key(1)]
    assert bytes(await again.get(key(2)) or b"") == payload(2, 3000)
    # A broken footer: the file is not a chunk file any more: a miss, deleted, counted.
    raw[-1] ^= 0x01
    path.write_bytes(raw)
    assert await again.get(key(2)) is None and not path.exists() and again.stats().corrupt == 1
    await again.close()
