"""The cache tier's admit/evict events, in vLLM's KV-event shape, for the router's prefix index.

`ChunkEvents` is the `TierListener` of every tier of the server's store: it turns "chunks entered/left tier
T" into ``BlockStored`` / ``BlockRemoved`` with ``medium`` ``"CPU"`` (memory tier), ``"DISK"`` (disk tier)
or ``"REMOTE"`` (any other tier: Redis), and a server ``clear`` into ``AllBlocksCleared``.

- ``block_hashes``: each chunk key's first 8 bytes as a big-endian int; ``parent_block_hash`` the same of
  the chunk before (None for a prompt's first chunk); ``block_size`` the server's chunk size.
- ``token_ids`` are what the router keys blocks by, and only a put carries them (``Put.token_ids``, one list
  per chunk, and ``Put.parent``). `remember` keeps them for the last ``max_remembered`` chunks (4 bytes per
  token), so a chunk reaching disk or Redis after the put, or promoted back into memory later, can still be
  announced. A chunk without known tokens, or whose token count is not the chunk size (a partial tail), gets
  no ``BlockStored``; ``BlockRemoved`` is always sent (a router ignores hashes it never stored).
- ``extra_keys``: ``("kvstack-model", model)`` for each chunk whose put named its model (``Put.model``, the
  engine's served model name), so a router credits the chunk only to requests for that model; absent when
  the put named none. A generic vLLM-event consumer skips blocks with extra keys it does not know, which
  errs toward no credit.
- Consecutive chunks stored in the same tier within one event-loop turn become one ``BlockStored`` when each
  one's parent is the previous one, as vLLM batches a request's blocks.
- Restarts: the disk tier keeps each chunk's parent key, model and tokens in its file (`annotation`, packed by
  `pack_note`), and the server announces the chunks it finds there at start (`restored`: ``BlockStored``
  DISK, parents before children), in the first batches, which later subscribers get by replay. The memory
  tier starts empty; Redis chunks written before a restart are not announced (their values carry no tokens).
- Removals Redis makes on its own (TTL expiry, eviction) reach subscribers as ``BlockRemoved`` REMOTE only
  when the tier next finds such a chunk missing (see ``kvstack.cache.tiers.redis``).

`EventPublisher` sends each loop turn's events as one ``EventBatch`` on a ZMQ PUB socket, in the frames vLLM
uses (``[topic, seq, payload]``, seq from 0), with topic ``kvstack-cache/<node>``: vLLM's events have no
node field, so the node that holds the chunks is in the topic. An optional replay ROUTER serves the last
``buffer_steps`` batches exactly as vLLM's does (request ``[b"", start_seq]``, replies ``[b"", topic, seq,
payload]``, then seq -1). PUB never waits: past the high-water mark messages are dropped and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import sys
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Final

import zmq
import zmq.asyncio

from kvstack.cache.keys import ChunkKey
from kvstack.cache.tiers.base import Tier
from kvstack.cache.tiers.disk import DiskTier
from kvstack.cache.tiers.memory import MemoryTier
from kvstack.kvevents.codec import (
    REPLAY_END_SEQ_BYTES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    encode_batch,
    encode_seq,
)

__all__ = [
    "MEDIUM_DISK",
    "MEDIUM_REMOTE",
    "ChunkEvents",
    "EventPublisher",
    "block_hash",
    "medium_of",
    "topic_for",
]

log = logging.getLogger(__name__)

MEDIUM_CPU: Final = "CPU"
MEDIUM_DISK: Final = "DISK"
MEDIUM_REMOTE: Final = "REMOTE"
TOPIC_PREFIX: Final = "kvstack-cache/"
MODEL_EXTRA_KEY: Final = "kvstack-model"  # extra_keys tag: the chunk's model follows


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


class EventPublisher:
    """A bound PUB socket (plus optional replay ROUTER) sending `EventBatch` es; see the module docstring."""

    def __init__(
        self,
        endpoint: str,
        *,
        node: str,
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        context: zmq.asyncio.Context | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if buffer_steps < 1:
            raise ValueError(f"buffer_steps must be >= 1, got {buffer_steps}")
        self.topic = topic_for(node).encode()
        self._requested = (endpoint, replay_endpoint)
        self._hwm = hwm
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._buffer_steps = buffer_steps
        self._ctx = context
        self._own_ctx = context is None
        self._clock = clock
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self.endpoint: str | None = None
        self.replay_endpoint: str | None = None
        self.next_seq = 0
        self.sent_events = 0
        self.dropped_batches = 0

    async def start(self) -> None:
        endpoint, replay_endpoint = self._requested
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        # A plain socket: publishing is synchronous (called from a loop callback) and never waits.
        pub: zmq.Socket[bytes] = zmq.Socket(self._ctx, zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self._hwm)
        pub.setsockopt(zmq.LINGER, 0)
        self._pub = pub
        try:
            self.endpoint = _bind(pub, endpoint, "cache event PUB")
            if replay_endpoint is not None:
                replay = self._ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.SNDHWM, self._buffer_steps + 1)  # a whole replay fits
                replay.setsockopt(zmq.LINGER, 0)
                self._replay = replay
                self.replay_endpoint = _bind(replay, replay_endpoint, "cache event replay")
                self._replay_task = asyncio.create_task(self._serve_replay(replay), name="cache-event-replay")
        except BaseException:
            await self.close()
            raise

    def publish(self, events: list[KVEvent]) -> None:
        if self._pub is None or not events:
            return
        payload = encode_batch(EventBatch(ts=self._clock(), events=events))
        seq = self.next_seq
        self.next_seq += 1
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart([self.topic, encode_seq(seq), payload], flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped_batches += 1
            return
        self.sent_events += len(events)

    async def close(self) -> None:
        task, self._replay_task = self._replay_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sock in (self._replay, self._pub):
            if sock is not None:
                sock.close(linger=0)
        self._replay = self._pub = None
        if self._own_ctx and self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def _serve_replay(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                log.warning(
                    "ignoring cache event replay request of %d frames (send [b'', seq])", len(frames) - 1
                )
                continue
            identity, _, start = frames
            start_seq = int.from_bytes(start, "big")
            try:
                for seq, payload in [item for item in self._buffer if item[0] >= start_seq]:
                    await sock.send_multipart([identity, b"", self.topic, encode_seq(seq), payload])
                await sock.send_multipart([identity, b"", b"", REPLAY_END_SEQ_BYTES, b""])
            except zmq.ZMQError as e:
                log.warning("cache event replay from seq %d failed: %s", start_seq, e)


class ChunkEvents:
    """Tier notifications -> KV events, flushed to ``publish`` once per event-loop turn."""

    def __init__(
        self,
        publish: Callable[[list[KVEvent]], None],
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


def _bind(sock: zmq.Socket, endpoint: str, what: str) -> str:
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        raise OSError(f"cannot bind the {what} socket to {endpoint}: {e} (port in use? use port 0)") from e
    bound: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return bound
