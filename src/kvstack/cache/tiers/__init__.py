"""Storage tiers of the KV cache behind one interface (`Tier`): memory, local disk, Redis/Valkey.

- `MemoryTier` (memory): page-rounded anonymous mappings under a byte budget, LRU, pinning.
- `DiskTier` (disk): a verified file per chunk in sharded directories, atomic writes, index rebuilt at start.
- `RedisTier` (redis): pipelined MGET/SET with a key prefix and TTL; down/up with backoff on connection loss.

Disk and Redis store each chunk as a checksummed `record`. `RedisTier` is imported from its module
(``kvstack.cache.tiers.redis``) so that using the other tiers does not import redis-py.
"""

from kvstack.cache.tiers.base import Payload, Tier, TierStats
from kvstack.cache.tiers.disk import DiskTier, FsyncPolicy
from kvstack.cache.tiers.memory import MemoryTier

__all__ = ["DiskTier", "FsyncPolicy", "MemoryTier", "Payload", "Tier", "TierStats"]
