"""A minimal RESP2 connection for the Redis tier's hot read path: bulk replies land in their own buffers.

redis-py's asyncio reader moves each value through the event loop's read buffer, a ``StreamReader`` buffer,
a ``bytes`` out of it and two more slices (and pauses the socket whenever 128 KiB are buffered): five copies
of every chunk. Here the connection is an ``asyncio.BufferedProtocol``: headers are parsed from a small
scratch buffer, and once a bulk string's length is known the socket reads its body straight into the
value's own buffer (one copy: kernel to value).

Bulk strings are received into buffers of a `BufferPool` (``kvstack.cache.tiers.buffers``) when one is
given; without reuse, 1 MiB values were read ~3x slower.

`RespConnection` runs one command or pipeline at a time (callers keep a pool of connections); a reply is a
bulk string (``bytearray``), None (nil), a simple string (``bytes``), an integer, or a flat array of those.
An error reply raises ``redis.exceptions.ResponseError`` from ``call`` and is returned in its place by
``send`` (a pipeline); a lost connection raises ``redis.exceptions.ConnectionError``.
Plain TCP and unix sockets only, with ``AUTH``/``SELECT`` from the URL (``rediss://`` is left to redis-py:
`RespAddress.from_url` returns None). Replies nested deeper than one array are refused (the tier never asks
for them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from redis.asyncio.connection import SSLConnection, parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from kvstack.cache.tiers.buffers import BufferPool

__all__ = ["RespAddress", "RespConnection", "RespReply", "pack_command"]

RespReply = bytearray | bytes | int | None | list[Any]
# Headers are read into the scratch with whatever follows them, and that part of a bulk string is copied
# once more: a small scratch keeps that part small (values are 64 KiB and more here).
_SCRATCH_BYTES = 8 * 1024


@dataclass(frozen=True, slots=True)
class RespAddress:
    """Where and how to connect: host and port, or a unix socket path; credentials and database."""

    host: str = "127.0.0.1"
    port: int = 6379
    path: str | None = None
    username: str | None = None
    password: str | None = None
    db: int = 0

    @classmethod
    def from_url(cls, url: str) -> RespAddress | None:
        """The address of a ``redis://`` or ``unix://`` URL; None for TLS (``rediss://``)."""
        parts = parse_url(url)
        if parts.get("connection_class") is SSLConnection:
            return None
        return cls(
            host=str(parts.get("host", "127.0.0.1")),
            port=int(parts.get("port", 6379)),
            path=parts.get("path"),
            username=parts.get("username"),
            password=parts.get("password"),
            db=int(parts.get("db", 0)),
        )


def pack_command(*args: bytes) -> list[bytes]:
    """``args`` as one RESP command (an array of bulk strings), in buffers for ``writelines``."""
    out = [b"*%d\r\n" % len(args)]
    out += [b"$%d\r\n%b\r\n" % (len(arg), arg) for arg in args]
    return out


class RespConnection(asyncio.BufferedProtocol):
    """One connection to a Redis server; see the module docstring."""

    def __init__(self, buffers: BufferPool | None = None) -> None:
        self._buffers = buffers
        self._transport: asyncio.Transport | None = None
        self._scratch = bytearray(_SCRATCH_BYTES)
        self._start = 0  # parsed up to here
        self._end = 0  # received up to here
        self._body: bytearray | None = None  # a bulk string being read straight into its buffer
        self._body_got = 0
        self._crlf = False  # the CRLF after a bulk string is still to skip
        self._array: list[Any] | None = None  # the array being filled, and how many items it needs
        self._array_len = 0
        self._waiter: asyncio.Future[list[Any]] | None = None
        self._replies: list[Any] = []  # replies of the commands in flight, in order
        self._want = 0
        self._lost: Exception | None = None

    @classmethod
    async def open(cls, address: RespAddress, buffers: BufferPool | None = None) -> RespConnection:
        """Connect and log in (``AUTH``, ``SELECT``); raises redis-py's ConnectionError/ResponseError."""
        loop = asyncio.get_running_loop()
        try:
            if address.path is not None:
                _, conn = await loop.create_unix_connection(lambda: cls(buffers), address.path)
            else:
                _, conn = await loop.create_connection(lambda: cls(buffers), address.host, address.port)
        except OSError as e:
            where = address.path or f"{address.host}:{address.port}"
            raise RedisConnectionError(f"cannot connect to redis at {where}: {e}") from e
        try:
            if address.password is not None:
                user = () if address.username is None else (address.username.encode(),)
                await conn.call(b"AUTH", *user, address.password.encode())
            if address.db:
                await conn.call(b"SELECT", b"%d" % address.db)
        except BaseException:
            conn.close()
            raise
        return conn

    @property
    def usable(self) -> bool:
        """Open, and no command in flight (a command that was cancelled leaves its reply unread)."""
        return self._lost is None and self._transport is not None and self._waiter is None

    async def call(self, *args: bytes) -> RespReply:
        """Send one command and return its reply (see the module docstring)."""
        [reply] = await self.send(pack_command(*args), 1)
        if isinstance(reply, ResponseError):
            raise reply
        return reply

    async def send(
        self, frames: Sequence[bytes | memoryview], replies: int
    ) -> list[RespReply | ResponseError]:
        """Send ``frames`` (``replies`` commands already in RESP, e.g. a pipeline whose payloads travel as
        buffers of their own) and return each command's reply (`RespReply`), an error reply as a
        ``ResponseError``."""
        if self._lost is not None or self._transport is None:
            raise RedisConnectionError(f"redis connection lost: {self._lost}")
        if self._waiter is not None:
            raise RuntimeError("RespConnection runs one command or pipeline at a time")
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        self._replies, self._want = [], replies
        self._transport.writelines(frames)
        try:
            return await waiter
        finally:
            if self._waiter is waiter:  # cancelled before its replies were read: they must not reach the
                self._waiter = None  # next command, so this connection is done
                self.close()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
        self._lost = self._lost or RedisConnectionError("closed")

    # -- asyncio.BufferedProtocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = RedisConnectionError(f"redis connection lost: {exc or 'closed by the server'}")
        self._fail(self._lost)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._body is not None:
            return memoryview(self._body)[self._body_got :]
        if self._start == self._end:
            self._start = self._end = 0
        elif len(self._scratch) - self._end < 1024:  # move the unparsed tail to the front
            rest = self._end - self._start
            self._scratch[:rest] = self._scratch[self._start : self._end]
            self._start, self._end = 0, rest
            if rest == len(self._scratch):  # a header line longer than the scratch: grow it
                self._scratch.extend(bytes(len(self._scratch)))
        return memoryview(self._scratch)[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._body is not None:
            self._body_got += nbytes
            if self._body_got < len(self._body):
                return
            body, self._body = self._body, None
            self._crlf = True
            self._item(body)
        else:
            self._end += nbytes
        try:
            self._parse()
        except (ValueError, ResponseError) as e:  # not RESP: this connection cannot go on
            self._fail(RedisConnectionError(f"unreadable reply from redis: {e}"))
            self.close()

    def eof_received(self) -> bool:
        return False  # close the transport: connection_lost follows

    # -- parsing

    def _parse(self) -> None:
        scratch = self._scratch
        while self._body is None:
            if self._crlf:
                if self._end - self._start < 2:
                    return
                self._start += 2
                self._crlf = False
                continue
            if self._waiter is None and self._start < self._end:
                raise ValueError("a reply arrived with no command waiting for it")
            line_end = scratch.find(b"\r\n", self._start, self._end)
            if line_end < 0:
                return
            kind = scratch[self._start]
            line = bytes(scratch[self._start + 1 : line_end])
            self._start = line_end + 2
            if kind == 0x24:  # $ bulk string
                self._bulk(int(line))
            elif kind == 0x2A:  # * array
                n = int(line)
                if self._array is not None:
                    raise ValueError("nested arrays are not read here")
                if n < 0:
                    self._item(None)
                elif n == 0:
                    self._item([])
                else:
                    self._array, self._array_len = [], n
            elif kind == 0x2B:  # + simple string
                self._item(line)
            elif kind == 0x3A:  # : integer
                self._item(int(line))
            elif kind == 0x2D:  # - error
                self._item(ResponseError(line.decode(errors="replace")))
            else:
                raise ValueError(f"unknown reply type {chr(kind)!r}")

    def _bulk(self, n: int) -> None:
        if n < 0:
            self._item(None)
            return
        body = bytearray(n) if self._buffers is None else self._buffers.take(n)
        have = min(n, self._end - self._start)
        body[:have] = self._scratch[self._start : self._start + have]
        self._start += have
        if have < n:  # the rest goes straight from the socket into the body
            self._body, self._body_got = body, have
            return
        self._crlf = True
        self._item(body)

    def _item(self, value: Any) -> None:
        if self._array is not None and not isinstance(value, ResponseError):
            self._array.append(value)
            if len(self._array) < self._array_len:
                return
            value, self._array = self._array, None
        elif self._array is not None:
            raise ResponseError(f"an error inside an array reply: {value}")
        waiter = self._waiter
        if waiter is None or waiter.done():
            raise ValueError("a reply arrived with no command waiting for it")
        self._replies.append(value)
        if len(self._replies) == self._want:
            self._waiter = None
            waiter.set_result(self._replies)

    def _fail(self, error: Exception) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
