"""The prefix index: which location (engine, cache node) holds which token block, and in which tier.

- `BlockKeyer` (keys): kvstack's own chained 64-bit keys of token-id blocks, per LoRA-adapter namespace and
  block size; never vLLM's hashes.
- `PrefixIndex` (prefix_index): exact knowledge from KV events, per-tier location bitmasks, one global bound
  on (location, block) entries with LRU eviction; ``lookup`` gives each location's consecutive prefix per
  tier. Its parts: block_table (the two-generation LRU), holders (interned per-tier location masks), bits
  (location bit allocation).
- `HistoryIndex` (history): approximate knowledge from what the router sent where, per-location LRU bound
  and TTL, for engines that publish no events.

This package imports nothing else of kvstack: scheduling and the event ingester depend on it, not the reverse.
"""

from kvstack.index.history import HistoryIndex, HistoryStats
from kvstack.index.keys import BlockKeyer
from kvstack.index.prefix_index import EngineHash, IndexStats, PrefixIndex, PrefixMatch, Tier

__all__ = [
    "BlockKeyer",
    "EngineHash",
    "HistoryIndex",
    "HistoryStats",
    "IndexStats",
    "PrefixIndex",
    "PrefixMatch",
    "Tier",
]
