"""The tiered store: memory first, then the lower tiers (disk, Redis, S3) in order, behind one object.

A chunk may sit in any tier; reads serve the longest consecutive prefix of the keys asked for, wherever each
chunk of it is, and a chunk read from a lower tier is promoted (copied into memory). ``put`` stores into
memory at once and queues each chunk for every lower tier: it never blocks and never awaits; a full queue
(``write_queue_size`` chunks per tier) drops the write and counts it in ``StoreStats.queue_drops``. ``clear``
never writes a lower tier while emptying it, nor wipes a chunk that a put during it reported stored. Each
method's docstring states what it answers.

``start`` starts the tiers and the writers; ``stop`` lets the queues drain for up to ``drain_timeout_s``,
cancels the writers and closes the tiers. The first tier must be a `MemoryTier`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstack.cache.keys import ChunkKey
from kvstack.cache.payload import Payload, byte_view
from kvstack.cache.tiers.base import Tier, TierStats
from kvstack.cache.tiers.memory import MemoryTier

__all__ = ["StoreStats", "TieredStore"]

log = logging.getLogger(__name__)

_WriteQueue = asyncio.Queue[tuple[ChunkKey, Payload]]


@dataclass(slots=True)
class StoreStats:
    tiers: dict[str, TierStats]
    """Each tier's own counters, by tier name, top tier first."""
    queued: dict[str, int]
    """Writes waiting in each lower tier's queue."""
    queue_drops: dict[str, int]
    """Writes dropped because that tier's queue was full or a clear was running."""
    promotions: int
    """Chunks copied into memory after a lower-tier hit."""


class TieredStore:
    """Memory plus lower tiers searched in order. Each lower tier has a bounded queue (``write_queue_size``
    chunks) drained by its own writer task in batches of up to ``write_batch`` (see `put`)."""

    def __init__(self, tiers: Sequence[Tier], *, write_queue_size: int = 64, write_batch: int = 8) -> None:
        if not tiers or not isinstance(tiers[0], MemoryTier):
            raise TypeError("TieredStore needs a MemoryTier first: puts and promotions land there")
        names = [tier.name for tier in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique (stats and lookups use them), got {names}")
        if write_queue_size < 1 or write_batch < 1:
            raise ValueError(
                f"need write_queue_size >= 1 and write_batch >= 1, got {write_queue_size}, {write_batch}"
            )
        self.memory: MemoryTier = tiers[0]
        self.tiers: tuple[Tier, ...] = tuple(tiers)
        self._write_batch = write_batch
        self._queues: dict[str, _WriteQueue] = {
            tier.name: asyncio.Queue(maxsize=write_queue_size) for tier in self.tiers[1:]
        }
        self._queue_drops = dict.fromkeys(self._queues, 0)
        self._writers: list[asyncio.Task[None]] = []
        self._promotions = 0
        self._clearing = 0  # clears running: puts do not reach the lower tiers meanwhile

    # -- lifecycle

    async def start(self) -> None:
        for tier in self.tiers:
            await tier.start()
        self._writers = [
            asyncio.get_running_loop().create_task(self._write_loop(tier, self._queues[tier.name]))
            for tier in self.tiers[1:]
        ]

    async def stop(self, drain_timeout_s: float = 5.0) -> None:
        """Let the queues drain for up to ``drain_timeout_s``, cancel the writers and close the tiers."""
        try:
            await asyncio.wait_for(self.flush(), drain_timeout_s)
        except TimeoutError:
            left = {name: queue.qsize() for name, queue in self._queues.items() if queue.qsize()}
            log.warning(
                "tiered store: stopping with writes still queued after %gs: %s", drain_timeout_s, left
            )
        writers, self._writers = self._writers, []
        for task in writers:
            task.cancel()
        await asyncio.gather(*writers, return_exceptions=True)
        for tier in reversed(self.tiers):
            await tier.close()

    async def flush(self) -> None:
        """Wait until every queued write has been handed to its tier (needs ``start``)."""
        for queue in self._queues.values():
            await queue.join()

    # -- reads

    async def lookup(self, keys: Sequence[bytes]) -> tuple[int, list[str]]:
        """(n, the name of a tier holding each of ``keys[:n]``) for the longest consecutive prefix held.

        A chunk may sit in any tier (chunk 0 in memory, chunk 1 only on disk), only the prefix must be
        unbroken. Tiers are asked in order and the search restarts at the top after each run, so runs are
        attributed to the highest tier holding their first chunk; no payload is read."""
        where: list[str] = []
        while len(where) < len(keys):
            rest = keys[len(where) :]
            for tier in self.tiers:
                run = tier.contains_now(rest)
                if run is None:
                    run = await tier.contains(rest)
                if run:
                    where.extend([tier.name] * run)
                    break
            else:
                break
        return len(where), where

    def lookup_now(self, keys: Sequence[bytes]) -> tuple[int, list[str]] | None:
        """`lookup` without awaiting, or None when a tier it must ask needs I/O (Redis): await `lookup`.
        Memory and the disk index answer without."""
        where: list[str] = []
        while len(where) < len(keys):
            rest = keys[len(where) :]
            for tier in self.tiers:
                run = tier.contains_now(rest)
                if run is None:
                    return None
                if run:
                    where.extend([tier.name] * run)
                    break
            else:
                break
        return len(where), where

    async def get(self, keys: Sequence[ChunkKey]) -> list[Payload]:
        """The payloads of the longest consecutive prefix of ``keys`` that every tier together can serve.

        Only chunks read and verified count, so the prefix can be shorter than `lookup` said (an entry was
        evicted or found corrupt meanwhile). A chunk read from a lower tier is promoted: copied into memory.
        Chunks after one that no tier holds (as far as the tiers with an index, memory and disk, can tell
        without I/O) are not read from the lower tiers: they could not be served."""
        found: list[Payload | None] = list(await self.memory.get_many(keys))
        from_lower: list[int] = []
        end = len(keys)  # chunks from here on come after a gap: not read
        for n, tier in enumerate(self.tiers[1:], 1):
            end = _first_gap(keys, found, end, self.tiers[n:])
            missing = [i for i in range(end) if found[i] is None]
            if not missing:
                break
            got = await tier.get_many([keys[i] for i in missing])
            for i, payload in zip(missing, got, strict=True):
                if payload is not None:
                    found[i] = payload
                    from_lower.append(i)
        prefix: list[Payload] = []
        for payload in found:
            if payload is None:
                break
            prefix.append(payload)
        for i in from_lower:
            if i < len(prefix) and self.memory.put_sync(keys[i], prefix[i]):
                self._promotions += 1
        return prefix

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each of ``keys`` is held by some tier (no payload is read). Each tier is asked about all
        the keys it may hold at once: one Redis pipeline, not a call per key."""
        found = [False] * len(keys)
        for tier in self.tiers:
            missing = [i for i, hit in enumerate(found) if not hit]
            if not missing:
                break
            present = await tier.contains_each([keys[i] for i in missing])
            for i, hit in zip(missing, present, strict=True):
                found[i] = hit
        return found

    # -- writes

    def put(self, keys: Sequence[ChunkKey], payloads: Sequence[Payload]) -> int:
        """Store each chunk in memory and queue it for the lower tiers; returns how many memory kept.

        Stores into memory at once (one copy); never blocks and never awaits. When a lower tier's queue is
        full the write is dropped and counted in ``StoreStats.queue_drops``. Queued chunks are views of the
        memory copy, so a queued chunk costs no extra memory, and if memory evicts it first its pages stay
        held (and counted in the memory budget) until the writer is done; a chunk memory refused (too big,
        everything pinned) is queued as a private copy."""
        if len(keys) != len(payloads):
            raise ValueError(f"{len(keys)} keys but {len(payloads)} payloads")
        kept = 0
        for key, data in zip(keys, payloads, strict=True):
            stored = self.memory.put_sync(key, data)
            kept += stored
            if not self._queues:
                continue
            if self._clearing:  # a lower tier being emptied takes no new chunk (see `clear`)
                for name in self._queue_drops:
                    self._queue_drops[name] += 1
                continue
            # Lower tiers write later: they need bytes the caller cannot change meanwhile.
            view = self.memory.peek(key) if stored else None
            frozen: Payload = view if view is not None else bytes(byte_view(data))
            for name, queue in self._queues.items():
                try:
                    queue.put_nowait((key, frozen))
                except asyncio.QueueFull:
                    self._queue_drops[name] += 1
        return kept

    async def delete(self, keys: Sequence[ChunkKey]) -> int:
        """Remove each of ``keys`` from every tier; returns how many were held by at least one. A write
        still queued for a lower tier when its key is deleted lands afterwards (the queue is not searched)."""
        removed = 0
        for key in keys:
            held = False
            for tier in self.tiers:
                held = await tier.delete(key) or held
            removed += held
        return removed

    async def clear(self, on_empty: Callable[[], None] | None = None) -> None:
        """Drop the queued writes and empty every tier; ``on_empty`` runs once memory is empty.

        Waits for the writes the lower tiers are already doing, empties memory, then each lower tier. Puts
        made while it runs are kept in memory only: their lower-tier writes are dropped (counted in
        ``queue_drops``), so no tier is written while it is being emptied, and a chunk a put stored during a
        clear is never wiped by that clear after it was reported stored. ``on_empty`` is called right after
        memory is emptied, with nothing awaited in between (the cache server announces the clear there:
        every chunk stored after that point is announced after the clear)."""
        self._clearing += 1
        try:
            for queue in self._queues.values():
                while not queue.empty():
                    queue.get_nowait()
                    queue.task_done()
            await self.flush()  # the batches the writers hold land first, then go with the rest
            self.memory.clear_sync()
            if on_empty is not None:
                on_empty()
            for tier in self.tiers[1:]:
                await tier.clear()
        finally:
            self._clearing -= 1

    def stats(self) -> StoreStats:
        return StoreStats(
            tiers={tier.name: tier.stats() for tier in self.tiers},
            queued={name: queue.qsize() for name, queue in self._queues.items()},
            queue_drops=dict(self._queue_drops),
            promotions=self._promotions,
        )

    async def _write_loop(self, tier: Tier, queue: _WriteQueue) -> None:
        while True:
            batch = [await queue.get()]
            while len(batch) < self._write_batch and not queue.empty():
                batch.append(queue.get_nowait())
            try:
                await tier.put_many(batch)
            except Exception:  # a tier must not raise; if one does, the writer survives it
                log.exception("tiered store: tier %s raised on a write of %d chunks", tier.name, len(batch))
            finally:
                for _ in batch:
                    queue.task_done()


def _first_gap(keys: Sequence[bytes], found: list[Payload | None], end: int, tiers: Sequence[Tier]) -> int:
    """The first chunk before ``end`` not found yet that none of ``tiers`` holds, as far as their indexes
    tell without I/O (a tier without one may hold anything); ``end`` when there is none."""
    for i in range(end):
        if found[i] is None and all(tier.contains_now((keys[i],)) == 0 for tier in tiers):
            return i
    return end
