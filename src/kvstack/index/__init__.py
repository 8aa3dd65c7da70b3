"""The prefix index: which location (engine, cache node) holds which token block, and in which tier.

- `BlockKeyer` (keys): kvstack's own chained 64-bit keys of token-id blocks, per model/LoRA namespace and
  block size; never vLLM's hashes.
- `PrefixIndex` (prefix_index): exact knowledge from KV events, per-tier location bitmasks, one global LRU
  bound on (location, block) entries; ``lookup`` gives each location's consecutive prefix per tier.
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
