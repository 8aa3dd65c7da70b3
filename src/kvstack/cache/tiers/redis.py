"""The Redis/Valkey tier: chunks shared across nodes, through the tier's own RESP connections and redis-py.

Keys: ``prefix + hex(chunk key)`` (prefix default ``kvstack:kv:``), so several caches can share one server
and ``clear`` removes only this tier's keys. Values: one `record` (64-byte header with magic, version,
length, key and xxh3_128 of the payload, then the payload), written with ``SET .. PX ttl`` (``ttl_s`` None:
no expiry; bound the server with ``maxmemory`` and ``maxmemory-policy allkeys-lru`` in any case). A value
that fails verification is deleted (``DEL``), counted in ``corrupt`` and a miss.

At most ``max_connections`` calls are on the wire at once, so no burst of requests can use up the server's
``maxclients``. Connection loss or a timeout (``socket_timeout_s``) marks the tier down: reads are misses and
writes are dropped without touching the network, counted, never raised, until a background probe gets an
answer; ``start`` never fails on an unreachable server. Removals Redis makes on its own (TTL expiry,
``maxmemory`` eviction, another client's ``DEL``) are reported when the tier next finds a chunk it reported
stored missing. `RedisTier` says what each call costs on the wire.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvstack.cache.keys import ChunkKey
from kvstack.cache.payload import Payload, byte_view
from kvstack.cache.tiers.base import Announcements, Reconnector, Tier, TierStats
from kvstack.cache.tiers.buffers import BufferPool
from kvstack.cache.tiers.record import HEADER_BYTES, CorruptRecord, pack_header, payload_of
from kvstack.cache.tiers.resp import RespAddress, RespConnection, pack_command

__all__ = ["RedisTier"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_Frames = Sequence[bytes | memoryview]  # RESP commands, payloads as buffers of their own
# Errors that mean "the server is not there": the tier goes down. Any other RedisError is counted only.
_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError, asyncio.TimeoutError)


class _Failed(enum.Enum):
    CALL = 0


class _WentDown(Exception):
    """The tier was marked down while a call waited for its turn on the wire: the call is not made."""


_FAILED = _Failed.CALL
_STREAM_WRITE_BYTES = 256 * 1024


class RedisTier(Tier):
    """Chunks in Redis/Valkey under ``prefix`` (see the module docstring).

    - ``get_many`` is one ``MGET``, ``put_many`` one pipeline of ``SET`` s and ``contains`` /
      ``contains_each`` one pipeline of ``STRLEN`` s, all through the tier's own `RespConnection` s
      (``kvstack.cache.tiers.resp``: each value is received straight into a reused buffer, one copy instead
      of redis-py's five; idle connections are kept, at most ``read_connections``), or through redis-py's
      connections for ``rediss://`` URLs. More calls than ``max_connections`` wait for a turn. ``STRLEN``
      rather than ``EXISTS``: a value of another type under a chunk's name (which ``MGET`` reads as nil) or
      one too short to be a record is found by a lookup too, deleted and counted corrupt, so lookups and
      gets agree. ``delete``, ``clear`` and the reconnect probe use redis-py (hiredis is not needed: redis-py
      never reads the values). The ``SET`` s (no transaction) are framed here in RESP, each record's header
      and payload as separate buffers of one bulk string, so the payload is not copied into a joined value.
    - ``socket_timeout_s`` (default 0.5 s) is below the cache clients' default of 1 s, so a stalled Redis
      costs a lookup its Redis answer, not the client's whole request. While the tier is down, a background
      task drops the client's connections and ``PING`` s with exponential backoff (``retry_initial_s``
      doubling up to ``retry_max_s``) and marks the tier up again on the first answer. redis-py's own
      retries are off, so a dead server costs one failed call, not a retry storm.
    - It reports the removal of a chunk it reported stored (the last ``max_announced``) when it next finds
      it missing: a ``contains`` (a lookup that reaches Redis), a ``get_many`` or a ``delete``. Until then a
      router may credit a chunk that is gone; the get then misses, and the engine recomputes.
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        prefix: str = "kvstack:kv:",
        ttl_s: float | None = 3600.0,
        socket_timeout_s: float = 0.5,
        connect_timeout_s: float = 1.0,
        retry_initial_s: float = 0.05,
        retry_max_s: float = 2.0,
        read_connections: int = 8,
        max_connections: int = 32,
        max_announced: int = 65_536,
        name: str = "redis",
    ) -> None:
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0 or None (no expiry), got {ttl_s}")
        if socket_timeout_s <= 0 or connect_timeout_s <= 0:
            raise ValueError(f"timeouts must be > 0, got {socket_timeout_s}, {connect_timeout_s}")
        if not 1 <= read_connections <= max_connections:
            raise ValueError(
                f"need 1 <= read_connections <= max_connections, got {read_connections}, {max_connections}"
            )
        if not 0 < retry_initial_s <= retry_max_s:
            raise ValueError(f"need 0 < retry_initial_s <= retry_max_s, got {retry_initial_s}, {retry_max_s}")
        self.name = name
        self.url = url
        self.prefix = prefix
        self._prefix = prefix.encode()
        self._ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self._px = b"" if self._ttl_ms is None else b"%d" % self._ttl_ms
        self._socket_timeout_s = socket_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._client: aioredis.Redis | None = None
        self._address = RespAddress.from_url(url)
        self._readers: list[RespConnection] = []  # idle connections of the get/put path
        self._buffers = BufferPool()
        # Keys reported stored: one found missing later (TTL, eviction, another client) is reported removed.
        self._announced = Announcements(self, max_announced)
        self._max_readers = read_connections
        self._in_flight = 0  # calls of the get/put path waiting for their replies
        self._turns = asyncio.Semaphore(max_connections)  # calls on the wire at once
        self._link = Reconnector(
            f"redis tier {self.name}: {url}", self._probe, retry_initial_s, retry_max_s, log
        )
        self._stats = TierStats(bytes=None, entries=None, capacity_bytes=None, up=False)

    @property
    def up(self) -> bool:
        return self._link.up

    # -- lifecycle

    async def start(self) -> None:
        if self._client is not None:
            return
        self._link.start()
        self._client = aioredis.Redis.from_url(
            self.url,
            socket_timeout=self._socket_timeout_s,
            socket_connect_timeout=self._connect_timeout_s,
            retry=Retry(NoBackoff(), 0),
            decode_responses=False,
        )
        try:
            await self._client.ping()
        except (*_UNREACHABLE, RedisError) as e:
            self._mark_down(e)
            return
        self._link.up = True

    async def close(self) -> None:
        await self._link.stop()
        client, self._client = self._client, None
        self._close_readers()
        if client is not None:
            await client.aclose()

    # -- Tier interface

    async def contains(self, keys: Sequence[bytes]) -> int:
        n = 0
        for present in await self._present(keys):
            if not present:
                break
            n += 1
        return n

    async def contains_each(self, keys: Sequence[bytes]) -> list[bool]:
        return await self._present(keys)

    async def get(self, key: ChunkKey) -> Payload | None:
        return (await self.get_many([key]))[0]

    async def get_many(self, keys: Sequence[ChunkKey]) -> list[Payload | None]:
        if not keys:
            return []
        names = [self._key(key) for key in keys]
        values = await self._guard(lambda client: self._mget(client, names))
        if values is _FAILED:
            self._stats.misses += len(keys)
            return [None] * len(keys)
        self._announced.missing([key for key, value in zip(keys, values, strict=True) if value is None])
        out: list[Payload | None] = []
        corrupt: list[bytes] = []
        corrupt_keys: list[ChunkKey] = []
        for key, name, value in zip(keys, names, values, strict=True):
            payload = None if value is None else self._unpack(key, value, name, corrupt)
            if payload is None:
                self._stats.misses += 1
                if value is not None:
                    corrupt_keys.append(key)
            else:
                self._stats.hits += 1
            out.append(payload)
        if corrupt:
            self._announced.removed(corrupt_keys)
            await self._guard(lambda client: client.delete(*corrupt))
        return out

    async def put(self, key: ChunkKey, data: Payload) -> bool:
        return await self.put_many([(key, data)]) == 1

    async def put_many(self, items: Sequence[tuple[ChunkKey, Payload]]) -> int:
        if not items:
            return 0

        async def set_each(client: aioredis.Redis) -> list[Any]:
            commands = (_set_frames(self._key(key), byte_view(data), key, self._px) for key, data in items)
            replies = await self._pipeline(client, commands, len(items), stream=True)
            return [reply if isinstance(reply, ResponseError) else reply == b"OK" for reply in replies]

        results = await self._guard(set_each)
        if results is _FAILED:
            self._stats.write_drops += len(items)
            return 0
        stored_keys = [key for (key, _), result in zip(items, results, strict=True) if result is True]
        stored = len(stored_keys)
        self._announced.stored(stored_keys)
        failed = [result for result in results if isinstance(result, Exception)]
        if failed:
            self._stats.errors += len(failed)
            log.warning(
                "redis tier %s: %d of %d writes failed, e.g. %s",
                self.name,
                len(failed),
                len(items),
                failed[0],
            )
        self._stats.writes += stored
        self._stats.write_drops += len(items) - stored
        return stored

    async def delete(self, key: ChunkKey) -> bool:
        removed = await self._guard(lambda client: client.delete(self._key(key)))
        if removed is _FAILED:
            return False
        if removed == 0:
            self._announced.missing([key])
            return False
        self._announced.removed((key,))
        return True

    async def clear(self) -> None:

        async def unlink_prefix(client: aioredis.Redis) -> None:
            batch: list[bytes] = []
            async for name in client.scan_iter(match=_glob_escape(self._prefix) + b"*", count=1000):
                batch.append(name)
                if len(batch) >= 1000:
                    await client.unlink(*batch)
                    batch.clear()
            if batch:
                await client.unlink(*batch)

        await self._guard(unlink_prefix)
        self._announced.clear()

    def stats(self) -> TierStats:
        stats = self._stats.copy()
        stats.up = self._link.up
        return stats

    # -- internals

    def _key(self, key: bytes) -> bytes:
        return self._prefix + key.hex().encode()

    async def _present(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key names a value long enough to be a record (one pipeline of ``STRLEN``); values
        that cannot be records (another type, too short) are deleted and counted corrupt."""
        if not keys:
            return []
        commands = [pack_command(b"STRLEN", self._key(key)) for key in keys]
        lengths = await self._guard(lambda client: self._pipeline(client, commands, len(keys)))
        if lengths is _FAILED:
            return [False] * len(keys)
        present: list[bool] = []
        missing: list[bytes] = []
        corrupt: list[bytes] = []
        for key, length in zip(keys, lengths, strict=True):
            present.append(isinstance(length, int) and length >= HEADER_BYTES)
            if length == 0:
                missing.append(key)
            elif isinstance(length, ResponseError) and not str(length).startswith("WRONGTYPE"):
                self._stats.errors += 1  # not about this value (e.g. an ACL refusal): no verdict on it
                log.warning("redis tier %s: STRLEN failed: %s", self.name, length)
            elif not present[-1]:
                corrupt.append(key)
        self._announced.missing(missing)
        if corrupt:
            self._stats.corrupt += len(corrupt)
            names = [self._key(key) for key in corrupt]
            log.warning(
                "redis tier %s: deleting %d values that are not records, e.g. %r",
                self.name,
                len(names),
                names[0],
            )
            self._announced.removed([ChunkKey(key) for key in corrupt])
            await self._guard(lambda client: client.delete(*names))
        return present

    async def _mget(
        self, client: aioredis.Redis, names: list[bytes]
    ) -> Sequence[bytes | bytearray | memoryview | None]:
        [reply] = await self._pipeline(client, [pack_command(b"MGET", *names)], 1)
        if isinstance(reply, ResponseError):
            raise reply
        if not isinstance(reply, list) or len(reply) != len(names):
            raise ResponseError(f"MGET of {len(names)} keys answered {type(reply).__name__}")
        return reply

    async def _pipeline(
        self,
        client: aioredis.Redis,
        commands: Iterable[Sequence[bytes | memoryview]],
        n: int,
        stream: bool = False,
    ) -> list[Any]:
        """Send ``n`` commands, each as its RESP frames (see `RespConnection.send`); their replies, an error
        reply as a ResponseError. Through one of the tier's own connections, or redis-py's for TLS.

        ``stream``: when no other call is in flight, write every 256 KiB as ``commands`` frames them, so
        Redis stores the first values while the rest are checksummed; with other calls in flight Redis
        is busy anyway, and the extra writes and reply packets only cost CPU (see `RespConnection.send`)."""
        async with self._turns:
            if not self._link.up:
                raise _WentDown
            if self._address is None:
                return await _redis_py_pipeline(client, [frame for frames in commands for frame in frames], n)
            return await self._send(commands, n, stream)

    async def _send(
        self, commands: Iterable[Sequence[bytes | memoryview]], n: int, stream: bool
    ) -> list[Any]:
        conn = self._readers.pop() if self._readers else await self._open_reader()
        write_every = _STREAM_WRITE_BYTES if stream and self._in_flight == 0 else None
        self._in_flight += 1
        try:
            async with asyncio.timeout(self._socket_timeout_s):  # no task per call, unlike wait_for
                replies = await conn.send(commands, n, write_every)
        except BaseException:
            conn.close()
            raise
        finally:
            self._in_flight -= 1
        if conn.usable and len(self._readers) < self._max_readers:
            self._readers.append(conn)
        else:
            conn.close()
        return replies

    async def _open_reader(self) -> RespConnection:
        assert self._address is not None
        return await asyncio.wait_for(
            RespConnection.open(self._address, self._buffers), self._connect_timeout_s
        )

    def _close_readers(self) -> None:
        readers, self._readers = self._readers, []
        for conn in readers:
            conn.close()

    def _unpack(
        self, key: ChunkKey, value: bytes | bytearray | memoryview, name: bytes, corrupt: list[bytes]
    ) -> memoryview | None:
        try:
            return payload_of(key, value)
        except CorruptRecord as e:
            self._stats.corrupt += 1
            corrupt.append(name)
            log.warning("redis tier %s: deleting corrupt value %r (%s)", self.name, name, e)
            return None

    async def _guard(self, call: Callable[[aioredis.Redis], Awaitable[_T]]) -> _T | _Failed:
        """``await call(client)``; `_FAILED` when the tier is down (without calling) or the call fails
        (counted, and the tier marked down when the server is unreachable)."""
        if not self._link.up or self._client is None:
            return _FAILED
        try:
            return await call(self._client)
        except _WentDown:
            pass
        except _UNREACHABLE as e:
            self._mark_down(e)
        except RedisError as e:
            self._stats.errors += 1
            log.warning("redis tier %s: %s", self.name, e)
        return _FAILED

    def _mark_down(self, error: BaseException) -> None:
        self._stats.errors += 1
        self._close_readers()  # their server is gone: new ones are opened when it is back
        self._link.down(f"{type(error).__name__}: {error}")

    async def _probe(self) -> str | None:
        """None when the server answers a PING on fresh connections, else what went wrong."""
        client = self._client
        if client is None:
            return "closed"
        try:
            # Connections to the old server are dead: start from fresh ones.
            await client.connection_pool.disconnect()
            await client.ping()
        except (*_UNREACHABLE, RedisError) as e:
            return f"{type(e).__name__}: {e}"
        return None


async def _redis_py_pipeline(
    client: aioredis.Redis, frames: Sequence[bytes | memoryview], n: int
) -> list[Any]:
    pool = client.connection_pool
    conn = await pool.get_connection()
    try:
        await conn.send_packed_command(frames)
        replies: list[Any] = []
        for _ in range(n):
            try:
                replies.append(await conn.read_response())
            except ResponseError as e:  # this command failed; its reply is read, the rest follow
                replies.append(e)
        return replies
    except BaseException:
        await conn.disconnect()  # unread replies must not reach the connection's next user
        raise
    finally:
        await pool.release(conn)


def _set_frames(name: bytes, payload: memoryview, key: ChunkKey, px: bytes) -> list[bytes | memoryview]:
    """``SET name <record> [PX px]`` in RESP, the record's payload as a frame of its own (not copied)."""
    header = pack_header(key, payload)
    argc = 5 if px else 3
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n%b" % (
        argc,
        len(name),
        name,
        len(header) + payload.nbytes,
        header,
    )
    tail = b"\r\n$2\r\nPX\r\n$%d\r\n%b\r\n" % (len(px), px) if px else b"\r\n"
    return [head, payload, tail]


def _glob_escape(text: bytes) -> bytes:
    return re.sub(rb"([*?\[\]\\])", rb"\\\1", text)
