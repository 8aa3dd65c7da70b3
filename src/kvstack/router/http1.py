"""The router's HTTP/1.1 server: llhttp (``httptools``) on an asyncio protocol, nothing else in the way.

The router's work per request is small (parse a JSON body, pick an engine, relay bytes), so the server
around it must be smaller still: aiohttp's server cost about 250 µs of CPU per proxied request on the
benchmark machine, more than routing and relaying together (docs/benchmarks.md, "Router overhead"). Here a
request is parsed straight into a `Request` (method, path, query string, headers, the whole body) and
handed to one handler coroutine per request; the handler either returns a `Response` (sent with its
length in one write) or streams through the connection (`start`, `write`, `end`: chunked encoding).

Protocol behaviour:
- keep-alive and pipelining: requests on one connection are answered in order, one handler at a time;
  at most ``MAX_PIPELINED`` wait, beyond that reading pauses until the handler catches up;
- ``Expect: 100-continue`` is answered before the body is read (or refused with 413 when the announced
  body is too large); chunked request bodies are decoded;
- limits, each answered in OpenAI error JSON then the connection closes: URL over ``MAX_URL_BYTES`` (414),
  headers over ``MAX_HEADER_BYTES`` or ``MAX_HEADERS`` (431), a body over ``max_body`` (413), malformed
  HTTP (400), a request not received within ``receive_timeout`` (408);
- an idle keep-alive connection closes after ``keep_alive_timeout``; beyond ``max_connections`` open
  connections a new one is answered 503 (OpenAI error JSON, ``Retry-After``) and closed;
- a client that disconnects cancels its handler (the proxy then closes the upstream request, which is how
  an engine learns to abort), and a write to a gone client raises ``ConnectionResetError``;
- write back-pressure: ``write`` waits while the client's socket buffer is over its high-water mark;
- HTTP/1.0 clients get close-delimited streams; HEAD is answered as GET without the body.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from email.utils import formatdate
from http import HTTPStatus
from typing import cast
from urllib.parse import parse_qsl

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from kvstack.openai.errors import OpenAIError

__all__ = ["Connection", "HttpServer", "Request", "Response"]

log = logging.getLogger(__name__)

MAX_URL_BYTES = 8 * 1024
MAX_HEADER_BYTES = 64 * 1024
MAX_HEADERS = 128
MAX_PIPELINED = 16
# How a response body is delimited.
_LENGTH, _CHUNKED, _CLOSE = 0, 1, 2


class Request:
    """One complete request."""

    __slots__ = ("_query", "body", "headers", "keep_alive", "method", "path", "query_string", "version")

    def __init__(
        self,
        method: str,
        path: str,
        query_string: str,
        headers: CIMultiDictProxy[str],
        body: bytes,
        version: str,
        keep_alive: bool,
    ) -> None:
        self.method = method
        self.path = path
        self.query_string = query_string
        self.headers = headers
        self.body = body
        self.version = version
        self.keep_alive = keep_alive
        self._query: dict[str, str] | None = None

    @property
    def query(self) -> dict[str, str]:
        """Query parameters (the first value of each name)."""
        if self._query is None:
            self._query = {}
            for key, value in parse_qsl(self.query_string, keep_blank_values=True):
                self._query.setdefault(key, value)
        return self._query


class Response:
    """A whole response, sent with its Content-Length."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int = 200, body: bytes = b"", headers: Iterable[tuple[str, str]] = ()) -> None:
        self.status = status
        self.body = body
        self.headers = list(headers)


Handler = Callable[[Request, "Connection"], Awaitable[Response | None]]


class _Refuse(Exception):
    """Raised from a parser callback: answer ``status`` and close the connection."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


_REASONS = {s.value: s.phrase for s in HTTPStatus}


class _Clock:
    """The Date header, formatted at most once a second."""

    def __init__(self) -> None:
        self._second = 0
        self._line = b""

    def date_line(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._line = f"Date: {formatdate(now, usegmt=True)}\r\n".encode("ascii")
        return self._line


class Connection(asyncio.Protocol):
    """One client connection: parses requests, runs their handler, writes the answers."""

    def __init__(self, server: HttpServer) -> None:
        self._server = server
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._pending: collections.deque[Request] = collections.deque()
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._reading_paused = False
        self._closed = False
        self._close_after = False  # no further request on this connection (upgrade, error, HTTP/1.0)
        # The request being received.
        self._receiving = False
        self._url = b""
        self._headers: list[tuple[str, str]] = []
        self._header_bytes = 0
        self._body: list[bytes] = []
        self._body_size = 0
        # The response being sent.
        self._request: Request | None = None
        self._started = False
        self._framing = _LENGTH
        self._head_only = False
        self._write_paused = False
        self._drain: asyncio.Future[None] | None = None

    # -- asyncio.Protocol --------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        if len(self._server._connections) >= self._server.max_connections:
            self._refuse(503, f"too many open connections (limit {self._server.max_connections})", True)
            return
        self._server._connections.add(self)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._arm(self._server.keep_alive_timeout)

    def data_received(self, data: bytes) -> None:
        if self._closed:
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._close_after = True  # the request was read; answer it, then close (no protocol switch)
            self.pause_reading()
        except httptools.HttpParserCallbackError as exc:
            refused = exc.__context__
            if isinstance(refused, _Refuse):
                self._refuse(refused.status, refused.message)
            else:
                log.exception("HTTP parser callback failed")
                self._refuse(500, "internal error while reading the request")
        except httptools.HttpParserError as exc:
            self._refuse(400, f"malformed HTTP request: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._server._connections.discard(self)
        self._disarm()
        self._pending.clear()
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("client disconnected"))
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the client left: its handler stops (and the proxy aborts upstream)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    # -- httptools callbacks -----------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._receiving = True
        self._url = b""
        self._headers = []
        self._header_bytes = 0
        self._body = []
        self._body_size = 0
        self._arm(self._server.receive_timeout)

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > MAX_URL_BYTES:
            raise _Refuse(414, f"request URL longer than {MAX_URL_BYTES} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value)
        if self._header_bytes > MAX_HEADER_BYTES or len(self._headers) >= MAX_HEADERS:
            raise _Refuse(431, f"request headers over {MAX_HEADER_BYTES} bytes or {MAX_HEADERS} fields")
        self._headers.append((name.decode("latin-1"), value.decode("utf-8", "surrogateescape")))

    def on_headers_complete(self) -> None:
        limit = self._server.max_body
        for name, value in self._headers:
            lname = name.lower()
            if lname == "content-length" and value.isdigit() and int(value) > limit:
                raise _Refuse(413, f"request body larger than {limit} bytes")
            if lname == "expect" and value.lower() == "100-continue" and self._transport is not None:
                self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body_size += len(body)
        if self._body_size > self._server.max_body:
            raise _Refuse(413, f"request body larger than {self._server.max_body} bytes")
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._receiving = False
        self._disarm()
        parser = self._parser
        path, _, query = self._url.decode("utf-8", "surrogateescape").partition("?")
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        request = Request(
            parser.get_method().decode("ascii", "replace"),
            path,
            query,
            CIMultiDictProxy(CIMultiDict(self._headers)),
            body,
            parser.get_http_version(),
            parser.should_keep_alive(),
        )
        self._body = []
        if self._task is None:
            self._task = self._loop.create_task(self._serve(request))
        else:
            self._pending.append(request)
            if len(self._pending) >= MAX_PIPELINED:
                self.pause_reading()

    # -- serving -----------------------------------------------------------------------------------
    async def _serve(self, request: Request) -> None:
        handler = self._server.handler
        while True:
            self._request = request
            self._started = False
            self._framing = _LENGTH
            self._head_only = request.method == "HEAD"
            try:
                response = await handler(request, self)
                if response is not None:
                    self.send(response.status, response.headers, response.body)
                elif not self._started:
                    raise RuntimeError(f"handler for {request.method} {request.path} sent no response")
            except asyncio.CancelledError:
                self._task = None
                raise
            except (ConnectionResetError, BrokenPipeError):
                self.close()
            except Exception:
                log.exception("handler for %s %s failed", request.method, request.path)
                if not self._started:
                    self.send_error(OpenAIError(500, "internal router error", "InternalServerError"))
                self._close_after = True
            if self._closed:
                break
            if self._framing == _CLOSE:
                # A close-delimited stream (HTTP/1.0) ends only when the connection does.
                self._close_after = True
            if self._close_after or not request.keep_alive:
                self.close()
                break
            if not self._pending:
                break
            request = self._pending.popleft()
            if self._reading_paused and len(self._pending) < MAX_PIPELINED // 2:
                self.resume_reading()
        self._task = None
        self._request = None
        if not self._closed:
            # A next request half received while this one was answered gets the rest of its time now.
            self._arm(self._server.receive_timeout if self._receiving else self._server.keep_alive_timeout)

    def _head(self, status: int, headers: Iterable[tuple[str, str]], framing: bytes) -> bytes:
        reason = _REASONS.get(status, "Unknown")
        lines = [f"HTTP/1.1 {status} {reason}\r\n".encode("ascii")]
        for name, value in headers:
            lines.append(f"{name}: {value}\r\n".encode("utf-8", "surrogateescape"))
        for name, value in self._server.default_headers:
            lines.append(f"{name}: {value}\r\n".encode("utf-8", "surrogateescape"))
        lines.append(self._server.clock.date_line())
        lines.append(framing)
        return b"".join(lines)

    def send(self, status: int, headers: Iterable[tuple[str, str]], body: bytes) -> None:
        """A whole response with its Content-Length (no waiting: the transport buffers it)."""
        if self._started:
            raise RuntimeError("response already started")
        self._started = True
        closing = self._close_after or (self._request is not None and not self._request.keep_alive)
        framing = b"Content-Length: %d\r\n%s\r\n" % (
            len(body),
            b"Connection: close\r\n" if closing else b"",
        )
        head = self._head(status, headers, framing)
        transport = self._transport
        if transport is None or self._closed or transport.is_closing():
            raise ConnectionResetError("client disconnected")
        if body and not self._head_only:
            transport.writelines((head, body))
        else:
            transport.write(head)

    def send_error(self, err: OpenAIError, headers: Iterable[tuple[str, str]] = ()) -> None:
        self.send(err.status, [("Content-Type", "application/json"), *headers], err.to_json())

    def start(self, status: int, headers: Iterable[tuple[str, str]]) -> None:
        """Begin a streamed response (chunked; close-delimited for HTTP/1.0 clients)."""
        if self._started:
            raise RuntimeError("response already started")
        self._started = True
        request = self._request
        if request is not None and request.version == "1.0":
            self._framing = _CLOSE
            framing = b"Connection: close\r\n\r\n"
        else:
            self._framing = _CHUNKED
            closing = self._close_after or (request is not None and not request.keep_alive)
            framing = b"Transfer-Encoding: chunked\r\n%s\r\n" % (b"Connection: close\r\n" if closing else b"")
        transport = self._transport
        if transport is None or self._closed or transport.is_closing():
            raise ConnectionResetError("client disconnected")
        transport.write(self._head(status, headers, framing))

    async def write(self, data: bytes) -> None:
        """One piece of a streamed body; waits while the client is not reading."""
        transport = self._transport
        if transport is None or self._closed or transport.is_closing():
            raise ConnectionResetError("client disconnected")
        if not data or self._head_only:
            return
        if self._framing == _CHUNKED:
            transport.writelines((b"%x\r\n" % len(data), data, b"\r\n"))
        else:
            transport.write(data)
        if self._write_paused:
            if self._drain is None or self._drain.done():
                self._drain = self._loop.create_future()
            await self._drain

    def end(self) -> None:
        """The end of a streamed body."""
        transport = self._transport
        if transport is None or self._closed or transport.is_closing():
            return
        if self._framing == _CHUNKED and not self._head_only:
            transport.write(b"0\r\n\r\n")

    @property
    def response_started(self) -> bool:
        return self._started

    # -- connection control --------------------------------------------------------------------------
    def _refuse(self, status: int, message: str, retry_later: bool = False) -> None:
        """Answer a request that could not be read (or a connection over the limit), then close."""
        self._close_after = True
        if self._task is not None or self._transport is None:
            self.close()  # a handler is answering an earlier request: there is no slot for this answer
            return
        err = OpenAIError(status, message, _REASONS.get(status, "Error"))
        head = self._head(
            status,
            [("Content-Type", "application/json"), *([("Retry-After", "1")] if retry_later else [])],
            b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(err.to_json()),
        )
        self._transport.writelines((head, err.to_json()))
        self.close()

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._timer = self._loop.call_later(seconds, self._timed_out)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self) -> None:
        self._timer = None
        if self._receiving and self._task is None:
            self._refuse(408, f"request not received within {self._server.receive_timeout:g} s")
        elif self._task is None:
            self.close()  # idle keep-alive connection

    def pause_reading(self) -> None:
        if not self._reading_paused and self._transport is not None and not self._closed:
            self._reading_paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self._reading_paused and self._transport is not None and not self._closed:
            self._reading_paused = False
            self._transport.resume_reading()

    def close(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    @property
    def idle(self) -> bool:
        return self._task is None and not self._receiving


class HttpServer:
    """Serves ``handler`` on a listening socket."""

    def __init__(
        self,
        handler: Handler,
        *,
        max_body: int,
        keep_alive_timeout: float = 75.0,
        receive_timeout: float = 60.0,
        default_headers: Iterable[tuple[str, str]] = (),
        max_connections: int = 16384,
    ) -> None:
        self.handler = handler
        self.max_connections = max_connections
        self.max_body = max_body
        self.keep_alive_timeout = keep_alive_timeout
        self.receive_timeout = receive_timeout
        self.default_headers = list(default_headers)
        self.clock = _Clock()
        self._connections: set[Connection] = set()
        self._server: asyncio.Server | None = None

    async def start(self, sock: socket.socket, backlog: int = 4096) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: Connection(self), sock=sock, backlog=backlog)

    @property
    def connections(self) -> int:
        return len(self._connections)

    async def close(self, grace: float = 5.0) -> None:
        """Stop accepting; close idle connections; give handlers ``grace`` seconds, then cancel them."""
        if self._server is not None:
            self._server.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while True:
            for conn in list(self._connections):
                if conn.idle:
                    conn.close()
            busy = [c for c in self._connections if not c.idle]
            if not busy or loop.time() >= deadline:
                break
            await asyncio.sleep(0.05)
        for conn in list(self._connections):
            conn.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
