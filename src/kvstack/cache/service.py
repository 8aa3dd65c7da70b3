"""`CacheService`: what the cache server answers, whichever transport a request came by (ZMQ or a unix
socket; the transports and the concurrency are ``kvstack.cache.server``'s).

- `authenticate`: with a ``secret``, a request's mac must be ``HMAC-SHA256(secret, header)``.
- `answer_now`: the reply of a request that needs no I/O (hello, stats, put, and a lookup every tier it asks
  answers from process memory), or None; `answer` awaits the store for the others.
- `failure`: the error reply for a request that raised, counted in
  ``kvstack_cache_protocol_errors_total{code}`` (a handler bug is logged with its trace).
- Requests over ``max_keys`` keys are refused; payloads travel through the client's shared-memory arena
  where it offered one (``kvstack.cache.shm``), through frames otherwise; a get reply carries at most
  ``max_message_bytes`` in frames (``more`` says to ask again). Puts with token ids feed the admit events.
- Partial tails: a put chunk with fewer token ids than ``chunk_size`` is a prompt's tail; it goes into
  ``tails`` (`TailIndex`, by its parent) and a lookup that asks gets the tails held after its prefix.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
from collections.abc import Callable, Sequence
from typing import Any

import kvstack
from kvstack.cache.events import ChunkEvents
from kvstack.cache.keys import KEY_BYTES, ChunkKey
from kvstack.cache.metrics import CacheMetrics
from kvstack.cache.payload import Payload
from kvstack.cache.protocol import (
    IN_FRAME,
    MAC_BYTES,
    Clear,
    ClearReply,
    ErrorCode,
    ErrorReply,
    Evict,
    EvictReply,
    Exists,
    ExistsReply,
    Get,
    GetReply,
    Hello,
    HelloReply,
    Lookup,
    LookupReply,
    ProtocolError,
    Put,
    PutReply,
    Reply,
    Request,
    Stats,
    StatsReply,
    StoredTail,
    key_bytes,
    request_mac,
    split_keys,
)
from kvstack.cache.shm import ALIGN, ArenaError, ServerArena, ServerArenas
from kvstack.cache.store import TieredStore
from kvstack.cache.tails import TailIndex
from kvstack.kvevents.publisher import KVEventPublisher

__all__ = ["MAX_MODEL_CHARS", "CacheService", "Frames"]

log = logging.getLogger(__name__)
MAX_MODEL_CHARS = 256  # Put.model

Frames = list[Any]
"""What a reply carries after its header: bytes, memoryviews, zmq.Frames."""


class CacheService:
    """The operations of a cache server over ``store``; see the module docstring."""

    def __init__(
        self,
        store: TieredStore,
        *,
        node: str,
        secret: bytes | None,
        max_message_bytes: int,
        max_keys: int,
        metrics: CacheMetrics,
        arenas: ServerArenas,
        events: ChunkEvents | None,
        publisher: KVEventPublisher | None,
        in_flight: Callable[[], int],
        chunk_size: int,
        tails: TailIndex,
    ) -> None:
        self.store = store
        self.chunk_size = chunk_size
        self.tails = tails
        self.node = node
        self.max_message_bytes = max_message_bytes
        self.max_keys = max_keys
        self.metrics = metrics
        self.arenas = arenas
        self.events = events
        self.publisher = publisher
        self._secret = secret
        self._in_flight = in_flight

    def failure(self, error: Exception, op: str, request_id: int) -> ErrorReply:
        """The error reply for a request that raised (counted; a handler bug is logged with its trace)."""
        if isinstance(error, ProtocolError):
            self.metrics.protocol_errors.labels(error.code).inc()
            return ErrorReply(id=error.request_id, code=error.code, message=error.message)
        self.metrics.protocol_errors.labels(ErrorCode.INTERNAL).inc()
        log.error("cache server: %s request failed", op, exc_info=error)
        return ErrorReply(id=request_id, code=ErrorCode.INTERNAL, message=f"{type(error).__name__}: {error}")

    def authenticate(self, header: memoryview, mac: memoryview, request_id: int) -> None:
        """Raise `ProtocolError` (``auth``) unless the mac signs the header with the server's secret."""
        if self._secret is None:
            return
        if len(mac) != MAC_BYTES:
            raise ProtocolError(
                ErrorCode.AUTH,
                "this server needs a shared secret: sign requests with it (mac frame)",
                request_id,
            )
        if not hmac.compare_digest(request_mac(self._secret, header), mac):
            raise ProtocolError(
                ErrorCode.AUTH, "wrong mac: the client's secret is not the server's", request_id
            )

    def answer_now(self, request: Request, frames: Sequence[memoryview]) -> tuple[Reply, Frames] | None:
        """The reply of a request that needs no I/O, or None: then `answer` it (in a task)."""
        rid = request.id
        match request:
            case Lookup():
                keys = self._key_bytes(request.keys, rid)
                found = self.store.lookup_now(keys)
                if found is None:
                    return None
                tails: list[StoredTail] = []
                if request.tails:
                    parent = self._tail_parent(request, keys, found[0])
                    now = self._tails_now(parent)
                    if now is None:
                        return None
                    tails = now
                return self._lookup_reply(rid, len(keys), *found, tails), []
            case Put():
                return self._put(request, frames), []
            case Hello():
                return self._hello(request), []
            case Stats():
                return StatsReply(id=rid, node=self.node, stats=self._stats()), []
        return None

    async def answer(self, request: Request) -> tuple[Reply, Frames]:
        """The reply of any request but hello, put and stats, after the store's I/O."""
        rid = request.id
        match request:
            case Lookup():
                keys = self._key_bytes(request.keys, rid)
                count, tiers = await self.store.lookup(keys)
                tails: list[StoredTail] = []
                if request.tails:
                    tails = await self._tails(self._tail_parent(request, keys, count))
                return self._lookup_reply(rid, len(keys), count, tiers, tails), []
            case Exists():
                present = await self.store.exists(self._key_bytes(request.keys, rid))
                return ExistsReply(id=rid, present=present), []
            case Get():
                return await self._get(request)
            case Evict():
                removed = await self.store.delete(self._keys(request.keys, rid))
                return EvictReply(id=rid, removed=removed), []
            case Clear():
                # The clear is announced as soon as memory is empty: a chunk stored while the lower
                # tiers are being emptied is announced after it (and kept: see TieredStore.clear).
                self.tails.clear()
                await self.store.clear(on_empty=None if self.events is None else self.events.cleared)
                return ClearReply(id=rid), []
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"op {type(request).__name__} is not served", rid)

    def _lookup_reply(
        self, rid: int, asked: int, count: int, tiers: list[str], tails: list[StoredTail]
    ) -> LookupReply:
        self.metrics.lookup_hits += count
        self.metrics.lookup_misses += asked - count
        return LookupReply(id=rid, count=count, tiers=tiers, tails=tails)

    def _tail_parent(self, request: Lookup, keys: Sequence[bytes], count: int) -> bytes | None:
        if count:
            return keys[count - 1]
        if request.parent is not None and len(request.parent) != KEY_BYTES:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"parent is {len(request.parent)} bytes, not 32", request.id
            )
        return request.parent

    def _tails_now(self, parent: bytes | None) -> list[StoredTail] | None:
        """The tails held after ``parent``, or None when a tier must be asked with I/O."""
        held: list[StoredTail] = []
        for length, key in self.tails.after(parent):
            found = self.store.lookup_now((key,))
            if found is None:
                return None
            if found[0]:
                held.append(StoredTail(length, key, found[1][0]))
            else:
                self.tails.forget(parent, key)
        return held

    async def _tails(self, parent: bytes | None) -> list[StoredTail]:
        held: list[StoredTail] = []
        for length, key in self.tails.after(parent):
            count, tiers = await self.store.lookup((key,))
            if count:
                held.append(StoredTail(length, key, tiers[0]))
            else:
                self.tails.forget(parent, key)
        return held

    def _hello(self, request: Hello) -> HelloReply:
        reply = HelloReply(
            id=request.id,
            node=self.node,
            server=f"kvstack {kvstack.__version__}",
            max_message_bytes=self.max_message_bytes,
            max_keys=self.max_keys,
        )
        if request.arena:
            try:
                self.arenas.open(request.arena, request.arena_nonce)
                reply.arena_ok = True
            except ArenaError as e:
                reply.arena_error = str(e)
        return reply

    async def _get(self, request: Get) -> tuple[GetReply, Frames]:
        rid = request.id
        keys = self._keys(request.keys, rid)
        arena = self._arena(request.arena, request.region_offset, request.region_size, rid)
        payloads = await self.store.get(keys)
        cursor, end = request.region_offset, request.region_offset + request.region_size
        sizes: list[int] = []
        offsets: list[int] = []
        frames: Frames = []
        framed = shared = 0
        more = False
        for payload in payloads:
            size = len(payload)
            start = -(-cursor // ALIGN) * ALIGN
            if arena is not None and start + size <= end:
                arena.map[start : start + size] = payload
                offsets.append(start)
                cursor = start + size
                shared += size
            elif framed + size <= self.max_message_bytes:
                frames.append(payload)
                offsets.append(IN_FRAME)
                framed += size
            else:
                more = True
                break
            sizes.append(size)
        self.metrics.misses.inc(len(keys) - len(sizes))
        self.metrics.payload_bytes.labels("get", "shm").inc(shared)
        self.metrics.payload_bytes.labels("get", "socket").inc(framed)
        return GetReply(id=rid, sizes=sizes, offsets=offsets, more=more), frames

    def _put(self, request: Put, frames: Sequence[memoryview]) -> PutReply:
        rid = request.id
        keys = self._keys(request.keys, rid)
        n = len(keys)
        offsets = request.offsets or [IN_FRAME] * n
        if len(request.sizes) != n or len(offsets) != n:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"{n} keys but {len(request.sizes)} sizes and {len(offsets)} offsets",
                rid,
            )
        if request.parent is not None and len(request.parent) != KEY_BYTES:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"parent is {len(request.parent)} bytes, not 32", rid)
        if request.model is not None and len(request.model) > MAX_MODEL_CHARS:
            # Kept with every chunk the events remember: a model name, not a payload.
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"model is over {MAX_MODEL_CHARS} characters", rid)
        if request.token_ids is not None and len(request.token_ids) > n:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"{len(request.token_ids)} token lists for {n} keys", rid
            )
        in_frames = sum(1 for offset in offsets if offset == IN_FRAME)
        if in_frames != len(frames):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"{in_frames} payloads announced in frames, {len(frames)} frames sent",
                rid,
            )
        arena: ServerArena | None = None
        if in_frames < n:
            if request.arena is None:
                raise ProtocolError(ErrorCode.BAD_REQUEST, "arena offsets given without an arena", rid)
            arena = self._arena(request.arena, 0, 0, rid, check=False)
        payloads: list[Payload] = []
        views: list[memoryview] = []
        frame_iter = iter(frames)
        shared = framed = 0
        try:
            for i, (size, offset) in enumerate(zip(request.sizes, offsets, strict=True)):
                if offset == IN_FRAME:
                    data = next(frame_iter)
                    if len(data) != size:
                        raise ProtocolError(
                            ErrorCode.BAD_REQUEST,
                            f"payload {i}: {len(data)} bytes in its frame, size says {size}",
                            rid,
                        )
                    framed += size
                else:
                    assert arena is not None
                    try:
                        arena.check_range(offset, size)
                    except ArenaError as e:
                        raise ProtocolError(ErrorCode.BAD_REQUEST, f"payload {i}: {e}", rid) from None
                    data = memoryview(arena.map)[offset : offset + size]
                    views.append(data)
                    shared += size
                payloads.append(data)
            if self.events is not None and request.token_ids:
                self.events.remember(keys, request.parent, request.token_ids, request.model)
            stored = self.store.put(keys, payloads)
            for i, tokens in enumerate(request.token_ids or ()):
                if 0 < len(tokens) < self.chunk_size:
                    self.tails.add(keys[i - 1] if i else request.parent, len(tokens), keys[i])
        finally:
            payloads.clear()
            for view in views:
                view.release()
        self.metrics.payload_bytes.labels("put", "shm").inc(shared)
        self.metrics.payload_bytes.labels("put", "socket").inc(framed)
        return PutReply(id=rid, stored=stored)

    def _keys(self, raw: bytes, rid: int) -> list[ChunkKey]:
        self._check_key_count(raw, rid)
        return split_keys(raw, rid)

    def _key_bytes(self, raw: bytes, rid: int) -> tuple[bytes, ...]:
        self._check_key_count(raw, rid)
        return key_bytes(raw, rid)

    def _check_key_count(self, raw: bytes, rid: int) -> None:
        if len(raw) > self.max_keys * KEY_BYTES:
            raise ProtocolError(
                ErrorCode.TOO_LARGE, f"{len(raw) // KEY_BYTES} keys is over max_keys={self.max_keys}", rid
            )

    def _arena(
        self, name: str | None, offset: int, size: int, rid: int, *, check: bool = True
    ) -> ServerArena | None:
        if name is None:
            return None
        try:
            arena = self.arenas.open(name)
            if check:
                arena.check_range(offset, size)
        except ArenaError as e:
            raise ProtocolError(ErrorCode.ARENA, str(e), rid) from None
        return arena

    def _stats(self) -> dict[str, Any]:
        stats = dataclasses.asdict(self.store.stats())
        stats["server"] = {
            "arenas": len(self.arenas),
            "in_flight": self._in_flight(),
            "tails": len(self.tails),
        }
        if self.publisher is not None:
            stats["server"]["events_published"] = self.publisher.sent_events
        return stats
