"""Which KV cache layouts the connector can move, told from tensor shapes alone, and the chunk-key namespace.

The connector moves whole blocks: a chunk's payload is ``[layers, blocks_per_chunk, *block]``, every
layer's blocks of the chunk's tokens, layers in the order of vLLM's KV cache group. Whole blocks make the
bytes inside a block opaque, so any layout whose block is one index of the first dimension works; what
the bytes mean is pinned by the key namespace (`kv_layout`), which names the platform, the block layout
and the block size, so engines with different layouts never share a chunk.

Supported: vLLM 0.32's CPU backend, per layer ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
(inside a block and head, the kernel stores the block's K rows, then its V rows: ``[2 * block_size,
head_size]``, not K and V side by side per token as the shape suggests; copying whole blocks never
depends on it). Recognised and refused, with the reason: the GPU backends' K/V-split layouts and MLA's
latent cache. Anything else is refused as unknown. A refused layout disables the connector; the engine
runs as if it had none.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstack.cache.keys import KVLayout

__all__ = ["AttentionShape", "LayoutVerdict", "block_layout_name", "detect_layout", "kv_layout"]


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """What vLLM's KV cache spec says of every attention layer (one KV cache group)."""

    num_layers: int
    num_kv_heads: int
    """Per tensor-parallel rank."""
    head_size: int
    dtype: str
    """e.g. "bfloat16" (torch's name without "torch.")."""
    block_size: int


@dataclass(frozen=True, slots=True)
class LayoutVerdict:
    name: str
    """The layout in vLLM's dimension names, or "unknown"."""
    supported: bool
    reason: str = ""
    """Why it is refused (empty when supported)."""


CPU_LAYOUT = "[blocks,kv_heads,block,2*head]"


def detect_layout(shape: tuple[int, ...], attn: AttentionShape, *, platform: str) -> LayoutVerdict:
    """The layout of one layer's KV cache tensor of ``shape`` on ``platform`` ("cpu", "cuda", ...)."""
    h, n, d = attn.num_kv_heads, attn.block_size, attn.head_size
    if len(shape) == 4 and shape[1:] == (h, n, 2 * d):
        if platform != "cpu":
            return LayoutVerdict(
                CPU_LAYOUT,
                False,
                f"the {CPU_LAYOUT} layout on {platform} is not verified yet (its block's K/V order depends "
                "on the attention backend); the connector supports the CPU backend",
            )
        return LayoutVerdict(CPU_LAYOUT, True)
    known = {
        (2, None, n, h, d): "[2,blocks,block,kv_heads,head]",
        (2, None, h, n, d): "[2,blocks,kv_heads,block,head]",
        (None, 2, n, h, d): "[blocks,2,block,kv_heads,head]",
        (None, 2, h, n, d): "[blocks,2,kv_heads,block,head]",
    }
    for pattern, name in known.items():
        matches = len(shape) == len(pattern) and all(
            p in (None, s) for p, s in zip(pattern, shape, strict=False)
        )
        if matches:
            return LayoutVerdict(
                name,
                False,
                f"the GPU-style {name} layout is not supported yet (K and V are split outside the block); "
                "run the connector on the CPU backend",
            )
    if len(shape) == 3 and shape[1] == n:
        return LayoutVerdict(
            "[blocks,block,latent]", False, "an MLA latent KV cache is not supported (no K/V heads)"
        )
    return LayoutVerdict(
        "unknown",
        False,
        f"unknown KV cache shape {tuple(shape)} for {h} KV heads, block {n}, head size {d}; "
        f"expected {CPU_LAYOUT} = (num_blocks, {h}, {n}, {2 * d})",
    )


def block_layout_name(attn: AttentionShape, platform: str) -> str:
    """The block layout part of the key namespace: platform, layout and block size."""
    return f"vllm-{platform}:{CPU_LAYOUT.replace(',block,', f',block={attn.block_size},')}"


def kv_layout(model: str, attn: AttentionShape, *, platform: str, tp_rank: int, tp_size: int) -> KVLayout:
    """The chunk-key namespace of one tensor-parallel rank of this engine."""
    return KVLayout(
        model=model,
        num_layers=attn.num_layers,
        num_kv_heads=attn.num_kv_heads,
        head_size=attn.head_size,
        dtype=attn.dtype,
        block_layout=block_layout_name(attn, platform),
        tp_rank=tp_rank,
        tp_size=tp_size,
    )
