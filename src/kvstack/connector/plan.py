"""What to load and save in one engine step: the plan the scheduler half hands the worker half, and the
block arithmetic behind it. No I/O, no vLLM, no torch.

A prompt is cut into chunks of ``chunk_size`` tokens (a multiple of the block size, so a chunk is
``blocks_per_chunk`` whole blocks); chunk ``c`` covers tokens ``[c * chunk_size, (c + 1) * chunk_size)`` and
the request's blocks ``block_ids[c * bpc : (c + 1) * bpc]``. Full chunks are keyed, and so is the prompt's
partial tail (its last ``n % chunk_size`` tokens, under its partial-tail key), whose payload is only the
blocks holding it (slots past its end in the last one are don't-care: vLLM writes them).

- Loads are planned in blocks (`plan_load`) up to `loadable_end`: the store's hit (whole chunks, then
  maybe a stored tail) capped just before the prompt's last token, which vLLM must compute to sample from.
- A chunk is saved by the engine that computes it, once all its tokens are computed (`plan_save`); chunks
  the store already held at lookup, and chunks that were a local prefix hit, are not saved again. The
  tail is saved with (or after) the last full chunks, once the whole prompt is computed.
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
    blocks: int | None = None
    """Blocks in the chunk's payload: None for a full chunk (``blocks_per_chunk``), fewer for a tail."""


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


def loadable_end(num_prompt_tokens: int, stored_end: int, block_size: int, tail: int = 0) -> int:
    """How far the prompt's KV can come from the store: ``stored_end`` (the end of the stored chunks, in
    tokens, a chunk boundary) plus a stored ``tail`` after it, capped before the prompt's last token, which
    vLLM computes. The result is a block boundary unless it ends in the tail or the store holds the whole
    prompt (then it is the prompt's length - 1)."""
    if num_prompt_tokens < 1:
        return 0
    if stored_end % block_size and stored_end < num_prompt_tokens - 1:  # a chunk (so block) boundary
        raise ValueError(f"stored end {stored_end} is not a multiple of the block size {block_size}")
    return max(0, min(stored_end + tail, num_prompt_tokens - 1))


def plan_load(
    keys: Sequence[RankKeys],
    start: int,
    end: int,
    *,
    chunk_size: int,
    block_size: int,
    block_ids: Sequence[int],
    tail: RankKeys | None = None,
) -> tuple[ChunkLoad, ...]:
    """The chunk loads that fill tokens ``[start, end)`` into ``block_ids``: ``start`` on a block boundary,
    ``end`` anywhere (a last block only partly needed is copied whole). With ``tail``, the last chunk is
    the partial tail under those keys, ``end`` its end: its payload is the blocks up to ``end``.

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
    if last_chunk - (tail is not None) >= len(keys) or end_b > len(block_ids):
        raise ValueError(
            f"load range [{start}, {end}) needs chunk {last_chunk} and block {end_b - 1}; "
            f"have {len(keys)} chunk keys and {len(block_ids)} blocks"
        )
    loads = []
    for c in range(start // chunk_size, last_chunk + 1):
        lo, hi = max(first_b, c * bpc), min(end_b, (c + 1) * bpc)
        if tail is not None and c == last_chunk:
            loads.append(ChunkLoad(tail, lo - c * bpc, tuple(block_ids[lo:hi]), end_b - c * bpc))
        else:
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
    tail: RankKeys | None = None,
) -> tuple[ChunkSave, ...]:
    """Saves of chunks ``[first_chunk, end_chunk)`` (all their tokens computed) from ``block_ids``; with
    ``tail``, then the partial tail ``token_ids[end_chunk * chunk_size:]`` under those keys (``end_chunk``
    must then be the prompt's last full chunk's end)."""
    bpc = chunk_size // block_size
    tail_tokens = len(token_ids) - end_chunk * chunk_size if tail is not None else 0
    need_blocks = end_chunk * bpc + -(-tail_tokens // block_size)
    if end_chunk > len(keys) or need_blocks > len(block_ids) or not 0 <= tail_tokens < chunk_size:
        raise ValueError(
            f"saving chunks up to {end_chunk} (and a {tail_tokens}-token tail) needs {end_chunk} keys and "
            f"{need_blocks} blocks, a tail shorter than a chunk; have {len(keys)} and {len(block_ids)}"
        )
    saves = [
        ChunkSave(
            keys[c],
            tuple(token_ids[c * chunk_size : (c + 1) * chunk_size]),
            tuple(block_ids[c * bpc : (c + 1) * bpc]),
        )
        for c in range(first_chunk, end_chunk)
    ]
    if tail is not None and tail_tokens:
        start = end_chunk * chunk_size
        saves.append(
            ChunkSave(tail, tuple(token_ids[start:]), tuple(block_ids[end_chunk * bpc : need_blocks]))
        )
    return tuple(saves)
