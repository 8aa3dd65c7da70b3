"""The KV cache tier: chunk payloads of KV cache stored outside the engines, shared between them.

- `chunk_keys` / `KVLayout` / `ChunkKey` (keys): chained blake3 keys of token-id chunks, namespaced by model,
  KV layout and tensor-parallel rank; stable across processes and machines.
- `tiers`: the `Tier` interface and its memory, disk and Redis implementations.
- `TieredStore` (store): the tiers searched in order, longest consecutive prefix, promotion into memory,
  bounded asynchronous writes to the lower tiers.
- The cache server (server, ``kvstack cache-server`` in cli) serves a store over ZMQ (protocol), with
  payloads in shared memory on the same host (shm), admit/evict events in vLLM's KV-event shape (events)
  and Prometheus metrics (metrics); `CacheClient` / `AsyncCacheClient` (client) turn every fault into a
  counted miss. Import them from their modules: this package's import stays free of ZMQ.

This package imports nothing of the router or scheduling.
"""

from kvstack.cache.keys import ChunkKey, KVLayout, chunk_keys
from kvstack.cache.store import StoreStats, TieredStore

__all__ = ["ChunkKey", "KVLayout", "StoreStats", "TieredStore", "chunk_keys"]
