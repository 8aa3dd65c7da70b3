"""Block key -> value in approximate LRU order: two generations of plain dicts (a CLOCK-like LRU).

``young`` takes every new or touched key; ``old`` is the previous generation. Touching a key in ``old``
moves it to ``young``; touching a key already in ``young`` costs nothing (one dict lookup, no reordering).
When ``old`` is used up, ``young`` becomes ``old``, in O(1).

Eviction is LRU at the resolution of one generation: a key touched since the last swap is evicted after
every key that was not, and ``old`` is evicted in the order its keys entered ``young``. A caller that touches
a prompt's keys last block first gets chains evicted from their tails.

Keys must be ints in [0, 2**64), as ``BlockKeyer`` makes them; nothing here is tracked by the garbage
collector, and every operation is O(1) amortized. Callers may read ``young`` and ``old`` directly in hot
loops (``young.get(k)``, then ``old.get(k)``); all writes go through the methods. Why generations rather
than an ``OrderedDict``: docs/design/prefix-index.md.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable
from typing import Generic, TypeVar

__all__ = ["BlockTable", "KeyQueue"]

V = TypeVar("V")

_MIN_REBUILD = 4096  # stale order items tolerated however small ``young`` is


class KeyQueue:
    """A FIFO of 64-bit unsigned keys in an ``array('Q')``: append at the end, pop from a moving head."""

    __slots__ = ("_head", "_items")

    def __init__(self, keys: Iterable[int] = ()) -> None:
        self._items = array("Q", keys)
        self._head = 0

    def __len__(self) -> int:
        return len(self._items) - self._head

    def __sizeof__(self) -> int:
        return object.__sizeof__(self) + sys.getsizeof(self._items)

    def append(self, key: int) -> None:
        self._items.append(key)

    def popleft(self) -> int:
        """The first key; IndexError when empty."""
        items, head = self._items, self._head
        key = items[head]
        head += 1
        if head >= _MIN_REBUILD and 2 * head >= len(items):  # drop the consumed half: amortized O(1)
            del items[:head]
            head = 0
        self._head = head
        return key


class BlockTable(Generic[V]):
    """Key -> value with two-generation LRU eviction; see the module docstring."""

    __slots__ = ("_old_order", "_young_order", "old", "young")

    def __init__(self) -> None:
        self.young: dict[int, V] = {}
        self.old: dict[int, V] = {}
        self._young_order = KeyQueue()  # keys as they entered young (some since left)
        self._old_order = KeyQueue()  # the same for old: its eviction order

    def __len__(self) -> int:
        return len(self.young) + len(self.old)

    def get(self, key: int) -> V | None:
        value = self.young.get(key)
        return self.old.get(key) if value is None else value

    def update(self, key: int, value: V) -> None:
        """Set the value of ``key`` where it is, without touching it (a new key goes to ``young``)."""
        if key in self.old:
            self.old[key] = value
        else:
            self._set_young(key, value)

    def touch(self, key: int, value: V) -> None:
        """Set ``key`` to ``value`` and make it young."""
        self.old.pop(key, None)
        self._set_young(key, value)

    def promote(self, key: int) -> None:
        """Move ``key`` from ``old`` to ``young`` (it must be in ``old``)."""
        self._set_young(key, self.old.pop(key))

    def delete(self, key: int) -> None:
        if self.young.pop(key, None) is None:
            del self.old[key]

    def pop_oldest(self) -> tuple[int, V]:
        """Remove and return the least recently touched key (at generation resolution)."""
        while True:
            order, old = self._old_order, self.old
            while order:
                key = order.popleft()
                value = old.pop(key, None)
                if value is not None:
                    return key, value
            if not self.young:
                raise KeyError("pop_oldest from an empty BlockTable")
            self.old, self.young = self.young, {}
            self._old_order, self._young_order = self._young_order, order

    def containers(self) -> tuple[object, ...]:
        """The containers, for ``sys.getsizeof`` (their keys and values not included)."""
        return (self.young, self.old, self._young_order, self._old_order)

    def _set_young(self, key: int, value: V) -> None:
        young = self.young
        if key not in young:
            order = self._young_order
            order.append(key)
            if len(order) > 2 * len(young) + _MIN_REBUILD:
                self._young_order = KeyQueue(young)  # dict order is entry order: drops the stale items
                self._young_order.append(key)
        young[key] = value
