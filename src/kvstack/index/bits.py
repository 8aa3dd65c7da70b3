"""Location bits: each location is one bit of a block's location mask.

Bit positions are small ints handed out smallest-free-first and reused once a location holds nothing, so
masks stay as short as the number of live locations (Python ints have no width limit: 256 locations or more
just make longer masks).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

__all__ = ["BitAllocator", "one_bits"]


def one_bits(mask: int) -> Iterator[int]:
    """Each set bit of ``mask`` as a one-bit mask, lowest first."""
    while mask:
        low = mask & -mask
        yield low
        mask ^= low


class BitAllocator:
    """One-bit masks for locations, the lowest free bit first."""

    __slots__ = ("_free", "_next")

    def __init__(self) -> None:
        self._next = 0
        self._free: list[int] = []  # heap of free bit positions

    def take(self) -> int:
        position = heapq.heappop(self._free) if self._free else self._next
        self._next = max(self._next, position + 1)
        return 1 << position

    def give(self, bit: int) -> None:
        heapq.heappush(self._free, bit.bit_length() - 1)
