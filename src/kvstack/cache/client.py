"""Clients of the cache server: `CacheClient` (synchronous, for the vLLM connector) and `AsyncCacheClient`.

Both have the same operations: ``lookup`` (consecutive prefix count), ``locate`` (a tier per chunk of that
prefix), ``exists``, ``get``, ``put``, ``evict``, ``clear``, ``server_stats``. Counters are in ``.stats``.

``put(keys, payloads, token_ids=, parent=, model=)`` should carry each chunk's token ids and the key of the
chunk before ``keys[0]`` (None for a prompt's first chunk): the server's admit events need them (see
``kvstack.cache.events``); ``model``, the engine's served model name, lets a router credit the chunks to
that model's requests only. ``get`` returns the payloads of the longest consecutive prefix it could serve
(possibly none); None means the operation failed.

Never an exception in the caller's hot path: an unreachable server, a timeout, an error reply, a malformed
reply, even a bug here, makes the operation a miss (``lookup`` 0, ``locate`` [], ``exists`` all False,
``get`` None, ``put`` False, ``evict`` 0, ``clear`` False, ``server_stats`` None), counted in
``stats.failures`` by reason and logged at most once per ``log_interval_s``. Only constructor arguments
raise.

- Timeouts: every round trip finishes within ``timeout_s`` (sending included: sockets have
  ``ZMQ_IMMEDIATE``, so nothing is queued for a server that is not connected). An operation is one round
  trip, plus one for ``hello`` when (re)connecting, plus one per split batch.
- After a timeout the socket is closed and a new one made on the next call (a late reply then cannot be
  mistaken for another one, and nothing queued for a dead server is delivered to its successor). The server
  is also considered down for a while: calls fail at once, without touching the network, for
  ``retry_initial_s`` doubling up to ``retry_max_s`` after each further failure, so a dead server costs one
  timeout per interval, not one per call. The first success resets it.
- Both clients speak through a DEALER socket and match replies to requests by id; `AsyncCacheClient` runs
  any number of requests concurrently over it (a reader task it owns dispatches the replies). A
  ``unix:///path`` endpoint speaks to a server on this host through its unix socket instead (``kvstack
  cache-server --unix-socket``): the same requests, without the ZMQ I/O threads (a lookup's round trip
  ~25% shorter here); a timeout or a lost connection closes it, and the next call connects anew.
- Shared memory (same host): at connect the client creates an arena (``arena_bytes``, allocated up front
  so a full /dev/shm fails here instead of crashing later) and offers it in ``hello``; if the server can map
  it, payloads travel through it (see ``kvstack.cache.shm``), else through the socket. An ``arena`` error
  from the server switches to the socket until the next connect. A request that lent arena space and timed
  out retires the arena (a new one is made at the next connect).
- One-copy put: ``reserve(sizes)`` hands out `Reservation`, writable views of arena regions (None when
  shared memory is off or the arena is full); write each chunk into its view and pass the views themselves
  (the same objects) as ``put`` payloads: they travel as offsets, without a copy on the client. A put frees
  the reserved regions among its payloads, whatever its outcome (the views must not be used after it);
  free the others with ``Reservation.release()`` (unreleased ones stay taken until the arena is retired).
  Any other payload, a slice of a reserved view included, is copied as before.
- ``get`` returns `Chunks`: read-only views into the arena or the reply frames, valid until
  ``Chunks.release()`` (or the end of its ``with`` block, or its garbage collection), which gives the arena
  space back: copy what you keep longer.
- Large requests are split: at most the server's ``max_keys`` keys and ``max_message_bytes`` of socket
  payloads per request.

The operations are written once, as generators that yield each request and receive its outcome (no I/O);
the two clients only move frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import time
import weakref
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import msgspec
import zmq
import zmq.asyncio

from kvstack.cache.payload import Payload, byte_view
from kvstack.cache.protocol import (
    IN_FRAME,
    UNIX_SCHEME,
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
    Stats,
    StatsReply,
    UnixFramer,
    decode_reply,
    encode,
    join_keys,
    recv_frames,
    request_mac,
    send_frames,
    unix_head,
)
from kvstack.cache.shm import ALIGN, ArenaError, ClientArena
from kvstack.logs import ThrottledLog

__all__ = ["AsyncCacheClient", "CacheClient", "Chunks", "ClientStats", "Reservation"]

log = logging.getLogger(__name__)

T = TypeVar("T")
# A put's message size is estimated as the base plus, per chunk, the metadata bound, 5 bytes per token id
# (msgpack's largest uint32) and the payload when it travels in a frame.
_HEADER_BASE_BYTES = 1024
_CHUNK_META_BYTES = 64  # its key, size and offset, msgpack-encoded, with room to spare
_DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
_DEFAULT_MAX_KEYS = 4096  # until the server says its own


@dataclass(slots=True)
class ClientStats:
    requests: int = 0
    """Round trips attempted (hello included)."""
    failures: dict[str, int] = field(default_factory=dict)
    """Round trips that failed, by reason: down (not sent: server considered down), timeout, unreachable,
    error:<code> (error reply), bad_reply, reset (connection reset under it), bug, too_large (not sent: a
    chunk alone over the server's message size limit)."""
    chunks_hit: int = 0
    """Chunks ``get`` returned."""
    chunks_missed: int = 0
    """Chunks ``get`` asked for and did not return (failures included)."""
    shm_bytes: int = 0
    socket_bytes: int = 0
    connects: int = 0
    stale_replies: int = 0


@dataclass(slots=True)
class Failure:
    reason: str
    detail: str = ""
    code: str = ""


@dataclass(slots=True)
class _Call:
    request: Any
    payloads: Sequence[Payload]
    expect: type[Reply]
    arena: ClientArena | None = None
    """The arena this request lent space of: retired if the request times out."""


_Outcome = tuple[Any, list[memoryview]] | Failure
_NO_PREFIX: tuple[int, list[str]] = (0, [])
_Plan = Generator[_Call, _Outcome, T]


class Chunks(Sequence[memoryview]):
    """The payloads a ``get`` returned, in key order (a consecutive prefix of the keys asked for)."""

    def __init__(self, views: list[memoryview], release: Callable[[], None] | None = None) -> None:
        self._views = views
        self._finalizer = None if release is None else weakref.finalize(self, release)

    def __len__(self) -> int:
        return len(self._views)

    def __getitem__(self, i: int) -> memoryview:  # type: ignore[override]
        return self._views[i]

    def __iter__(self) -> Iterator[memoryview]:
        return iter(self._views)

    def release(self) -> None:
        """Give the arena space back; the views must not be used after this."""
        for view in self._views:
            with contextlib.suppress(BufferError):  # a view of a view: the space is still returned
                view.release()
        self._views = []
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> Chunks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Reservation(Sequence[memoryview]):
    """Writable arena regions from ``reserve``, one per size; pass the views to ``put`` as they are."""

    def __init__(self, views: list[memoryview], release: Callable[[list[memoryview]], None]) -> None:
        self._views = views
        self._release = release

    def __len__(self) -> int:
        return len(self._views)

    def __getitem__(self, i: int) -> memoryview:  # type: ignore[override]
        return self._views[i]

    def __iter__(self) -> Iterator[memoryview]:
        return iter(self._views)

    def release(self) -> None:
        """Give back the regions no ``put`` has sent yet; the views must not be used after this."""
        views, self._views = self._views, []
        self._release(views)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(slots=True)
class _Reserved:
    view: memoryview
    arena: ClientArena
    offset: int


def _free_regions(regions: list[tuple[ClientArena, int]]) -> None:
    for arena, offset in regions:
        if not arena.retired:
            arena.allocator.free(offset)


class _ClientCore:
    """Everything but the socket: request building, reply checking, arena use, backoff, counters."""

    def __init__(
        self,
        endpoint: str,
        *,
        secret: bytes | None,
        timeout_s: float,
        shm: bool,
        arena_bytes: int,
        shm_dir: str,
        retry_initial_s: float,
        retry_max_s: float,
        name: str,
        log_interval_s: float,
    ) -> None:
        if not endpoint or "://" not in endpoint:
            raise ValueError(
                "endpoint must be a ZMQ endpoint like tcp://127.0.0.1:5560 or a unix socket like "
                f"unix:///run/kvstack/cache.sock, got {endpoint!r}"
            )
        self.unix_path: str | None = None
        if endpoint.startswith(UNIX_SCHEME):
            self.unix_path = endpoint[len(UNIX_SCHEME) :]
            if not self.unix_path:
                raise ValueError(
                    f"a unix endpoint needs a path, like unix:///run/kvstack/cache.sock, got {endpoint!r}"
                )
        if secret is not None and not secret:
            raise ValueError("secret must be non-empty (or None)")
        if timeout_s <= 0 or not 0 < retry_initial_s <= retry_max_s:
            raise ValueError(
                f"need timeout_s > 0 and 0 < retry_initial_s <= retry_max_s, got {timeout_s}, "
                f"{retry_initial_s}, {retry_max_s}"
            )
        if shm and arena_bytes < 1 << 16:
            raise ValueError(f"arena_bytes must be >= 64 KiB, got {arena_bytes}")
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.stats = ClientStats()
        self.server: HelloReply | None = None
        self.arena: ClientArena | None = None
        self.shm_ok = False
        self._secret = secret
        self._shm_wanted = shm
        self._arena_bytes = arena_bytes
        self._shm_dir = shm_dir
        self._retry = (retry_initial_s, retry_max_s)
        self._delay = retry_initial_s
        self._down_until = 0.0
        self._name = name
        self._ids = itertools.count(1)
        self._chunk_hint = 0  # the largest payload seen: how much arena a get lends per key
        # Regions handed out by `reserve`, by id() of their view (the view is held here, so its id is not
        # reused): a put recognises them by identity and sends their offsets instead of copying.
        self._reserved: dict[int, _Reserved] = {}
        self._log = ThrottledLog(log, log_interval_s)

    # -- connection

    def hello_call(self) -> _Call:
        if self._shm_wanted and (self.arena is None or self.arena.retired):
            try:
                self.arena = ClientArena(self._arena_bytes, directory=self._shm_dir)
            except ArenaError as e:
                self._shm_wanted = False
                log.warning("cache client: no shared memory (%s); payloads go through the socket", e)
        arena = self.arena if self._shm_wanted else None
        request = Hello(
            id=next(self._ids),
            client=self._name,
            arena=None if arena is None else arena.name,
            arena_nonce=b"" if arena is None else arena.nonce,
        )
        return _Call(request, (), HelloReply)

    def on_hello(self, outcome: _Outcome) -> Failure | None:
        if isinstance(outcome, Failure):
            return outcome
        reply: HelloReply = outcome[0]
        self.server = reply
        self.stats.connects += 1
        self.shm_ok = reply.arena_ok
        if self.arena is not None and not reply.arena_ok:
            log.info(
                "cache client: server %s cannot use the shared memory arena (%s)",
                reply.node,
                reply.arena_error,
            )
        return None

    def frames(self, call: _Call) -> list[Any]:
        header = encode(call.request)
        mac = b"" if self._secret is None else request_mac(self._secret, header)
        return [header, mac, *call.payloads]

    def down(self) -> Failure | None:
        """A failure when the server is considered down (the call is not sent)."""
        if time.monotonic() < self._down_until:
            return self.failed(None, Failure("down", f"{self.endpoint} failed recently; retrying later"))
        return None

    def outcome(self, call: _Call, reply: Reply, payloads: list[memoryview]) -> _Outcome:
        """The outcome of ``call`` from its reply and the reply's payload frames (failures counted)."""
        if isinstance(reply, ErrorReply):
            return self.failed(call, Failure(f"error:{reply.code}", reply.message, reply.code))
        if not isinstance(reply, call.expect):
            return self.failed(
                call, Failure("bad_reply", f"a {type(reply).__name__} reply to a {call.expect.__name__}")
            )
        self._delay = self._retry[0]
        return reply, payloads

    def decode(self, header: memoryview | None) -> Reply | None:
        try:
            return decode_reply(header) if header is not None else None
        except (msgspec.MsgspecError, ValueError, TypeError):
            self.stats.stale_replies += 1
            self._log.warning("cache client: %s sent an unreadable reply; ignored", self.endpoint)
            return None

    def failed(self, call: _Call | None, failure: Failure) -> Failure:
        failures = self.stats.failures
        failures[failure.reason] = failures.get(failure.reason, 0) + 1
        if failure.reason in ("timeout", "unreachable", "reset"):
            if failure.reason != "reset":  # the request that timed out already counted
                self._down_until = time.monotonic() + self._delay
                self._delay = min(2 * self._delay, self._retry[1])
            self.server = None
            if call is not None and call.arena is not None:
                call.arena.retire()  # the server may still touch the space this request lent
        if failure.reason != "down" and failure.code != ErrorCode.ARENA:
            self._log.warning(
                "cache client: %s %s: %s %s (a miss)",
                self.endpoint,
                type(call.request).__name__.lower() if call is not None else "request",
                failure.reason,
                failure.detail,
            )
        return failure

    # -- arena use

    def _arena(self) -> ClientArena | None:
        arena = self.arena
        return arena if self.shm_ok and arena is not None and not arena.retired else None

    @property
    def max_keys(self) -> int:
        return self.server.max_keys if self.server is not None and self.server.max_keys else _DEFAULT_MAX_KEYS

    @property
    def max_message_bytes(self) -> int:
        limit = self.server.max_message_bytes if self.server is not None else 0
        return limit or _DEFAULT_MAX_MESSAGE_BYTES

    # -- operations (generators: yield a call, receive its outcome, return the result)

    def lookup_plan(self, keys: Sequence[bytes]) -> _Plan[tuple[int, list[str]]]:
        count, tiers = 0, []
        for start in range(0, len(keys), self.max_keys):
            batch = keys[start : start + self.max_keys]
            outcome = yield _Call(Lookup(id=next(self._ids), keys=join_keys(batch)), (), LookupReply)
            if isinstance(outcome, Failure):
                break
            reply: LookupReply = outcome[0]
            if not 0 <= reply.count <= len(batch) or len(reply.tiers) != reply.count:
                self.failed(None, Failure("bad_reply", f"lookup count {reply.count} for {len(batch)} keys"))
                break
            count += reply.count
            tiers += reply.tiers
            if reply.count < len(batch):
                break
        return count, tiers

    def exists_plan(self, keys: Sequence[bytes]) -> _Plan[list[bool]]:
        present: list[bool] = []
        for start in range(0, len(keys), self.max_keys):
            batch = keys[start : start + self.max_keys]
            outcome = yield _Call(Exists(id=next(self._ids), keys=join_keys(batch)), (), ExistsReply)
            if isinstance(outcome, Failure):
                break
            reply: ExistsReply = outcome[0]
            if len(reply.present) != len(batch):
                self.failed(None, Failure("bad_reply", f"{len(reply.present)} answers for {len(batch)} keys"))
                break
            present += reply.present
        return present + [False] * (len(keys) - len(present))

    def get_plan(self, keys: Sequence[bytes]) -> _Plan[Chunks | None]:
        views: list[memoryview] = []
        regions: list[tuple[ClientArena, int]] = []
        failed = False
        while len(views) < len(keys):
            batch = keys[len(views) : len(views) + self.max_keys]
            arena, offset, size = self._lend(len(batch))
            call = _Call(
                Get(
                    id=next(self._ids),
                    keys=join_keys(batch),
                    arena=None if arena is None else arena.name,
                    region_offset=offset,
                    region_size=size,
                ),
                (),
                GetReply,
                arena,
            )
            outcome = yield call
            if isinstance(outcome, Failure):
                if arena is not None and not arena.retired:
                    arena.allocator.free(offset)
                if outcome.code == ErrorCode.ARENA and arena is not None:
                    self.shm_ok = False  # the socket until the next connect; this batch again
                    continue
                failed = not views
                break
            reply: GetReply = outcome[0]
            got = self._place(reply, outcome[1], len(batch), arena, offset, size, regions)
            if got is None:
                failed = not views
                break
            views += got
            if not got or (len(got) < len(batch) and not reply.more):
                break
        self.stats.chunks_hit += len(views)
        self.stats.chunks_missed += len(keys) - len(views)
        if failed:
            return None
        return Chunks(views, (lambda: _free_regions(regions)) if regions else None)

    def _lend(self, n_keys: int) -> tuple[ClientArena | None, int, int]:
        arena = self._arena()
        if arena is None:
            return None, 0, 0
        allocator = arena.allocator
        want = n_keys * (self._chunk_hint + ALIGN) if self._chunk_hint else allocator.capacity // 4
        size = min(want, allocator.largest_free())
        offset = allocator.alloc(size) if size >= ALIGN else None
        if offset is None:
            return None, 0, 0
        return arena, offset, size

    def _place(
        self,
        reply: GetReply,
        frames: list[memoryview],
        asked: int,
        arena: ClientArena | None,
        offset: int,
        size: int,
        regions: list[tuple[ClientArena, int]],
    ) -> list[memoryview] | None:
        """The views of a get reply's payloads; None (counted) when the reply does not add up."""
        used_end = offset
        views: list[memoryview] = []
        frame_iter = iter(frames)
        problem = ""
        if arena is not None and arena.retired and any(at != IN_FRAME for at in reply.offsets):
            # Another request timed out meanwhile and retired the arena: its bytes may be gone.
            self.failed(None, Failure("reset", "the arena was retired while this get ran"))
            return None
        if len(reply.sizes) != len(reply.offsets) or len(reply.sizes) > asked:
            problem = f"{len(reply.sizes)} sizes, {len(reply.offsets)} offsets for {asked} keys"
        elif sum(1 for o in reply.offsets if o == IN_FRAME) != len(frames):
            problem = f"{len(frames)} payload frames for {reply.offsets.count(IN_FRAME)} framed payloads"
        else:
            for n, at in zip(reply.sizes, reply.offsets, strict=True):
                if at == IN_FRAME:
                    view = next(frame_iter).toreadonly()
                    if len(view) != n:
                        problem = f"a {len(view)}-byte frame for a {n}-byte payload"
                        break
                    self.stats.socket_bytes += n
                elif arena is None or n < 0 or at < offset or at + n > offset + size:
                    problem = (
                        f"payload at [{at}, {at + n}) outside the lent region [{offset}, {offset + size})"
                    )
                    break
                else:
                    view = arena.view[at : at + n].toreadonly()
                    used_end = max(used_end, at + n)
                    self.stats.shm_bytes += n
                views.append(view)
                self._chunk_hint = max(self._chunk_hint, n)
        if arena is not None and not arena.retired:
            arena.allocator.shrink(offset, used_end - offset)
            if used_end > offset:
                regions.append((arena, offset))
        if problem:
            self.failed(None, Failure("bad_reply", problem))
            if arena is not None and used_end > offset:
                _free_regions([regions.pop()])
            return None
        return views

    def reserve(self, sizes: Sequence[int]) -> Reservation | None:
        """Writable arena regions of ``sizes`` bytes (each > 0), or None (no shared memory, or no room)."""
        arena = self._arena()
        if arena is None or not sizes:
            return None
        if any(n <= 0 for n in sizes):
            raise ValueError(f"reserve: sizes must be > 0, got {list(sizes)}")
        offsets: list[int] = []
        for n in sizes:
            at = arena.allocator.alloc(n)
            if at is None:
                for done in offsets:
                    arena.allocator.free(done)
                return None
            offsets.append(at)
        views = []
        for n, at in zip(sizes, offsets, strict=True):
            view = arena.view[at : at + n]
            self._reserved[id(view)] = _Reserved(view, arena, at)
            views.append(view)
        return Reservation(views, self.release)

    def release(self, views: Sequence[object]) -> None:
        """Free the reserved regions of ``views`` (views already sent by a put are skipped)."""
        if not self._reserved:
            return
        for view in views:
            region = self._reserved.get(id(view))
            if region is None or region.view is not view:
                continue
            del self._reserved[id(view)]
            if not region.arena.retired:
                region.arena.allocator.free(region.offset)
            with contextlib.suppress(BufferError):  # exported further (numpy): its memory stays mapped
                view.release()

    def put_plan(
        self,
        keys: Sequence[bytes],
        payloads: Sequence[Payload],
        token_ids: Sequence[Sequence[int]] | None,
        parent: bytes | None,
        model: str | None = None,
    ) -> _Plan[bool]:
        if len(keys) != len(payloads) or (token_ids is not None and len(token_ids) != len(keys)):
            raise ValueError(
                f"put: {len(keys)} keys, {len(payloads)} payloads, "
                f"{'no' if token_ids is None else len(token_ids)} token lists (one per key)"
            )
        join_keys(keys)  # checks every key is 32 bytes
        data = [byte_view(p) for p in payloads]
        self._chunk_hint = max([self._chunk_hint, *(d.nbytes for d in data)])
        reserved = [self._reserved.get(id(p)) for p in payloads] if self._reserved else [None] * len(keys)
        reserved = [
            r if r is not None and r.view is p else None for r, p in zip(reserved, payloads, strict=True)
        ]
        return (yield from self._put_batches(keys, data, reserved, token_ids, parent, model))

    def _put_batches(
        self,
        keys: Sequence[bytes],
        data: list[memoryview],
        reserved: list[_Reserved | None],
        token_ids: Sequence[Sequence[int]] | None,
        parent: bytes | None,
        model: str | None,
    ) -> _Plan[bool]:
        start = 0
        while start < len(keys):
            arena = self._arena()
            sizes: list[int] = []
            offsets: list[int] = []
            frames: list[memoryview] = []
            lent: list[int] = []
            shared = False
            framed = 0
            used = _HEADER_BASE_BYTES + (
                0 if model is None else len(model.encode())
            )  # an upper bound of the message size, to stay under the server's limit
            end = start
            while end < len(keys) and end - start < self.max_keys:
                n = data[end].nbytes
                region = reserved[end]
                if region is not None and region.arena is arena:
                    at: int | None = region.offset  # already in the arena: no copy, no allocation
                else:
                    region = None
                    at = arena.allocator.alloc(n) if arena is not None and n else None
                cost = _CHUNK_META_BYTES + (0 if token_ids is None else 5 * len(token_ids[end]))
                cost += n if at is None else 0
                if used + cost > self.max_message_bytes:
                    if arena is not None and at is not None and region is None:
                        arena.allocator.free(at)
                    if end > start:
                        break
                    # Alone over the server's limit: the server would drop the connection unanswered (a
                    # timeout here, and the server taken for down), so the chunk is not sent at all.
                    self.failed(
                        None,
                        Failure(
                            "too_large",
                            f"a {n}-byte chunk does not fit the server's {self.max_message_bytes}-byte "
                            "messages (start it with a larger --max-message-mb, or use shared memory)",
                        ),
                    )
                    return False
                used += cost
                if region is not None and at is not None:
                    shared = True
                    offsets.append(at)
                elif arena is not None and at is not None:
                    arena.view[at : at + n] = data[end]
                    lent.append(at)
                    offsets.append(at)
                else:
                    frames.append(data[end])
                    offsets.append(IN_FRAME)
                    framed += n
                sizes.append(n)
                end += 1
            request = Put(
                id=next(self._ids),
                keys=join_keys(keys[start:end]),
                sizes=sizes,
                offsets=offsets if lent or shared else [],
                arena=arena.name if arena is not None and (lent or shared) else None,
                parent=bytes(keys[start - 1]) if start else None if parent is None else bytes(parent),
                token_ids=None if token_ids is None else [list(t) for t in token_ids[start:end]],
                model=model,
            )
            outcome = yield _Call(request, frames, PutReply, arena if lent or shared else None)
            if arena is not None and not arena.retired:
                for at in lent:
                    arena.allocator.free(at)
            if isinstance(outcome, Failure):
                if outcome.code == ErrorCode.ARENA and (lent or shared):
                    self.shm_ok = False  # this batch again, through the socket
                    continue
                return False
            self.stats.socket_bytes += framed
            self.stats.shm_bytes += sum(sizes) - framed
            start = end
        return True

    def evict_plan(self, keys: Sequence[bytes]) -> _Plan[int]:
        removed = 0
        for start in range(0, len(keys), self.max_keys):
            batch = keys[start : start + self.max_keys]
            outcome = yield _Call(Evict(id=next(self._ids), keys=join_keys(batch)), (), EvictReply)
            if isinstance(outcome, Failure):
                break
            removed += outcome[0].removed
        return removed

    def clear_plan(self) -> _Plan[bool]:
        outcome = yield _Call(Clear(id=next(self._ids)), (), ClearReply)
        return not isinstance(outcome, Failure)

    def stats_plan(self) -> _Plan[dict[str, Any] | None]:
        outcome = yield _Call(Stats(id=next(self._ids)), (), StatsReply)
        if isinstance(outcome, Failure):
            return None
        reply: StatsReply = outcome[0]
        return {"node": reply.node, **reply.stats}

    def bug(self, what: str, error: Exception, miss: T) -> T:
        """A miss for an operation that raised (bad arguments, or a bug here)."""
        failures = self.stats.failures
        failures["bug"] = failures.get("bug", 0) + 1
        self._log.warning(
            "cache client: %s raised %s: %s; returning a miss", what, type(error).__name__, error
        )
        log.debug("cache client: %s failed", what, exc_info=error)
        return miss


_S = TypeVar("_S", bound=zmq.Socket[Any])


def _dealer(ctx: zmq.Context[_S], endpoint: str) -> _S:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.RECONNECT_IVL, 50)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    sock.connect(endpoint)
    return sock


class CacheClient:
    """Synchronous client (one request at a time; not thread-safe). See the module docstring."""

    def __init__(
        self,
        endpoint: str,
        *,
        secret: bytes | None = None,
        timeout_s: float = 1.0,
        shm: bool = True,
        arena_bytes: int = 128 << 20,
        shm_dir: str = "/dev/shm",
        retry_initial_s: float = 0.05,
        retry_max_s: float = 2.0,
        name: str = "",
        log_interval_s: float = 10.0,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self._core = _ClientCore(
            endpoint,
            secret=secret,
            timeout_s=timeout_s,
            shm=shm,
            arena_bytes=arena_bytes,
            shm_dir=shm_dir,
            retry_initial_s=retry_initial_s,
            retry_max_s=retry_max_s,
            name=name,
            log_interval_s=log_interval_s,
        )
        self.stats = self._core.stats
        self._ctx = context if context is not None else zmq.Context()
        self._own_ctx = context is None
        self._sock: zmq.Socket[Any] | None = None
        self._link: _UnixLink | None = None

    @property
    def node(self) -> str | None:
        """The server's node name, once connected."""
        return None if self._core.server is None else self._core.server.node

    @property
    def shm_active(self) -> bool:
        return self._core.shm_ok

    def lookup(self, keys: Sequence[bytes]) -> int:
        return self._run(lambda: self._core.lookup_plan(keys), _NO_PREFIX, "lookup")[0]

    def locate(self, keys: Sequence[bytes]) -> list[str]:
        return self._run(lambda: self._core.lookup_plan(keys), _NO_PREFIX, "lookup")[1]

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return self._run(lambda: self._core.exists_plan(keys), [False] * len(keys), "exists")

    def get(self, keys: Sequence[bytes]) -> Chunks | None:
        return self._run(lambda: self._core.get_plan(keys), None, "get", missed=len(keys))

    def put(
        self,
        keys: Sequence[bytes],
        payloads: Sequence[Payload],
        *,
        token_ids: Sequence[Sequence[int]] | None = None,
        parent: bytes | None = None,
        model: str | None = None,
    ) -> bool:
        try:
            return self._run(
                lambda: self._core.put_plan(keys, payloads, token_ids, parent, model), False, "put"
            )
        finally:  # sent or not, reserved regions among the payloads are the put's: freed now
            self._core.release(payloads)

    def reserve(self, sizes: Sequence[int]) -> Reservation | None:
        """Writable arena regions to fill and pass to ``put`` (one copy less); None: use ordinary payloads."""
        try:
            if self._core.down() or self._connect():
                return None
            return self._core.reserve(sizes)
        except Exception as e:
            return self._core.bug("reserve", e, None)

    def evict(self, keys: Sequence[bytes]) -> int:
        return self._run(lambda: self._core.evict_plan(keys), 0, "evict")

    def clear(self) -> bool:
        return self._run(self._core.clear_plan, False, "clear")

    def server_stats(self) -> dict[str, Any] | None:
        return self._run(self._core.stats_plan, None, "stats")

    def close(self) -> None:
        self._reset()
        if self._core.arena is not None:
            self._core.arena.retire()
        if self._own_ctx:
            self._ctx.term()

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- driving a plan

    def _run(self, make_plan: Callable[[], _Plan[T]], miss: T, what: str, missed: int = 0) -> T:
        core = self._core
        try:
            down = core.down() or self._connect()
            if down is not None:
                core.stats.chunks_missed += missed
                return miss
            plan = make_plan()
            call = next(plan)
            while True:
                call = plan.send(self._roundtrip(call))
        except StopIteration as stop:
            result: T = stop.value
            return result
        except Exception as e:  # never into the caller's hot path
            return core.bug(what, e, miss)

    def _connect(self) -> Failure | None:
        if (self._sock is not None or self._link is not None) and self._core.server is not None:
            return None
        call = self._core.hello_call()
        return self._core.on_hello(self._exchange(call))

    def _roundtrip(self, call: _Call) -> _Outcome:
        failure = self._connect()
        return failure if failure is not None else self._exchange(call)

    def _exchange(self, call: _Call) -> _Outcome:
        core = self._core
        if core.unix_path is not None:
            return self._exchange_unix(call, core.unix_path)
        deadline = time.monotonic() + core.timeout_s
        if self._sock is None:
            self._sock = _dealer(self._ctx, core.endpoint)
            self._sock.setsockopt(zmq.SNDTIMEO, max(1, int(core.timeout_s * 1000)))
        sock = self._sock
        core.stats.requests += 1
        try:
            send_frames(sock, core.frames(call))
        except zmq.ZMQError as e:
            self._reset()
            return core.failed(call, Failure("unreachable", f"cannot send ({e}); is the server running?"))
        while True:
            # A receive timeout rather than a poll: no Poller is built per call on the lookup path.
            left_ms = int((deadline - time.monotonic()) * 1000)
            try:
                if left_ms <= 0:
                    raise zmq.Again()
                sock.setsockopt(zmq.RCVTIMEO, left_ms)
                parts = recv_frames(sock)
            except zmq.Again:
                self._reset()
                return core.failed(call, Failure("timeout", f"no reply within {core.timeout_s}s"))
            reply = core.decode(parts[0].buffer)
            if reply is None or reply.id != call.request.id:
                core.stats.stale_replies += reply is not None
                continue
            return core.outcome(call, reply, [part.buffer for part in parts[1:]])

    def _exchange_unix(self, call: _Call, path: str) -> _Outcome:
        core = self._core
        deadline = time.monotonic() + core.timeout_s
        core.stats.requests += 1
        try:
            if self._link is None:
                self._link = _UnixLink(path, core.timeout_s)
            link = self._link
            link.send(core.frames(call), deadline)
            while True:
                parts = link.recv(deadline)
                reply = core.decode(parts[0])
                if reply is None or reply.id != call.request.id:
                    core.stats.stale_replies += reply is not None
                    continue
                return core.outcome(call, reply, parts[1:])
        except TimeoutError:
            self._reset()
            return core.failed(call, Failure("timeout", f"no reply within {core.timeout_s}s"))
        except ProtocolError as e:
            self._reset()
            return core.failed(call, Failure("bad_reply", e.message))
        except OSError as e:
            self._reset()
            return core.failed(call, Failure("unreachable", f"{path}: {e}; is the server running?"))

    def _reset(self) -> None:
        sock, self._sock = self._sock, None
        link, self._link = self._link, None
        self._core.server = None
        if sock is not None:
            sock.close(linger=0)
        if link is not None:
            link.close()


class AsyncCacheClient:
    """Asynchronous client: concurrent requests over one socket. See the module docstring."""

    def __init__(
        self,
        endpoint: str,
        *,
        secret: bytes | None = None,
        timeout_s: float = 1.0,
        shm: bool = True,
        arena_bytes: int = 128 << 20,
        shm_dir: str = "/dev/shm",
        retry_initial_s: float = 0.05,
        retry_max_s: float = 2.0,
        name: str = "",
        log_interval_s: float = 10.0,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self._core = _ClientCore(
            endpoint,
            secret=secret,
            timeout_s=timeout_s,
            shm=shm,
            arena_bytes=arena_bytes,
            shm_dir=shm_dir,
            retry_initial_s=retry_initial_s,
            retry_max_s=retry_max_s,
            name=name,
            log_interval_s=log_interval_s,
        )
        self.stats = self._core.stats
        self._ctx = context if context is not None else zmq.asyncio.Context()
        self._own_ctx = context is None
        self._sock: zmq.asyncio.Socket | None = None
        self._link: _AsyncUnixLink | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, tuple[_Call, asyncio.Future[_Outcome]]] = {}
        self._connecting: asyncio.Lock | None = None

    @property
    def node(self) -> str | None:
        return None if self._core.server is None else self._core.server.node

    @property
    def shm_active(self) -> bool:
        return self._core.shm_ok

    async def lookup(self, keys: Sequence[bytes]) -> int:
        return (await self._run(lambda: self._core.lookup_plan(keys), _NO_PREFIX, "lookup"))[0]

    async def locate(self, keys: Sequence[bytes]) -> list[str]:
        return (await self._run(lambda: self._core.lookup_plan(keys), _NO_PREFIX, "lookup"))[1]

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return await self._run(lambda: self._core.exists_plan(keys), [False] * len(keys), "exists")

    async def get(self, keys: Sequence[bytes]) -> Chunks | None:
        return await self._run(lambda: self._core.get_plan(keys), None, "get", missed=len(keys))

    async def put(
        self,
        keys: Sequence[bytes],
        payloads: Sequence[Payload],
        *,
        token_ids: Sequence[Sequence[int]] | None = None,
        parent: bytes | None = None,
        model: str | None = None,
    ) -> bool:
        try:
            return await self._run(
                lambda: self._core.put_plan(keys, payloads, token_ids, parent, model), False, "put"
            )
        finally:  # sent or not, reserved regions among the payloads are the put's: freed now
            self._core.release(payloads)

    async def reserve(self, sizes: Sequence[int]) -> Reservation | None:
        """Writable arena regions to fill and pass to ``put`` (one copy less); None: use ordinary payloads."""
        try:
            if self._core.down() or await self._connect():
                return None
            return self._core.reserve(sizes)
        except Exception as e:
            return self._core.bug("reserve", e, None)

    async def evict(self, keys: Sequence[bytes]) -> int:
        return await self._run(lambda: self._core.evict_plan(keys), 0, "evict")

    async def clear(self) -> bool:
        return await self._run(self._core.clear_plan, False, "clear")

    async def server_stats(self) -> dict[str, Any] | None:
        return await self._run(self._core.stats_plan, None, "stats")

    async def aclose(self) -> None:
        await self._reset()
        if self._core.arena is not None:
            self._core.arena.retire()
        if self._own_ctx:
            self._ctx.term()

    async def __aenter__(self) -> AsyncCacheClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- driving a plan

    async def _run(self, make_plan: Callable[[], _Plan[T]], miss: T, what: str, missed: int = 0) -> T:
        core = self._core
        try:
            down = core.down() or await self._connect()
            if down is not None:
                core.stats.chunks_missed += missed
                return miss
            plan = make_plan()
            call = next(plan)
            while True:
                call = plan.send(await self._roundtrip(call))
        except StopIteration as stop:
            result: T = stop.value
            return result
        except Exception as e:
            return core.bug(what, e, miss)

    def _connected(self) -> bool:
        return (self._sock is not None or self._link is not None) and self._core.server is not None

    async def _connect(self) -> Failure | None:
        if self._connected():
            return None
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._connected():
                return None
            # Callers queued here while a connect failed must not each wait out a timeout of their own.
            return self._core.down() or self._core.on_hello(await self._exchange(self._core.hello_call()))

    async def _roundtrip(self, call: _Call) -> _Outcome:
        failure = await self._connect()
        return failure if failure is not None else await self._exchange(call)

    async def _exchange(self, call: _Call) -> _Outcome:
        core = self._core
        if core.unix_path is not None:
            return await self._exchange_unix(call, core.unix_path)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + core.timeout_s
        sock = self._sock
        if sock is None:
            sock = self._sock = _dealer(self._ctx, core.endpoint)
            self._reader = loop.create_task(self._read(sock), name="cache-client-reader")
        future: asyncio.Future[_Outcome] = loop.create_future()
        rid = call.request.id
        self._pending[rid] = (call, future)
        core.stats.requests += 1
        try:
            await asyncio.wait_for(sock.send_multipart(core.frames(call), copy=False), core.timeout_s)
            outcome = await asyncio.wait_for(future, max(0.0, deadline - loop.time()))
        except TimeoutError:
            await self._reset(sock)
            return core.failed(call, Failure("timeout", f"no reply within {core.timeout_s}s"))
        except zmq.ZMQError as e:
            await self._reset(sock)
            return core.failed(call, Failure("unreachable", f"cannot send ({e}); is the server running?"))
        finally:
            self._pending.pop(rid, None)
        if isinstance(outcome, Failure) and outcome.reason == "reset":
            return core.failed(call, outcome)
        return outcome

    async def _exchange_unix(self, call: _Call, path: str) -> _Outcome:
        core = self._core
        loop = asyncio.get_running_loop()
        deadline = loop.time() + core.timeout_s
        core.stats.requests += 1
        link = self._link
        if link is None:
            try:
                _, new_link = await asyncio.wait_for(
                    loop.create_unix_connection(lambda: _AsyncUnixLink(self), path), core.timeout_s
                )
            except TimeoutError:
                return core.failed(call, Failure("timeout", f"no connection within {core.timeout_s}s"))
            except OSError as e:
                return core.failed(call, Failure("unreachable", f"{path}: {e}; is the server running?"))
            link = self._link = new_link
        future: asyncio.Future[_Outcome] = loop.create_future()
        rid = call.request.id
        self._pending[rid] = (call, future)
        try:
            link.send(core.frames(call))
            outcome = await asyncio.wait_for(future, max(0.0, deadline - loop.time()))
        except TimeoutError:
            await self._reset(link=link)
            return core.failed(call, Failure("timeout", f"no reply within {core.timeout_s}s"))
        except OSError as e:  # the connection closed under us
            await self._reset(link=link)
            return core.failed(call, Failure("unreachable", f"{path}: {e}"))
        finally:
            self._pending.pop(rid, None)
        if isinstance(outcome, Failure) and outcome.reason == "reset":
            return core.failed(call, outcome)
        return outcome

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            parts = await sock.recv_multipart(copy=False)
            self._on_reply(parts[0].buffer, [part.buffer for part in parts[1:]])

    def _on_reply(self, header: memoryview, payloads: list[memoryview]) -> None:
        reply = self._core.decode(header)
        if reply is None:
            return
        entry = self._pending.get(reply.id)
        if entry is None or entry[1].done():
            self._core.stats.stale_replies += 1
            return
        call, future = entry
        future.set_result(self._core.outcome(call, reply, payloads))

    def _fail_pending(self, why: str) -> None:
        for _, future in list(self._pending.values()):
            if not future.done():
                future.set_result(Failure("reset", why))

    def _link_lost(self, link: _AsyncUnixLink) -> None:
        if link is self._link:
            self._link = None
            self._core.server = None
            self._fail_pending("the server closed the connection")

    async def _reset(
        self, sock: zmq.asyncio.Socket | None = None, link: _AsyncUnixLink | None = None
    ) -> None:
        if (sock is not None and sock is not self._sock) or (link is not None and link is not self._link):
            return  # another request already replaced it
        sock, self._sock = self._sock, None
        link, self._link = self._link, None
        self._core.server = None
        reader, self._reader = self._reader, None
        self._fail_pending("the connection was reset after another request timed out")
        if link is not None:
            link.close()
        if reader is not None:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        if sock is not None:
            sock.close(linger=0)


# A reply's frames and bytes, bounded for the framer: a get reply carries at most the server's
# max_message_bytes in frames (256 MiB by default), one frame per key.
_MAX_REPLY_FRAMES = 1 << 20
_MAX_REPLY_BYTES = 1 << 32
_IOV_MAX = 512  # buffers per sendmsg (Linux allows 1024)
_RECV_BYTES = 1 << 18


class _UnixLink:
    """`CacheClient` 's unix-socket connection: blocking, every call bounded by the request's deadline."""

    def __init__(self, path: str, timeout_s: float) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.connect(path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.framer = UnixFramer(_MAX_REPLY_FRAMES, _MAX_REPLY_BYTES)

    def send(self, frames: Sequence[Any], deadline: float) -> None:
        views = [memoryview(part).cast("B") for part in (unix_head(frames), *frames)]
        views = [view for view in views if view.nbytes]
        while views:
            self.sock.settimeout(_left(deadline))
            sent = self.sock.sendmsg(views[:_IOV_MAX])
            while sent:  # drop what went out
                if sent >= views[0].nbytes:
                    sent -= views.pop(0).nbytes
                else:
                    views[0] = views[0][sent:]
                    sent = 0

    def recv(self, deadline: float) -> list[memoryview]:
        while True:
            frames = self.framer.next()
            if frames is not None:
                return frames
            self.sock.settimeout(_left(deadline))
            data = self.sock.recv(_RECV_BYTES)
            if not data:
                raise ConnectionResetError("the server closed the connection")
            self.framer.feed(data)

    def close(self) -> None:
        self.sock.close()


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError()
    return left


class _AsyncUnixLink(asyncio.Protocol):
    """`AsyncCacheClient` 's unix-socket connection: hands each reply to the client as it is read."""

    def __init__(self, client: AsyncCacheClient) -> None:
        self.client = client
        self.framer = UnixFramer(_MAX_REPLY_FRAMES, _MAX_REPLY_BYTES)
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.framer.feed(data)
        try:
            while (frames := self.framer.next()) is not None:
                self.client._on_reply(frames[0], frames[1:])
        except ProtocolError as e:
            self.client._core._log.warning(
                "cache client: %s: %s; reconnecting", self.client._core.endpoint, e
            )
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.client._link_lost(self)

    def send(self, frames: Sequence[Any]) -> None:
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the connection to the server is closed")
        self.transport.writelines([unix_head(frames), *frames])

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()
