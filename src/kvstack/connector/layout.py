"""Which KV cache layouts the connector can move, told from tensor shapes alone, and the chunk-key namespace.

The connector moves whole blocks through a block-first view of each layer's cache: a block is one index
of dimension 0 of that view (`LayoutVerdict.block_dim` says where it is in the tensor itself). A chunk's
payload is ``[layers, blocks_per_chunk, *block]`` in the view's logical order, layers in the order of
vLLM's KV cache group. `detect_layout` lists the layouts handled: vLLM 0.32's per-layer view and the
K/V-split 5-D layouts. Refused, with the reason: MLA's latent cache (no K/V heads), and anything else
(unknown). A refused layout disables the connector; the engine runs as if it had none.

The copies never look inside a block, and the same shape can hold different bytes, so the key namespace
(`block_layout_name`) names the platform, the attention backend, the tensor layout and the block size, and
engines that differ in any of them never share a chunk. vLLM's physical layout (which dimension is
outermost in memory) is not in it: the copies go through the logical view, so a payload is the same
whatever the strides.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstack.cache.keys import KVLayout

__all__ = [
    "PAGED_LAYOUT",
    "AttentionShape",
    "LayoutVerdict",
    "block_layout_name",
    "detect_layout",
    "kv_layout",
]


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
    block_dim: int = 0
    """The tensor dimension that indexes blocks (1 for the K/V-outer layouts ``[2, blocks, ...]``)."""


PAGED_LAYOUT = "[blocks,kv_heads,block,2*head]"
"""vLLM 0.32's per-layer view for every attention backend (``allocate_kv_cache``: ``[B, H, N, C]``)."""

_SPLIT_KV = {
    (2, None, "n", "h"): ("[2,blocks,block,kv_heads,head]", 1),
    (2, None, "h", "n"): ("[2,blocks,kv_heads,block,head]", 1),
    (None, 2, "n", "h"): ("[blocks,2,block,kv_heads,head]", 0),
    (None, 2, "h", "n"): ("[blocks,2,kv_heads,block,head]", 0),
}


def detect_layout(shape: tuple[int, ...], attn: AttentionShape) -> LayoutVerdict:
    """The layout of one layer's KV cache tensor of ``shape`` (``d`` = head size):

    =================================  =======================  ==========================================
    layer tensor                       block in the payload     seen in
    =================================  =======================  ==========================================
    [blocks,kv_heads,block,2*head]     [kv_heads, block, 2d]    vLLM 0.32, every backend (per-layer view)
    [2,blocks,block,kv_heads,head]     [2, block, kv_heads, d]  K/V outside the blocks (flash-attn style)
    [2,blocks,kv_heads,block,head]     [2, kv_heads, block, d]
    [blocks,2,block,kv_heads,head]     [2, block, kv_heads, d]  K/V inside each block (flashinfer style)
    [blocks,2,kv_heads,block,head]     [2, kv_heads, block, d]
    =================================  =======================  ==========================================

    For the K/V-outer layouts the view swaps the first two dimensions, so a payload block is its K half then
    its V half, as for the K/V-inner ones. When ``kv_heads`` equals the block size, the two 5-D orders of one
    family have the same shape; they are named block-major. The copies are the same either way, and the
    backend in the namespace pins the meaning.
    """
    h, n, d = attn.num_kv_heads, attn.block_size, attn.head_size
    if len(shape) == 4 and shape[1:] == (h, n, 2 * d):
        return LayoutVerdict(PAGED_LAYOUT, True)
    if len(shape) == 5 and shape[-1] == d:
        if shape[:2] == (2, 2):
            return LayoutVerdict(
                "unknown", False, f"KV cache shape {tuple(shape)} is ambiguous: K/V and 2 blocks in front"
            )
        sizes = {"n": n, "h": h}
        for (k0, k1, a, b), (name, block_dim) in _SPLIT_KV.items():
            if k0 in (None, shape[0]) and k1 in (None, shape[1]) and shape[2:4] == (sizes[a], sizes[b]):
                return LayoutVerdict(name, True, block_dim=block_dim)
    if len(shape) == 3 and shape[1] == n:
        return LayoutVerdict(
            "[blocks,block,latent]", False, "an MLA latent KV cache is not supported (no K/V heads)"
        )
    return LayoutVerdict(
        "unknown",
        False,
        f"unknown KV cache shape {tuple(shape)} for {h} KV heads, block {n}, head size {d}; expected "
        f"{PAGED_LAYOUT} = (num_blocks, {h}, {n}, {2 * d}) or a K/V-split 5-D layout (a block split into "
        "smaller kernel blocks is not supported)",
    )


def block_layout_name(layout: str, *, platform: str, backend: str, block_size: int) -> str:
    """The block layout part of the key namespace: platform, attention backend, tensor layout and block
    size, e.g. "vllm-cpu/CPU_ATTN:[blocks,kv_heads,block=128,2*head]". The backend is in it because one
    shape can hold different bytes: in vLLM 0.32 the CPU backend stores a head's block as its K rows then its
    V rows, flash-attn K and V side by side per token. vLLM's physical layout (``LBHNC``, ``LBNHC``, ...) is
    not."""
    return f"vllm-{platform}/{backend}:{layout.replace(',block,', f',block={block_size},')}"


def kv_layout(model: str, attn: AttentionShape, *, block_layout: str, tp_rank: int, tp_size: int) -> KVLayout:
    """The chunk-key namespace of one tensor-parallel rank of this engine (``block_layout`` from
    `block_layout_name`)."""
    return KVLayout(
        model=model,
        num_layers=attn.num_layers,
        num_kv_heads=attn.num_kv_heads,
        head_size=attn.head_size,
        dtype=attn.dtype,
        block_layout=block_layout,
        tp_rank=tp_rank,
        tp_size=tp_size,
    )
