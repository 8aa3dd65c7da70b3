"""Chunk keys of the KV cache tier: one chained 32-byte blake3 key per chunk of token ids.

A chunk is ``chunk_size`` consecutive prompt tokens (`DEFAULT_CHUNK_SIZE`); chunk ``i`` covers tokens
``[i * chunk_size, (i + 1) * chunk_size)``. Only full chunks get a key unless ``include_partial`` is set, in
which case a shorter tail gets one more key, never equal to a full chunk's.

`chunk_keys` computes them (its docstring states the key scheme, v1) from `KVLayout.namespace`: the model,
the KV layout and the tensor-parallel slice, so engines with the same model and layout share keys and
different layouts never do. Every key depends on every token before it and on nothing of the process or
the machine (not ``PYTHONHASHSEED``): keys are stable across engines and restarts.

Token ids may come in any form that holds integers (`TokenIds`); keys depend on the values only, never on
the form. A caller that keys the same ids more than once (e.g. one layout per tensor-parallel rank) packs
them once with `pack_token_ids` and passes the result.
"""

from __future__ import annotations

import functools
import json
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeAlias, cast

from blake3 import blake3

__all__ = ["DEFAULT_CHUNK_SIZE", "ChunkKey", "KVLayout", "TokenIds", "chunk_keys", "pack_token_ids"]

KEY_BYTES = 32
DEFAULT_CHUNK_SIZE = 128
"""Tokens per chunk unless configured: one CPU vLLM block, 8 of a GPU engine's 16-token blocks. The smaller a
chunk, the less of a prompt's tail is left out of the tier (only full chunks are keyed)."""
_NAMESPACE_PREFIX = b"kvstack-kv-chunk/v1\0"
_FULL_CONTEXT = "kvstack 2025 kv-chunk full-chunk key v1"
_TAIL_CONTEXT = "kvstack 2025 kv-chunk partial-tail key v1"
_ROOT_PARENT = bytes(KEY_BYTES)
_U32 = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What makes the bytes of one chunk's KV data: model, KV cache shape and dtype, tensor-parallel slice."""

    model: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str
    block_layout: str = ""
    """How the engine lays a chunk out, e.g. "vllm-cpu:[blocks,kv_heads,block,2*head]"."""
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "tp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVLayout.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"KVLayout.tp_rank must be in [0, tp_size={self.tp_size}), got {self.tp_rank}")

    def namespace(self) -> bytes:
        """The canonical bytes every chunk key of this layout is derived from: canonical JSON (sorted keys, no
        spaces) of every field, prefixed with ``b"kvstack-kv-chunk/v1\\0"``. Any field that changes the bytes
        of a chunk's KV data is in it."""
        return _NAMESPACE_PREFIX + json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()


class ChunkKey(bytes):
    """A 32-byte chunk key (a ``bytes``: hashable, compact, usable as a dict key); ``str()`` is its hex."""

    __slots__ = ()

    def __new__(cls, digest: bytes) -> ChunkKey:
        if len(digest) != KEY_BYTES:
            raise ValueError(f"a chunk key is {KEY_BYTES} bytes, got {len(digest)}")
        return super().__new__(cls, digest)

    @classmethod
    def from_hex(cls, text: str) -> ChunkKey:
        return cls(bytes.fromhex(text))

    def __str__(self) -> str:
        return self.hex()

    def __repr__(self) -> str:
        return f"ChunkKey({self.hex()[:16]}…)"


TokenIds: TypeAlias = "Sequence[int] | array[int] | memoryview | Any"
"""Token ids: a list or other sequence of ``int`` (as tokenizers and vLLM hold them), or any one-dimensional
buffer of integers (``array('I')``, a numpy array of any integer dtype, a ``memoryview``; ``bytes`` count as
a buffer of uint8 ids, as they do as a sequence). A buffer of native uint32 on a little-endian host is hashed
in place; a list is packed first, which costs about as much as hashing it."""

_INT_FORMATS = frozenset("bBhHiIlLqQnN")
_LITTLE = sys.byteorder == "little"


def pack_token_ids(token_ids: TokenIds) -> memoryview:
    """Token ids as a read-only ``memoryview`` of little-endian uint32 (format ``I``), what `chunk_keys`
    hashes; raises ValueError unless they are integers in [0, 2**32). A contiguous native uint32 buffer on
    a little-endian host comes back as a view of itself (no copy)."""
    if isinstance(token_ids, list):  # the common case first
        return _pack_ints(token_ids)
    try:
        view = memoryview(cast(Any, token_ids))
    except TypeError:  # a sequence without the buffer protocol (tuple, range, ...)
        return _pack_ints(list(token_ids))
    code = view.format.lstrip("@")
    if code not in _INT_FORMATS:
        raise ValueError(
            f"token ids must be integers in native byte order, got a buffer of format {view.format!r}"
        )
    if view.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got a buffer of shape {view.shape}")
    if view.itemsize == 4 and code in "IL" and _LITTLE and view.c_contiguous:
        return view.cast("B").cast("I").toreadonly()
    numpy = sys.modules.get("numpy")  # a caller holding numpy arrays has it loaded: convert without a list
    if numpy is None:
        return _pack_ints(view.tolist())
    ints = numpy.asarray(view)
    low, high = (int(ints.min()), int(ints.max())) if ints.size else (0, 0)
    if low < 0 or high >= 1 << 32:
        raise ValueError(f"token ids must be integers in [0, 2**32), got ids from {low} to {high}")
    return memoryview(ints.astype("<u4")).cast("B").cast("I").toreadonly()


def _pack_ints(ints: list[int]) -> memoryview:
    packed = array("I")
    if packed.itemsize != 4:  # the key scheme hashes uint32 token ids
        raise RuntimeError("array('I') is not 4 bytes on this platform; chunk keys need uint32 packing")
    try:
        packed.fromlist(ints)
    except (OverflowError, TypeError) as e:
        raise ValueError(f"token ids must be integers in [0, 2**32): {e}") from None
    if not _LITTLE:
        packed.byteswap()
    return memoryview(packed).toreadonly()


@functools.lru_cache(maxsize=64)
def _derived_keys(layout: KVLayout, chunk_size: int) -> tuple[bytes, bytes]:
    # Cached: a layout's namespace is JSON-encoded and hashed twice, ~40 µs, the same for every prompt.
    material = layout.namespace() + _U32.pack(chunk_size)
    full = blake3(material, derive_key_context=_FULL_CONTEXT).digest()
    tail = blake3(material, derive_key_context=_TAIL_CONTEXT).digest()
    return full, tail


def chunk_keys(
    token_ids: TokenIds,
    layout: KVLayout,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    include_partial: bool = False,
    parent: ChunkKey | None = None,
) -> list[ChunkKey]:
    """One chained key per full chunk of ``token_ids`` (plus the partial tail when ``include_partial``).

    Key scheme (v1): with ``namespace = KVLayout.namespace()``, two 32-byte keys are derived with blake3's
    derive-key mode (``_FULL_CONTEXT``, ``_TAIL_CONTEXT``) from ``namespace || chunk_size`` as 4 little-endian
    bytes: ``k_full`` for full chunks and ``k_tail`` for the partial tail, so a partial chunk never equals a
    full one whatever its length. ``key_i = blake3_keyed(k_full, key_{i-1} || tokens_i)``
    with ``key_{-1}`` 32 zero bytes (or ``parent``) and ``tokens_i`` the chunk's token ids as little-endian
    uint32; the tail is ``blake3_keyed(k_tail, key_{n-1} || len(tail) as uint32 || tokens_tail)``.

    ``token_ids``: any `TokenIds`; the same ids in any form give the same keys. ``parent`` continues a
    chain: ``chunk_keys(b, layout, parent=chunk_keys(a, layout)[-1])`` equals the keys of ``a + b`` after
    ``a``'s when ``a`` is a whole number of chunks.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    k_full, k_tail = _derived_keys(layout, chunk_size)
    data = pack_token_ids(token_ids).cast("B")
    stride = 4 * chunk_size
    full_end = len(data) - len(data) % stride
    key: bytes = _ROOT_PARENT if parent is None else parent
    keys: list[ChunkKey] = []
    # One keyed hasher reset per chunk: building one costs as much as hashing a 1 KiB chunk.
    hasher = blake3(key=k_full)
    reset, update, digest, append = hasher.reset, hasher.update, hasher.digest, keys.append
    new_key = bytes.__new__  # a digest is always 32 bytes: skip ChunkKey's length check in the loop
    for off in range(0, full_end, stride):
        reset()
        update(key)
        update(data[off : off + stride])
        key = new_key(ChunkKey, digest())
        append(key)
    if include_partial and full_end < len(data):
        tail = data[full_end:]
        hasher = blake3(key, key=k_tail)
        hasher.update(_U32.pack(len(tail) // 4))
        hasher.update(tail)
        keys.append(ChunkKey(hasher.digest()))
    return keys
