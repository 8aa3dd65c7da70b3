"""A lean gRPC server: HTTP/2 over cleartext (h2c, prior knowledge), one asyncio protocol per connection
(`kvstack.http.grpc_connection`) and callbacks per call (`kvstack.http.grpc_stream`), no task per stream.

``GrpcServer(methods)`` serves ``methods``: ``"/package.Service/Method"`` -> a factory that takes the call's
`GrpcStream` and returns its `StreamHandler` (`unary` makes one from a request -> response function).
Limits: a request message over ``max_message_bytes`` ends its call with RESOURCE_EXHAUSTED, a compressed one
with UNIMPLEMENTED; an unknown method gets UNIMPLEMENTED; streams beyond ``max_concurrent_streams`` are
refused (REFUSED_STREAM); a call whose responses would take the connection's bytes waiting for the peer's
flow-control window over ``max_buffered_bytes`` ends with RESOURCE_EXHAUSTED. ``header_table_size`` is the
HPACK table we let the client use. ``close(grace_s)`` sends GOAWAY and lets calls in flight finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Mapping

from kvstack.http import h2_frames as h2
from kvstack.http.grpc_connection import Connection
from kvstack.http.grpc_status import GrpcError, Status
from kvstack.http.grpc_stream import Factory, GrpcStream, StreamHandler, unary

__all__ = ["GrpcError", "GrpcServer", "GrpcStream", "Status", "StreamHandler", "unary"]


class GrpcServer:
    """Serves ``methods`` (``"/package.Service/Method"`` -> handler factory) on a listening socket."""

    def __init__(
        self,
        methods: Mapping[str, Factory],
        *,
        max_message_bytes: int = 4 << 20,
        max_concurrent_streams: int = 1024,
        max_buffered_bytes: int | None = None,
        header_table_size: int = h2.DEFAULT_HEADER_TABLE,
    ) -> None:
        self.methods = dict(methods)
        self.max_message_bytes = max_message_bytes
        self.max_concurrent_streams = max_concurrent_streams
        # Responses one connection holds back for the peer's window: at least a few whole messages.
        self.max_buffered_bytes = max_buffered_bytes or 4 * (max_message_bytes + 5)
        self.header_table_size = header_table_size
        self._connections: set[Connection] = set()
        self._server: asyncio.Server | None = None
        self._all_gone: asyncio.Event | None = None  # set when the last connection closes (close())

    async def start(self, sock: socket.socket, backlog: int = 4096) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: Connection(self), sock=sock, backlog=backlog)

    def _connection_gone(self, conn: Connection) -> None:
        self._connections.discard(conn)
        if not self._connections and self._all_gone is not None:
            self._all_gone.set()

    @property
    def connections(self) -> int:
        return len(self._connections)

    @property
    def open_streams(self) -> int:
        """Calls in progress over all connections."""
        return sum(c.open_streams for c in self._connections)

    async def close(self, grace_s: float = 5.0) -> None:
        """Stop accepting; GOAWAY every connection; give calls in flight ``grace_s``, then reset them."""
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            conn.shutdown()
        self._all_gone = asyncio.Event()
        if self._connections:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._all_gone.wait(), grace_s)
        for conn in list(self._connections):
            conn.abort()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
