"""A minimal RESP2 connection for the Redis tier's hot path: values are returned where the socket put them.

`RespConnection` is an ``asyncio.BufferedProtocol`` that reads into an *arena*, a 2 MiB buffer filled front
to back: a reply's lines and its bulk strings up to 256 KiB land there, and each such value is returned as a
``memoryview`` slice of it, never copied after the kernel's copy; a larger bulk string is read straight into
a ``bytearray`` of its own, again one copy. Bytes of an arena are never written twice once a value of it was
handed out, so a value keeps its arena alive while it is referenced: hold a copy, not the view, to keep one
value long (the store copies what it promotes into its memory tier).

A connection runs one command or pipeline at a time (callers keep a pool of connections). A reply is a bulk
string (``memoryview`` or ``bytearray``), None (nil), a simple string (``bytes``), an integer, or a flat array
of those (`RespReply`); replies nested deeper are refused (the tier never asks for them). An error reply
raises ``redis.exceptions.ResponseError`` from ``call`` and is returned in its place by ``send`` (a pipeline);
a lost connection raises ``redis.exceptions.ConnectionError``. Plain TCP and unix sockets only, with
``AUTH``/``SELECT`` from the URL (``rediss://`` is left to redis-py: `RespAddress.from_url` returns None).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from redis.asyncio.connection import SSLConnection, parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from kvstack.cache.tiers.buffers import BufferPool

__all__ = ["ARENA_BYTES", "ARENA_VALUE_MAX", "RespAddress", "RespConnection", "RespReply", "pack_command"]

RespReply = memoryview | bytearray | bytes | int | None | list[Any]
ARENA_BYTES = 2 << 20
# Bulk strings up to this size are sliced out of the arena; larger ones get a buffer of their own.
ARENA_VALUE_MAX = 256 * 1024
# Between items, with less than this free at the arena's end, reading goes on in a fresh arena.
_ARENA_MIN_READ = 64 * 1024
# After a large bulk string the next is likely large too: read only this much for its header, since what
# follows the header in the arena is copied once more into the value's own buffer.
_HEADER_READ = 8 * 1024


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
    """One connection to a Redis server; see the module docstring.

    A command whose arena is over half used by values handed out starts in a fresh one, so a reply of up to
    1 MiB is not split across two arenas (which costs a copy of the part already received); reading also
    moves on when too little is left. Arenas and large-value buffers come from a `BufferPool`
    (``kvstack.cache.tiers.buffers``) when one is given, and are reused once nothing refers to them.
    """

    def __init__(self, buffers: BufferPool | None = None) -> None:
        self._buffers = buffers
        self._transport: asyncio.Transport | None = None
        self._arena = self._new_arena()
        self._start = 0  # parsed up to here
        self._end = 0  # received up to here
        self._handed_out = False  # a value is a view of this arena: its bytes must stay as they are
        self._slice_len = -1  # a bulk string of this length, starting at _start, is arriving in the arena
        self._body: bytearray | None = None  # a larger bulk string being read straight into its own buffer
        self._body_got = 0
        self._large_last = False  # the last bulk string had a buffer of its own
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
        """Send one command and return its reply (`RespReply`); an error reply raises ``ResponseError``."""
        [reply] = await self.send([pack_command(*args)], 1)
        if isinstance(reply, ResponseError):
            raise reply
        return reply

    async def send(
        self,
        commands: Iterable[Sequence[bytes | memoryview]],
        replies: int,
        write_every: int | None = None,
    ) -> list[RespReply | ResponseError]:
        """Send ``replies`` commands (a pipeline), each given as its RESP frames (a payload may travel as a
        buffer of its own), and return each command's reply (`RespReply`), an error reply as a
        ``ResponseError``. All frames go out in one write, or, with ``write_every``, whenever that many
        bytes are framed: with ``commands`` a generator, the server then works on the first commands while
        the caller frames the rest (measured on 2 cores: a pipeline of 16 SETs of 64 KiB took 0.83x the
        time, written every 256 KiB; but with 4 such pipelines in flight, 1.14x)."""
        if self._lost is not None or self._transport is None:
            raise RedisConnectionError(f"redis connection lost: {self._lost}")
        if self._waiter is not None:
            raise RuntimeError("RespConnection runs one command or pipeline at a time")
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        self._replies, self._want = [], replies
        if self._handed_out and self._end > len(self._arena) // 2 and self._end - self._start < 4096:
            self._switch_arena()  # over half used (and what is unparsed, if anything, is small): start afresh
        try:
            if write_every is None:
                self._transport.writelines([frame for frames in commands for frame in frames])
            else:
                framed: list[bytes | memoryview] = []
                framed_bytes = 0
                for frames in commands:
                    framed += frames
                    framed_bytes += sum(map(len, frames))
                    if framed_bytes >= write_every:
                        self._transport.writelines(framed)
                        framed, framed_bytes = [], 0
                self._transport.writelines(framed)
        except BaseException:  # part of the pipeline went out: its replies must not reach another command
            self._waiter = None
            self.close()
            raise
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
        if self._start == self._end and not self._handed_out:
            self._start = self._end = 0
        elif len(self._arena) - self._end < _ARENA_MIN_READ and self._slice_len < 0:
            # Between items (an arriving slice always fits its arena): go on at the front of this arena
            # when none of it was handed out, else in a fresh one; the unparsed tail (part of a line) moves.
            if self._handed_out:
                self._switch_arena()
            else:
                rest = self._end - self._start
                self._arena[:rest] = self._arena[self._start : self._end]
                self._start, self._end = 0, rest
            if self._end == len(self._arena):
                raise ValueError(f"a reply line longer than {len(self._arena)} bytes")
        if self._large_last and self._slice_len < 0:
            return memoryview(self._arena)[self._end : self._end + _HEADER_READ]
        return memoryview(self._arena)[self._end :]

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
        arena = self._arena
        while self._body is None:
            if self._slice_len >= 0:
                n = self._slice_len
                if self._end - self._start < n + 2:
                    return
                value = memoryview(arena)[self._start : self._start + n]
                self._start += n + 2
                self._slice_len = -1
                self._handed_out = True
                array = self._array
                if array is not None and len(array) + 1 < self._array_len:
                    array.append(value)  # the usual case, without _item's checks
                else:
                    self._item(value)
                continue
            if self._crlf:
                if self._end - self._start < 2:
                    return
                self._start += 2
                self._crlf = False
                continue
            if self._waiter is None and self._start < self._end:
                raise ValueError("a reply arrived with no command waiting for it")
            line_end = arena.find(b"\r\n", self._start, self._end)
            if line_end < 0:
                return
            kind = arena[self._start]
            if kind == 0x24:  # $ bulk string
                n = int(arena[self._start + 1 : line_end])
                self._start = line_end + 2
                if 0 <= n <= ARENA_VALUE_MAX and self._start + n + 2 <= len(arena):
                    self._large_last = False  # _bulk's usual case: a value that fits the arena's rest
                    self._slice_len = n
                    continue
                self._bulk(n)
                arena = self._arena  # _bulk may have moved on to a fresh arena
                continue
            line = bytes(arena[self._start + 1 : line_end])
            self._start = line_end + 2
            if kind == 0x2A:  # * array
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
        self._large_last = n > ARENA_VALUE_MAX
        if not self._large_last:  # sliced out of the arena once all of it (and its CRLF) is in
            if self._start + n + 2 > len(self._arena):
                self._switch_arena()
            self._slice_len = n
            return
        body = bytearray(n) if self._buffers is None else self._buffers.take(n)
        have = min(n, self._end - self._start)
        body[:have] = memoryview(self._arena)[self._start : self._start + have]
        self._start += have
        if have < n:  # the rest goes straight from the socket into the body
            self._body, self._body_got = body, have
            return
        self._crlf = True
        self._item(body)

    def _new_arena(self) -> bytearray:
        return bytearray(ARENA_BYTES) if self._buffers is None else self._buffers.take(ARENA_BYTES)

    def _switch_arena(self) -> None:
        """Go on reading in a fresh arena, moving the unparsed tail (part of a line or of a bulk string)."""
        arena, rest = self._new_arena(), self._end - self._start
        arena[:rest] = memoryview(self._arena)[self._start : self._end]
        self._arena, self._start, self._end, self._handed_out = arena, 0, rest, False

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
