"""The contract every KV cache tier implements (memory, local disk, Redis, S3), and its counters.

A tier (`Tier`) maps `ChunkKey` to an opaque payload (one chunk's KV bytes). Rules every tier keeps:

- No method raises for a tier fault (I/O error, lost connection, corrupt entry): a read fault is a miss, a
  write fault is a dropped write, and both are counted in `TierStats`. Programming errors still raise.
- A corrupt entry (failed length or checksum check) is deleted, counted in ``corrupt`` and read as a miss: a
  tier never returns bytes it did not verify.
- ``get`` may return a read-only ``memoryview`` into the tier's own storage (no copy); callers that keep it
  longer than a moment should copy it or use the tier's pinning where it has one.
- ``start`` and ``close`` own whatever the tier runs (threads, connections, tasks); a tier is used between
  them.
- An optional ``listener`` (`TierListener`) hears which chunks entered and left the tier (`Tier` says when).
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Container, Sequence
from dataclasses import dataclass, replace
from itertools import takewhile
from typing import Protocol

from kvstack.backoff import Backoff
from kvstack.cache.keys import ChunkKey
from kvstack.cache.payload import Payload

__all__ = [
    "Announcements",
    "Reconnector",
    "Tier",
    "TierListener",
    "TierStats",
    "held_prefix",
]


def held_prefix(keys: Sequence[bytes], held: Container[bytes]) -> int:
    """How many of ``keys``, from the first, are in ``held`` (an index): the scan runs in C and stops at the
    first missing key (128 keys in a third of a Python loop's time)."""
    return len(list(takewhile(held.__contains__, keys)))


@dataclass(slots=True)
class TierStats:
    """Counters of one tier since it started; ``bytes``/``entries``/``capacity_bytes`` are None when the
    tier cannot know them (Redis)."""

    hits: int = 0
    misses: int = 0
    writes: int = 0
    """Payloads stored."""
    write_drops: int = 0
    """Writes not stored: too large, no room (everything pinned), tier down, or an I/O error."""
    evictions: int = 0
    errors: int = 0
    """I/O or connection errors (each also shows as a miss or a dropped write)."""
    corrupt: int = 0
    """Entries that failed verification: deleted and read as misses."""
    bytes: int | None = 0
    entries: int | None = 0
    capacity_bytes: int | None = None
    up: bool = True
    page_cache_reads: int | None = None
    """Hits read on the event loop because their file was wholly in the page cache (the disk tier; None
    for tiers that do not read files)."""

    def copy(self) -> TierStats:
        return replace(self)


class TierListener(Protocol):
    """Told which chunks entered or left a tier (admit/evict events); must not raise or block."""

    def stored(self, tier: Tier, keys: Sequence[ChunkKey]) -> None: ...

    def removed(self, tier: Tier, keys: Sequence[ChunkKey]) -> None: ...

    def annotation(self, key: ChunkKey) -> bytes | None:
        """What a persistent tier should keep with ``key``'s chunk for `restored` (None: nothing)."""
        ...

    def restored(self, tier: Tier, items: Sequence[tuple[ChunkKey, bytes]], done: bool) -> None:
        """Chunks ``tier`` holds, with the annotation kept with each (`Tier.announce_held`), in batches;
        ``done`` on the last call."""
        ...


class Tier(ABC):
    """One storage tier of chunk payloads; see the module docstring for the rules.

    ``listener`` (optional, set by whoever owns the tier, e.g. the cache server) hears which chunks entered
    the tier (``stored``) and left it (``removed``: evicted, deleted, found corrupt), on the event loop,
    synchronously. ``clear`` is not reported (the owner knows about it). A tier that keeps chunks across
    restarts (disk) also keeps, with each chunk, the listener's ``annotation`` of it (for the cache server:
    the chunk's parent key and token ids, what an admit event needs), and `announce_held` hands the chunks
    it holds back to the listener with their annotations (``restored``), e.g. chunks found at start. A tier
    whose entries can vanish without it knowing (Redis: TTL expiry, ``maxmemory`` eviction, another client's
    delete) reports a removal when it next finds an entry it reported stored missing (a lookup or a get that
    asks for it; see `Announcements`).
    """

    name: str
    listener: TierListener | None = None

    async def start(self) -> None:  # noqa: B027 - optional hook, most tiers need nothing
        """Acquire resources (threads, connections); called once before use."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release everything ``start`` acquired; pending work is finished or dropped, never left running."""

    async def announce_held(self) -> int:
        """Hand every chunk this tier holds with an annotation to ``listener.restored``; returns how many.
        A tier that keeps no annotations (memory, Redis) has nothing to hand back."""
        return 0

    @abstractmethod
    async def contains(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are present consecutively (no payload is read).

        Keys may be plain 32-byte ``bytes``: a `ChunkKey` hashes and compares as its bytes."""

    def contains_now(self, keys: Sequence[bytes]) -> int | None:
        """`contains` answered without I/O or awaiting, or None when this tier cannot (then await
        `contains`). Memory and the disk index answer from process memory; Redis cannot."""
        return None

    async def contains_each(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each of ``keys`` is present, gaps or not (no payload is read). The default asks
        `contains_now`, else `contains`, key by key, one after another; a tier that can ask about many keys
        in one round trip (Redis: one pipeline) overrides it."""
        present = []
        for key in keys:
            run = self.contains_now((key,))
            present.append((await self.contains((key,)) if run is None else run) > 0)
        return present

    @abstractmethod
    async def get(self, key: ChunkKey) -> Payload | None:
        """The verified payload of ``key``, or None."""

    async def get_many(self, keys: Sequence[ChunkKey]) -> list[Payload | None]:
        """The payload of each key, or None where missing."""
        return [await self.get(key) for key in keys]

    @abstractmethod
    async def put(self, key: ChunkKey, data: Payload) -> bool:
        """Store a copy of ``data`` under ``key`` (replacing any); False when the write was dropped."""

    async def put_many(self, items: Sequence[tuple[ChunkKey, Payload]]) -> int:
        """Store each (key, data); returns how many were stored."""
        stored = 0
        for key, data in items:
            stored += await self.put(key, data)
        return stored

    @abstractmethod
    async def delete(self, key: ChunkKey) -> bool:
        """Remove ``key``; True when it was present."""

    @abstractmethod
    async def clear(self) -> None:
        """Remove every entry of this tier (for Redis: every key under the tier's prefix)."""

    @abstractmethod
    def stats(self) -> TierStats:
        """A snapshot of the counters."""


class Announcements:
    """The listener side of a tier whose entries can vanish without it knowing (Redis, S3).

    It tells ``tier.listener`` what was stored and removed, and remembers the last ``limit`` keys reported
    stored (newest last) so that one found missing later (TTL, eviction, another client's delete) is
    reported removed exactly once. Keys older than the last ``limit`` are forgotten: their disappearance
    goes unreported, which keeps memory bounded."""

    def __init__(self, tier: Tier, limit: int) -> None:
        self._tier = tier
        self._limit = limit
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def stored(self, keys: Sequence[ChunkKey]) -> None:
        listener = self._tier.listener
        if not keys or listener is None:
            return
        listener.stored(self._tier, keys)
        remembered = self._keys
        for key in keys:
            remembered[key] = None
            remembered.move_to_end(key)
        while len(remembered) > self._limit:
            remembered.popitem(last=False)

    def removed(self, keys: Sequence[ChunkKey]) -> None:
        """The tier removed ``keys`` itself (deleted, found corrupt)."""
        for key in keys:
            self._keys.pop(key, None)
        listener = self._tier.listener
        if keys and listener is not None:
            listener.removed(self._tier, keys)

    def missing(self, keys: Sequence[bytes]) -> None:
        """``keys`` were found absent: those reported stored are reported removed."""
        if not self._keys:
            return
        gone = [ChunkKey(key) for key in keys if key in self._keys]
        for key in gone:
            del self._keys[key]
        listener = self._tier.listener
        if gone and listener is not None:
            listener.removed(self._tier, gone)

    def clear(self) -> None:
        """The tier was cleared (not reported: the owner asked for it)."""
        self._keys.clear()


class Reconnector:
    """Whether a tier's network service (Redis, S3) is usable, and the task that probes it back when not.

    `down` marks it unusable (logged once per outage) and starts probing: ``probe()`` every ``initial_s``
    seconds, doubling up to ``max_s``; it returns None when the service answers, else what is wrong (logged
    when the answer changes). The first None marks it up again. `stop` ends the probing for good."""

    def __init__(
        self,
        where: str,
        probe: Callable[[], Awaitable[str | None]],
        initial_s: float,
        max_s: float,
        logger: logging.Logger,
    ) -> None:
        self.up = False
        self._where = where
        self._probe = probe
        self._backoff = Backoff(initial_s, max_s)
        self._log = logger
        self._task: asyncio.Task[None] | None = None
        self._stopped = False

    def start(self) -> None:
        """Probing may begin (again, after `stop`)."""
        self._stopped = False

    def down(self, why: str) -> None:
        if self._stopped:
            return
        if self.up or self._task is None:
            self._log.warning(
                "%s unusable (%s); serving without it, retrying every <= %gs",
                self._where,
                why,
                self._backoff.max_s,
            )
        self.up = False
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._probing(why))

    async def stop(self) -> None:
        self._stopped = True
        self.up = False
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _probing(self, last: str) -> None:
        delays = self._backoff.sequence()
        while not self._stopped:
            await asyncio.sleep(delays.next())
            try:
                problem = await self._probe()
            except Exception as e:  # a probe that fails in a way it did not expect still retries
                problem = f"{type(e).__name__}: {e}"
            if problem is None:
                self.up = True
                self._log.warning("%s is reachable again", self._where)
                return
            if problem != last:  # a new answer: say it once
                self._log.warning("%s still unusable: %s", self._where, problem)
                last = problem
