"""The KV cache tier: chunk payloads of KV cache stored outside the engines, shared between them.

- `chunk_keys` / `KVLayout` / `ChunkKey` (keys): chained blake3 keys of token-id chunks, namespaced by model,
  KV layout and tensor-parallel rank; stable across processes and machines.
- `tiers`: the `Tier` interface and its memory, disk and Redis implementations.
- `TieredStore` (store): the tiers searched in order, longest consecutive prefix, promotion into memory,
  bounded asynchronous writes to the lower tiers.

This package imports nothing of the router or scheduling.
"""

from kvstack.cache.keys import ChunkKey, KVLayout, chunk_keys
from kvstack.cache.store import StoreStats, TieredStore

__all__ = ["ChunkKey", "KVLayout", "StoreStats", "TieredStore", "chunk_keys"]
