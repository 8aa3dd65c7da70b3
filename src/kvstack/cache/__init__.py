"""The KV cache tier: chunk payloads of KV cache stored outside the engines, shared between them.

- `chunk_keys` / `KVLayout` / `ChunkKey` (keys): chained blake3 keys of token-id chunks.
- `tiers`: the `Tier` interface and its memory, disk, Redis and S3 implementations.
- `TieredStore` (store): the tiers searched in order, longest consecutive prefix, promotion into memory.
- The cache server (server, ``kvstack cache-server`` in cli) serves a store over ZMQ or a unix socket
  (protocol), with payloads in shared memory on the same host (shm), admit/evict events (events) and
  Prometheus metrics (metrics); `CacheClient` / `AsyncCacheClient` (client) turn every fault into a miss.

Importing this package (as ``kvstack.cache.client`` does, inside vLLM) loads only the keys: `TieredStore`
and `StoreStats` are loaded from the store module on first use. Nothing here imports the router.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstack.cache.keys import ChunkKey, KVLayout, chunk_keys

if TYPE_CHECKING:
    from kvstack.cache.store import StoreStats, TieredStore

__all__ = ["ChunkKey", "KVLayout", "StoreStats", "TieredStore", "chunk_keys"]


def __getattr__(name: str) -> Any:
    # The store pulls in every tier; the client and the connector import this package without needing it.
    if name in ("StoreStats", "TieredStore"):
        from kvstack.cache import store

        return getattr(store, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
