"""`ClientCore`: everything of a cache client but the socket, shared by `CacheClient` and `AsyncCacheClient`.

It builds each request's frames (header, mac, payloads), checks each reply against its request, counts
failures by reason and logs them (throttled). The operations are written once, as `Plan` generators that
yield each `Call` and receive its outcome; the clients only move frames. A large request is split into
calls of at most the server's ``max_keys`` keys and ``max_message_bytes`` of socket payloads; a put chunk
alone over that limit is not sent (``too_large``).

After a timeout or an unreachable server, the server is considered down: calls fail at once (``down``),
without touching the network, for the next delay of a ``kvstack.backoff`` sequence (``retry_initial_s``
doubling up to ``retry_max_s``, no jitter), so a dead server costs one timeout per delay, not one per call.
The first success resets the sequence. Shared memory (same host): ``hello`` offers the client's arena,
created at connect (``arena_bytes``, allocated up front); if the server maps it, payloads travel through it,
and an ``arena`` error reply switches to the socket until the next connect. A call that lent arena space and
timed out retires the arena (a new one is made at the next connect).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any, TypeVar

import msgspec

from kvstack.backoff import Backoff
from kvstack.cache.client.arena import Reserved, free_regions, lend_region, place_payloads, reserve_regions
from kvstack.cache.client.calls import Call, Failure, Outcome, Plan
from kvstack.cache.client.results import Chunks, ClientStats, Reservation
from kvstack.cache.keys import KEY_BYTES
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
    Put,
    PutReply,
    Reply,
    Stats,
    StatsReply,
    StoredTail,
    decode_reply,
    encode,
    join_keys,
    request_mac,
)
from kvstack.cache.shm import ArenaError, ClientArena
from kvstack.logs import ThrottledLog

__all__ = ["ClientCore"]

log = logging.getLogger(__name__)

T = TypeVar("T")
# A put's message size is estimated as the base plus, per chunk, the metadata bound, 5 bytes per token id
# (msgpack's largest uint32) and the payload when it travels in a frame.
_HEADER_BASE_BYTES = 1024
_CHUNK_META_BYTES = 64  # its key, size and offset, msgpack-encoded, with room to spare
_DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
_DEFAULT_MAX_KEYS = 4096  # until the server says its own


class ClientCore:
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
        self._retry = Backoff(retry_initial_s, retry_max_s).sequence()
        self._down_until = 0.0
        self._name = name
        self._ids = itertools.count(1)
        self._chunk_hint = 0  # the largest payload seen: how much arena a get lends per key
        # Regions handed out by `reserve`, by id() of their view (the view is held here, so its id is not
        # reused): a put recognises them by identity and sends their offsets instead of copying.
        self._reserved: dict[int, Reserved] = {}
        self._log = ThrottledLog(log, log_interval_s)

    # -- connection

    def hello_call(self) -> Call:
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
        return Call(request, (), HelloReply)

    def on_hello(self, outcome: Outcome) -> Failure | None:
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

    def frames(self, call: Call) -> list[Any]:
        header = encode(call.request)
        mac = b"" if self._secret is None else request_mac(self._secret, header)
        return [header, mac, *call.payloads]

    def down(self) -> Failure | None:
        """A failure when the server is considered down (the call is not sent)."""
        if time.monotonic() < self._down_until:
            return self.failed(None, Failure("down", f"{self.endpoint} failed recently; retrying later"))
        return None

    def outcome(self, call: Call, reply: Reply, payloads: list[memoryview]) -> Outcome:
        """The outcome of ``call`` from its reply and the reply's payload frames (failures counted)."""
        if isinstance(reply, ErrorReply):
            return self.failed(call, Failure(f"error:{reply.code}", reply.message, reply.code))
        if not isinstance(reply, call.expect):
            return self.failed(
                call, Failure("bad_reply", f"a {type(reply).__name__} reply to a {call.expect.__name__}")
            )
        self._retry.reset()
        return reply, payloads

    def decode(self, header: memoryview | None) -> Reply | None:
        try:
            return decode_reply(header) if header is not None else None
        except (msgspec.MsgspecError, ValueError, TypeError):
            self.stats.stale_replies += 1
            self._log.warning("cache client: %s sent an unreadable reply; ignored", self.endpoint)
            return None

    def failed(self, call: Call | None, failure: Failure) -> Failure:
        failures = self.stats.failures
        failures[failure.reason] = failures.get(failure.reason, 0) + 1
        if failure.reason in ("timeout", "unreachable", "reset"):
            if failure.reason != "reset":  # the request that timed out already counted
                self._down_until = time.monotonic() + self._retry.next()
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

    def warn(self, msg: str, *args: object) -> None:
        """A warning, throttled with the client's others (at most one per ``log_interval_s``)."""
        self._log.warning(msg, *args)

    def bug(self, what: str, error: Exception, miss: T) -> T:
        """A miss for an operation that raised (bad arguments, or a bug here)."""
        failures = self.stats.failures
        failures["bug"] = failures.get("bug", 0) + 1
        self._log.warning(
            "cache client: %s raised %s: %s; returning a miss", what, type(error).__name__, error
        )
        log.debug("cache client: %s failed", what, exc_info=error)
        return miss

    @property
    def max_keys(self) -> int:
        return self.server.max_keys if self.server is not None and self.server.max_keys else _DEFAULT_MAX_KEYS

    @property
    def max_message_bytes(self) -> int:
        limit = self.server.max_message_bytes if self.server is not None else 0
        return limit or _DEFAULT_MAX_MESSAGE_BYTES

    # -- arena use

    def _arena(self) -> ClientArena | None:
        arena = self.arena
        return arena if self.shm_ok and arena is not None and not arena.retired else None

    def reserve(self, sizes: Sequence[int]) -> Reservation | None:
        """Writable arena regions of ``sizes`` bytes (each > 0), or None (no shared memory, or no room)."""
        arena = self._arena()
        if arena is None or not sizes:
            return None
        reserved = reserve_regions(arena, sizes)
        if reserved is None:
            return None
        for region in reserved:
            self._reserved[id(region.view)] = region
        return Reservation([region.view for region in reserved], self.release)

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

    # -- operations (generators: yield a call, receive its outcome, return the result)

    def lookup_plan(
        self, keys: Sequence[bytes], tails: bool = False, parent: bytes | None = None
    ) -> Plan[tuple[int, list[str], list[StoredTail]]]:
        """(count, tiers, tails): with ``tails``, the partial tails held right after the prefix found
        (``parent``: the key before ``keys[0]``, None at a prompt's start)."""
        count, tiers = 0, []
        after: list[StoredTail] = []
        for start in range(0, len(keys), self.max_keys):
            batch = keys[start : start + self.max_keys]
            before = keys[start - 1] if start else parent
            before = None if before is None or not tails else bytes(before)  # msgspec encodes bytes only
            request = Lookup(id=next(self._ids), keys=join_keys(batch), tails=tails, parent=before)
            outcome = yield Call(request, (), LookupReply)
            if isinstance(outcome, Failure):
                break
            reply: LookupReply = outcome[0]
            if not 0 <= reply.count <= len(batch) or len(reply.tiers) != reply.count:
                self.failed(None, Failure("bad_reply", f"lookup count {reply.count} for {len(batch)} keys"))
                break
            count += reply.count
            tiers += reply.tiers
            after = [t for t in reply.tails if len(t.key) == KEY_BYTES and t.length > 0] if tails else []
            if reply.count < len(batch):
                break
        return count, tiers, after

    def exists_plan(self, keys: Sequence[bytes]) -> Plan[list[bool]]:
        present: list[bool] = []
        for start in range(0, len(keys), self.max_keys):
            batch = keys[start : start + self.max_keys]
            outcome = yield Call(Exists(id=next(self._ids), keys=join_keys(batch)), (), ExistsReply)
            if isinstance(outcome, Failure):
                break
            reply: ExistsReply = outcome[0]
            if len(reply.present) != len(batch):
                self.failed(None, Failure("bad_reply", f"{len(reply.present)} answers for {len(batch)} keys"))
                break
            present += reply.present
        return present + [False] * (len(keys) - len(present))

    def get_plan(self, keys: Sequence[bytes]) -> Plan[Chunks | None]:
        views: list[memoryview] = []
        regions: list[tuple[ClientArena, int]] = []
        failed = False
        while len(views) < len(keys):
            batch = keys[len(views) : len(views) + self.max_keys]
            arena = self._arena()
            lent = None if arena is None else lend_region(arena, len(batch), self._chunk_hint)
            if lent is None:
                arena, offset, size = None, 0, 0
            else:
                offset, size = lent
            call = Call(
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
            got, largest = place_payloads(
                reply, outcome[1], len(batch), arena, offset, size, regions, self.stats
            )
            self._chunk_hint = max(self._chunk_hint, largest)
            if isinstance(got, Failure):
                self.failed(None, got)
                failed = not views
                break
            views += got
            if not got or (len(got) < len(batch) and not reply.more):
                break
        self.stats.chunks_hit += len(views)
        self.stats.chunks_missed += len(keys) - len(views)
        if failed:
            return None
        return Chunks(views, (lambda: free_regions(regions)) if regions else None)

    def put_plan(
        self,
        keys: Sequence[bytes],
        payloads: Sequence[Payload],
        token_ids: Sequence[Sequence[int]] | None,
        parent: bytes | None,
        model: str | None = None,
    ) -> Plan[bool]:
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
        reserved: list[Reserved | None],
        token_ids: Sequence[Sequence[int]] | None,
        parent: bytes | None,
        model: str | None,
    ) -> Plan[bool]:
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
            outcome = yield Call(request, frames, PutReply, arena if lent or shared else None)
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

    def evict_plan(self, keys: Sequence[bytes]) -> Plan[int]:
        removed = 0
        for start in range(0, len(keys), self.max_keys):
            batch = keys[start : start + self.max_keys]
            outcome = yield Call(Evict(id=next(self._ids), keys=join_keys(batch)), (), EvictReply)
            if isinstance(outcome, Failure):
                break
            removed += outcome[0].removed
        return removed

    def clear_plan(self) -> Plan[bool]:
        outcome = yield Call(Clear(id=next(self._ids)), (), ClearReply)
        return not isinstance(outcome, Failure)

    def stats_plan(self) -> Plan[dict[str, Any] | None]:
        outcome = yield Call(Stats(id=next(self._ids)), (), StatsReply)
        if isinstance(outcome, Failure):
            return None
        reply: StatsReply = outcome[0]
        return {"node": reply.node, **reply.stats}
