"""The local disk tier: one file per chunk under a byte budget, LRU, verified on every read.

Files: ``root/ab/<key hex>.kv``, a checksummed record plus the listener's note (``chunkfile``); at start the
directory is scanned to rebuild the index, oldest mtime first (``chunkdir``), then the budget is enforced.
``capacity_bytes`` bounds the sum of file sizes, counting writes in flight and the file a rewrite replaces
(until the rename); eviction deletes least recently used files first. A hit bumps its file's mtime.

Writes go to a temp file in the same directory, then ``os.replace`` onto the final name: a reader, or a
restart after ``kill -9``, sees the old file, the complete new one, or none; what survives a machine crash
depends on ``fsync`` (`FsyncPolicy`). A corrupt or truncated file is deleted, counted in ``corrupt`` and read
as a miss. Blocking file I/O runs in ``io_threads`` threads the tier starts in ``start`` and joins in
``close``; the index is only touched on the event loop. A full disk drops the write and lowers the budget
to what the tier holds, so later writes evict instead of failing (`DiskTier` says how reads are batched and
how the budget recovers).
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal, TypeVar

from kvstack.cache.keys import ChunkKey
from kvstack.cache.payload import Payload, byte_view
from kvstack.cache.tiers.base import Tier, TierStats, held_prefix
from kvstack.cache.tiers.chunkdir import remove_all, scan
from kvstack.cache.tiers.chunkfile import (
    chunk_path,
    file_bytes_of,
    fsync_dir,
    map_payload,
    note_footer,
    read_header,
    remove_file,
    start_writeback,
    temp_path,
    write_record,
)
from kvstack.cache.tiers.pagecache import PageCache
from kvstack.cache.tiers.record import CorruptRecord
from kvstack.logs import ThrottledLog

__all__ = ["DiskTier", "FsyncPolicy"]

log = logging.getLogger(__name__)

FsyncPolicy = Literal["never", "data", "always"]
"""What a ``put`` that returned True guarantees. ``never``: no fsync (a killed process loses nothing it
renamed; a machine crash may lose recent chunks or leave torn files, which the checksum rejects: a miss, not
bad data). ``data``: each file's data is synced before its rename (a crash right after the put may lose the
chunk, never corrupt it). ``always``: ``data`` plus an fsync of the directory after the rename (the chunk
survives a crash). A batch starts the writeback of all its files (``sync_file_range``) before syncing each, so
one journal commit covers most of it."""
_ANNOUNCE_BATCH = 256
_MIN_JOB_BYTES = 1 << 20
_READ_AHEAD = 16  # files of a read job opened and hinted together (bounds the descriptors a job holds)
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
_ROOM_RECHECK_S = 2.0  # while limited by a full file system: how often a put re-checks its free space
_WARN_EVERY_S = 10.0  # at most one warning per errno for failed writes
_T = TypeVar("_T")


@dataclass(slots=True, eq=False)
class _File:
    """An indexed chunk file; a new object per write, so a late failure of an old read cannot unindex it."""

    size: int


@dataclass(slots=True)
class _Read:
    data: memoryview | None = None
    file_bytes: int = 0
    corrupt: str | None = None  # why the file was deleted
    error: OSError | None = None


@dataclass(slots=True)
class _Write:
    file_bytes: int
    error: OSError | None = None


@dataclass(slots=True)
class _PendingWrite:
    """A put accepted on the loop: its bytes are reserved and the index entries it evicted are gone."""

    key: ChunkKey
    payload: memoryview
    note: bytes | None
    file_bytes: int
    replaced_bytes: int  # the indexed file it replaces (0: none), on the disk until the rename
    doomed: list[ChunkKey]


class DiskTier(Tier):
    """Chunk files under ``root`` within ``capacity_bytes``; see the module docstring.

    Reads: a hit is a read-only view of the mapped payload, no copy (see `chunkfile.map_payload`). A job
    opens and hints (``POSIX_FADV_WILLNEED``) up to 16 files before reading the first, so cold files are
    fetched together. Files wholly in the page cache (``cachestat``, see `pagecache`) are read on the event
    loop, up to ``inline_read_bytes`` per call (0: never); the rest, and all other blocking file I/O, run in
    the ``io_threads`` threads, a batch cut into at most ``io_threads`` jobs of at least 1 MiB.

    Full disk (a write fails with ``ENOSPC`` or ``EDQUOT``): that write is dropped and the limit
    (`limit_bytes`) drops to the bytes the tier holds, so later writes evict the oldest chunks instead of
    failing too. While limited, a put with no other write in flight re-checks the free space (``statvfs``,
    at most every 2 s) and raises the limit to the tier's files plus what is free, up to ``capacity_bytes``.
    (A quota is invisible to ``statvfs``: an exhausted one costs a dropped write per re-check.) Failed writes
    are logged at most once per 10 s per errno, with how many were not.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        fsync: FsyncPolicy = "never",
        io_threads: int = 2,
        inline_read_bytes: int = 16 << 20,
        name: str = "disk",
    ) -> None:
        if fsync not in ("never", "data", "always"):
            raise ValueError(f"fsync must be never, data or always, got {fsync!r}")
        if capacity_bytes < 0 or io_threads < 1 or inline_read_bytes < 0:
            raise ValueError(
                "need capacity_bytes >= 0, io_threads >= 1, inline_read_bytes >= 0; "
                f"got {capacity_bytes}, {io_threads}, {inline_read_bytes}"
            )
        self.name = name
        self.root = Path(root)
        self._root = os.fspath(self.root)
        self.capacity_bytes = capacity_bytes
        self.fsync: FsyncPolicy = fsync
        self._io_threads = io_threads
        self.inline_read_bytes = inline_read_bytes
        self._page_cache = PageCache()  # asked on the event loop only
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: set[asyncio.Future[Any]] = set()
        self._index: OrderedDict[ChunkKey, _File] = OrderedDict()  # LRU first
        self._used = 0  # file bytes indexed
        self._reserved = 0  # file bytes of writes in flight
        self._limit = capacity_bytes  # lower while the file system is full
        self._recheck_at = 0.0  # monotonic time of the next free-space check while limited
        self._tmp_seq = itertools.count()
        self._stats = TierStats(capacity_bytes=capacity_bytes)
        self._page_cache_reads = 0
        self._write_warnings: dict[int | None, ThrottledLog] = {}  # by errno

    @property
    def limit_bytes(self) -> int:
        """The budget in effect: ``capacity_bytes``, or less while the file system is full."""
        return self._limit

    # -- lifecycle

    async def start(self) -> None:
        if self._pool is not None:
            return
        self._pool = ThreadPoolExecutor(self._io_threads, thread_name_prefix=f"kvstack-{self.name}")
        found = await self._run(partial(scan, self.root, self.name))
        self._index = OrderedDict((key, _File(size)) for key, size in found)
        self._used = sum(file.size for file in self._index.values())
        doomed = self._evict_for(0)
        if doomed:
            await self._run(lambda: self._unlink_all(doomed))
        log.info(
            "disk tier %s: %d chunks (%d bytes) in %s", self.name, len(self._index), self._used, self.root
        )

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        # Jobs finish before the pool goes (a write is never cut in half), then its idle threads are joined.
        await asyncio.gather(*self._inflight, return_exceptions=True)
        pool.shutdown(wait=True)

    # -- Tier interface

    async def contains(self, keys: Sequence[bytes]) -> int:
        return self.contains_now(keys)

    def contains_now(self, keys: Sequence[bytes]) -> int:
        return held_prefix(keys, self._index)

    async def get(self, key: ChunkKey) -> Payload | None:
        return (await self.get_many([key]))[0]

    async def get_many(self, keys: Sequence[ChunkKey]) -> list[Payload | None]:
        files: dict[ChunkKey, _File] = {}
        for key in keys:
            file = self._index.get(key)
            if file is not None:
                self._index.move_to_end(key)
                files[key] = file
        if files and self._pool is None:  # before any file is opened
            raise RuntimeError(f"disk tier {self.name} is not started")
        reads: dict[ChunkKey, _Read] = {}
        cached, uncached = self._sort_by_residency(files, reads)
        parts = list(_slices(uncached, self._jobs(sum(files[key].size for key in uncached))))
        jobs = [self._submit(partial(self._read_batch, part)) for part in parts]  # the threads start now
        for i, (key, fd) in enumerate(cached):
            try:
                reads[key] = self._read_file(key, fd, cached=True)
            except BaseException:
                for _, left in cached[i + 1 :]:
                    os.close(left)
                raise
            if reads[key].data is not None:
                self._page_cache_reads += 1
        for part, results in zip(
            parts, await asyncio.gather(*(asyncio.shield(job) for job in jobs)), strict=True
        ):
            reads.update(zip(part, results, strict=True))
        out: list[Payload | None] = []
        for key in keys:
            read = reads.get(key)
            if read is not None and read.data is not None:
                self._stats.hits += 1
                out.append(read.data)
                continue
            self._stats.misses += 1
            out.append(None)
            if read is not None:
                del reads[key]  # a key asked twice is reported once
                self._drop_failed_read(key, files[key], read)
        return out

    def _drop_failed_read(self, key: ChunkKey, file: _File, read: _Read) -> None:
        if read.corrupt is not None:
            self._stats.corrupt += 1
            log.warning("disk tier %s: deleted corrupt chunk %s (%s)", self.name, key.hex(), read.corrupt)
        if read.error is not None:
            self._stats.errors += 1
            log.warning("disk tier %s: cannot read chunk %s: %s", self.name, key.hex(), read.error)
        if self._index.get(key) is file:
            self._forget(key)
            if self.listener is not None:
                self.listener.removed(self, (key,))

    async def put(self, key: ChunkKey, data: Payload) -> bool:
        return await self.put_many([(key, data)]) == 1

    async def put_many(self, items: Sequence[tuple[ChunkKey, Payload]]) -> int:
        if self._pool is None:
            raise RuntimeError(f"disk tier {self.name} is not started")
        pending = [write for key, data in items if (write := self._accept(key, data)) is not None]

        jobs = [
            self._run(partial(self._write_batch, part), partial(self._settle_batch, part))
            for part in _slices(pending, self._jobs(sum(write.file_bytes for write in pending)))
        ]
        return sum(result.error is None for results in await asyncio.gather(*jobs) for result in results)

    def _accept(self, key: ChunkKey, data: Payload) -> _PendingWrite | None:
        """Reserve room for one put (evicting from the index), or count it dropped and return None."""
        if self._limit < self.capacity_bytes and not self._reserved and time.monotonic() >= self._recheck_at:
            self._recheck_room()
        payload = byte_view(data)
        note = None if self.listener is None else self.listener.annotation(key)
        file_bytes = file_bytes_of(payload.nbytes, note)
        # Too big, or writes in flight hold the room, or the file system is full and nothing is left to evict.
        if self._reserved + file_bytes > self._limit:
            self._stats.write_drops += 1
            return None
        old = self._index.get(key)
        replaced_bytes = 0 if old is None else old.size
        self._forget(key)  # replaced below; its file is reserved with the new one until the rename
        doomed = self._evict_for(file_bytes + replaced_bytes)
        self._reserved += file_bytes + replaced_bytes
        if doomed and self.listener is not None:
            self.listener.removed(self, doomed)
        return _PendingWrite(key, payload, note, file_bytes, replaced_bytes, doomed)

    def _settle_batch(self, writes: Sequence[_PendingWrite], results: list[_Write] | None) -> None:
        """Index (or count as dropped) each finished write; None: the whole job failed unexpectedly."""
        for i, write in enumerate(writes):
            self._settle(write, None if results is None else results[i])

    def _settle(self, write: _PendingWrite, result: _Write | None) -> None:
        key = write.key
        self._reserved -= write.file_bytes + write.replaced_bytes
        if result is None or result.error is not None:
            self._stats.errors += 1
            self._stats.write_drops += 1
            error = None if result is None else result.error
            if error is not None and error.errno in _FULL:
                self._file_system_full()
            self._warn_failed_write(key, error)
            if write.replaced_bytes and key not in self._index and self.listener is not None:
                self.listener.removed(self, (key,))
            return
        self._forget(key)  # a concurrent put of the same key may have finished first
        self._index[key] = _File(write.file_bytes)
        self._used += write.file_bytes
        self._stats.writes += 1
        if self.listener is not None:
            self.listener.stored(self, (key,))

    async def announce_held(self) -> int:
        """Hand every indexed chunk that carries a note to ``listener.restored``, oldest first, in batches
        read in the tier's threads (the index may change meanwhile: chunks gone by then are skipped)."""
        listener = self.listener
        if listener is None:
            return 0
        keys = list(self._index)
        announced = 0
        for start in range(0, len(keys), _ANNOUNCE_BATCH):
            part = keys[start : start + _ANNOUNCE_BATCH]
            notes = await self._run(partial(self._read_notes, part))
            items = [(k, n) for k, n in zip(part, notes, strict=True) if n is not None and k in self._index]
            listener.restored(self, items, False)
            announced += len(items)
        listener.restored(self, [], True)
        return announced

    async def delete(self, key: ChunkKey) -> bool:
        """Remove ``key``; False when it was not indexed, or its file could not be deleted (then it stays
        indexed, as it stays on the disk and would come back with a restart)."""
        file = self._index.get(key)
        if file is None:
            return False
        if not await self._run(partial(remove_file, self._path(key))):
            self._stats.errors += 1
            return False
        if self._index.get(key) is file:  # not evicted, failed or rewritten meanwhile
            self._forget(key)
            if self.listener is not None:
                self.listener.removed(self, (key,))
        return True

    async def clear(self) -> None:
        self._index.clear()
        self._used = 0
        await self._run(partial(remove_all, self.root))

    def stats(self) -> TierStats:
        stats = self._stats.copy()
        stats.bytes = self._used + self._reserved
        stats.entries = len(self._index)
        stats.page_cache_reads = self._page_cache_reads
        return stats

    # -- index (event loop only)

    def _forget(self, key: ChunkKey) -> None:
        file = self._index.pop(key, None)
        if file is not None:
            self._used -= file.size

    def _evict_for(self, file_bytes: int) -> list[ChunkKey]:
        """Drop LRU entries from the index until ``file_bytes`` more fit (or the index is empty); returns the
        keys whose files to delete."""
        doomed: list[ChunkKey] = []
        while self._index and self._used + self._reserved + file_bytes > self._limit:
            key, file = self._index.popitem(last=False)
            self._used -= file.size
            doomed.append(key)
        self._stats.evictions += len(doomed)
        return doomed

    def _file_system_full(self) -> None:
        """A write found the file system full. It held what the tier holds now, so that is the limit from
        here on (the oldest chunks make room for new ones) until `_recheck_room` finds free space."""
        self._limit = min(self._limit, self._used + self._reserved)
        self._recheck_at = time.monotonic() + _ROOM_RECHECK_S
        log.debug("disk tier %s: file system full: limit %d bytes", self.name, self._limit)

    def _warn_failed_write(self, key: ChunkKey, error: OSError | None) -> None:
        """At most one warning per ``_WARN_EVERY_S`` per errno, with how many were not logged."""
        kind = None if error is None else error.errno
        warnings = self._write_warnings.get(kind)
        if warnings is None:
            warnings = self._write_warnings[kind] = ThrottledLog(log, _WARN_EVERY_S)
        why = "unexpected failure" if error is None else str(error)
        if kind in _FULL:
            why += (
                f"; keeping to the {self._limit} bytes it holds (budget {self.capacity_bytes}), evicting"
                f" the oldest chunks for new ones, until {self.root} has free space again (checked every"
                f" {_ROOM_RECHECK_S:g}s)"
            )
        warnings.warning("disk tier %s: cannot write chunk %s: %s", self.name, key.hex(), why)

    def _recheck_room(self) -> None:
        """While limited, with no write in flight (so no file half written or evicted but not yet deleted):
        the limit becomes what the tier's files take plus what the file system has free."""
        self._recheck_at = time.monotonic() + _ROOM_RECHECK_S
        try:
            free = _free_bytes(self._root)
        except OSError as e:
            log.debug("disk tier %s: cannot check free space: %s", self.name, e)
            return
        self._limit = min(self.capacity_bytes, self._used + free)
        log.debug("disk tier %s: %d bytes free: limit %d bytes", self.name, free, self._limit)
        if self._limit == self.capacity_bytes:
            log.info(
                "disk tier %s: %s has room again: back to the full %d-byte budget",
                self.name,
                self.root,
                self._limit,
            )

    def _jobs(self, nbytes: int) -> int:
        """How many jobs to cut a batch of ``nbytes`` into: at most ``io_threads``, each of at least
        ``_MIN_JOB_BYTES`` (see the class docstring)."""
        return max(1, min(self._io_threads, nbytes // _MIN_JOB_BYTES))

    async def _run(self, job: Callable[[], _T], settle: Callable[[_T | None], None] | None = None) -> _T:
        """Run ``job`` in the tier's threads; ``settle`` sees its result (None if it raised) on the loop,
        whether or not the awaiting task is cancelled meanwhile."""
        return await asyncio.shield(self._submit(job, settle))

    def _submit(
        self, job: Callable[[], _T], settle: Callable[[_T | None], None] | None = None
    ) -> asyncio.Future[_T]:
        """Hand ``job`` to the tier's threads now (see `_run`); await the future shielded, so a cancelled
        caller leaves it in ``_inflight`` until it ends (``close`` waits for it)."""
        if self._pool is None:
            raise RuntimeError(f"disk tier {self.name} is not started")
        future = asyncio.get_running_loop().run_in_executor(self._pool, job)
        self._inflight.add(future)
        future.add_done_callback(self._inflight.discard)
        if settle is not None:
            future.add_done_callback(
                lambda f: settle(None if f.cancelled() or f.exception() is not None else f.result())
            )
        return future

    def _sort_by_residency(
        self, files: dict[ChunkKey, _File], reads: dict[ChunkKey, _Read]
    ) -> tuple[list[tuple[ChunkKey, int]], list[ChunkKey]]:
        """The files to read on the loop (wholly in the page cache, within ``inline_read_bytes``; each with
        its open descriptor) and the keys to read in the threads. A file that cannot be opened goes into
        ``reads`` as what its read would have been."""
        budget = self.inline_read_bytes
        if not budget or not self._page_cache.available:
            return [], list(files)
        cached: list[tuple[ChunkKey, int]] = []
        uncached: list[ChunkKey] = []
        for key, file in files.items():
            if file.size > budget:
                uncached.append(key)
                continue
            fd = self._open_for_read(key)
            if not isinstance(fd, int):
                reads[key] = fd
            elif self._page_cache.resident(fd, file.size):
                cached.append((key, fd))
                budget -= file.size
            else:
                os.close(fd)  # the thread reopens it: ~2 µs, against a read from the disk
                uncached.append(key)
        return cached, uncached

    # -- files (tier threads only)

    def _path(self, key: ChunkKey) -> str:
        return chunk_path(self._root, key)

    def _tmp_path(self, key: ChunkKey) -> str:
        return temp_path(self._root, key, next(self._tmp_seq))

    def _read_batch(self, keys: Sequence[ChunkKey]) -> list[_Read]:
        """Read ``keys`` in windows of ``_READ_AHEAD`` files: all of a window are opened and asked for
        (``POSIX_FADV_WILLNEED``) before the first is mapped, so cold files are read from the disk together
        (the device gets the window at once, not one file after the other); for a file already in the page
        cache the hint costs a lookup (~1 µs)."""
        reads: list[_Read] = []
        for start in range(0, len(keys), _READ_AHEAD):
            window = keys[start : start + _READ_AHEAD]
            opened = [self._open_for_read(key) for key in window]
            for fd in opened:
                if isinstance(fd, int):
                    with suppress(OSError):
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            reads += [
                self._read_file(key, fd) if isinstance(fd, int) else fd
                for key, fd in zip(window, opened, strict=True)
            ]
        return reads

    def _open_for_read(self, key: ChunkKey) -> int | _Read:
        """An open descriptor of ``key``'s file, or the `_Read` that says why there is none."""
        try:
            return os.open(self._path(key), os.O_RDONLY)
        except FileNotFoundError:
            return _Read()
        except OSError as e:
            return _Read(error=e)

    def _write_batch(self, writes: Sequence[_PendingWrite]) -> list[_Write]:
        """Write each chunk to a temp file, sync it as the policy says, rename it into place."""
        results = [_Write(write.file_bytes) for write in writes]
        synced = self.fsync != "never"
        written: list[tuple[_Write, str, str, int]] = []  # result, temp path, final path, fd
        for write, result in zip(writes, results, strict=True):
            self._unlink_all(write.doomed)
            path = self._path(write.key)
            tmp = self._tmp_path(write.key)
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except OSError as e:
                self._failed_write(result, e, path)
                continue
            note = write.note
            tail = [] if note is None else [memoryview(note), memoryview(note_footer(note))]
            try:
                write_record(fd, write.key, write.payload, tail)
                if synced:
                    start_writeback(fd)
            except OSError as e:
                os.close(fd)
                self._failed_write(result, e, path, tmp)
                continue
            written.append((result, tmp, path, fd))
        # Every file's writeback was started above, so the first fdatasync's journal commit covers most of
        # the batch and the others mostly wait for data already on its way: not one commit per file.
        renamed: list[tuple[_Write, str]] = []
        for result, tmp, path, fd in written:
            try:
                try:
                    if synced:
                        os.fdatasync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, path)
            except OSError as e:
                self._failed_write(result, e, path, tmp)
                continue
            renamed.append((result, path))
        if self.fsync == "always":
            for parent in {os.path.dirname(path) for _, path in renamed}:
                try:
                    fsync_dir(parent)
                except OSError as e:
                    for result, path in renamed:
                        if os.path.dirname(path) == parent:
                            self._failed_write(result, e, path)
        return results

    def _read_notes(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        notes: list[bytes | None] = []
        for key in keys:
            try:
                with open(self._path(key), "rb", buffering=0) as f:
                    notes.append(read_header(f.fileno(), key)[3])
            except (OSError, CorruptRecord):  # gone, or invalid: its next read deletes it
                notes.append(None)
        return notes

    def _failed_write(self, result: _Write, error: OSError, path: str, tmp: str | None = None) -> None:
        result.error = error
        if tmp is not None:
            remove_file(tmp)
        remove_file(path)  # an older version is no longer indexed: do not leave it behind

    def _read_file(self, key: ChunkKey, fd: int, cached: bool = False) -> _Read:
        """Map, verify and close ``fd``, the open file of ``key`` (``cached``: see `map_payload`); a corrupt
        file is deleted."""
        try:
            data, file_bytes = map_payload(key, fd, cached=cached)
            with suppress(OSError):  # recency is a hint; a read-only disk still serves
                os.utime(fd)
            return _Read(data=data, file_bytes=file_bytes)
        except CorruptRecord as e:
            remove_file(self._path(key))
            return _Read(corrupt=str(e))
        except OSError as e:
            return _Read(error=e)
        finally:
            os.close(fd)

    def _unlink_all(self, keys: Sequence[ChunkKey]) -> None:
        for key in keys:
            remove_file(self._path(key))


def _free_bytes(path: str) -> int:
    """Bytes an unprivileged writer can still add to ``path``'s file system (0 when it is out of inodes)."""
    st = os.statvfs(path)
    if st.f_files and not st.f_favail:  # some file systems (btrfs) report no inode counts at all
        return 0
    return st.f_bavail * st.f_frsize


def _slices(items: Sequence[_T], n: int) -> Iterator[Sequence[_T]]:
    """``items`` cut into at most ``n`` contiguous, non-empty slices of near-equal length."""
    n = min(n, len(items))
    for i in range(n):
        yield items[len(items) * i // n : len(items) * (i + 1) // n]
