"""KV cache tiers and the tiered store: memory (LRU, pinning, budget, flat memory), disk (verified files,
restart, LRU budget, corruption, kill -9 during writes) and the store (prefix across tiers, promotion,
bounded write queues)."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import mmap
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from array import array
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import pytest
from blake3 import blake3

from kvstack.cache import ChunkKey, TieredStore
from kvstack.cache.tiers import DiskTier, FsyncPolicy, MemoryTier, Payload
from kvstack.cache.tiers.base import Announcements, Reconnector
from kvstack.cache.tiers.pagecache import PageCache
from kvstack.cache.tiers.record import HEADER_BYTES, CorruptRecord, pack_header, payload_of
from support.cache import TierRecorder

T = TypeVar("T")

PAGE = mmap.PAGESIZE


def key(i: int, ns: bytes = b"k") -> ChunkKey:
    return ChunkKey(blake3(ns + str(i).encode()).digest())


def payload(i: int, size: int) -> bytes:
    return blake3(b"payload" + str(i).encode()).digest(length=size)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


# -- memory


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


# -- disk


def chunk_path(root: Path, k: ChunkKey) -> Path:
    text = k.hex()
    return root / text[:2] / f"{text}.kv"


def files(root: Path, pattern: str) -> list[Path]:
    return list(root.rglob(pattern))


def truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


@pytest.fixture(params=["page-cache-on-loop", "threads-only"])
async def disk(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[DiskTier]:
    """A disk tier that reads cached files on the loop (the default), and one that never does."""
    inline = 16 << 20 if request.param == "page-cache-on-loop" else 0
    tier = DiskTier(tmp_path / "kv", 1 << 20, inline_read_bytes=inline)
    await tier.start()
    yield tier
    await tier.close()


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


def drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)  # only clean pages can be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if cached(path):
        pytest.skip(f"{path.parent}'s file system keeps its files in memory (tmpfs): none can be dropped")


def cached(path: Path) -> bool | None:
    fd = os.open(path, os.O_RDONLY)
    try:
        return PageCache().resident(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


needs_cachestat = pytest.mark.skipif(
    not PageCache().available,
    reason="this kernel cannot say what is in the page cache (cachestat, Linux 6.5+)",
)


@needs_cachestat
def test_page_cache_says_whether_a_whole_file_is_cached(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(os.urandom(10 * PAGE + 1))
    assert cached(path) is True
    drop_from_page_cache(path)
    with open(path, "rb") as f:  # one page back is not the whole file
        f.read(PAGE)
    assert cached(path) is False
    path.read_bytes()
    assert cached(path) is True


def test_page_cache_stops_asking_where_the_system_cannot_answer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import ctypes
    import errno

    probe = PageCache()
    calls = 0

    def refused(*args: object) -> int:  # as a seccomp filter or a kernel before 6.5 answers
        nonlocal calls
        calls += 1
        ctypes.set_errno(errno.ENOSYS)
        return -1

    probe._call = refused
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    fd = os.open(path, os.O_RDONLY)
    try:
        with caplog.at_level(logging.INFO):
            assert probe.resident(fd, 100) is None and probe.resident(fd, 100) is None
        assert calls == 1 and not probe.available and "ENOSYS" in caplog.text
        probe = PageCache()
        if probe.available:  # a bad descriptor is one unknown answer, not the end of asking
            assert probe.resident(-1, 100) is None and probe.available
    finally:
        os.close(fd)


def counting_jobs(tier: DiskTier) -> list[int]:
    """Count the tier's thread jobs: the returned list holds the count."""
    pool = tier._pool
    assert pool is not None
    submit, jobs = pool.submit, [0]

    def counting_submit(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        jobs[0] += 1
        return submit(fn, *args, **kwargs)

    pool.submit = counting_submit  # type: ignore[method-assign]  # counts, then submits as before
    return jobs


@needs_cachestat
async def test_disk_reads_cached_files_on_the_loop_and_the_rest_in_its_threads(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20, inline_read_bytes=3 * (HEADER_BYTES + 5000))
    await tier.start()
    assert await tier.put_many([(key(i), payload(i, 5000)) for i in range(8)]) == 8
    jobs = counting_jobs(tier)
    for i in (1, 4):
        drop_from_page_cache(chunk_path(tmp_path, key(i)))
    # Cached files within the budget (three) are read on the loop; the dropped ones and the cached ones
    # over the budget go to the threads.
    got = await tier.get_many([key(i) for i in range(8)])
    assert [bytes(g or b"") for g in got] == [payload(i, 5000) for i in range(8)]
    assert tier.stats().page_cache_reads == 3 and tier.stats().hits == 8 and jobs[0] == 1
    # Everything is cached now: three on the loop, the other five in one job, whatever the order.
    got = await tier.get_many([key(i) for i in (7, 6, 5, 4, 3, 2, 1, 0)])
    assert all(g is not None for g in got) and tier.stats().page_cache_reads == 6 and jobs[0] == 2
    # A batch within the budget needs no thread at all.
    assert [bytes(g or b"") for g in await tier.get_many([key(4), key(1)])] == [
        payload(4, 5000),
        payload(1, 5000),
    ]
    assert tier.stats().page_cache_reads == 8 and jobs[0] == 2
    # Off: every read is the threads'.
    tier.inline_read_bytes = 0
    assert all(g is not None for g in await tier.get_many([key(0), key(1)]))
    assert tier.stats().page_cache_reads == 8 and jobs[0] == 3
    await tier.close()


async def test_disk_without_page_cache_answers_reads_everything_in_its_threads(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    tier._page_cache._call = None  # what a kernel before 6.5 leaves
    await tier.start()
    assert await tier.put_many([(key(i), payload(i, 500)) for i in range(4)]) == 4
    jobs = counting_jobs(tier)
    got = await tier.get_many([key(i) for i in range(5)])
    assert [None if g is None else bytes(g) for g in got] == [payload(i, 500) for i in range(4)] + [None]
    assert jobs[0] == 1 and tier.stats().page_cache_reads == 0
    await tier.close()


@needs_cachestat
async def test_disk_page_cache_reads_are_exported_and_a_missing_file_on_the_loop_is_a_miss(
    tmp_path: Path,
) -> None:
    from kvstack.cache.metrics import CacheMetrics

    disk = DiskTier(tmp_path / "d", 1 << 20)
    store = TieredStore([MemoryTier(1 << 20), disk])
    await store.start()
    assert await disk.put_many([(key(i), payload(i, 300)) for i in range(3)]) == 3
    chunk_path(disk.root, key(1)).unlink()  # gone behind the tier's back: a miss, and forgotten
    got = await disk.get_many([key(0), key(1), key(2)])
    assert [None if g is None else bytes(g) for g in got] == [payload(0, 300), None, payload(2, 300)]
    assert await disk.contains([key(1)]) == 0
    text = CacheMetrics(store).render().decode()
    assert 'kvstack_cache_page_cache_reads_total{tier="disk"} 2.0' in text.splitlines()
    assert 'kvstack_cache_page_cache_reads_total{tier="memory"}' not in text
    await store.stop()


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


async def test_disk_flipped_bytes_are_a_miss_deleted_and_counted(disk: DiskTier) -> None:
    for i, offset in enumerate([HEADER_BYTES + 777, 9, 20, 50]):  # payload, length, key, checksum
        await disk.put(key(i), payload(i, 2000))
        path = chunk_path(disk.root, key(i))
        raw = bytearray(path.read_bytes())
        raw[offset] ^= 0x01
        path.write_bytes(raw)
        assert await disk.get(key(i)) is None
        assert not path.exists()
        assert await disk.contains([key(i)]) == 0
    assert disk.stats().corrupt == 4 and disk.stats().entries == 0 and disk.stats().bytes == 0


async def test_disk_large_chunks_written_in_pieces_verify_and_catch_flips(tmp_path: Path) -> None:
    import xxhash

    from kvstack.cache.tiers.chunkfile import WRITE_PIECE as _WRITE_PIECE

    tier = DiskTier(tmp_path, 64 << 20)
    await tier.start()
    sizes = [_WRITE_PIECE - 1, _WRITE_PIECE, _WRITE_PIECE + 1, 2 * _WRITE_PIECE + 12345]
    data = {i: blake3(bytes([i])).digest(length=size) for i, size in enumerate(sizes)}
    assert await tier.put_many([(key(i), d) for i, d in data.items()]) == len(sizes)
    for i, d in data.items():
        raw = chunk_path(tier.root, key(i)).read_bytes()
        assert raw[HEADER_BYTES:] == d and raw[48:64] == xxhash.xxh3_128_digest(d)  # one-shot == pieces
        assert bytes(await tier.get(key(i)) or b"") == d
    # A flip in the second piece of a large chunk is caught like any other.
    path = chunk_path(tier.root, key(3))
    flipped = bytearray(path.read_bytes())
    flipped[HEADER_BYTES + _WRITE_PIECE + 100] ^= 0x40
    path.write_bytes(flipped)
    assert await tier.get(key(3)) is None and not path.exists() and tier.stats().corrupt == 1
    await tier.close()


async def test_disk_truncated_file_is_a_miss_and_deleted(disk: DiskTier) -> None:
    await disk.put(key(1), payload(1, 4000))
    path = chunk_path(disk.root, key(1))
    truncate(path, HEADER_BYTES + 1000)
    assert await disk.get(key(1)) is None and not path.exists()
    assert disk.stats().corrupt == 1


async def test_disk_start_cleans_temp_and_invalid_files_and_keeps_others(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    await tier.start()
    await tier.put(key(1), payload(1, 100))
    await tier.put(key(2), payload(2, 100))
    await tier.close()
    shard = chunk_path(tmp_path, key(1)).parent
    tmp = shard / f".{key(1).hex()}.123.0.tmp"
    tmp.write_bytes(b"half a chunk")
    truncated = chunk_path(tmp_path, key(2))
    truncated.write_bytes(truncated.read_bytes()[:-1])
    garbage = chunk_path(tmp_path, key(3))
    garbage.parent.mkdir(parents=True, exist_ok=True)
    garbage.write_bytes(b"not a record")
    misplaced = shard / f"{key(4).hex()}.kv"  # a valid name in the wrong directory
    misplaced.write_bytes(b"x" * 100)
    foreign = tmp_path / "README"
    foreign.write_text("not ours")
    again = DiskTier(tmp_path, 1 << 20)
    await again.start()
    assert again.stats().entries == 1
    assert not tmp.exists() and not truncated.exists() and not garbage.exists() and not misplaced.exists()
    assert foreign.exists()
    assert bytes(await again.get(key(1)) or b"") == payload(1, 100)
    await again.close()


def kill_test_payload(i: int, bases: list[bytes]) -> bytes:
    return i.to_bytes(8, "little") + bases[i % len(bases)]


def kill_test_bases() -> list[bytes]:
    return [blake3(b"base" + bytes([n])).digest(length=n << 18) for n in (1, 2, 4)]


# The writer runs the same payload functions as the checks below (their source, not an import of this
# module: importing pytest would cost each writer a second).
_WRITER_IMPORTS = """
from __future__ import annotations
import asyncio, sys
from blake3 import blake3
from kvstack.cache.keys import ChunkKey
from kvstack.cache.tiers.disk import DiskTier
"""
_WRITER = "\n".join(
    [_WRITER_IMPORTS, *(inspect.getsource(f) for f in (key, kill_test_payload, kill_test_bases))]
) + textwrap.dedent(
    """
    bases = kill_test_bases()
    def payload(i): return kill_test_payload(i, bases)

    async def main(root, first):
        tier = DiskTier(root, 1 << 40, fsync="data")  # a write spends most time with its temp file open
        await tier.start()
        i = first
        while True:
            await tier.put_many([(key(j), payload(j)) for j in range(i, i + 4)])
            i += 4
            if i == first + 8:
                print("writing", flush=True)

    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
    """
)


async def test_disk_kill_9_during_writes_never_serves_a_corrupt_chunk(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    per_round = 100_000  # round r writes chunks r * per_round, r * per_round + 1, ...
    rounds = temp_files_at_kill = 0
    # At least 3 kills, and more until one lands mid-write (a temp file is left): almost always at once.
    while rounds < 3 or (temp_files_at_kill == 0 and rounds < 8):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _WRITER, str(root), str(rounds * per_round), stdout=subprocess.PIPE
        )
        assert proc.stdout is not None
        assert await asyncio.wait_for(proc.stdout.readline(), 20) == b"writing\n"
        await asyncio.sleep(random.uniform(0.05, 0.2))
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        temp_files_at_kill += len(files(root, "*.tmp"))
        rounds += 1
    assert temp_files_at_kill > 0

    tier = DiskTier(root, 1 << 40)
    await tier.start()
    assert not files(root, "*.tmp")
    bases = kill_test_bases()
    served = 0
    for r in range(rounds):
        for i in range(r * per_round, r * per_round + 5_000):
            got = await tier.get(key(i))
            if got is not None:
                assert bytes(got) == kill_test_payload(i, bases), f"chunk {i} served with wrong content"
                served += 1
    assert served == tier.stats().entries == len(files(root, "*.kv")) >= rounds * 8
    assert tier.stats().corrupt == 0
    await tier.close()


# -- store


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


# -- announcements of a tier whose entries can vanish unseen (Redis, S3) ----------------------------------
def test_announcements_report_a_vanished_key_once_and_stay_bounded() -> None:
    heard = TierRecorder()
    tier = MemoryTier(1 << 20)
    tier.listener = heard
    announced = Announcements(tier, limit=3)
    keys = [key(i) for i in range(5)]
    announced.stored(keys)
    assert heard.stored_keys == keys and len(announced) == 3  # only the newest three are remembered
    announced.missing([keys[0], keys[3], key(99)])  # keys[0] was forgotten; key(99) never reported
    assert heard.removed_keys == [keys[3]]
    announced.missing([keys[3]])
    assert heard.removed_keys == [keys[3]]  # reported once
    announced.removed([keys[4]])
    assert heard.removed_keys == [keys[3], keys[4]] and len(announced) == 1
    announced.clear()
    announced.missing([keys[2]])
    assert heard.removed_keys == [keys[3], keys[4]] and len(announced) == 0
    tier.listener = None
    announced.stored([key(7)])  # nobody listens: nothing to remember
    assert len(announced) == 0


async def test_reconnector_probes_with_backoff_logs_changes_once_and_stops(
    caplog: pytest.LogCaptureFixture,
) -> None:
    answers: list[str | Exception | None] = [
        "refused",
        "refused",
        "no such bucket",
        RuntimeError("boom"),
        None,
    ]
    probed: list[float] = []
    loop = asyncio.get_running_loop()

    async def probe() -> str | None:
        probed.append(loop.time())
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    logger = logging.getLogger("kvstack.test.reconnector")
    link = Reconnector("tier t: service", probe, 0.01, 0.04, logger)
    link.start()
    with caplog.at_level(logging.WARNING, logger=logger.name):
        link.up = True
        link.down("refused")
        link.down("refused")  # already down: not logged again, one probing task
        assert not link.up
        for _ in range(200):
            if link.up:
                break
            await asyncio.sleep(0.01)
    assert link.up and len(probed) == 5
    gaps = [b - a for a, b in itertools.pairwise(probed)]
    assert gaps[1] >= 0.015 and gaps[2] >= 0.035  # 0.01 doubling, capped at 0.04
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "tier t: service unusable (refused); serving without it, retrying every <= 0.04s",
        "tier t: service still unusable: no such bucket",
        "tier t: service still unusable: RuntimeError: boom",  # an unexpected failure is a failed probe
        "tier t: service is reachable again",
    ]
    await link.stop()
    link.down("refused")  # stopped: no new probing
    await asyncio.sleep(0.05)
    assert len(probed) == 5 and not link.up


def test_payload_of_a_record_checks_every_byte_and_says_what_failed() -> None:
    key = ChunkKey(blake3(b"record").digest())
    payload = os.urandom(5000)
    record = pack_header(key, payload) + payload
    view = payload_of(key, bytearray(record))
    assert view.readonly and bytes(view) == payload
    assert bytes(payload_of(key, memoryview(record))) == payload
    flips = [
        (0, "bad magic"),
        (4, "unknown record version"),
        (8, "header says"),  # the payload length
        (16, "holds chunk"),  # the key
        (48, "payload checksum mismatch"),  # the stored checksum
        (HEADER_BYTES + 4321, "payload checksum mismatch"),  # a payload byte
    ]
    for at, reason in flips:
        broken = bytearray(record)
        broken[at] ^= 0x40
        with pytest.raises(CorruptRecord, match=reason):
            payload_of(key, broken)
    with pytest.raises(CorruptRecord, match="holds chunk"):
        payload_of(ChunkKey(blake3(b"another").digest()), record)
    with pytest.raises(CorruptRecord, match="shorter than its"):
        payload_of(key, record[:40])
    with pytest.raises(CorruptRecord, match="header says"):
        payload_of(key, record[:-1])
