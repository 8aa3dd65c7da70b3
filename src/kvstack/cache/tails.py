"""`TailIndex`: where the cache server finds a prompt's partial last chunk (its "tail") in one lookup.

A tail is stored like any chunk, under its partial-tail key (``chunk_keys(..., include_partial=True)``),
which only a client holding the tokens can compute. The index maps the key of the chunk before the tail
(its parent; 32 zero bytes at a prompt's start) to the tails stored after it, ``{length: key}``, so a
lookup can offer them right after the prefix it found. It holds at most ``limit`` tails, least recently
added or offered parent first out; an entry may outlive its chunk (the caller checks the store before
offering one and calls `forget` for what is gone). Tails are never announced as KV events.
"""

from __future__ import annotations

from collections import OrderedDict

from kvstack.cache.keys import KEY_BYTES

__all__ = ["DEFAULT_TAIL_LIMIT", "ROOT_PARENT", "TailIndex"]

DEFAULT_TAIL_LIMIT = 65_536
"""Tails indexed at most: about 10 MB of keys, more tails than a 1 GiB memory tier of CPU chunks holds."""
ROOT_PARENT = bytes(KEY_BYTES)
"""The parent of a tail that starts at a prompt's start."""


class TailIndex:
    """Parent key -> {tail length: tail key}, bounded by ``limit`` tails (see the module docstring)."""

    def __init__(self, limit: int = DEFAULT_TAIL_LIMIT) -> None:
        if limit < 1:
            raise ValueError(f"the tail index needs room for at least one tail, got limit {limit}")
        self.limit = limit
        self._by_parent: OrderedDict[bytes, dict[int, bytes]] = OrderedDict()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def add(self, parent: bytes | None, length: int, key: bytes) -> None:
        """Remember a tail of ``length`` tokens stored under ``key`` after ``parent`` (None: the start)."""
        parent = ROOT_PARENT if parent is None else bytes(parent)
        tails = self._by_parent.get(parent)
        if tails is None:
            tails = self._by_parent[parent] = {}
        else:
            self._by_parent.move_to_end(parent)
        self._size += length not in tails
        tails[length] = bytes(key)
        while self._size > self.limit:
            _, dropped = self._by_parent.popitem(last=False)
            self._size -= len(dropped)
            if dropped is tails:  # a single parent over the limit keeps its newest tails
                keep = dict(list(tails.items())[-self.limit :])
                self._by_parent[parent] = keep
                self._size += len(keep)

    def after(self, parent: bytes | None) -> list[tuple[int, bytes]]:
        """The tails indexed after ``parent``, longest first (may include evicted chunks)."""
        parent = ROOT_PARENT if parent is None else parent
        tails = self._by_parent.get(parent)
        if not tails:
            return []
        self._by_parent.move_to_end(parent)
        return sorted(tails.items(), reverse=True)

    def forget(self, parent: bytes | None, key: bytes) -> None:
        """Drop the tail ``key`` after ``parent`` (its chunk is gone)."""
        parent = ROOT_PARENT if parent is None else parent
        tails = self._by_parent.get(parent)
        if tails is None:
            return
        for length, known in list(tails.items()):
            if known == key:
                del tails[length]
                self._size -= 1
        if not tails:
            del self._by_parent[parent]

    def clear(self) -> None:
        self._by_parent.clear()
        self._size = 0
