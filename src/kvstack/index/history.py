"""The approximate prefix index: what the router itself sent where, for engines that publish no KV events.

After routing a prompt, the router ``record``s its block keys (``BlockKeyer``, the same keys as the exact
index) for the chosen location; ``lookup`` then answers, per location, how many consecutive blocks from block
0 were sent there recently. It is a guess at the engine's prefix cache, so it forgets on its own:

- ``ttl_s`` (default 600 s): an entry older than this never matches; expired entries are purged by every
  ``record``/``lookup``/``purge``, O(1) amortized per entry.
- ``max_blocks_per_location`` (default 50,000): past it a location's least recently sent blocks are dropped;
  a prompt's blocks are recorded last block first, so a chain is dropped from its tail.

Time is passed in (``now``, seconds, non-decreasing: ``time.monotonic()`` in the router), never read here.
``lookup`` is O(prompt blocks up to the longest match); ``forget`` is O(that location's blocks). Memory is
about 180 bytes per (location, block) entry, none of it walked by the garbage collector. Structures and
reasoning: docs/design/prefix-index.md.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from kvstack.index.bits import BitAllocator, one_bits

__all__ = ["HistoryIndex", "HistoryStats"]


@dataclass(frozen=True, slots=True)
class HistoryStats:
    entries: int  # (location, block) pairs
    blocks: int
    locations: int
    evicted: int  # dropped by the per-location bound
    expired: int  # dropped by the TTL


_MIN_COMPACT = 4096  # order items tolerated (consumed or stale) before compacting, however small a location


class _Sent:
    """What one location was sent: key -> time, and the send order, oldest first."""

    __slots__ = ("_head", "_keys", "_times", "bit", "name", "sent")

    def __init__(self, name: str, bit: int) -> None:
        self.name = name
        self.bit = bit
        self.sent: dict[int, float] = {}
        self._keys = array("Q")  # send order; item i is current iff sent.get(_keys[i]) == _times[i]
        self._times = array("d")
        self._head = 0

    def record(self, key: int, now: float) -> bool:
        """``key`` sent at ``now``; True if it was not held before."""
        new = key not in self.sent
        self.sent[key] = now
        self._keys.append(key)
        self._times.append(now)
        if len(self._keys) - self._head > 2 * len(self.sent) + _MIN_COMPACT:
            self._compact()
        return new

    def oldest(self) -> tuple[int, float] | None:
        """The least recently sent (key, time), skipping stale order items."""
        keys, times, sent = self._keys, self._times, self.sent
        head = self._head
        while head < len(keys):
            key, t = keys[head], times[head]
            if sent.get(key) == t:
                self._head = head
                return key, t
            head += 1
        self._head = head
        return None

    def drop_oldest(self) -> int:
        """Forget the key ``oldest()`` returned; returns it."""
        key = self._keys[self._head]
        del self.sent[key]
        self._head += 1
        if self._head >= _MIN_COMPACT and 2 * self._head >= len(self._keys):  # amortized O(1)
            del self._keys[: self._head]
            del self._times[: self._head]
            self._head = 0
        return key

    def _compact(self) -> None:
        """Keep the current order items only (each key's latest send)."""
        keys, times = array("Q"), array("d")
        sent, seen = self.sent, set()
        for i in range(self._head, len(self._keys)):
            key, t = self._keys[i], self._times[i]
            if sent.get(key) == t and key not in seen:
                seen.add(key)
                keys.append(key)
                times.append(t)
        self._keys, self._times, self._head = keys, times, 0


class HistoryIndex:
    """Recently routed blocks per location, bounded per location and by age."""

    def __init__(self, max_blocks_per_location: int = 50_000, ttl_s: float = 600.0) -> None:
        if max_blocks_per_location < 1:
            raise ValueError(f"max_blocks_per_location must be >= 1, got {max_blocks_per_location}")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.max_blocks_per_location = max_blocks_per_location
        self.ttl_s = ttl_s
        self._masks: dict[int, int] = {}  # block key -> bitmask of locations it was sent to
        self._locations: dict[str, _Sent] = {}
        self._by_bit: dict[int, _Sent] = {}
        self._bits = BitAllocator()
        self._entries = 0
        self._evicted = 0
        self._expired = 0

    def record(self, location: str, keys: Sequence[int], now: float) -> None:
        """Remember that the blocks ``keys`` were sent to ``location`` at ``now``."""
        self.purge(now)
        if not keys:
            return
        loc = self._locations.get(location)
        if loc is None:
            loc = self._new_location(location)
        bit, masks = loc.bit, self._masks
        for i in range(len(keys) - 1, -1, -1):  # block 0 last: the most recent, dropped last
            key = keys[i]
            if loc.record(key, now):
                masks[key] = masks.get(key, 0) | bit
                self._entries += 1
        while len(loc.sent) > self.max_blocks_per_location:
            loc.oldest()
            self._unmask(loc.drop_oldest(), bit)
            self._evicted += 1

    def lookup(self, keys: Sequence[int], now: float) -> dict[str, int]:
        """Per location sent block 0 within the TTL, how many consecutive blocks of ``keys`` it was sent."""
        self.purge(now)
        if not keys:
            return {}
        get = self._masks.get
        alive = start = get(keys[0], 0)
        if not alive:
            return {}
        lengths: dict[int, int] = {}  # location bit -> consecutive blocks
        for i in range(1, len(keys)):
            m = alive & get(keys[i], 0)
            if m != alive:
                for b in one_bits(alive ^ m):
                    lengths[b] = i
                alive = m
                if not m:
                    break
        for b in one_bits(alive):
            lengths[b] = len(keys)
        out: dict[str, int] = {}
        for b in one_bits(start):
            out[self._by_bit[b].name] = lengths[b]
        return out

    def forget(self, location: str) -> int:
        """Drop everything recorded for ``location`` (it restarted or left); returns the entries dropped."""
        loc = self._locations.get(location)
        if loc is None:
            return 0
        for key in loc.sent:
            self._unmask(key, loc.bit)
        dropped = len(loc.sent)
        loc.sent.clear()
        self._release(loc)
        return dropped

    def purge(self, now: float) -> int:
        """Drop entries older than ``ttl_s``; returns how many. Called by ``record`` and ``lookup`` too."""
        oldest_kept = now - self.ttl_s
        purged = 0
        for loc in list(self._locations.values()):
            while (oldest := loc.oldest()) is not None and oldest[1] <= oldest_kept:
                self._unmask(loc.drop_oldest(), loc.bit)
                purged += 1
            if not loc.sent:
                self._release(loc)
        self._expired += purged
        return purged

    def locations(self) -> list[str]:
        """Locations with at least one block recorded within the TTL (as of the last call)."""
        return list(self._locations)

    def stats(self) -> HistoryStats:
        return HistoryStats(
            entries=self._entries,
            blocks=len(self._masks),
            locations=len(self._locations),
            evicted=self._evicted,
            expired=self._expired,
        )

    def _new_location(self, name: str) -> _Sent:
        loc = _Sent(name, self._bits.take())
        self._by_bit[loc.bit] = loc
        self._locations[name] = loc
        return loc

    def _release(self, loc: _Sent) -> None:
        del self._locations[loc.name]
        del self._by_bit[loc.bit]
        self._bits.give(loc.bit)

    def _unmask(self, key: int, bit: int) -> None:
        mask = self._masks[key] & ~bit
        if mask:
            self._masks[key] = mask
        else:
            del self._masks[key]
        self._entries -= 1
