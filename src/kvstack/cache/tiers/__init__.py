"""Storage tiers of the KV cache behind one interface (`Tier`): memory, local disk, Redis/Valkey, S3.

- `MemoryTier` (memory): page-rounded anonymous mappings under a byte budget, LRU, pinning.
- `DiskTier` (disk): a verified file per chunk in sharded directories, atomic writes, index rebuilt at start.
- `RedisTier` (redis): pipelined MGET/SET with a key prefix and TTL; down/up with backoff on connection loss.
- `S3Tier` (s3): an object per chunk under a key prefix in a bucket, concurrent HEAD/GET/PUT (bounded),
  expiry by the bucket's lifecycle rules; down/up with backoff like Redis.

Disk, Redis and S3 store each chunk as a checksummed `record`. `RedisTier` and `S3Tier` are imported from
their modules (``kvstack.cache.tiers.redis``, ``kvstack.cache.tiers.s3``) so that using the other tiers
imports neither redis-py nor aiobotocore (an optional extra: ``pip install 'kvstack[s3]'``).
"""

from kvstack.cache.payload import Payload
from kvstack.cache.tiers.base import Tier, TierStats
from kvstack.cache.tiers.disk import DiskTier, FsyncPolicy
from kvstack.cache.tiers.memory import MemoryTier

__all__ = ["DiskTier", "FsyncPolicy", "MemoryTier", "Payload", "Tier", "TierStats"]
