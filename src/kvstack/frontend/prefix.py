"""A front end's prefix knowledge: the index fed by KV events, its own routing history, and the per-request
lookup that turns both into the ``PrefixView`` scheduling reads.

- Events (``apply``/``reset``, the subscribers' `KVEventSink`): a ``BlockStored`` is keyed by kvstack's
  chained hash of its token ids, from its parent's key (an unknown parent makes it an orphan: counted and
  skipped); ``BlockRemoved`` goes through the engine-hash map; ``AllBlocksCleared`` and a reset clear the
  location. Blocks whose ``extra_keys`` hold more than their LoRA adapter's name are skipped.
- An engine seen down (``engine_down``: its process went away, whatever answers at its URL next has an
  empty cache) loses its index entries and its routing history. ``on_dropped(engine, reason, entries)``
  hears every such drop and every reset.
- Namespaces: per LoRA adapter and block size; a request's model is looked up as an adapter once an
  engine's events named it so. A request with a ``cache_salt`` gets no exact credit (history is salted).
- Layout: per location, only the full-attention (group, block size) that carried the most tokens is indexed.
- History, for engines without events: each decision's prompt in ``history_block_size``-token blocks for
  the chosen engine, bounded per engine with a TTL (``HistoryIndex``).
- Cache servers (``add_cache(location, node)``): CPU/DISK chunks are credited to engines on the cache's
  node, REMOTE ones (also indexed under ``<location>#remote``) to any engine; an engine's view per tier is
  the longer of its own prefix and the credited one. A chunk tagged ``(MODEL_EXTRA_KEY, model)`` is credited
  only to that model's requests; no cache chunk is credited to a LoRA adapter's requests.
"""

from __future__ import annotations

import functools
import logging
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from kvstack.engines.state import EngineState
from kvstack.index.history import HistoryIndex
from kvstack.index.keys import BlockKeyer
from kvstack.index.prefix_index import PrefixIndex, Tier
from kvstack.kvevents.codec import MODEL_EXTRA_KEY, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvstack.scheduling.interfaces import PrefixView

log = logging.getLogger(__name__)

__all__ = ["PrefixLocator", "PrefixLookup", "PrefixSource"]

# vLLM's KVCacheSpecKind values whose blocks are a reusable prefix (every earlier token's KV is kept).
_PREFIX_KINDS: Final = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
_KEYERS: Final = 64  # (namespace, block size) keyers kept: a few adapters times a few block sizes
_ADAPTERS: Final = 4096  # LoRA adapter names remembered from events (the oldest is forgotten first)
_LAYOUTS: Final = 8  # (group, block size) pairs tallied per location


@dataclass(slots=True)
class IngestStats:
    stored_blocks: int = 0
    removed_blocks: int = 0
    orphans: int = 0  # BlockStored whose parent the index does not know
    skipped_extra_keys: int = 0
    skipped_layout: int = 0  # blocks of a non-full-attention group, another group or another block size
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
        self,
        token_ids: Sequence[int],
        candidates: Sequence[EngineState],
        now: float,
        *,
        model: str = "",
        cache_salt: str | None = None,
    ) -> PrefixLookup: ...

    def record(self, engine: str, lookup: PrefixLookup, now: float | None = None) -> None: ...


@dataclass(slots=True)
class _Layout:
    """A location's indexed (group, block size) and the tokens its events carried per pair."""

    main: tuple[int | None, int]
    tokens: dict[tuple[int | None, int], int]

    def count(self, seen: tuple[int | None, int], tokens: int) -> bool:
        """Add an event's tokens; True when ``seen`` is (now) the main layout."""
        tally = self.tokens
        tally[seen] = total = tally.get(seen, 0) + tokens
        if seen != self.main and total > tally[self.main]:
            self.main = seen
        if len(tally) > _LAYOUTS:
            del tally[min((k for k in tally if k != self.main), key=tally.__getitem__)]
        return seen == self.main


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
        self._keyers = functools.lru_cache(maxsize=_KEYERS)(BlockKeyer)
        self._layouts: dict[str, _Layout] = {}
        self._block_sizes: dict[str, int] = {}  # location -> its layout's block size (read per request)
        self._adapters: dict[str, None] = {}  # LoRA adapter names events carried, oldest first
        self._history_keyer = BlockKeyer("router-history", history_block_size)
        self._cache_nodes: dict[str, str | None] = {}  # cache location -> node it runs on
        self._named_caches: set[str] = set()  # cache locations whose events name the chunks' model
        self.on_dropped: Callable[[str, str, int], None] | None = None  # (engine, reason, entries dropped)

    def keyer(self, namespace: str, block_size: int) -> BlockKeyer:
        return self._keyers(namespace, block_size)

    def block_size(self, engine: str) -> int | None:
        return self._block_sizes.get(engine)

    def namespace(self, model: str) -> str:
        """The index namespace of a request for ``model``: the model when events named it as a LoRA adapter,
        else the base namespace ``""``."""
        return model if model in self._adapters else ""

    # -- KV events (KVEventSink) ------------------------------------------------------------------------
    def apply(self, engine: str, batch: EventBatch) -> None:
        index = self.index
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(engine, event)
            elif isinstance(event, BlockRemoved):
                if not self._in_layout_group(engine, event.group_idx):
                    self.stats.skipped_layout += len(event.block_hashes)
                    continue
                tier = Tier.from_medium(event.medium)
                index.remove_hashes(engine, event.block_hashes, tier)
                if tier is Tier.REMOTE and engine in self._cache_nodes:
                    index.remove_hashes(_remote(engine), event.block_hashes, tier)
                self.stats.removed_blocks += len(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.reset(engine, "AllBlocksCleared")

    def _stored(self, engine: str, event: BlockStored) -> None:
        hashes = event.block_hashes
        cache = engine in self._cache_nodes
        namespace = _cache_namespace_of(event) if cache else _namespace_of(event)
        if namespace is None:
            self.stats.skipped_extra_keys += len(hashes)
            return
        size = event.block_size
        if size < 1 or len(event.token_ids) != size * len(hashes):
            self.stats.malformed += 1
            return
        kind = event.kv_cache_spec_kind
        if (kind is not None and kind not in _PREFIX_KINDS) or not self._in_layout(engine, event):
            self.stats.skipped_layout += len(hashes)
            return
        parent: int | None = None
        if event.parent_block_hash is not None:
            parent = self.index.key_for_hash(engine, event.parent_block_hash)
            if parent is None:
                self.stats.orphans += 1
                return
        if cache:
            if namespace:
                self._named_caches.add(engine)
        elif namespace and namespace not in self._adapters:
            self._adapters[namespace] = None
            if len(self._adapters) > _ADAPTERS:
                del self._adapters[next(iter(self._adapters))]
        keys = self.keyer(namespace, size).keys_from(parent, event.token_ids)
        tier = Tier.from_medium(event.medium)
        self.index.store(engine, keys, tier, hashes)
        if tier is Tier.REMOTE and cache:
            self._block_sizes[_remote(engine)] = size
            self.index.store(_remote(engine), keys, tier, hashes)
        self.stats.stored_blocks += len(keys)

    def _in_layout(self, engine: str, event: BlockStored) -> bool:
        """Count the event towards the engine's layout; True when its blocks are of that layout."""
        seen = (event.group_idx, event.block_size)
        layout = self._layouts.get(engine)
        if layout is None:
            self._layouts[engine] = _Layout(seen, {seen: len(event.token_ids)})
            self._block_sizes[engine] = event.block_size
            return True
        before = layout.main
        if not layout.count(seen, len(event.token_ids)):
            return False
        if seen != before:
            log.info(
                "engine %s: KV events now mostly carry block size %d (group %s), was %d (group %s); "
                "indexing those",
                engine,
                seen[1],
                seen[0],
                before[1],
                before[0],
            )
            self._block_sizes[engine] = event.block_size
        return True

    def _in_layout_group(self, engine: str, group_idx: int | None) -> bool:
        layout = self._layouts.get(engine)
        return group_idx is None or layout is None or layout.main[0] in (None, group_idx)

    def reset(self, engine: str, reason: str) -> None:
        log.info("engine %s: prefix index entries dropped (%s)", engine, reason)
        self._dropped(engine, reason, self._clear(engine))

    def engine_down(self, engine: str) -> int:
        """The engine's process went away: drop its index entries and routing history (its block size and
        layout stay for the process that comes back); returns the entries dropped."""
        dropped = self._clear(engine) + self.history.forget(engine)
        if dropped:
            log.info("engine %s is down: its %d prefix entries dropped", engine, dropped)
        self._dropped(engine, "engine_down", dropped)
        return dropped

    def _clear(self, engine: str) -> int:
        self.stats.clears += 1
        dropped = self.index.clear_location(engine)
        if engine in self._cache_nodes:
            self.index.clear_location(_remote(engine))
        layout = self._layouts.get(engine)
        if layout is not None:
            # A restarted engine may come back with another block size: it takes over after one block more
            # than one block of the old size (a partial block alone never does).
            layout.tokens = {layout.main: layout.main[1]}
        return dropped

    def _dropped(self, engine: str, reason: str, entries: int) -> None:
        if self.on_dropped is not None:
            self.on_dropped(engine, reason, entries)

    def add_cache(self, location: str, node: str | None) -> None:
        """A cache server whose events arrive as ``location``, on ``node`` (None: no node-local credit)."""
        self._cache_nodes[location] = node

    def forget(self, engine: str) -> None:
        """The engine left the fleet: drop everything known about it."""
        self.index.clear_location(engine)
        self.history.forget(engine)
        self._block_sizes.pop(engine, None)
        self._layouts.pop(engine, None)

    # -- per request -------------------------------------------------------------------------------------
    def lookup(
        self,
        token_ids: Sequence[int],
        candidates: Sequence[EngineState],
        now: float | None = None,
        *,
        model: str = "",
        cache_salt: str | None = None,
    ) -> PrefixLookup:
        """Per candidate, how much of the prompt it holds: from the index for engines whose events gave a
        block size, from the history for all (scorers pick which to trust). ``model`` selects the LoRA
        namespace (see ``namespace``); a ``cache_salt`` leaves only the (salted) history."""
        now = time.monotonic() if now is None else now
        # Packed once: every block size and the history key the same ids (packing is most of the cost).
        try:
            packed = token_ids if isinstance(token_ids, array) else array("I", token_ids)
        except (OverflowError, TypeError):
            # Ids no tokenizer makes (negative, huge): the engine will refuse the request; route it anyway.
            return PrefixLookup(PrefixView(len(token_ids)), [])
        namespace = self.namespace(model) if model else ""
        urls = {e.url for e in candidates}
        precise: dict[str, tuple[int, ...]] = {}
        if not cache_salt:
            self._precise(packed, namespace, model, candidates, urls, precise)
        history_keyer = self._history_keyer
        if cache_salt:  # salts are per user, too many to cache: one short hash per request
            history_keyer = BlockKeyer(f"router-history\0{namespace}\0{cache_salt}", self.history_block_size)
        elif namespace:
            history_keyer = self.keyer(f"router-history\0{namespace}", self.history_block_size)
        history_keys = history_keyer.keys(packed)
        approximate: dict[str, int] = {}
        if history_keys:
            step = self.history_block_size
            for url, blocks in self.history.lookup(history_keys, now).items():
                if url in urls:
                    approximate[url] = blocks * step
        return PrefixLookup(PrefixView(len(token_ids), precise, approximate), history_keys)

    def _precise(
        self,
        packed: Sequence[int],
        namespace: str,
        model: str,
        candidates: Sequence[EngineState],
        urls: set[str],
        precise: dict[str, tuple[int, ...]],
    ) -> None:
        sizes = self._block_sizes
        groups: dict[tuple[str, int], list[str]] = {}  # (namespace, block size) -> locations
        for url in urls:
            size = sizes.get(url)
            if size is not None:
                groups.setdefault((namespace, size), []).append(url)
        caches = self._cache_nodes if not namespace else {}  # caches hold no adapter's chunks
        for cache in caches:
            cache_namespace = _model_namespace(model) if cache in self._named_caches else ""
            for location in (cache, _remote(cache)):
                size = sizes.get(location)
                if size is not None:
                    groups.setdefault((cache_namespace, size), []).append(location)
        held: dict[str, tuple[int, ...]] = {}  # location -> cumulative tokens per tier
        for (group_namespace, size), locations in groups.items():
            matches = self.index.lookup(self.keyer(group_namespace, size).keys(packed))
            for location in locations:
                match = matches.get(location)
                if match is not None:
                    held[location] = tuple(b * size for b in match.blocks_by_tier)
        for url in urls:
            if url in held:
                precise[url] = held[url]
        if caches:
            self._credit_caches(held, candidates, precise, model)

    def _credit_caches(
        self,
        held: dict[str, tuple[int, ...]],
        candidates: Sequence[EngineState],
        precise: dict[str, tuple[int, ...]],
        model: str,
    ) -> None:
        for location, node in self._cache_nodes.items():
            tiers = held.get(location)
            shared = held.get(_remote(location))  # REMOTE chunks alone: any engine can load them
            if tiers is None and shared is None:
                continue
            named = location in self._named_caches
            for engine in candidates:
                if named and engine.endpoint.models and model not in engine.endpoint.models:
                    continue  # another model's engine: the chunks are of no use to it
                local = node is not None and engine.endpoint.node == node
                credit = tiers if local else shared
                if credit is None:
                    continue
                own = precise.get(engine.url)
                precise[engine.url] = credit if own is None else tuple(map(max, own, credit))

    async def find(
        self,
        token_ids: Sequence[int],
        candidates: Sequence[EngineState],
        now: float,
        *,
        model: str = "",
        cache_salt: str | None = None,
    ) -> PrefixLookup:
        return self.lookup(token_ids, candidates, now, model=model, cache_salt=cache_salt)

    def record(self, engine: str, lookup: PrefixLookup, now: float | None = None) -> None:
        """Remember that the prompt went to ``engine`` (the history behind approximate scoring)."""
        if lookup.history_keys:
            self.history.record(engine, lookup.history_keys, time.monotonic() if now is None else now)


def _remote(location: str) -> str:
    return f"{location}#remote"


def _cache_namespace_of(event: BlockStored) -> str | None:
    """The namespace of a cache server's chunks: their model's when the events name it, ``""`` when they do
    not (an older server, or a put that named no model), None for extra keys of any other kind."""
    extra = event.extra_keys
    if not extra:
        return ""
    first = extra[0]
    if first is None or len(first) != 2 or first[0] != MODEL_EXTRA_KEY or not isinstance(first[1], str):
        return None
    if any(keys != first for keys in extra):
        return None
    return _model_namespace(first[1])


def _model_namespace(model: str) -> str:
    # NUL never appears in a LoRA adapter's name, so a model's namespace never meets an adapter's.
    return f"\0model\0{model}"


def _namespace_of(event: BlockStored) -> str | None:
    """The namespace of a stored event's blocks: its LoRA adapter (``""`` for the base model), or None when
    a block's ``extra_keys`` hold more than the adapter's name. vLLM 0.32 publishes each block's extra keys
    untagged, the adapter's as its bare name: a LoRA-only block's are ``(lora_name,)``."""
    lora = event.lora_name or ""
    if event.extra_keys:
        only_lora = (lora,) if lora else None
        for keys in event.extra_keys:
            if keys is not None and tuple(keys) != only_lora:
                return None
    return lora
