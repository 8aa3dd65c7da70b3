"""The exact prefix index: which location (engine or cache node) holds which block, in which tier.

Fed by KV events (engines' ``BlockStored``/``BlockRemoved``/``AllBlocksCleared`` and the cache tier's
admit/evict events), read by scorers: ``lookup(keys)`` gives, per location, the consecutive prefix it holds
from block 0, overall and per tier (``PrefixMatch``). One process, no locks: call it from one event loop.

One bound: ``max_entries`` (location, block) pairs, whatever their tiers; past it the least recently used
blocks (LRU by generations, see block_table) are evicted with all their entries. A store or a lookup hit
makes a block recent (a prompt's blocks last block first), so a chain is evicted from its tail, never leaving
a tail whose prefix is gone. Engine hashes given to ``store`` map ``BlockRemoved`` back to keys and share the
blocks' bound.

Costs: ``lookup`` O(prompt blocks up to the longest match + matching locations); ``store``/``remove_*``
O(blocks given); ``clear_location`` O(that location's entries); eviction O(1) per block. Every per-block
container holds only ints, which the garbage collector never walks. Structures and reasoning:
docs/design/prefix-index.md.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Final, NamedTuple

from kvstack.index.bits import BitAllocator, one_bits
from kvstack.index.block_table import BlockTable
from kvstack.index.holders import EMPTY, HolderTable, Masks

__all__ = ["EngineHash", "IndexStats", "PrefixIndex", "PrefixMatch", "Tier"]

EngineHash = int | bytes
_Hashes = EngineHash | tuple[EngineHash, ...] | None  # what one (location, block) entry was stored with
# A block stored again at one location under several engine hashes (another KV-cache group, a re-store after
# a partial removal) keeps at most this many, the newest; older ones become unknown to ``remove_hashes``.
_MAX_HASHES_PER_ENTRY: Final = 4
_KEY_LIMIT: Final = 2**64  # block keys are unsigned 64-bit (the LRU order keeps them in an array('Q'))
# Rough CPython 3.11 object sizes for ``stats().approx_bytes``: a 64-bit int, a 4-tuple.
_INT_BYTES: Final = 48
_TUPLE_BYTES: Final = 80


class Tier(IntEnum):
    """Where a block is held, best first: a lower tier is cheaper to use."""

    GPU = 0
    CPU = 1
    DISK = 2
    REMOTE = 3

    @classmethod
    def from_medium(cls, medium: str | None) -> Tier:
        """The tier of a KV-event medium: None or "GPU" -> GPU, "CPU" -> CPU, "STORAGE"/"DISK" -> DISK,
        "REMOTE" -> REMOTE (case-insensitive). An unknown medium (a future vLLM offload target) maps to DISK:
        usable, but ranked below memory, so it never outranks a known fast tier."""
        if medium is None:
            return cls.GPU
        return _MEDIA.get(medium.upper(), cls.DISK)


_MEDIA: Final = {
    "GPU": Tier.GPU,
    "CPU": Tier.CPU,
    "STORAGE": Tier.DISK,
    "DISK": Tier.DISK,
    "REMOTE": Tier.REMOTE,
}


class PrefixMatch(NamedTuple):
    """One location's consecutive prefix from block 0.

    ``blocks``: the prefix length in any tier. ``blocks_by_tier[t]``: the longest consecutive prefix available
    at tier ``t`` or better (never decreasing with ``t``; ``blocks_by_tier[Tier.REMOTE] == blocks``).
    """

    blocks: int
    blocks_by_tier: tuple[int, int, int, int]

    def at(self, tier: Tier) -> int:
        """Consecutive prefix blocks available at ``tier`` or better."""
        return self.blocks_by_tier[tier]


@dataclass(frozen=True, slots=True)
class IndexStats:
    entries: int  # (location, block) pairs, the bounded quantity
    blocks: int
    locations: int
    engine_hashes: int  # engine hash -> key mappings, all locations
    evicted_entries: int
    evicted_blocks: int
    unknown_removals: int  # removals that matched no entry at that tier (unknown hash/key/location)
    holder_sets: int  # distinct (gpu, cpu, disk, remote) location masks in use
    approx_bytes: int


class _Location:
    __slots__ = ("bit", "by_hash", "members", "name")

    def __init__(self, name: str, bit: int) -> None:
        self.name = name
        self.bit = bit
        self.members: dict[int, _Hashes] = {}
        self.by_hash: dict[EngineHash, int] = {}


class PrefixIndex:
    """Which locations hold which blocks in which tier, bounded by ``max_entries`` (location, block) pairs."""

    def __init__(self, max_entries: int = 4_000_000) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._blocks: BlockTable[int] = BlockTable()  # key -> holder-set id
        self._holders = HolderTable()
        self._locations: dict[str, _Location] = {}
        self._by_bit: dict[int, _Location] = {}
        self._bits = BitAllocator()
        self._entries = 0
        self._evicted_entries = 0
        self._evicted_blocks = 0
        self._unknown_removals = 0

    @property
    def evicted_entries(self) -> int:
        """Entries evicted by the bound since the index was made (cheap; ``stats`` walks containers)."""
        return self._evicted_entries

    def __len__(self) -> int:
        """Number of (location, block) entries."""
        return self._entries

    # -- writes

    def store(
        self,
        location: str,
        keys: Sequence[int],
        tier: Tier = Tier.GPU,
        engine_hashes: Sequence[EngineHash] | None = None,
    ) -> None:
        """Record that ``location`` holds the blocks ``keys`` (ints in [0, 2**64), as ``BlockKeyer`` makes) in
        ``tier``. Idempotent; makes the blocks young again.

        ``engine_hashes[i]``, when given, is the engine's hash of ``keys[i]``: remembered so that
        ``remove_hashes`` and ``key_for_hash`` can find the block.
        """
        if engine_hashes is not None and len(engine_hashes) != len(keys):
            raise ValueError(f"{len(engine_hashes)} engine hashes for {len(keys)} keys: they must pair up")
        if not keys:
            return
        if min(keys) < 0 or max(keys) >= _KEY_LIMIT:
            raise ValueError("block keys must be ints in [0, 2**64), as BlockKeyer makes them")
        loc = self._location(location)
        bit, t = loc.bit, int(tier)
        blocks, holders, members, by_hash = self._blocks, self._holders, loc.members, loc.by_hash
        young_get, masks_of = blocks.young.get, holders.masks
        fresh = holders.acquire(_with(EMPTY, t, add=bit), uses=0)
        new_blocks = added = 0
        # Last block first: block 0 enters the young generation last, so eviction takes a chain from its tail.
        for i in range(len(keys) - 1, -1, -1):
            key = keys[i]
            hid = young_get(key)
            if hid is None:
                hid = blocks.old.get(key)
                if hid is None:
                    blocks.touch(key, fresh)
                    new_blocks += 1
                else:
                    masks = masks_of[hid]
                    if not masks[t] & bit:
                        hid = holders.replace(hid, _with(masks, t, add=bit))
                    blocks.touch(key, hid)
            else:
                masks = masks_of[hid]
                if not masks[t] & bit:
                    blocks.update(key, holders.replace(hid, _with(masks, t, add=bit)))
            h = None if engine_hashes is None else engine_hashes[i]
            if key not in members:
                members[key] = h
                added += 1
            elif h is not None:
                members[key] = self._add_hash(loc, key, members[key], h)
            if h is not None:
                by_hash[h] = key
        holders.add_uses(fresh, new_blocks)  # counted at once (freed if no block took it)
        self._entries += added
        if self._entries > self.max_entries:
            self._evict()

    def remove_hashes(
        self, location: str, engine_hashes: Sequence[EngineHash], tier: Tier | None = None
    ) -> int:
        """Forget that ``location`` holds the blocks with these engine hashes in ``tier`` (None: every tier).

        Returns how many of the hashes matched a held block; the others (unknown hash, or not held in that
        tier) are ignored and counted in ``stats().unknown_removals``.
        """
        loc = self._locations.get(location)
        if loc is None:
            self._unknown_removals += len(engine_hashes)
            return 0
        by_hash = loc.by_hash
        removed = 0
        for h in engine_hashes:
            key = by_hash.get(h)
            if key is not None and self._drop(loc, key, tier):
                removed += 1
        self._unknown_removals += len(engine_hashes) - removed
        self._release_if_empty(loc)
        return removed

    def remove_keys(self, location: str, keys: Sequence[int], tier: Tier | None = None) -> int:
        """Forget that ``location`` holds the blocks ``keys`` in ``tier`` (None: every tier).

        Returns how many keys matched a held block; the others are counted in ``stats().unknown_removals``.
        """
        loc = self._locations.get(location)
        if loc is None:
            self._unknown_removals += len(keys)
            return 0
        removed = sum(1 for key in keys if self._drop(loc, key, tier))
        self._unknown_removals += len(keys) - removed
        self._release_if_empty(loc)
        return removed

    def clear_location(self, location: str) -> int:
        """Forget everything ``location`` holds (engine restart, ``AllBlocksCleared``, an event gap without
        replay). O(that location's entries). Returns the number of entries removed."""
        loc = self._locations.get(location)
        if loc is None:
            return 0
        blocks, holders, keep = self._blocks, self._holders, ~loc.bit
        for key in loc.members:
            hid = blocks.get(key)
            assert hid is not None
            g, c, d, r = holders.masks[hid]
            masks = (g & keep, c & keep, d & keep, r & keep)
            if masks == EMPTY:
                blocks.delete(key)
                holders.release(hid)
            else:
                blocks.update(key, holders.replace(hid, masks))
        removed = len(loc.members)
        self._entries -= removed
        loc.members.clear()
        loc.by_hash.clear()
        self._release_if_empty(loc)
        return removed

    # -- reads

    def key_for_hash(self, location: str, engine_hash: EngineHash) -> int | None:
        """Our key of the block ``location`` stored under ``engine_hash``, if still indexed."""
        loc = self._locations.get(location)
        return None if loc is None else loc.by_hash.get(engine_hash)

    def lookup(self, keys: Sequence[int]) -> dict[str, PrefixMatch]:
        """Per location holding block 0, its consecutive prefix of ``keys`` (overall and per tier).

        Walks the keys once with a running mask of still-matching locations per tier (``a_t``: holding every
        block so far at tier ``t`` or better), and stops at the first block no remaining location holds. The
        blocks matched (up to the longest match) become young.
        """
        if not keys:
            return {}
        young_get, old_get = self._blocks.young.get, self._blocks.old.get
        masks_of = self._holders.masks
        from_old: list[int] = []  # positions of the blocks found in the old generation
        prev = young_get(keys[0])
        if prev is None:
            prev = old_get(keys[0])
            if prev is None:
                return {}
            from_old.append(0)
        g, c, d, r = masks_of[prev]
        a0 = g
        a1 = a0 | c
        a2 = a1 | d
        a3 = a2 | r
        start = (a0, a1, a2, a3)
        # (position, locations leaving a3 there, locations leaving a0/a1/a2 there but staying in a3)
        drops: list[tuple[int, int, int, int, int]] = []
        end = len(keys)
        for i in range(1, end):
            key = keys[i]
            hid = young_get(key)
            if hid is None:
                hid = old_get(key)
                if hid is None:
                    end = i
                    break
                from_old.append(i)
            if hid == prev:  # same holders in the same tiers as the block before: nothing changes
                continue
            prev = hid
            g, c, d, r = masks_of[hid]
            m0 = a0 & g
            g |= c
            m1 = a1 & g
            g |= d
            m2 = a2 & g
            m3 = a3 & (g | r)
            if m3 != a3 or m2 != a2 or m1 != a1 or m0 != a0:
                drops.append((i, a3 ^ m3, (a0 ^ m0) & m3, (a1 ^ m1) & m3, (a2 ^ m2) & m3))
                a0, a1, a2, a3 = m0, m1, m2, m3
                if not m3:
                    end = i
                    break
        promote = self._blocks.promote
        for i in reversed(from_old):  # blocks 0..end-1 matched somewhere: make them young, block 0 last
            if i < end:
                promote(keys[i])
        return self._matches(start, a3, drops, end)

    def _matches(
        self, start: Masks, alive: int, drops: list[tuple[int, int, int, int, int]], end: int
    ) -> dict[str, PrefixMatch]:
        """Per-location prefix lengths from the positions where locations left the running masks.

        A location's prefix at tier t < 3 is its overall prefix unless it left a_t before a3 (then that
        position) or never held block 0 at tier t or better (then 0). Locations with the same prefix in every
        tier share one PrefixMatch per position; only tiered ones get their own.
        """
        s0, s1, s2, s3 = start
        tiered = s3 & ~s0  # no block 0 in GPU; below, also the locations that left a lower tier early
        early: tuple[dict[int, int], ...] = ({}, {}, {})  # per tier < 3: location bit -> its shorter prefix
        for pos, _, left0, left1, left2 in drops:
            if left0 | left1 | left2:
                tiered |= left0 | left1 | left2
                for at_t, m in zip(early, (left0, left1, left2), strict=True):
                    while m:
                        low = m & -m
                        at_t[low] = pos
                        m ^= low
        e0, e1, e2 = early
        by_bit = self._by_bit
        new = tuple.__new__  # PrefixMatch(...) runs a Python-level __new__: 10x the cost
        out: dict[str, PrefixMatch] = {}
        for pos, left in [*((d[0], d[1]) for d in drops), (end, alive)]:
            same = new(PrefixMatch, (pos, (pos, pos, pos, pos)))
            while left:
                low = left & -left
                left ^= low
                if low & tiered:
                    by_tier = (
                        e0.get(low, pos) if s0 & low else 0,
                        e1.get(low, pos) if s1 & low else 0,
                        e2.get(low, pos) if s2 & low else 0,
                        pos,
                    )
                    out[by_bit[low].name] = new(PrefixMatch, (pos, by_tier))
                else:
                    out[by_bit[low].name] = same
        return out

    def location_entries(self, location: str) -> int:
        """Blocks ``location`` holds (any tier)."""
        loc = self._locations.get(location)
        return 0 if loc is None else len(loc.members)

    def locations(self) -> list[str]:
        """Locations holding at least one block."""
        return list(self._locations)

    def stats(self) -> IndexStats:
        """Counts and an estimate of the memory held (containers exactly, ints and holder sets roughly)."""
        hashes = sum(len(loc.by_hash) for loc in self._locations.values())
        approx = sum(sys.getsizeof(c) for c in self._blocks.containers())
        approx += len(self._blocks) * _INT_BYTES  # the keys
        approx += len(self._holders) * (_TUPLE_BYTES + 3 * _INT_BYTES)
        for loc in self._locations.values():
            approx += sys.getsizeof(loc.members) + sys.getsizeof(loc.by_hash)
        approx += hashes * _INT_BYTES
        return IndexStats(
            entries=self._entries,
            blocks=len(self._blocks),
            locations=len(self._locations),
            engine_hashes=hashes,
            evicted_entries=self._evicted_entries,
            evicted_blocks=self._evicted_blocks,
            unknown_removals=self._unknown_removals,
            holder_sets=len(self._holders),
            approx_bytes=approx,
        )

    # -- internals

    def _location(self, name: str) -> _Location:
        loc = self._locations.get(name)
        if loc is None:
            loc = _Location(name, self._bits.take())
            self._by_bit[loc.bit] = loc
            self._locations[name] = loc
        return loc

    def _release_if_empty(self, loc: _Location) -> None:
        """Free an empty location's bit for reuse: no mask holds it any more."""
        if loc.members or self._locations.get(loc.name) is not loc:
            return
        del self._locations[loc.name]
        del self._by_bit[loc.bit]
        self._bits.give(loc.bit)

    def _add_hash(self, loc: _Location, key: int, hashes: _Hashes, new: EngineHash) -> _Hashes:
        """``hashes`` plus ``new``: the newest ``_MAX_HASHES_PER_ENTRY``, the older ones' maps dropped."""
        if hashes is None or hashes == new:
            return new
        if not isinstance(hashes, tuple):
            return (hashes, new)
        if new in hashes:
            return hashes
        kept = (*hashes, new)
        for old in kept[:-_MAX_HASHES_PER_ENTRY]:
            if loc.by_hash.get(old) == key:
                del loc.by_hash[old]
        return kept[-_MAX_HASHES_PER_ENTRY:]

    def _drop(self, loc: _Location, key: int, tier: Tier | None) -> bool:
        """Clear ``loc``'s bit of ``key`` in ``tier`` (None: all); False if it held nothing there."""
        hid = self._blocks.get(key)
        if hid is None:
            return False
        masks, bit = self._holders.masks[hid], loc.bit
        if tier is None:
            if not (masks[0] | masks[1] | masks[2] | masks[3]) & bit:
                return False
            keep = ~bit
            new = (masks[0] & keep, masks[1] & keep, masks[2] & keep, masks[3] & keep)
        else:
            if not masks[tier] & bit:
                return False
            new = _with(masks, tier, remove=bit)
        if not (new[0] | new[1] | new[2] | new[3]) & bit:
            self._forget_entry(loc, key)
            self._entries -= 1
        if new == EMPTY:
            self._blocks.delete(key)
            self._holders.release(hid)
        else:
            self._blocks.update(key, self._holders.replace(hid, new))
        return True

    def _forget_entry(self, loc: _Location, key: int) -> None:
        """Drop ``loc``'s membership of ``key`` and the engine hashes it was stored with."""
        hashes = loc.members.pop(key)
        if hashes is None:
            return
        by_hash = loc.by_hash
        for h in hashes if isinstance(hashes, tuple) else (hashes,):
            if by_hash.get(h) == key:  # the hash may have been re-stored for another block since
                del by_hash[h]

    def _evict(self) -> None:
        blocks, holders, by_bit = self._blocks, self._holders, self._by_bit
        while self._entries > self.max_entries:
            key, hid = blocks.pop_oldest()
            g, c, d, r = holders.masks[hid]
            holders.release(hid)
            self._evicted_blocks += 1
            for bit in one_bits(g | c | d | r):
                loc = by_bit[bit]
                self._forget_entry(loc, key)
                self._entries -= 1
                self._evicted_entries += 1
                self._release_if_empty(loc)


def _with(masks: Masks, tier: int, add: int = 0, remove: int = 0) -> Masks:
    """``masks`` with the bits ``add`` set and ``remove`` cleared in ``tier``."""
    g, c, d, r = masks
    if tier == 0:
        g = (g | add) & ~remove
    elif tier == 1:
        c = (c | add) & ~remove
    elif tier == 2:
        d = (d | add) & ~remove
    else:
        r = (r | add) & ~remove
    return (g, c, d, r)
