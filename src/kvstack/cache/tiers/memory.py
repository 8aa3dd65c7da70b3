"""The memory tier: chunk payloads in process memory under a byte budget, LRU, with pinning.

Each entry is one anonymous mapping sized to its payload rounded up to whole pages; freeing an entry unmaps
it, so the tier's memory is exactly the sum of its mappings. ``capacity_bytes`` bounds the page-rounded size
of every mapping the tier holds, including evicted or deleted entries a reader still sees through a view,
and is never exceeded: a put that cannot make room (everything left is pinned or still being read), or that
is larger than the budget, is dropped and counted. Eviction takes the least recently used entry first (a
get, a pin or a put makes an entry the most recent) and skips pinned entries.

``get`` returns a read-only ``memoryview`` into the entry's mapping, no copy, and an entry is never written
again while any view of it is alive; ``with tier.pinned(key) as view:`` also keeps the entry in the tier
while the block runs. A reader that keeps a view for long holds memory the cache cannot reuse: copy, or keep
views short. Not thread-safe: use it from one event loop; the async methods are thin wrappers of the
``*_sync`` core, which never blocks (no I/O).
"""

from __future__ import annotations

import logging
import mmap
import sys
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress

from kvstack.cache.keys import ChunkKey
from kvstack.cache.payload import Payload, byte_view
from kvstack.cache.tiers.base import Tier, TierStats, held_prefix

__all__ = ["MemoryTier"]

log = logging.getLogger(__name__)

_PAGE = mmap.PAGESIZE
_MAP_FLAGS = mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0)
_EMPTY = memoryview(b"")


def _round_to_pages(size: int) -> int:
    return -(-size // _PAGE) * _PAGE


class _Entry:
    __slots__ = ("buf", "capacity", "pins", "size")

    def __init__(self, buf: mmap.mmap | None, size: int) -> None:
        self.buf = buf  # None once the mapping is unmapped or taken for reuse
        self.capacity = 0 if buf is None else len(buf)
        self.size = size
        self.pins = 0

    def refs(self) -> int:
        """References to the mapping: this entry's own plus one per live buffer export (view)."""
        return sys.getrefcount(self.buf)


class MemoryTier(Tier):
    """Chunk payloads in page-rounded anonymous mappings within ``capacity_bytes`` (see the module doc).

    Storage: one anonymous private mapping (``mmap``, pre-faulted) per entry; an empty payload too gets a
    page, so every entry counts in the budget and no number of them can grow the process outside it.

    When the evicted mapping has the size the new payload needs and nobody reads it, it is reused in place:
    a full cache of equal-size chunks (the usual case) puts at memcpy speed, with no page faults. An entry
    evicted or replaced while a view of it (or a slice of one) is alive keeps its mapping, still counted in
    the budget, until the last view is gone; liveness of views is read from the mapping's reference count
    (CPython's buffer protocol keeps one reference per live export).

    Cost: a put of N bytes is one memcpy of N bytes (plus, into a fresh mapping, faulting in its pages); a
    get copies nothing.
    """

    def __init__(self, capacity_bytes: int, *, name: str = "memory") -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[ChunkKey, _Entry] = OrderedDict()
        self._held: list[_Entry] = []  # out of the index, still pinned or seen through views
        self._used = 0  # page-rounded bytes of every mapping in _entries and _held
        self._stats = TierStats(capacity_bytes=capacity_bytes)
        # The reference count of a mapping nobody reads, measured rather than assumed (it differs across
        # CPython versions).
        probe = _Entry(mmap.mmap(-1, _PAGE, flags=mmap.MAP_PRIVATE), 0)
        self._idle_refs = probe.refs()
        assert probe.buf is not None
        probe.buf.close()

    # -- sync core

    def contains_sync(self, keys: Sequence[bytes]) -> int:
        return held_prefix(keys, self._entries)

    def get_sync(self, key: ChunkKey) -> memoryview | None:
        """A read-only view of the payload (no copy), or None; the entry becomes the most recent."""
        entry = self._entries.get(key)
        if entry is None:
            self._stats.misses += 1
            return None
        self._stats.hits += 1
        self._entries.move_to_end(key)
        return self._view(entry)

    def peek(self, key: ChunkKey) -> memoryview | None:
        """Like `get_sync` without counting a hit or touching the LRU order (for the store's write queue)."""
        entry = self._entries.get(key)
        return None if entry is None else self._view(entry)

    @contextmanager
    def pinned(self, key: ChunkKey) -> Iterator[memoryview | None]:
        """A view of ``key``'s payload (None on a miss, released on exit); the entry is not evicted inside
        the block."""
        entry = self._entries.get(key)
        if entry is None:
            self._stats.misses += 1
            yield None
            return
        self._stats.hits += 1
        self._entries.move_to_end(key)
        entry.pins += 1
        view = self._view(entry)
        try:
            yield view
        finally:
            # The reader may have made views of the view: then the mapping stays held until they go.
            with suppress(BufferError):
                view.release()
            entry.pins -= 1
            if entry.pins == 0 and self._held:
                self._reclaim_held()

    def put_sync(self, key: ChunkKey, data: Payload) -> bool:
        """Store a copy of ``data`` (replacing ``key``'s entry); False when it cannot fit in the budget."""
        src = byte_view(data)
        size = src.nbytes
        capacity = _round_to_pages(max(size, 1))
        if capacity > self.capacity_bytes:
            self._stats.write_drops += 1
            return False
        buf: mmap.mmap | None = None
        old = self._entries.pop(key, None)
        if old is not None:
            buf = self._retire(old, reuse_capacity=capacity)
        if buf is None and self._held and self._used + capacity > self.capacity_bytes:
            self._reclaim_held()
        victims: list[ChunkKey] = []
        while buf is None and self._used + capacity > self.capacity_bytes:
            victim = self._lru_unpinned()
            if victim is None:
                break
            self._stats.evictions += 1
            victims.append(victim)
            buf = self._retire(self._entries.pop(victim), reuse_capacity=capacity)
        if old is not None:  # reported as removed if the new payload is dropped below
            victims.append(key)
        if buf is None:
            if self._used + capacity > self.capacity_bytes:
                self._stats.write_drops += 1
                self._report_removed(victims)
                return False
            try:
                buf = mmap.mmap(-1, capacity, flags=_MAP_FLAGS)
            except OSError as e:
                self._stats.errors += 1
                self._stats.write_drops += 1
                log.warning("memory tier %s: cannot map %d bytes (%s); chunk dropped", self.name, capacity, e)
                self._report_removed(victims)
                return False
            self._used += capacity
        if old is not None:
            victims.pop()
        self._report_removed(victims)
        memoryview(buf)[:size] = src
        self._entries[key] = _Entry(buf, size)
        self._stats.writes += 1
        if self.listener is not None:
            self.listener.stored(self, (key,))
        return True

    def delete_sync(self, key: ChunkKey) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._retire(entry, reuse_capacity=None)
        self._report_removed([key])
        return True

    def clear_sync(self) -> None:
        entries = list(self._entries.values())
        self._entries.clear()
        for entry in entries:
            self._retire(entry, reuse_capacity=None)

    @property
    def held_bytes(self) -> int:
        """Bytes of mappings already out of the index but still pinned or seen through views."""
        return sum(entry.capacity for entry in self._held)

    # -- Tier interface

    async def close(self) -> None:
        self.clear_sync()

    async def contains(self, keys: Sequence[bytes]) -> int:
        return self.contains_sync(keys)

    def contains_now(self, keys: Sequence[bytes]) -> int:
        return self.contains_sync(keys)

    async def get(self, key: ChunkKey) -> Payload | None:
        return self.get_sync(key)

    async def get_many(self, keys: Sequence[ChunkKey]) -> list[Payload | None]:
        return [self.get_sync(key) for key in keys]

    async def put(self, key: ChunkKey, data: Payload) -> bool:
        return self.put_sync(key, data)

    async def delete(self, key: ChunkKey) -> bool:
        return self.delete_sync(key)

    async def clear(self) -> None:
        self.clear_sync()

    def stats(self) -> TierStats:
        stats = self._stats.copy()
        stats.bytes = self._used
        stats.entries = len(self._entries)
        return stats

    # -- internals

    def _view(self, entry: _Entry) -> memoryview:
        if entry.buf is None:
            return _EMPTY
        return memoryview(entry.buf)[: entry.size].toreadonly()

    def _report_removed(self, keys: list[ChunkKey]) -> None:
        if keys and self.listener is not None:
            self.listener.removed(self, keys)

    def _lru_unpinned(self) -> ChunkKey | None:
        for key, entry in self._entries.items():
            if entry.pins == 0:
                return key
        return None

    def _is_read(self, entry: _Entry) -> bool:
        return entry.pins > 0 or entry.refs() > self._idle_refs

    def _retire(self, entry: _Entry, reuse_capacity: int | None) -> mmap.mmap | None:
        """Free an entry that left the index; returns its mapping (still counted) instead when nobody reads
        it and it has exactly ``reuse_capacity`` bytes."""
        if entry.buf is None:
            return None
        if not self._is_read(entry):
            if entry.capacity == reuse_capacity:
                buf, entry.buf = entry.buf, None
                return buf
            if self._unmap(entry):
                return None
        self._held.append(entry)
        return None

    def _unmap(self, entry: _Entry) -> bool:
        assert entry.buf is not None
        try:
            entry.buf.close()
        except BufferError:  # a view the reference count did not show: keep the mapping held
            return False
        self._used -= entry.capacity
        entry.buf = None
        return True

    def _reclaim_held(self) -> None:
        still_read: list[_Entry] = []
        for entry in self._held:
            if self._is_read(entry) or not self._unmap(entry):
                still_read.append(entry)
        self._held = still_read
