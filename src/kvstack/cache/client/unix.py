"""The cache clients' unix-socket connections to a server on this host (``unix:///path``, served by
``kvstack cache-server --unix-socket``): the same requests as through ZMQ, without its I/O threads, each
message framed as in ``kvstack.cache.protocol`` (`unix_head`, `UnixFramer`).

- `UnixLink` (for `CacheClient`): blocking; every send and receive is bounded by the request's deadline
  (``TimeoutError`` past it, ``ConnectionResetError`` when the server closes the connection).
- `AsyncUnixLink` (for `AsyncCacheClient`): an asyncio protocol that hands each reply to its owner as it
  is read, and closes the connection on a framing error (the stream cannot be trusted past it).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

from kvstack.cache.protocol import ProtocolError, UnixFramer, unix_head

__all__ = ["AsyncUnixLink", "UnixLink"]

# A reply's frames and bytes, bounded for the framer: a get reply carries at most the server's
# max_message_bytes in frames (256 MiB by default), one frame per key.
_MAX_REPLY_FRAMES = 1 << 20
_MAX_REPLY_BYTES = 1 << 32
_IOV_MAX = 512  # buffers per sendmsg (Linux allows 1024)
_RECV_BYTES = 1 << 18


class UnixLink:
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


class AsyncUnixLink(asyncio.Protocol):
    """`AsyncCacheClient` 's unix-socket connection: hands each reply to ``on_reply`` as it is read;
    ``on_broken`` hears a framing error (then the connection is closed), ``on_lost`` the connection's end."""

    def __init__(
        self,
        on_reply: Callable[[memoryview, list[memoryview]], None],
        on_lost: Callable[[AsyncUnixLink], None],
        on_broken: Callable[[ProtocolError], None],
    ) -> None:
        self.on_reply = on_reply
        self.on_lost = on_lost
        self.on_broken = on_broken
        self.framer = UnixFramer(_MAX_REPLY_FRAMES, _MAX_REPLY_BYTES)
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.framer.feed(data)
        try:
            while (frames := self.framer.next()) is not None:
                self.on_reply(frames[0], frames[1:])
        except ProtocolError as e:
            self.on_broken(e)
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.on_lost(self)

    def send(self, frames: Sequence[Any]) -> None:
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the connection to the server is closed")
        self.transport.writelines([unix_head(frames), *frames])

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()
