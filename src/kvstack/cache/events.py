"""The cache tier's admit/evict events, in vLLM's KV-event shape, for the routers' prefix indexes.

`ChunkEvents` is the `TierListener` of every tier of the server's store: "chunks entered/left tier T"
becomes ``BlockStored`` / ``BlockRemoved`` with medium ``CPU`` (memory tier), ``DISK`` (disk tier) or
``REMOTE`` (any other tier), a ``clear`` becomes ``AllBlocksCleared``. One event-loop turn's events go to
``publish`` as one batch; consecutive chained chunks stored in one tier become one ``BlockStored``.

- ``block_hashes``: a chunk key's first 8 bytes, big-endian (`block_hash`); ``block_size``: the chunk size.
- Only a put carries token ids: `remember` keeps each full chunk's tokens, parent and model (the last
  ``max_remembered`` chunks). A chunk with no known tokens (a prompt's partial tail included: routers count
  full chunks) gets no ``BlockStored``; ``BlockRemoved`` always.
- ``extra_keys``: ``(MODEL_EXTRA_KEY, model)`` per chunk when the put named its model.
- Restarts: the disk tier keeps each chunk's note (`annotation`, `pack_note`); `restored` announces the
  chunks it finds at start, parents before children. Redis chunks from before a restart are not announced.
- Topic: ``kvstack-cache/<node>`` (`topic_for`), since vLLM's events carry no node.
"""

from __future__ import annotations

import asyncio
import struct
import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Final

from kvstack.cache.keys import ChunkKey
from kvstack.cache.tiers.base import Tier
from kvstack.cache.tiers.disk import DiskTier
from kvstack.cache.tiers.memory import MemoryTier
from kvstack.kvevents.codec import MODEL_EXTRA_KEY, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = [
    "MEDIUM_DISK",
    "MEDIUM_REMOTE",
    "ChunkEvents",
    "block_hash",
    "medium_of",
    "topic_for",
]

MEDIUM_CPU: Final = "CPU"
MEDIUM_DISK: Final = "DISK"
MEDIUM_REMOTE: Final = "REMOTE"
TOPIC_PREFIX: Final = "kvstack-cache/"


def block_hash(key: bytes) -> int:
    """A chunk key as a KV-event block hash: its first 8 bytes, big-endian."""
    return int.from_bytes(key[:8], "big")


def medium_of(tier: Tier) -> str:
    if isinstance(tier, MemoryTier):
        return MEDIUM_CPU
    if isinstance(tier, DiskTier):
        return MEDIUM_DISK
    return MEDIUM_REMOTE


def topic_for(node: str) -> str:
    return TOPIC_PREFIX + node


class ChunkEvents:
    """Tier notifications -> KV events, flushed to ``publish`` once per event-loop turn."""

    def __init__(
        self,
        publish: Callable[[list[KVEvent]], object],
        *,
        chunk_size: int,
        max_remembered: int = 16_384,
    ) -> None:
        if chunk_size < 1 or max_remembered < 0:
            raise ValueError(
                f"need chunk_size >= 1 and max_remembered >= 0, got {chunk_size}, {max_remembered}"
            )
        self._publish = publish
        self.chunk_size = chunk_size
        self._max = max_remembered
        self._tokens: OrderedDict[ChunkKey, tuple[bytes | None, array[int], str | None]] = OrderedDict()
        self._pending: list[KVEvent] = []
        self._scheduled = False
        # Restored chunks whose parent is restored but not announced yet, by parent (see `restored`).
        self._waiting: dict[bytes, list[ChunkKey]] = {}
        self._waiting_keys: set[ChunkKey] = set()

    def remember(
        self,
        keys: Sequence[ChunkKey],
        parent: bytes | None,
        token_ids: Sequence[Sequence[int]],
        model: str | None = None,
    ) -> None:
        """Keep each full chunk's tokens, parent and model, for its ``BlockStored`` events (see the module
        doc)."""
        previous = parent
        for key, tokens in zip(keys, token_ids, strict=False):
            if len(tokens) == self.chunk_size and self._max:
                try:
                    packed = array("I", tokens)
                except (OverflowError, TypeError):
                    packed = None
                if packed is not None:
                    self._keep(key, previous, packed, model)
            previous = key

    def _keep(self, key: ChunkKey, parent: bytes | None, tokens: array[int], model: str | None) -> None:
        self._tokens[key] = (parent, tokens, model)
        self._tokens.move_to_end(key)
        while len(self._tokens) > self._max:
            self._tokens.popitem(last=False)

    # -- TierListener

    def stored(self, tier: Tier, keys: Sequence[ChunkKey]) -> None:
        medium = medium_of(tier)
        for key in keys:
            known = self._tokens.get(key)
            if known is None:
                continue
            parent, tokens, model = known
            extra = None if model is None else (MODEL_EXTRA_KEY, model)
            last = self._pending[-1] if self._pending else None
            if (
                isinstance(last, BlockStored)
                and last.medium == medium
                and parent is not None
                and last.block_hashes[-1] == block_hash(parent)
                and (last.extra_keys[-1] if last.extra_keys else None) == extra
            ):
                last.block_hashes.append(block_hash(key))
                last.token_ids.extend(tokens)
                if last.extra_keys:
                    last.extra_keys.append(extra)
            else:
                self._add(
                    BlockStored(
                        block_hashes=[block_hash(key)],
                        parent_block_hash=None if parent is None else block_hash(parent),
                        token_ids=tokens.tolist(),
                        block_size=self.chunk_size,
                        medium=medium,
                        extra_keys=None if extra is None else [extra],
                    )
                )

    def annotation(self, key: ChunkKey) -> bytes | None:
        """The note a disk tier keeps with ``key``'s chunk: its parent key, model and token ids (see
        `restored`)."""
        known = self._tokens.get(key)
        if known is None:
            return None
        parent, tokens, model = known
        return pack_note(parent, tokens, model)

    def restored(self, tier: Tier, items: Sequence[tuple[ChunkKey, bytes]], done: bool) -> None:
        """Announce chunks a tier held before this server started (``BlockStored`` in their tier's medium),
        each after its parent, as a router needs (a block whose parent it does not know is an orphan): a
        chunk whose parent is neither announced nor known waits for it; those still waiting when ``done``
        comes are announced anyway (their parent was evicted, or is in no tier)."""
        for key, note in items:
            unpacked = unpack_note(note, self.chunk_size)
            if unpacked is None:
                continue
            parent, tokens, model = unpacked
            self._keep(key, parent, tokens, model)
            if parent is None or (parent in self._tokens and parent not in self._waiting_keys):
                self._announce_restored(tier, key)
            else:
                self._waiting.setdefault(parent, []).append(key)
                self._waiting_keys.add(key)
        if done:
            for children in list(self._waiting.values()):
                for child in children:
                    if child in self._waiting_keys:  # not released by an earlier one meanwhile
                        self._waiting_keys.discard(child)
                        self._announce_restored(tier, child)
            self._waiting.clear()
            self._waiting_keys.clear()

    def _announce_restored(self, tier: Tier, key: ChunkKey) -> None:
        """Announce ``key``, then every chunk that waited for it, depth first (a chain stays in order)."""
        todo = [key]
        while todo:
            current = todo.pop()
            self.stored(tier, (current,))
            children = self._waiting.pop(current, [])
            self._waiting_keys.difference_update(children)
            todo.extend(reversed(children))

    def removed(self, tier: Tier, keys: Sequence[ChunkKey]) -> None:
        medium = medium_of(tier)
        last = self._pending[-1] if self._pending else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.extend(block_hash(key) for key in keys)
        else:
            self._add(BlockRemoved(block_hashes=[block_hash(key) for key in keys], medium=medium))

    def cleared(self) -> None:
        self._pending.clear()
        self._add(AllBlocksCleared())

    def flush(self) -> None:
        self._scheduled = False
        events, self._pending = self._pending, []
        if events:
            self._publish(events)

    def _add(self, event: KVEvent) -> None:
        self._pending.append(event)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)


_NOTE_VERSION = b"\x01"
_NOTE_WITH_MODEL = b"\x02"  # version 1 plus the model name after the parent
_NO_PARENT = bytes(32)  # a chunk key is never 32 zero bytes (chunk_keys' chain starts from them)
_MODEL_LEN = struct.Struct("<H")


def pack_note(parent: bytes | None, tokens: array[int], model: str | None = None) -> bytes:
    """A chunk's parent key, model and token ids as a disk tier keeps them: version byte, the parent (32
    zero bytes: none), with a model its UTF-8 length (uint16) and bytes (version 2), the token ids as
    little-endian uint32. Without a model the note is version 1, as before models were carried."""
    if sys.byteorder == "big":
        tokens = array("I", tokens)
        tokens.byteswap()
    head = parent if parent is not None else _NO_PARENT
    if model is None:
        return _NOTE_VERSION + head + tokens.tobytes()
    name = model.encode()
    if len(name) > 0xFFFF:  # no served model name is this long; the chunk's note just goes without it
        return _NOTE_VERSION + head + tokens.tobytes()
    return _NOTE_WITH_MODEL + head + _MODEL_LEN.pack(len(name)) + name + tokens.tobytes()


def unpack_note(note: bytes, chunk_size: int) -> tuple[bytes | None, array[int], str | None] | None:
    """(parent, token ids, model) of a `pack_note` note of a full chunk; None for anything else."""
    version, at, model = note[:1], 33, None
    if version == _NOTE_WITH_MODEL and len(note) >= at + _MODEL_LEN.size:
        (length,) = _MODEL_LEN.unpack_from(note, at)
        at += _MODEL_LEN.size + length
        try:
            model = note[at - length : at].decode()
        except UnicodeDecodeError:
            return None
    elif version != _NOTE_VERSION:
        return None
    if len(note) != at + 4 * chunk_size:
        return None
    tokens = array("I", note[at:])
    if sys.byteorder == "big":
        tokens.byteswap()
    parent = note[1:33]
    return (None if parent == _NO_PARENT else ChunkKey(parent)), tokens, model
