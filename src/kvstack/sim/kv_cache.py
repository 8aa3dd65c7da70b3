"""Paged KV blocks with prefix caching, behaving like vLLM v1's block pool.

What is modelled, because routers and the conformance suite can observe it:
- a fixed pool of blocks; block 0 is the null block and never handed out, so usage is
  ``1 - free / (num_blocks - 1)`` exactly as vLLM reports ``vllm:kv_cache_usage_perc``;
- a free queue ordered for eviction: cached blocks released by a request go to the tail in the
  order given (a request frees its tail block first), uncached ones to the head;
- a hash -> blocks map: the same block hash may be held by several physical blocks (a prompt
  that missed part of its prefix recomputes it into a fresh block), as in vLLM;
- KV events: one ``BlockStored`` per caching call (all newly full blocks of one request in one
  step), one ``BlockRemoved`` per evicted hash, ``AllBlocksCleared`` on reset.

Block hashes are the simulator's own chained hash of token ids, seeded per engine: like vLLM's
(whose hash depends on the algorithm and PYTHONHASHSEED) they are opaque to consumers, who must
key blocks by token ids.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import xxhash

from kvstack.kvevents.codec import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent

NULL_BLOCK_ID = 0


@dataclass(slots=True, eq=False)
class Block:
    """One physical KV block."""

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


def chain_block_hashes(
    token_ids: Sequence[int], block_size: int, *, seed: int, parent: int | None = None, start: int = 0
) -> list[int]:
    """Chained 63-bit hashes of the full blocks of ``token_ids[start:]``; ``parent``: the block before."""
    hashes: list[int] = []
    prev = parent if parent is not None else seed
    for begin in range(start, len(token_ids) - block_size + 1, block_size):
        h = xxhash.xxh3_64_intdigest(
            prev.to_bytes(8, "big") + array("q", token_ids[begin : begin + block_size]).tobytes(), seed=seed
        )
        # 63 bits: vLLM's int hashes are unsigned 64-bit, but smaller ints keep every consumer's
        # msgpack decoder on the fast int path; consumers must treat them as opaque anyway.
        prev = h & 0x7FFF_FFFF_FFFF_FFFF
        hashes.append(prev)
    return hashes


class FreeBlockQueue:
    """Eviction order of unreferenced blocks; O(1) pop, append, prepend and removal."""

    def __init__(self, blocks: Iterable[Block]) -> None:
        self._queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in blocks)

    def __len__(self) -> int:
        return len(self._queue)

    def popleft(self) -> Block:
        return self._queue.popitem(last=False)[1]

    def append(self, block: Block) -> None:
        self._queue[block.block_id] = block

    def prepend(self, block: Block) -> None:
        self._queue[block.block_id] = block
        self._queue.move_to_end(block.block_id, last=False)

    def remove(self, block: Block) -> None:
        del self._queue[block.block_id]


class KVCache:
    """Block pool + prefix cache of one simulated engine."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        hash_seed: int = 0,
        medium: str | None = "GPU",
        emit_events: bool = True,
    ) -> None:
        if num_blocks < 2:
            raise ValueError("num_blocks must be at least 2 (block 0 is the null block)")
        if block_size < 1:
            raise ValueError("block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_seed = hash_seed
        self.medium = medium
        self.emit_events = emit_events
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.blocks[NULL_BLOCK_ID].ref_cnt = 1
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self._cached: dict[int, dict[int, Block]] = {}
        self._events: list[KVEvent] = []

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_cached_hashes(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of usable blocks referenced by requests (cached free blocks count as free)."""
        return 1.0 - len(self.free_queue) / (self.num_blocks - 1)

    def block_hashes(self, token_ids: Sequence[int], *, have: list[int] | None = None) -> list[int]:
        """Hashes of every full block of ``token_ids``, extending ``have`` (hashes already computed)."""
        have = have if have is not None else []
        parent = have[-1] if have else None
        return have + chain_block_hashes(
            token_ids, self.block_size, seed=self.hash_seed, parent=parent, start=len(have) * self.block_size
        )

    def longest_cached_prefix(self, block_hashes: Sequence[int], max_tokens: int) -> list[Block]:
        """Blocks of the longest cached prefix, at most ``max_tokens // block_size`` of them."""
        if not self.enable_prefix_caching:
            return []
        hit: list[Block] = []
        for h in block_hashes[: max_tokens // self.block_size]:
            holders = self._cached.get(h)
            if not holders:
                break
            hit.append(next(iter(holders.values())))
        return hit

    # -- mutations -----------------------------------------------------------------------------
    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on prefix-hit blocks, pulling unreferenced ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[Block] | None:
        """``n`` fresh blocks (evicting cached ones from the head of the free queue), or None."""
        if n > len(self.free_queue):
            return None
        out: list[Block] = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def free(self, ordered_blocks: Iterable[Block]) -> None:
        """Drop one reference on each block; ``ordered_blocks`` lists the first to evict first."""
        evict_first: list[Block] = []
        for block in ordered_blocks:
            if block.block_id == NULL_BLOCK_ID:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None or not self.enable_prefix_caching:
                    evict_first.append(block)
                else:
                    self.free_queue.append(block)
        # Prepending one at a time reverses the order, so walk backwards to keep the caller's.
        for block in reversed(evict_first):
            self.free_queue.prepend(block)

    def cache_full_blocks(
        self,
        blocks: Sequence[Block],
        block_hashes: Sequence[int],
        token_ids: Sequence[int],
        num_cached: int,
        num_full: int,
        *,
        lora_name: str | None = None,
    ) -> None:
        """Register ``blocks[num_cached:num_full]`` as full and reusable; emits one BlockStored."""
        if not self.enable_prefix_caching or num_full <= num_cached:
            return
        new_hashes: list[BlockHash] = []
        for i in range(num_cached, num_full):
            block, h = blocks[i], block_hashes[i]
            new_hashes.append(h)
            if block.block_hash == h:
                continue
            block.block_hash = h
            self._cached.setdefault(h, {})[block.block_id] = block
        if self.emit_events:
            bs = self.block_size
            self._events.append(
                BlockStored(
                    block_hashes=new_hashes,
                    parent_block_hash=block_hashes[num_cached - 1] if num_cached else None,
                    token_ids=list(token_ids[num_cached * bs : num_full * bs]),
                    block_size=bs,
                    medium=self.medium,
                    lora_name=lora_name,
                )
            )

    def reset(self) -> bool:
        """Forget every cached hash; refused (False) while any request holds blocks."""
        if len(self.free_queue) != self.num_blocks - 1:
            return False
        self._cached.clear()
        for block in self.blocks:
            block.block_hash = None
        if self.emit_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def _evict(self, block: Block) -> None:
        h = block.block_hash
        if h is None:
            return
        block.block_hash = None
        holders = self._cached.get(h)
        if holders is None or holders.pop(block.block_id, None) is None:
            return
        if not holders:
            del self._cached[h]
        # vLLM reports the hash removed even when another physical copy still holds it.
        if self.emit_events:
            self._events.append(BlockRemoved(block_hashes=[h], medium=self.medium))
