"""The router's prefix knowledge: the index fed by engines' KV events, its own routing history, and the
per-request lookup that turns both into the ``PrefixView`` scheduling reads.

Event ingestion (``apply``/``reset``, the `KVEventSink` of the subscribers): a ``BlockStored`` is keyed by
kvstack's chained hash of its token ids, chained from the key the index holds for its parent's engine hash
(a parent the index does not know, because it was stored before the router listened or was evicted from
the index, makes the event an orphan: counted and skipped, never guessed). ``BlockRemoved`` goes through
the engine-hash map. ``AllBlocksCleared`` and every subscriber reset clear the engine. Blocks with
``extra_keys`` (multimodal inputs, cache salts) are skipped: their tokens alone do not identify them.

Namespace: keys are per LoRA adapter and block size, not per model. Events do not name the model, and it
is not needed: the model filter keeps only engines serving the request's model before scoring, and each
model's prompts are tokenized with that model's tokenizer.

History (for engines without events): after each decision the prompt's blocks are recorded for the chosen
engine in ``history_block_size``-token blocks; bounded per engine with a TTL (``HistoryIndex``).

Cache servers (kvstack's KV cache tier) publish the same events for the chunks they hold, with medium CPU,
DISK or REMOTE; they are locations too (``add_cache(location, node)``). An engine is credited with a cache's
chunks in their tier when it runs on the cache's node, and with REMOTE chunks (a tier shared across nodes)
wherever it runs. An engine's view per tier is then the longer of its own prefix and the credited one:
both start at the prompt's first token, so the longer one is what it can serve without recomputing.
A cache's REMOTE chunks are also indexed under a second location (``<location>#remote``), so an engine on
another node is credited only with a prefix made of chunks it can actually reach.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvstack.engines.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvstack.engines.state import EngineState
from kvstack.index.history import HistoryIndex
from kvstack.index.keys import BlockKeyer
from kvstack.index.prefix_index import PrefixIndex, Tier
from kvstack.scheduling.interfaces import PrefixView

log = logging.getLogger(__name__)

__all__ = ["PrefixLocator", "PrefixLookup", "PrefixSource"]


@dataclass(slots=True)
class IngestStats:
    stored_blocks: int = 0
    removed_blocks: int = 0
    orphans: int = 0  # BlockStored whose parent the index does not know
    skipped_extra_keys: int = 0
    malformed: int = 0  # token count does not match the hashes and block size
    clears: int = 0


@dataclass(slots=True)
class PrefixLookup:
    """One request's lookup: the view for scheduling and the history keys to record after the decision."""

    view: PrefixView
    history_keys: list[int]


class PrefixSource(Protocol):
    """Where a request's prefix view comes from: the locator below, or (in experiments) an oracle that
    asks the engines themselves."""

    async def find(
        self, token_ids: Sequence[int], candidates: Sequence[EngineState], now: float
    ) -> PrefixLookup: ...

    def record(self, engine: str, lookup: PrefixLookup, now: float | None = None) -> None: ...


class PrefixLocator:
    def __init__(
        self,
        index: PrefixIndex | None = None,
        history: HistoryIndex | None = None,
        *,
        history_block_size: int = 64,
    ) -> None:
        self.index = index if index is not None else PrefixIndex()
        self.history = history if history is not None else HistoryIndex()
        self.history_block_size = history_block_size
        self.stats = IngestStats()
        self._keyers: dict[tuple[str, int], BlockKeyer] = {}
        self._block_sizes: dict[str, int] = {}  # engine URL -> block size seen in its events
        self._history_keyer = BlockKeyer("router-history", history_block_size)
        self._cache_nodes: dict[str, str | None] = {}  # cache location -> node it runs on

    def keyer(self, namespace: str, block_size: int) -> BlockKeyer:
        keyer = self._keyers.get((namespace, block_size))
        if keyer is None:
            keyer = self._keyers[(namespace, block_size)] = BlockKeyer(namespace, block_size)
        return keyer

    def block_size(self, engine: str) -> int | None:
        return self._block_sizes.get(engine)

    # -- KV events (KVEventSink) ------------------------------------------------------------------------
    def apply(self, engine: str, batch: EventBatch) -> None:
        index = self.index
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(engine, event)
            elif isinstance(event, BlockRemoved):
                tier = Tier.from_medium(event.medium)
                index.remove_hashes(engine, event.block_hashes, tier)
                if tier is Tier.REMOTE and engine in self._cache_nodes:
                    index.remove_hashes(_remote(engine), event.block_hashes, tier)
                self.stats.removed_blocks += len(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.reset(engine, "AllBlocksCleared")

    def _stored(self, engine: str, event: BlockStored) -> None:
        hashes = event.block_hashes
        if event.extra_keys and any(k is not None for k in event.extra_keys):
            self.stats.skipped_extra_keys += len(hashes)
            return
        size = event.block_size
        if size < 1 or len(event.token_ids) != size * len(hashes):
            self.stats.malformed += 1
            return
        parent: int | None = None
        if event.parent_block_hash is not None:
            parent = self.index.key_for_hash(engine, event.parent_block_hash)
            if parent is None:
                self.stats.orphans += 1
                return
        self._block_sizes[engine] = size
        keys = self.keyer(event.lora_name or "", size).keys_from(parent, event.token_ids)
        tier = Tier.from_medium(event.medium)
        self.index.store(engine, keys, tier, hashes)
        if tier is Tier.REMOTE and engine in self._cache_nodes:
            self._block_sizes[_remote(engine)] = size
            self.index.store(_remote(engine), keys, tier, hashes)
        self.stats.stored_blocks += len(keys)

    def reset(self, engine: str, reason: str) -> None:
        log.info("engine %s: prefix index entries dropped (%s)", engine, reason)
        self.stats.clears += 1
        self.index.clear_location(engine)
        if engine in self._cache_nodes:
            self.index.clear_location(_remote(engine))

    def add_cache(self, location: str, node: str | None) -> None:
        """A cache server whose events arrive as ``location``, on ``node`` (None: no node-local credit)."""
        self._cache_nodes[location] = node

    def forget(self, engine: str) -> None:
        """The engine left the fleet: drop everything known about it."""
        self.index.clear_location(engine)
        self.history.forget(engine)
        self._block_sizes.pop(engine, None)

    # -- per request -------------------------------------------------------------------------------------
    def lookup(
        self, token_ids: Sequence[int], candidates: Sequence[EngineState], now: float | None = None
    ) -> PrefixLookup:
        """Per candidate, how much of the prompt it holds: from the index for engines whose events gave a
        block size, from the history for all (scorers pick which to trust)."""
        now = time.monotonic() if now is None else now
        # Packed once: every block size and the history key the same ids (packing is most of the cost).
        try:
            packed = token_ids if isinstance(token_ids, array) else array("I", token_ids)
        except (OverflowError, TypeError):
            # Ids no tokenizer makes (negative, huge): the engine will refuse the request; route it anyway.
            return PrefixLookup(PrefixView(len(token_ids)), [])
        urls = {e.url for e in candidates}
        precise: dict[str, tuple[int, ...]] = {}
        by_size: dict[int, list[str]] = {}
        for location in (*urls, *self._cache_nodes, *map(_remote, self._cache_nodes)):
            size = self._block_sizes.get(location)
            if size is not None:
                by_size.setdefault(size, []).append(location)
        held: dict[str, tuple[int, ...]] = {}  # location -> cumulative tokens per tier
        for size, locations in by_size.items():
            matches = self.index.lookup(self.keyer("", size).keys(packed))
            for location in locations:
                match = matches.get(location)
                if match is not None:
                    held[location] = tuple(b * size for b in match.blocks_by_tier)
        for url in urls:
            if url in held:
                precise[url] = held[url]
        if self._cache_nodes:
            self._credit_caches(held, candidates, precise)
        history_keys = self._history_keyer.keys(packed)
        approximate: dict[str, int] = {}
        if history_keys:
            step = self.history_block_size
            for url, blocks in self.history.lookup(history_keys, now).items():
                if url in urls:
                    approximate[url] = blocks * step
        return PrefixLookup(PrefixView(len(token_ids), precise, approximate), history_keys)

    def _credit_caches(
        self,
        held: dict[str, tuple[int, ...]],
        candidates: Sequence[EngineState],
        precise: dict[str, tuple[int, ...]],
    ) -> None:
        for location, node in self._cache_nodes.items():
            tiers = held.get(location)
            shared = held.get(_remote(location))  # REMOTE chunks alone: any engine can load them
            if tiers is None and shared is None:
                continue
            for engine in candidates:
                local = node is not None and engine.endpoint.node == node
                credit = tiers if local else shared
                if credit is None:
                    continue
                own = precise.get(engine.url)
                precise[engine.url] = credit if own is None else tuple(map(max, own, credit))

    async def find(
        self, token_ids: Sequence[int], candidates: Sequence[EngineState], now: float
    ) -> PrefixLookup:
        return self.lookup(token_ids, candidates, now)

    def record(self, engine: str, lookup: PrefixLookup, now: float | None = None) -> None:
        """Remember that the prompt went to ``engine`` (the history behind approximate scoring)."""
        if lookup.history_keys:
            self.history.record(engine, lookup.history_keys, time.monotonic() if now is None else now)


def _remote(location: str) -> str:
    return f"{location}#remote"
