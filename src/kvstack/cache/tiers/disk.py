"""The local disk tier: one file per chunk under a byte budget, LRU, verified on every read.

Layout: ``root/ab/<64 hex digits>.kv`` where ``ab`` is the first byte of the key: 256 shard directories, all
created by ``start`` so a write never creates a directory (ext4's hashed directories hold hundreds of
thousands of entries each). A file is one `record` (64-byte header with magic, version, length, key and
xxh3_128 of the payload, then the payload), optionally followed by a note: the listener's ``annotation`` of
the chunk (for the cache server: its parent key and token ids), then a 16-byte footer (the note's length,
its xxh3_64, ``b"KVNT"``). The note is what ``announce_held`` hands back after a restart; a note that fails
its checksum only keeps the chunk from being announced, a broken footer makes the file invalid. (Files
with a note are deleted as invalid by builds before notes existed.)

Writes go to ``.<hex>.<pid>.<n>.tmp`` in the same directory, then ``os.replace`` onto the final name, so a
reader (or a restart after ``kill -9``) sees either the old file, the complete new one, or none: a chunk is
never served partial or corrupt whatever the policy (the checksum is verified on every read). What a
``put`` that returned True guarantees, by ``fsync`` policy:

- ``never``: no fsync. A killed process loses nothing it renamed (the page cache survives it); a machine
  crash or power loss may lose any chunk written since the kernel last wrote back (ext4: up to ~30 s), or
  leave its file empty or torn, which the checksum rejects on read (a miss, not bad data).
- ``data``: each file's data is on the disk (``fdatasync``) before it is renamed, so a chunk survives a
  machine crash if its name does; the rename itself is not synced (it reaches the disk with the file
  system's next journal commit, ext4: within ~5 s), so a crash right after the put may lose the chunk,
  never corrupt it.
- ``always``: ``data`` plus an fsync of the directory after the rename: the chunk survives a machine crash.

A batch (``put_many``) writes all its temp files first and starts their writeback together
(``sync_file_range``), then ``fdatasync`` s and renames each: the guarantees above hold per file, but one
journal commit covers most of the batch instead of one commit per file (with ``always``, each directory is
synced once per batch).

Reads open the files of a job (up to 16 at a time) and hint each (``POSIX_FADV_WILLNEED``) before reading the
first, so cold files are fetched from the disk together; then each file is mapped read-only and the header,
the length against the file size and the checksum are checked on the mapping (in the threads, the checksum
pass faults the pages in as they arrive; a file known to be cached, read on the loop, is mapped with
``MAP_POPULATE``, see `_read_file`); a hit returns a read-only view of the mapped payload, with no copy and no
zeroed buffer. (Tried and dropped: ``pread`` into a new ``bytes``, ~5x slower in the tier's threads, as glibc
hands each thread's freed buffers back to the OS and every read faults in fresh pages; ``preadv`` into reused
pooled buffers, no faster than mapping at 1 MiB and slower in the tier's two threads, though it saves ~25% per
64 KiB file.) The view keeps its mapping alive, and the tier never changes a file in place (it replaces by
rename and deletes by unlink), so a view already returned keeps the verified bytes even if the chunk is later
evicted, deleted or rewritten: the mapping holds the old inode. Something else truncating a chunk file in
place while a view is held would make reading that view fault (SIGBUS). A corrupt or truncated file is
deleted, counted in ``corrupt`` and read as a miss. A hit also bumps the file's mtime, which is the LRU order
a restart recovers.

Start: the directory is scanned (in the tier's threads) to rebuild the index: temp files are deleted, ``.kv``
files whose name, header or note footer is invalid are deleted, the rest are indexed oldest mtime first;
then the budget is enforced. ``capacity_bytes`` bounds the sum of file sizes (header and note included),
counting writes in flight and the file a rewrite replaces (until the rename); eviction deletes least recently
used files first.

Full disk (a write fails with ``ENOSPC`` or ``EDQUOT``: a budget larger than the file system, or a disk shared
with other data): that write is dropped and the tier lowers its limit (``limit_bytes``) to the bytes it holds
at that moment, so each later write evicts the oldest chunks to make room instead of failing too. While
limited, a put with no other write in flight re-checks the free space (``statvfs``, at most every 2 s) and
sets the limit to what the tier's files take plus what is free, never above ``capacity_bytes``: space freed
by others is used again. (A quota is not visible to ``statvfs``: an exhausted one costs one dropped write
per re-check.) Failed writes are logged at most once per 10 s per errno, with how many were not.

Page-cache hits are read on the event loop: before a ``get_many`` hands files to its threads, the tier asks
the kernel (``cachestat``, Linux 6.5+, see `pagecache`) whether each file is wholly in the page cache, and
reads those on the loop, up to ``inline_read_bytes`` per call (16 MiB: ~2 ms of the loop at this machine's
memory speed; 0 turns it off), while its threads read the rest. Mapping and checksumming a cached file is a
memory read, like a memory-tier hit, and a thread hop costs about as much as a cached MiB (measured
2026-12-03 on warm 1 MiB files, batches of 8: 5.4-7.6 GB/s through the threads, 7.5-9.3 on the loop, against
dd's 8.3-8.8). A page evicted between the question and the read is read from the disk on the loop: rare, and
bounded by the budget. Without ``cachestat`` every read goes to the threads.

All other blocking file I/O runs in a thread pool the tier creates in ``start`` and shuts down (joining its
threads) in ``close``; a ``get_many``/``put_many`` batch is cut into at most ``io_threads`` jobs of at least 1
MiB each: a job's hop through the pool (~70 µs here, ~170 µs for two gathered) costs more than a small file's
I/O, while two jobs of 4 MiB each read 1.4x faster than one of 8 MiB when the other core is free (0.87x when
it is not). The index itself is only touched on the event loop.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import functools
import itertools
import logging
import mmap
import os
import re
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

import xxhash

from kvstack.cache.keys import ChunkKey
from kvstack.cache.payload import Payload, byte_view
from kvstack.cache.tiers.base import Tier, TierStats, held_prefix
from kvstack.cache.tiers.pagecache import PageCache
from kvstack.cache.tiers.record import (
    HEADER_BYTES,
    CorruptRecord,
    checksum_pieces,
    pack_header,
    payload_length,
    verify_record,
)
from kvstack.logs import ThrottledLog

__all__ = ["DiskTier", "FsyncPolicy"]

log = logging.getLogger(__name__)

FsyncPolicy = Literal["never", "data", "always"]
_SUFFIX = ".kv"
_NAME = re.compile(r"[0-9a-f]{64}\.kv")
_SHARDS = [f"{n:02x}" for n in range(256)]
_SYNC_FILE_RANGE_WRITE = 2
_NOTE_FOOTER = struct.Struct("<I8s4s")  # note length, xxh3_64 of the note, magic
_NOTE_MAGIC = b"KVNT"
_ANNOUNCE_BATCH = 256
_MIN_JOB_BYTES = 1 << 20
_WRITE_PIECE = 1 << 20  # fits the L2 cache with room to spare
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux
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
    """Chunk files under ``root`` within ``capacity_bytes``; see the module docstring."""

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
        found = await self._run(self._scan)
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
        file_bytes = HEADER_BYTES + payload.nbytes + (0 if note is None else len(note) + _NOTE_FOOTER.size)
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
        if not await self._run(partial(self._unlink, self._path(key))):
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
        await self._run(self._remove_everything)

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
        ``_MIN_JOB_BYTES`` (see the module docstring)."""
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
        # A plain string: building a pathlib.Path costs ~6 µs here, as much as opening the file.
        text = key.hex()
        return f"{self._root}/{text[:2]}/{text}{_SUFFIX}"

    def _tmp_path(self, key: ChunkKey) -> str:
        text = key.hex()
        return f"{self._root}/{text[:2]}/.{text}.{os.getpid()}.{next(self._tmp_seq)}.tmp"

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
            tail = [] if note is None else [memoryview(note), memoryview(_note_footer(note))]
            try:
                _write_record(fd, write.key, write.payload, tail)
                if synced:
                    _start_writeback(fd)
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
                    _fsync_dir(parent)
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
                    notes.append(_read_header(f.fileno(), key)[3])
            except (OSError, CorruptRecord):  # gone, or invalid: its next read deletes it
                notes.append(None)
        return notes

    def _failed_write(self, result: _Write, error: OSError, path: str, tmp: str | None = None) -> None:
        result.error = error
        if tmp is not None:
            self._unlink(tmp)
        self._unlink(path)  # an older version is no longer indexed: do not leave it behind

    def _read_file(self, key: ChunkKey, fd: int, cached: bool = False) -> _Read:
        """Map, verify and close ``fd``, the open file of ``key``; ``cached``: all its pages are in the page
        cache, so the mapping's page table is filled in the map call (``MAP_POPULATE``) instead of by one
        fault per few pages during the checksum pass (warm 1-16 MiB files read back from the disk: 1.15-1.35x
        here; files the tier wrote itself, in larger folios, fault cheaply either way)."""
        flags = mmap.MAP_SHARED | (_MAP_POPULATE if cached else 0)
        try:
            file_bytes = os.lseek(fd, 0, os.SEEK_END)  # the size, without building a stat result
            if file_bytes < HEADER_BYTES:
                raise CorruptRecord(f"file of {file_bytes} bytes, shorter than a {HEADER_BYTES}-byte header")
            mapping = mmap.mmap(fd, file_bytes, flags=flags, prot=mmap.PROT_READ)
            data = _verified_payload(key, mapping)
            with suppress(OSError):  # recency is a hint; a read-only disk still serves
                os.utime(fd)
            return _Read(data=data, file_bytes=file_bytes)
        except CorruptRecord as e:
            self._unlink(self._path(key))
            return _Read(corrupt=str(e))
        except OSError as e:
            return _Read(error=e)
        finally:
            os.close(fd)

    def _unlink_all(self, keys: Sequence[ChunkKey]) -> None:
        for key in keys:
            self._unlink(self._path(key))

    @staticmethod
    def _unlink(path: str | Path) -> bool:
        """Delete ``path``; False (logged) when it is still there."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("cannot delete %s: %s", path, e)
            return False
        return True

    def _shard_dirs(self) -> list[Path]:
        return _subdirs(self.root)

    def _scan(self) -> list[tuple[ChunkKey, int]]:
        """Creates the shard directories; returns every valid chunk file as (key, bytes), oldest mtime first;
        deletes temp and invalid files."""
        self.root.mkdir(parents=True, exist_ok=True)
        for name in _SHARDS:
            (self.root / name).mkdir(exist_ok=True)
        found: list[tuple[int, ChunkKey, int]] = []
        for shard in self._shard_dirs():
            with os.scandir(shard) as it:
                for entry in it:
                    if entry.name.endswith(".tmp"):
                        self._unlink(Path(entry.path))
                    elif entry.name.endswith(_SUFFIX) and entry.is_file(follow_symlinks=False):
                        chunk = self._check_header(Path(entry.path), entry.name, shard)
                        if chunk is not None:
                            found.append(chunk)
        found.sort(key=lambda item: item[0])
        return [(key, size) for _, key, size in found]

    def _check_header(self, path: Path, name: str, shard: Path) -> tuple[int, ChunkKey, int] | None:
        key = ChunkKey.from_hex(name[:64]) if _NAME.fullmatch(name) else None
        try:
            if key is None or os.path.dirname(self._path(key)) != os.fspath(shard):
                raise CorruptRecord("not a chunk file name, or in the wrong directory")
            with open(path, "rb", buffering=0) as f:
                file_bytes = _read_header(f.fileno(), key, read_note=False)[2]
                mtime_ns = os.fstat(f.fileno()).st_mtime_ns
        except CorruptRecord as e:
            log.warning("disk tier %s: deleting invalid chunk file %s (%s)", self.name, path, e)
            self._unlink(path)
            return None
        except OSError as e:
            log.warning("disk tier %s: skipping unreadable %s (%s)", self.name, path, e)
            return None
        return mtime_ns, key, file_bytes

    def _remove_everything(self) -> None:
        for shard in self._shard_dirs():
            with os.scandir(shard) as it:
                for entry in it:
                    if entry.name.endswith((_SUFFIX, ".tmp")):
                        self._unlink(Path(entry.path))


def _subdirs(path: Path) -> list[Path]:
    try:
        with os.scandir(path) as it:
            return [Path(e.path) for e in it if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []


def _free_bytes(path: str) -> int:
    """Bytes an unprivileged writer can still add to ``path``'s file system (0 when it is out of inodes)."""
    st = os.statvfs(path)
    if st.f_files and not st.f_favail:  # some file systems (btrfs) report no inode counts at all
        return 0
    return st.f_bavail * st.f_frsize


def _read_header(fd: int, key: ChunkKey, *, read_note: bool = True) -> tuple[bytes, int, int, bytes | None]:
    """(header, payload length, file bytes, note) of an open chunk file; raises `CorruptRecord` when the
    header or the note's footer is invalid or the file size disagrees with them. The note is read (and its
    checksum checked) only with ``read_note``."""
    file_bytes = os.fstat(fd).st_size
    header = os.pread(fd, HEADER_BYTES, 0)
    length = payload_length(key, header)
    record_end = HEADER_BYTES + length
    if file_bytes < record_end:
        raise CorruptRecord(f"header says {length} payload bytes, the file holds {file_bytes - HEADER_BYTES}")
    if record_end == file_bytes:
        return header, length, file_bytes, None
    footer = os.pread(fd, _NOTE_FOOTER.size, file_bytes - _NOTE_FOOTER.size)
    note_bytes = _note_bytes(footer, file_bytes - record_end)
    if not read_note:
        return header, length, file_bytes, None
    note = os.pread(fd, note_bytes, record_end)
    if _note_footer(note) != footer:
        raise CorruptRecord("the chunk's note fails its checksum")
    return header, length, file_bytes, note


def _note_footer(note: bytes) -> bytes:
    return _NOTE_FOOTER.pack(len(note), xxhash.xxh3_64_digest(note), _NOTE_MAGIC)


def _note_bytes(footer: bytes | memoryview, trailing: int) -> int:
    """The length of the note whose footer is ``footer``, given ``trailing`` bytes after the record;
    raises `CorruptRecord` unless they are exactly a note and its footer."""
    if trailing < _NOTE_FOOTER.size or len(footer) != _NOTE_FOOTER.size:
        raise CorruptRecord(f"{trailing} bytes after the record, not a note")
    length, _, magic = _NOTE_FOOTER.unpack(footer)
    if magic != _NOTE_MAGIC or length + _NOTE_FOOTER.size != trailing:
        raise CorruptRecord(f"{trailing} bytes after the record are not a note (magic {magic!r}, {length})")
    return int(length)


def _verified_payload(key: ChunkKey, mapping: mmap.mmap) -> memoryview:
    """The payload of a mapped chunk file as a read-only view that keeps the mapping alive; raises
    `CorruptRecord` (after unmapping) unless the whole record verifies (a note after it must be framed
    right; its own checksum is checked when it is read, by ``announce_held``)."""
    with memoryview(mapping) as record:
        payload: memoryview | None = None
        try:
            with record[:HEADER_BYTES] as header:
                record_end = HEADER_BYTES + payload_length(key, header)
                if record_end < len(record):
                    with record[-_NOTE_FOOTER.size :] as footer:
                        _note_bytes(footer, len(record) - record_end)
                payload = record[HEADER_BYTES:record_end]
                verify_record(key, header, payload)
        except BaseException:
            if payload is not None:
                payload.release()
            record.release()
            mapping.close()
            raise
        return payload


def _slices(items: Sequence[_T], n: int) -> Iterator[Sequence[_T]]:
    """``items`` cut into at most ``n`` contiguous, non-empty slices of near-equal length."""
    n = min(n, len(items))
    for i in range(n):
        yield items[len(items) * i // n : len(items) * (i + 1) // n]


def _write_record(fd: int, key: ChunkKey, payload: memoryview, tail: list[memoryview]) -> None:
    """Write the record of ``payload`` (header, payload) and ``tail`` into the new file ``fd``. A payload over
    ``_WRITE_PIECE`` is checksummed and written piece by piece, each piece hashed just before it is copied
    out, while it is in the CPU cache: one pass over the payload from memory instead of two (+10% at 16 MiB
    here); the header, which holds the checksum, is written last, at offset 0."""
    if payload.nbytes <= _WRITE_PIECE:
        _write_all(fd, [memoryview(pack_header(key, payload)), payload, *tail])
        return
    hasher = checksum_pieces()
    os.lseek(fd, HEADER_BYTES, os.SEEK_SET)
    for start in range(0, payload.nbytes, _WRITE_PIECE):
        piece = payload[start : start + _WRITE_PIECE]
        hasher.update(piece)
        _write_all(fd, [piece])
    _write_all(fd, tail)
    header = pack_header(key, payload, hasher.digest())
    if os.pwrite(fd, header, 0) != len(header):  # 64 bytes into a regular file: short only on a fault
        raise OSError(errno.EIO, "short write of a chunk header")


def _write_all(fd: int, parts: list[memoryview]) -> None:
    while parts:
        written = os.writev(fd, parts)
        while parts and written >= parts[0].nbytes:
            written -= parts[0].nbytes
            parts = parts[1:]
        if written:
            parts[0] = parts[0][written:]


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's sync_file_range (Linux), or None where there is none."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return cast(Callable[[int, int, int, int], int], call)


def _start_writeback(fd: int) -> None:
    """Start writing the file's dirty pages to the disk without waiting (a hint: fdatasync still decides)."""
    call = _sync_file_range()
    if call is not None:
        call(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
