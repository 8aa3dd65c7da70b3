"""What is in the page cache (`PageCache`, cachestat) and the disk tier's use of it: cached files read
on the loop, the rest in its threads, and the count of those reads exported."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from kvstack.cache import TieredStore
from kvstack.cache.tiers import DiskTier, MemoryTier
from kvstack.cache.tiers.pagecache import PageCache
from kvstack.cache.tiers.record import HEADER_BYTES
from support.cache import PAGE, chunk_path, counting_jobs, key, payload


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
