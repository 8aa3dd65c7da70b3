"""One gRPC call as a handler sees it: `GrpcStream` (method, metadata, ``send``, ``finish``), the
`StreamHandler` a method's factory makes for it, and `unary`, the factory of a request -> response method.

A handler gets each request message (``on_message``, without the 5-byte prefix), the client's half-close
(``on_end``), and ``on_reset`` when the call ends without its own ``finish``: the client reset it, the
connection died, or the server ended it (a message over the size limit or compressed, responses the client
leaves unread, a handler that raised). ``send`` and ``finish`` do nothing once the stream is closed. The
connection (`kvstack.http.grpc_server`) calls the handler synchronously from its reads: a handler that
needs to wait starts its own task.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import struct
import traceback
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from kvstack.http import h2_frames as h2
from kvstack.http.grpc_status import RESPONSE_HEADERS, GrpcError, Status, trailers
from kvstack.logs import ThrottledLog

if TYPE_CHECKING:
    from kvstack.http.grpc_server import Connection

__all__ = ["Factory", "GrpcStream", "StreamHandler", "unary"]

log = logging.getLogger(__name__)
failures = ThrottledLog(log)

DATA_AND_PREFIX = struct.Struct(">BHBBIBI")  # a DATA frame header then a message's 5-byte prefix
MESSAGE_PREFIX = struct.Struct(">BI")


class StreamHandler(Protocol):
    """One call's receiver, made by its method's factory; after its ``finish`` or ``on_reset``, nothing is
    called any more."""

    def on_message(self, data: bytes) -> None: ...

    def on_end(self) -> None:
        """The client half-closed: no more messages."""

    def on_reset(self) -> None:
        """The call ended without this handler's ``finish``: stop its work."""


Factory = Callable[["GrpcStream"], StreamHandler]


class _NoHandler:
    def on_message(self, data: bytes) -> None:
        pass

    def on_end(self) -> None:
        pass

    def on_reset(self) -> None:
        pass


_NO_HANDLER = _NoHandler()


class GrpcStream:
    """One call: its method and metadata, and the way to answer (``send``, ``finish``)."""

    __slots__ = (
        "_conn",
        "_handler",
        "_headers_sent",
        "_pending",
        "_rbuf",
        "_recv_unacked",
        "_recv_window",
        "_rneed",
        "_send_window",
        "_trailers",
        "closed",
        "id",
        "metadata",
        "method",
        "remote_closed",
    )

    def __init__(
        self,
        conn: Connection,
        stream_id: int,
        method: str,
        metadata: list[tuple[str, str]],
        send_window: int,
        recv_window: int,
    ) -> None:
        self._conn = conn
        self.id = stream_id
        self.method = method
        self.metadata = metadata
        self.closed = False  # finished, reset, or ended by the server: send and finish do nothing
        self.remote_closed = False  # the client half-closed
        self._handler: StreamHandler = _NO_HANDLER
        self._headers_sent = False
        self._send_window = send_window  # what we may send (the peer's window)
        self._recv_window = recv_window  # what the peer may send before our next WINDOW_UPDATE
        self._recv_unacked = 0
        self._pending: collections.deque[memoryview] | None = None  # DATA waiting for the peer's window
        self._trailers: bytes | None = None  # sent once _pending drains
        self._rbuf: bytearray | None = None  # a request message in pieces
        self._rneed = 0

    def send(self, message: bytes) -> None:
        """One response message (the response headers go first, once)."""
        if self.closed:
            return
        conn = self._conn
        out = conn._out
        if not self._headers_sent:
            self._headers_sent = True
            out.append(h2.frame(h2.HEADERS, h2.END_HEADERS, self.id, RESPONSE_HEADERS))
        size = len(message)
        n = size + 5
        if (
            self._pending is None
            and n <= self._send_window
            and n <= conn._send_window
            and n <= conn._peer_max_frame
        ):
            self._send_window -= n
            conn._send_window -= n
            out.append(DATA_AND_PREFIX.pack(n >> 16, n & 0xFFFF, h2.DATA, 0, self.id, 0, size))
            out.append(message)
        else:
            conn._queue(self, MESSAGE_PREFIX.pack(0, size) + message)
        if not conn._receiving:
            conn._schedule_flush()

    def finish(self, status: int = Status.OK, message: str = "") -> None:
        """End the call: trailers with ``status`` and ``message``, END_STREAM."""
        if self.closed:
            return
        self.closed = True
        block = trailers(status, message)
        if not self._headers_sent:
            self._headers_sent = True
            block = RESPONSE_HEADERS + block  # trailers-only response
        frame = h2.frame(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, self.id, block)
        conn = self._conn
        if self._pending:
            self._trailers = frame  # after the DATA still waiting for the window
        else:
            conn._out.append(frame)
            conn._local_done(self)
        if not conn._receiving:
            conn._schedule_flush()

    @property
    def buffered(self) -> int:
        """Response bytes waiting for the peer's flow-control window."""
        return sum(len(p) for p in self._pending) if self._pending else 0

    # -- called by the connection -----------------------------------------------------------------
    def _receive(self, data: bytes) -> None:
        """DATA payload: split into messages, each handed to the handler."""
        if self._rbuf is not None:
            self._rbuf += data
            if len(self._rbuf) < self._rneed:
                return
            data = bytes(self._rbuf)
            self._rbuf = None
        pos, end = 0, len(data)
        limit = self._conn._server.max_message_bytes
        while end - pos >= 5:
            flag, length = MESSAGE_PREFIX.unpack_from(data, pos)
            if flag:
                if flag == 1:
                    self._end_by_server(Status.UNIMPLEMENTED, "compressed messages are not supported")
                else:
                    self._end_by_server(Status.INTERNAL, f"message flag {flag} is not 0 or 1")
                return
            if length > limit:
                self._end_by_server(
                    Status.RESOURCE_EXHAUSTED,
                    f"request message of {length} bytes is larger than the limit of {limit} bytes",
                )
                return
            stop = pos + 5 + length
            if stop > end:
                self._rneed = 5 + length
                break
            message = data[pos + 5 : stop]
            pos = stop
            try:
                self._handler.on_message(message)
            except Exception:
                self._handler_failed("on_message")
            if self.closed:
                return
        else:
            self._rneed = 5
        if pos < end:
            self._rbuf = bytearray(memoryview(data)[pos:])

    def _end_by_server(self, status: int, message: str) -> None:
        """The server ends the call (a refused message, a failed handler): finish, then ``on_reset``."""
        if not self.closed:
            self.finish(status, message)
            self._rbuf = None
            self._tell_reset()

    def _handler_failed(self, where: str) -> None:
        failures.warning("gRPC handler for %s failed in %s: %s", self.method, where, traceback.format_exc())
        self._end_by_server(Status.INTERNAL, f"handler for {self.method} failed")

    def _reset(self) -> None:
        """The call is gone (reset, connection lost): ``on_reset`` unless the handler finished it."""
        self._pending = None
        self._rbuf = None
        if not self.closed:
            self.closed = True
            self._tell_reset()

    def _tell_reset(self) -> None:
        try:
            self._handler.on_reset()
        except Exception:
            failures.warning(
                "gRPC handler for %s failed in on_reset: %s", self.method, traceback.format_exc()
            )


# -- unary methods -----------------------------------------------------------------------------------
UnaryFunction = Callable[[bytes], "bytes | Awaitable[bytes]"]


class _Unary:
    __slots__ = ("_fn", "_request", "_stream", "_task")

    def __init__(self, stream: GrpcStream, fn: UnaryFunction) -> None:
        self._stream = stream
        self._fn = fn
        self._request: bytes | None = None
        self._task: asyncio.Task[None] | None = None

    def on_message(self, data: bytes) -> None:
        if self._request is not None:
            self._stream.finish(Status.UNIMPLEMENTED, "a unary method takes one request message")
        self._request = data

    def on_end(self) -> None:
        stream = self._stream
        if self._request is None:
            stream.finish(Status.UNIMPLEMENTED, "a unary method takes one request message, got none")
            return
        try:
            result = self._fn(self._request)
        except GrpcError as exc:
            stream.finish(exc.status, exc.message)
            return
        if inspect.isawaitable(result):
            self._task = asyncio.get_running_loop().create_task(self._answer(result))
        else:
            stream.send(result)
            stream.finish()

    async def _answer(self, pending: Awaitable[bytes]) -> None:
        stream = self._stream
        try:
            result = await pending
        except GrpcError as exc:
            stream.finish(exc.status, exc.message)
            return
        except Exception:
            failures.warning("gRPC unary %s failed: %s", stream.method, traceback.format_exc())
            stream.finish(Status.INTERNAL, f"handler for {stream.method} failed")
            return
        stream.send(result)
        stream.finish()

    def on_reset(self) -> None:
        if self._task is not None:
            self._task.cancel()


def unary(fn: UnaryFunction) -> Factory:
    """The factory of a unary method: ``fn(request bytes)`` -> response bytes, or an awaitable of them.

    A `GrpcError` raised by ``fn`` ends the call with its status; any other exception with INTERNAL.
    """

    def factory(stream: GrpcStream) -> StreamHandler:
        return _Unary(stream, fn)

    return factory
