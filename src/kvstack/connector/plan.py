"""What to load and save in one engine step: the plan the scheduler half hands the worker half, and the
block arithmetic behind it. No I/O, no vLLM, no torch.

A prompt is cut into chunks of ``chunk_size`` tokens (a multiple of the block size, so a chunk is
``blocks_per_chunk`` whole blocks); chunk ``c`` covers tokens ``[c * chunk_size, (c + 1) * chunk_size)`` and
the request's blocks ``block_ids[c * bpc : (c + 1) * bpc]``. Only full chunks of the prompt are keyed.

- Loads are planned in blocks (`plan_load`) up to `loadable_end`: the store's hit (whole chunks) capped just
  before the prompt's last token, which vLLM must compute to sample from it.
- A chunk is saved by the engine that computes it, once all its tokens are computed (`plan_save`); chunks
  the store already held at lookup, and chunks that were a local prefix hit, are not saved again.
- Saves run after the step, in the background (``kvstack.connector.saves``); `StepPlan` says which
  requests' blocks vLLM keeps for them (``held``) and which it freed (``preempted``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstack.cache.keys import ChunkKey

__all__ = [
    "ChunkLoad",
    "ChunkSave",
    "RequestLoad",
    "RequestSave",
    "StepPlan",
    "loadable_end",
    "plan_load",
    "plan_save",
]

RankKeys = tuple[ChunkKey, ...]
"""One chunk's key per tensor-parallel rank (each rank stores its own slice of the heads)."""


@dataclass(frozen=True, slots=True)
class ChunkLoad:
    keys: RankKeys
    first_block: int
    """The chunk's first block to copy (0 unless the local prefix hit ends inside this chunk)."""
    block_ids: tuple[int, ...]
    """Destination blocks for the chunk's blocks ``first_block, first_block + 1, ...``."""


@dataclass(frozen=True, slots=True)
class RequestLoad:
    req_id: str
    chunks: tuple[ChunkLoad, ...]
    """Consecutive chunks, in order: a chunk is useful only if every one before it loaded."""

    def block_ids(self, from_chunk: int = 0) -> list[int]:
        """Destination blocks of chunks ``from_chunk`` on (what to report as failed when they are lost)."""
        return [b for chunk in self.chunks[from_chunk:] for b in chunk.block_ids]


@dataclass(frozen=True, slots=True)
class ChunkSave:
    keys: RankKeys
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RequestSave:
    req_id: str
    parent: RankKeys | None
    """The key of the chunk before ``chunks[0]`` (None for a prompt's first chunk)."""
    chunks: tuple[ChunkSave, ...]


@dataclass(slots=True)
class StepPlan:
    """Everything the workers do in one step: loads before the forward pass, saves queued after it, and
    what the scheduler half told vLLM about blocks that saves may still read."""

    loads: list[RequestLoad] = field(default_factory=list)
    saves: list[RequestSave] = field(default_factory=list)
    failed_block_ids: list[int] = field(default_factory=list)
    """Blocks vLLM expects loaded that no load can fill (reported back as load errors, so recomputed)."""
    held: list[str] = field(default_factory=list)
    """Finished requests whose blocks vLLM keeps until the workers report their saves done."""
    preempted: list[str] = field(default_factory=list)
    """Requests with saves in flight whose blocks vLLM freed (preemption): stop reading them now."""
    block_layout: str = ""
    """The block layout of the key namespace the plan's chunk keys belong to (``kvstack.connector.layout``):
    a worker whose KV cache has another one must not load or save them."""

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves or self.failed_block_ids or self.held or self.preempted)


def loadable_end(num_prompt_tokens: int, stored_end: int, block_size: int) -> int:
    """How far the prompt's KV can come from the store: ``stored_end`` (the end of the stored chunks, in
    tokens, a chunk boundary) capped before the prompt's last token, which vLLM computes. The result is a
    block boundary unless the store holds the whole prompt (then it is the prompt's length - 1)."""
    if num_prompt_tokens < 1:
        return 0
    end = max(0, min(stored_end, num_prompt_tokens - 1))
    if end % block_size and end != num_prompt_tokens - 1:  # a stored end is a chunk (so block) boundary
        raise ValueError(f"stored end {stored_end} is not a multiple of the block size {block_size}")
    return end


def plan_load(
    keys: Sequence[RankKeys],
    start: int,
    end: int,
    *,
    chunk_size: int,
    block_size: int,
    block_ids: Sequence[int],
) -> tuple[ChunkLoad, ...]:
    """The chunk loads that fill tokens ``[start, end)`` into ``block_ids``: ``start`` on a block boundary,
    ``end`` anywhere (a last block only partly needed is copied whole).

    ``keys`` are the prompt's chunk keys from chunk 0; ``block_ids`` the request's blocks from block 0. The
    local prefix hit ends on a block boundary, possibly inside a chunk, so a chunk is fetched whole and only
    its blocks past the hit are copied (``first_block``). When the store holds the whole prompt, the load ends
    inside the last block: that block is copied whole, and the slots past the end (the last token's) are
    written again by vLLM's forward pass. Raises ValueError when the range does not start on a block boundary
    or reaches past the keys or blocks.
    """
    if start % block_size or not 0 <= start < end:
        raise ValueError(f"load range [{start}, {end}) is empty or does not start on a block ({block_size})")
    bpc = chunk_size // block_size
    first_b, end_b = start // block_size, -(-end // block_size)
    last_chunk = (end - 1) // chunk_size
    if last_chunk >= len(keys) or end_b > len(block_ids):
        raise ValueError(
            f"load range [{start}, {end}) needs chunk {last_chunk} and block {end_b - 1}; "
            f"have {len(keys)} chunk keys and {len(block_ids)} blocks"
        )
    loads = []
    for c in range(start // chunk_size, last_chunk + 1):
        lo, hi = max(first_b, c * bpc), min(end_b, (c + 1) * bpc)
        loads.append(ChunkLoad(keys[c], lo - c * bpc, tuple(block_ids[lo:hi])))
    return tuple(loads)


def plan_save(
    keys: Sequence[RankKeys],
    token_ids: Sequence[int],
    first_chunk: int,
    end_chunk: int,
    *,
    chunk_size: int,
    block_size: int,
    block_ids: Sequence[int],
) -> tuple[ChunkSave, ...]:
    """Saves of chunks ``[first_chunk, end_chunk)`` (all their tokens computed) from ``block_ids``."""
    bpc = chunk_size // block_size
    if end_chunk > len(keys) or end_chunk * bpc > len(block_ids):
        raise ValueError(
            f"saving chunks up to {end_chunk} needs {end_chunk} keys and {end_chunk * bpc} blocks; "
            f"have {len(keys)} and {len(block_ids)}"
        )
    return tuple(
        ChunkSave(
            keys[c],
            tuple(token_ids[c * chunk_size : (c + 1) * chunk_size]),
            tuple(block_ids[c * bpc : (c + 1) * bpc]),
        )
        for c in range(first_chunk, end_chunk)
    )
