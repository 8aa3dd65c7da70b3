"""The worker half's I/O: whole KV blocks between vLLM's per-layer cache tensors and chunk payloads.

A chunk's payload is the raw bytes of a ``[layers, blocks_per_chunk, *block]`` tensor (one per chunk,
every layer in it, so the store's chunk is the router's block), where ``block`` is one block of a layer's
block-first view (``kvstack.connector.layout``); a prompt's partial tail holds only the blocks it covers.
Its size is checked on load, its meaning is pinned by the key namespace.

A load is synchronous: copied in before the forward pass reads it. A save has two phases, run by the
background thread of ``kvstack.connector.saves``: ``gather`` copies the blocks (the only phase that reads
them) straight into arena regions reserved from the save client, ``send`` puts those regions (offsets, no
further copy). Loads and saves use two clients: a `CacheClient` is not thread-safe.

`BlockMover` never raises for a cache fault: a lost or malformed chunk is a failed load (its blocks and
every later block of the request are returned as failed, so vLLM recomputes them; a chunk of the wrong
size is evicted), a failed put is a dropped save.
"""

# torch is not in kvstack's dev environment; it is in the vLLM environment this runs in.
# mypy: disable-error-code="import-not-found"
from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence

import torch

from kvstack.cache.client import CacheClient
from kvstack.connector.plan import ChunkLoad, RequestLoad, RequestSave

Payloads = list[memoryview]

__all__ = ["BlockMover"]


class BlockMover:
    """Copies chunks between the cache server and the KV blocks of ``layers`` (one tensor per layer, in
    the key namespace's layer order, blocks along dimension ``block_dim``), as tensor-parallel rank
    ``rank``: loads through ``client``, saves through ``save_client`` (the same one unless saves run on
    another thread).

    A block is one index of dimension 0 of a layer's block-first view: the tensor itself when blocks index
    its first dimension, the tensor with its first two dimensions swapped for the K/V-outer layouts
    ``[2, blocks, ...]`` (a block is then ``[2, *rest]``, its K half and its V half).

    Device caches (CUDA and the like): a load copies the chunk's part to the device in one synchronous copy
    (the payload has been read when it returns), then scatters it into the blocks on the device, in stream
    order before the forward pass. A save first waits for the forward pass that wrote the blocks
    (`written`: a device event recorded after it, waited on by the save thread), gathers the blocks on the
    device and copies them to the host region in one synchronous copy (the blocks have been read when it
    returns, so vLLM may reuse them). On the CPU none of this applies: blocks are copied in place.
    """

    def __init__(
        self,
        layers: Sequence[torch.Tensor],
        *,
        blocks_per_chunk: int,
        rank: int,
        client: CacheClient,
        save_client: CacheClient | None = None,
        block_dim: int = 0,
        model: str | None = None,
    ) -> None:
        if not layers:
            raise ValueError("no KV cache layers to move")
        if block_dim not in (0, 1):
            raise ValueError(f"blocks must index dimension 0 or 1, got {block_dim}")
        # Views, never copies: writes through them land in vLLM's cache, whatever its strides.
        self._blocks = [t.transpose(0, 1) if block_dim else t for t in layers]
        first = self._blocks[0]
        self._dtype = first.dtype
        self._device = first.device
        self._on_host = first.device.type == "cpu"
        self.block_shape = tuple(first.shape[1:])
        self.blocks_per_chunk = blocks_per_chunk
        self.chunk_shape = (len(layers), blocks_per_chunk, *self.block_shape)
        self.chunk_bytes = math.prod(self.chunk_shape) * first.element_size()
        self._rank = rank
        self.client = client
        self.save_client = save_client or client
        self.model = model  # the served model name the saved chunks' events carry (see kvstack.cache.events)

    def load(self, load: RequestLoad) -> tuple[int, list[int]]:
        """Copies the chunks of ``load`` into their blocks: (chunks loaded, blocks that failed)."""
        got = self.client.get([chunk.keys[self._rank] for chunk in load.chunks])
        if got is None:
            return 0, load.block_ids()
        with got:
            for i, chunk in enumerate(load.chunks):
                if i >= len(got):
                    return i, load.block_ids(i)
                if len(got[i]) != self._bytes(chunk.blocks or self.blocks_per_chunk):
                    # It can never load: evict it, so lookups stop offering it and the next engine to
                    # compute the chunk saves it again.
                    self.client.evict([chunk.keys[self._rank]])
                    return i, load.block_ids(i)
                self._copy_in(got[i], chunk)
        return len(load.chunks), []

    def written(self) -> Callable[[], None] | None:
        """Called after a forward pass, on its thread: what a save thread must call before gathering the
        blocks that pass wrote (None on the CPU, where the pass is over when it returns)."""
        if self._on_host:
            return None
        event = torch.Event(device=self._device)
        event.record()  # on the device's current stream, behind the forward pass's kernels
        return event.synchronize

    def save(self, save: RequestSave) -> bool:
        """Both phases at once (a synchronous save)."""
        return self.send(save, self.gather(save))

    def gather(self, save: RequestSave) -> Payloads:
        """The chunks' blocks, copied once: into reserved arena regions when the save client has room,
        else into new buffers. The only phase that reads the KV cache."""
        reserved = self.save_client.reserve([self._bytes(len(chunk.block_ids)) for chunk in save.chunks])
        if reserved is None:
            return [self._gather_new(chunk.block_ids) for chunk in save.chunks]
        try:
            for view, chunk in zip(reserved, save.chunks, strict=True):
                self._gather_into(view, chunk.block_ids)
        except BaseException:
            reserved.release()
            raise
        return list(reserved)  # the views themselves: the put sends their offsets

    def send(self, save: RequestSave, payloads: Payloads) -> bool:
        """Puts the gathered chunks; token ids go with rank 0's only (one admit event per chunk)."""
        rank = self._rank
        return self.save_client.put(
            [chunk.keys[rank] for chunk in save.chunks],
            payloads,
            token_ids=[chunk.token_ids for chunk in save.chunks] if rank == 0 else None,
            parent=None if save.parent is None else save.parent[rank],
            model=self.model if rank == 0 else None,
        )

    def _shape(self, blocks: int) -> tuple[int, ...]:
        """A payload of ``blocks`` blocks (a full chunk's, or a partial tail's)."""
        return (self.chunk_shape[0], blocks, *self.block_shape)

    def _bytes(self, blocks: int) -> int:
        return self.chunk_bytes // self.blocks_per_chunk * blocks

    def _copy_in(self, payload: memoryview, chunk: ChunkLoad) -> None:
        with warnings.catch_warnings():
            # The payload is a read-only view (shared memory or a ZMQ frame); it is only read here.
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(payload, dtype=torch.uint8)
        source = raw.view(self._dtype).view(self._shape(chunk.blocks or self.blocks_per_chunk))
        part = source[:, chunk.first_block : chunk.first_block + len(chunk.block_ids)]
        # To a device: one synchronous copy, done reading the payload when it returns (the caller then
        # releases it). On the CPU: no copy, the blocks are filled from the payload directly.
        part = part.to(self._device)
        index = torch.tensor(chunk.block_ids, dtype=torch.long, device=self._device)
        for layer, blocks in enumerate(self._blocks):
            blocks.index_copy_(0, index, part[layer])

    def _gather_into(self, region: memoryview, block_ids: Sequence[int]) -> None:
        # The tensor over the region dies here: the put can then release the view (no export left).
        shape = self._shape(len(block_ids))
        out = torch.frombuffer(region, dtype=torch.uint8).view(self._dtype).view(shape)
        self._index_select(out, block_ids)

    def _gather_new(self, block_ids: Sequence[int]) -> memoryview:
        out = torch.empty(self._shape(len(block_ids)), dtype=self._dtype)
        self._index_select(out, block_ids)
        return memoryview(out.view(-1).view(torch.uint8).numpy())

    def _index_select(self, out: torch.Tensor, block_ids: Sequence[int]) -> None:
        """The blocks ``block_ids`` of every layer into ``out`` (host memory, the chunk's shape)."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self._device)
        if self._on_host:
            for layer, blocks in enumerate(self._blocks):
                torch.index_select(blocks, 0, index, out=out[layer])
            return
        staged = torch.stack([blocks.index_select(0, index) for blocks in self._blocks])
        out.copy_(staged)  # device -> host, synchronous: the blocks have been read when it returns
