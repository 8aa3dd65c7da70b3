"""Reusable receive buffers for a tier's read path: `BufferPool`.

A tier that reads each chunk into memory it allocates (the Redis tier's replies) would otherwise allocate
a fresh buffer per chunk: for 1 MiB and more glibc maps it (or grows the heap) and the kernel zero-fills it
page by page, which costs more than the copy itself. A pool lends the same buffers again once the views
handed out of them are gone. (The disk tier maps its files instead.)
"""

from __future__ import annotations

import sys

__all__ = ["BufferPool"]


class BufferPool:
    """``bytearray`` s lent for chunks being read, reused once nothing refers to them.

    Whether a buffer is still referenced is read from its reference count (CPython keeps one reference per
    live view through the view's managed buffer), as the memory tier does for its mappings. At most
    ``max_idle_bytes`` of unreferenced buffers are kept for reuse; the rest are freed. Use it from one
    thread (the event loop); a buffer may be filled elsewhere while the caller holds it.
    """

    def __init__(self, max_idle_bytes: int = 32 << 20) -> None:
        self._max_idle = max_idle_bytes
        self._idle: dict[int, list[bytearray]] = {}  # by size
        self._idle_bytes = 0
        self._lent: list[bytearray] = []
        probe = [bytearray(1)]
        self._free_refs = sys.getrefcount(probe[0])  # measured: it differs across CPython versions

    def take(self, size: int) -> bytearray:
        """A buffer of exactly ``size`` bytes (contents undefined: the caller overwrites all of it)."""
        free = self._idle.get(size)
        if not free and self._lent:
            self._reclaim()
            free = self._idle.get(size)
        if free:
            buf = free.pop()
            self._idle_bytes -= size
        else:
            buf = bytearray(size)
        if size <= self._max_idle:
            self._lent.append(buf)
        return buf

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    def _reclaim(self) -> None:
        lent, self._lent = self._lent, []
        for i in range(len(lent)):
            buf = lent[i]
            # References here: the list slot, `buf`, getrefcount's argument; a probe measured the same.
            if sys.getrefcount(buf) > self._free_refs + 1:
                self._lent.append(buf)
            elif self._idle_bytes + len(buf) <= self._max_idle:
                self._idle.setdefault(len(buf), []).append(buf)
                self._idle_bytes += len(buf)
