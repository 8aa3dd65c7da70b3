"""Interned holder sets: who holds a block in which tier, as a small int id shared by all such blocks.

A holder set is ``(gpu, cpu, disk, remote)``: one location bitmask per tier. Most blocks share one with many
others (every block of a conversation cached by one engine), so the index stores an int id per block and the
set once here, with a use count; a set no block uses is freed and its id reused.

Why ids rather than the tuples themselves: a dict whose values are all ints is never tracked by the garbage
collector, while one holding a single freshly made tuple is, and then every full collection walks all its
millions of entries. Equal ids mean equal sets, so ``lookup`` can skip a block whose id is the previous
block's.
"""

from __future__ import annotations

from typing import Final

__all__ = ["EMPTY", "HolderTable", "Masks"]

Masks = tuple[int, int, int, int]  # location bitmask per tier, indexed by Tier
EMPTY: Final[Masks] = (0, 0, 0, 0)


class HolderTable:
    """Holder sets by id, interned and counted."""

    __slots__ = ("_free", "_ids", "_uses", "masks")

    def __init__(self) -> None:
        self.masks: list[Masks] = []  # id -> holder set (EMPTY while the id is free); read directly
        self._uses: list[int] = []
        self._ids: dict[Masks, int] = {}
        self._free: list[int] = []

    def __len__(self) -> int:
        """Holder sets in use."""
        return len(self._ids)

    def acquire(self, masks: Masks, uses: int = 1) -> int:
        """The id of ``masks``, counted ``uses`` more times."""
        hid = self._ids.get(masks)
        if hid is None:
            if self._free:
                hid = self._free.pop()
                self.masks[hid] = masks
            else:
                hid = len(self.masks)
                self.masks.append(masks)
                self._uses.append(0)
            self._ids[masks] = hid
        self._uses[hid] += uses
        return hid

    def add_uses(self, hid: int, uses: int) -> None:
        """Count ``uses`` more (or fewer) uses of ``hid``; the set is freed at zero."""
        self._uses[hid] += uses
        if not self._uses[hid]:
            del self._ids[self.masks[hid]]
            self.masks[hid] = EMPTY
            self._free.append(hid)

    def release(self, hid: int) -> None:
        """One use of ``hid`` fewer; the set is freed at zero."""
        self.add_uses(hid, -1)

    def replace(self, hid: int, masks: Masks) -> int:
        """Move one use from ``hid`` to ``masks``; returns the id of ``masks``."""
        new = self.acquire(masks)
        self.release(hid)
        return new
