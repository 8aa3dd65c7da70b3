"""The router's HTTP/1.1 server: llhttp (``httptools``) on an asyncio protocol, nothing else in the way.

A request is parsed straight into a `Request` (method, path, query string, headers, the whole body) and
handed to one handler coroutine per request, run by the connection's one task; the handler either returns
a `Response` (sent with its length in one write) or streams through the connection (`start`, `write`,
`end`: chunked encoding). A server with a ``direct`` callable offers it each request first (soon after it
was read): it may answer from callbacks with no coroutine (then `Connection.finish`), hand the rest to
`Connection.serve_rest`, or decline, and the handler gets the request; requests pipelined behind one the
handler answers are the handler's too. Why not aiohttp's server: docs/design/router-request-path.md.

Requests on one connection are answered in order, one handler at a time (keep-alive and pipelining, at
most ``MAX_PIPELINED`` waiting). A request over a limit (``MAX_URL_BYTES``, ``MAX_HEADER_BYTES``,
``MAX_HEADERS``, ``max_body``, ``receive_timeout``) or beyond ``max_connections`` is answered in OpenAI
error JSON, then the connection closes. A client that disconnects cancels its handler, and a write to a
gone client raises ``ConnectionResetError``. `Connection` lists the protocol behaviour in full (RFC 9112
checks, ``Expect: 100-continue``, ``Upgrade``, half-close, HTTP/1.0, HEAD).
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
# Request headers on_headers_complete looks at; any other name costs one set lookup.
_CHECKED_HEADERS = frozenset({"host", "content-length", "expect", "transfer-encoding", "upgrade"})
# llhttp's error reason for a version it does not parse (HTTP/1.2, HTTP/3.0, ...).
_LLHTTP_BAD_VERSION = "Invalid HTTP version"
# A deadline this close counts as reached (the loop's timers fire on whole milliseconds).
_TIMER_SLACK_S = 0.001
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
# Takes a request and answers it from callbacks, with no coroutine (True), or declines it (False): the
# handler gets it. One that takes a request calls `Connection.finish` once it is answered, or hands the
# rest to `Connection.serve_rest`.
Direct = Callable[[Request, "Connection"], bool]


class _Refuse(Exception):
    """Raised from a parser callback: answer ``status`` and close the connection."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


_REASONS = {s.value: s.phrase for s in HTTPStatus}
# The status line of every status with a known reason, encoded once.
_STATUS_LINES = {code: f"HTTP/1.1 {code} {reason}\r\n".encode("ascii") for code, reason in _REASONS.items()}


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


def _origin_form(target: str) -> str:
    """The path of an absolute-form request target (``http://host/p`` -> ``/p``, RFC 9112 §3.2.2).

    Other targets (``*``, CONNECT's ``host:port``) are returned as they are.
    """
    scheme, sep, rest = target.partition("://")
    if not sep or scheme.lower() not in ("http", "https"):
        return target
    return "/" + rest.partition("/")[2]


class Connection(asyncio.Protocol):
    """One client connection: parses requests, runs their handler, writes the answers.

    Protocol behaviour:

    - keep-alive and pipelining: requests on one connection are answered in order, one handler at a time; at
      most ``MAX_PIPELINED`` wait, beyond that reading pauses until the handler catches up, and no further
      request is taken while the client leaves its answers unread (transport over its high-water mark);
    - ``Expect: 100-continue`` is answered once all headers passed their checks (413 instead when the
      announced body is too large), held while an earlier answer is still being sent (dropped if the body
      comes meanwhile), never sent to HTTP/1.0; chunked request bodies are decoded;
    - RFC 9112 request checks: exactly one Host (400; none is fine for HTTP/1.0), HTTP/1.0 or 1.1 only (505),
      no transfer coding but chunked (501); an absolute-form target (``http://host/path``) is served by its
      path;
    - an ``Upgrade`` offer (h2c, websocket) is ignored and the request served as HTTP/1.1 with its body (RFC
      9110 §7.8); a CONNECT request is answered, then the connection closes;
    - limits, each answered in OpenAI error JSON then the connection closes: URL over ``MAX_URL_BYTES`` (414),
      headers over ``MAX_HEADER_BYTES`` or ``MAX_HEADERS`` (431), a body over ``max_body`` (413), malformed
      HTTP (400), a request not received within ``receive_timeout`` (408); a bad request pipelined behind
      others is refused after their answers (RFC 9112 §9.3.2), reading stops meanwhile;
    - a client that half-closes (``shutdown(SHUT_WR)``) is taken as gone, as nginx and uvicorn take it: the
      FIN of a close and of a half-close look the same, and a client that left must cancel its handler;
    - an idle keep-alive connection closes after ``keep_alive_timeout``; beyond ``max_connections`` open
      connections a new one is answered 503 (OpenAI error JSON, ``Retry-After``) and closed;
    - a client that disconnects cancels its handler (the proxy then closes the upstream request, which is how
      an engine learns to abort), and a write to a gone client raises ``ConnectionResetError``;
    - write back-pressure: ``write`` waits while the client's socket buffer is over its high-water mark;
    - HTTP/1.0 clients get close-delimited streams, and ``Connection: keep-alive`` when they asked for it and
      the connection stays open; HEAD is answered as GET without the body.
    """

    def __init__(self, server: HttpServer) -> None:
        self._server = server
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._pending: collections.deque[Request] = collections.deque()
        # The connection's one task, made at its first request; between requests it waits on ``_next``.
        self._task: asyncio.Task[None] | None = None
        self._next: asyncio.Future[Request] | None = None
        self._rest: asyncio.Task[None] | None = None  # a direct request's rest, run as a coroutine
        # Called once if the client leaves while a request taken directly is being answered.
        self.on_lost: Callable[[], None] | None = None
        self._next_after_drain = False  # pipelined requests wait until the client reads its answers
        self._serving = False  # a request is being answered (and others may wait in _pending)
        # The connection's one deadline (0: none) and the timer that checks it (see _arm).
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._reading_paused = False
        self._closed = False
        self._close_after = False  # no further request on this connection (CONNECT, error, HTTP/1.0)
        self._refusal: tuple[int, str] | None = None  # a bad request's answer, due after the earlier ones
        # The request being received.
        self._receiving = False
        self._url = b""
        self._version = "1.1"
        self._headers: list[tuple[str, str]] = []
        self._header_bytes = 0
        self._body: list[bytes] = []
        self._body_size = 0
        self._upgrade_offer = False  # its head is replayed without Upgrade (_without_upgrade)
        self._continue_held = False  # it expects 100 Continue while an earlier answer is being sent
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
        while True:
            try:
                self._parser.feed_data(data)
                return
            except httptools.HttpParserUpgrade as exc:
                rest = data[exc.args[0] :]
            except httptools.HttpParserCallbackError as exc:
                refused = exc.__context__
                if isinstance(refused, _Refuse):
                    self._refuse(refused.status, refused.message)
                else:
                    log.exception("HTTP parser callback failed")
                    self._refuse(500, "internal error while reading the request")
                return
            except httptools.HttpParserError as exc:
                if str(exc) == _LLHTTP_BAD_VERSION:
                    self._refuse(505, "HTTP version not supported; send HTTP/1.1")
                else:
                    self._refuse(400, f"malformed HTTP request: {exc}")
                return
            if not self._upgrade_offer:
                self._close_after = True  # CONNECT: what follows is not HTTP; answer it, then close
                self.pause_reading()
                return
            data = self._without_upgrade() + rest  # a loop, not recursion: many may be pipelined

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._server._connections.discard(self)
        self._disarm()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._pending.clear()
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("client disconnected"))
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the client left: its handler stops (and the proxy aborts upstream)
        if self._rest is not None and not self._rest.done():
            self._rest.cancel()
        lost = self.on_lost
        if lost is not None:
            self.on_lost = None
            lost()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None
        if self._next_after_drain:
            self._next_after_drain = False
            self._next_pending()

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
        parser = self._parser
        self._version = version = parser.get_http_version()
        if version != "1.1" and version != "1.0":
            raise _Refuse(505, f"HTTP/{version} is not supported; send HTTP/1.1")
        hosts = 0
        expect = upgrade = False
        codings: str | None = None
        for name, value in self._headers:
            lname = name.lower()
            if lname not in _CHECKED_HEADERS:
                continue
            if lname == "host":
                hosts += 1
            elif lname == "content-length":
                if value.isdigit() and int(value) > self._server.max_body:
                    raise _Refuse(413, f"request body larger than {self._server.max_body} bytes")
            elif lname == "expect":
                expect = value.lower() == "100-continue"
            elif lname == "transfer-encoding":
                codings = value if codings is None else f"{codings},{value}"
            else:
                upgrade = True
        if hosts != 1 and (hosts > 1 or version == "1.1"):
            raise _Refuse(400, f"request has {hosts} Host headers; HTTP/1.1 needs exactly one")
        if codings is not None and "," in codings:
            # Only chunked is decoded; llhttp itself refuses (400) codings that do not end in chunked.
            raise _Refuse(501, f"Transfer-Encoding {codings!r} not supported: send the body plain or chunked")
        if upgrade and parser.should_upgrade() and parser.get_method() != b"CONNECT":
            self._upgrade_offer = True  # data_received reads this request again without Upgrade
            return
        if expect and version == "1.1":  # never a 1xx to HTTP/1.0 (RFC 9110 §15.2)
            if self._serving:
                self._continue_held = True  # an earlier answer is being sent: _serve sends this one after it
            elif self._transport is not None:
                self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body_size += len(body)
        if self._body_size > self._server.max_body:
            raise _Refuse(413, f"request body larger than {self._server.max_body} bytes")
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._upgrade_offer:
            return  # llhttp skipped the body; the request is read again without Upgrade (data_received)
        self._receiving = False
        self._continue_held = False
        self._disarm()
        parser = self._parser
        path, _, query = self._url.decode("utf-8", "surrogateescape").partition("?")
        if path[:1] != "/":
            path = _origin_form(path)
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        request = Request(
            parser.get_method().decode("ascii", "replace"),
            path,
            query,
            CIMultiDictProxy(CIMultiDict(self._headers)),
            body,
            self._version,
            parser.should_keep_alive(),
        )
        self._body = []
        if self._serving:
            self._pending.append(request)
            if len(self._pending) >= MAX_PIPELINED:
                self.pause_reading()
            return
        self._serving = True
        if self._server.direct is not None:
            # Soon, not now: every socket that is ready is read before the answers' writes go out.
            self._loop.call_soon(self._take, request)
        else:
            self._to_task(request)

    # -- serving -----------------------------------------------------------------------------------
    def _take(self, request: Request) -> None:
        """``request``'s turn: the server's ``direct`` path, or, when that declines it, the handler."""
        direct = self._server.direct
        if self._closed:
            self._serving = False
            return
        self._begin(request)
        try:
            taken = direct is not None and direct(request, self)
        except Exception:
            self.failed()
            self.finish()
            return
        if not taken:
            self._to_task(request)

    def _to_task(self, request: Request) -> None:
        """Hand ``request`` to the connection's task (made at its first request)."""
        waiting = self._next
        if waiting is not None:
            self._next = None
            waiting.set_result(request)
        else:
            self._task = self._loop.create_task(self._serve(request))

    def _begin(self, request: Request) -> None:
        self._request = request
        self._started = False
        self._framing = _LENGTH
        self._head_only = request.method == "HEAD"

    def serve_rest(self, answering: Awaitable[Response | None]) -> None:
        """The rest of a request ``direct`` took, as a coroutine: what it returns is answered as a handler's
        answer is, then the connection takes its next request. The client leaving cancels it."""
        self._rest = self._loop.create_task(self._serve_rest(answering))

    async def _serve_rest(self, answering: Awaitable[Response | None]) -> None:
        try:
            await self._answer(answering)
        finally:
            self._rest = None
        self.finish()

    def finish(self) -> None:
        """The request ``direct`` took is answered (or its client left): the connection takes the next."""
        self.on_lost = None
        request = self._request
        if self._closed:
            self._serving = False
            self._request = None
            return
        if self._framing == _CLOSE or self._close_after or request is None or not request.keep_alive:
            self._serving = False
            self._request = None
            self.close()
            return
        if self._pending:
            if self._write_paused:
                self._next_after_drain = True  # (see _serve: no further request while answers go unread)
            else:
                self._next_pending()
            return
        self._idle_again()

    def _next_pending(self) -> None:
        if self._closed or not self._pending:
            return
        request = self._pending.popleft()
        if self._reading_paused and len(self._pending) < MAX_PIPELINED // 2:
            self.resume_reading()
        self._loop.call_soon(self._take, request)

    def _idle_again(self) -> bool:
        """Every request received is answered: wait for the next one (False: the connection is done)."""
        self._serving = False
        self._request = None
        transport = self._transport
        if transport is None or transport.is_closing():
            return False
        if self._refusal is not None:
            self._refuse(*self._refusal)  # a bad request behind the ones answered: its turn now, then close
            return False
        if self._continue_held and not self._body_size:
            transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # the request being received is next
        self._continue_held = False
        # A next request half received while this one was answered gets the rest of its time now.
        self._arm(self._server.receive_timeout if self._receiving else self._server.keep_alive_timeout)
        return True

    async def _answer(self, answering: Awaitable[Response | None]) -> None:
        """Send what the handler's ``answering`` returns; a handler that fails gets a 500 if it can."""
        request = self._request
        try:
            response = await answering
            if response is not None:
                self.send(response.status, response.headers, response.body)
            elif not self._started:
                what = "" if request is None else f" for {request.method} {request.path}"
                raise RuntimeError(f"handler{what} sent no response")
        except (ConnectionResetError, BrokenPipeError):
            self.close()
        except Exception:
            self.failed()

    def failed(self) -> None:
        """(In an ``except`` block) answering the request failed in the router: the error is logged, the
        client gets a 500 if nothing was sent yet, and the connection closes after it."""
        request = self._request
        what = "" if request is None else f" for {request.method} {request.path}"
        log.exception("handler%s failed", what)
        self._close_after = True
        if not self._started:
            with contextlib.suppress(ConnectionResetError):
                self.send_error(OpenAIError(500, "internal router error", "InternalServerError"))

    async def _serve(self, request: Request) -> None:
        """Answer ``request``, those pipelined behind it, then every later one: the connection's one task
        (a task per request would cost each one a task's set-up), waiting on ``_next`` between requests."""
        handler = self._server.handler
        try:
            while True:
                self._begin(request)
                await self._answer(handler(request, self))
                if self._closed:
                    return
                if self._framing == _CLOSE:
                    # A close-delimited stream (HTTP/1.0) ends only when the connection does.
                    self._close_after = True
                if self._close_after or not request.keep_alive:
                    self.close()
                    return
                if self._pending:
                    if self._write_paused:
                        # The client leaves its answers unread: take no further request until it reads, or a
                        # client that pipelines and never reads would grow the answers buffered here without
                        # bound.
                        try:
                            await self._drained()
                        except ConnectionResetError:
                            return
                    request = self._pending.popleft()
                    if self._reading_paused and len(self._pending) < MAX_PIPELINED // 2:
                        self.resume_reading()
                    continue
                if not self._idle_again():
                    return
                waiting = self._next = self._loop.create_future()
                request = await waiting
        finally:
            self._task = self._next = self._request = None
            self._serving = False

    def _head(self, status: int, headers: Iterable[tuple[str, str]], framing: bytes) -> bytes:
        server = self._server
        status_line = _STATUS_LINES.get(status) or f"HTTP/1.1 {status} Unknown\r\n".encode("ascii")
        fields = ""
        for name, value in headers:  # (a loop: a comprehension would cost a function object per call)
            fields += f"{name}: {value}\r\n"
        encoded = fields.encode("utf-8", "surrogateescape")
        return b"".join((status_line, encoded, server.default_lines, server.clock.date_line(), framing))

    def send(self, status: int, headers: Iterable[tuple[str, str]], body: bytes) -> None:
        """A whole response with its Content-Length (no waiting: the transport buffers it)."""
        if self._started:
            raise RuntimeError("response already started")
        self._started = True
        request = self._request
        if self._close_after or (request is not None and not request.keep_alive):
            connection = b"Connection: close\r\n"
        elif request is not None and request.version == "1.0":
            connection = b"Connection: keep-alive\r\n"  # else an HTTP/1.0 client waits for the close
        else:
            connection = b""
        if status == 204 or status == 304:  # no body, and (RFC 9110 §8.6) no Content-Length on a 204 either
            framing = connection + b"\r\n"
            body = b""
        else:
            framing = b"Content-Length: %d\r\n%s\r\n" % (len(body), connection)
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
            await self._drained()

    async def _drained(self) -> None:
        """Wait until the client reads the buffered answers (``ConnectionResetError`` if it left)."""
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

    @property
    def closed(self) -> bool:
        """The client's connection is gone (or closing)."""
        return self._closed or self._transport is None or self._transport.is_closing()

    def _without_upgrade(self) -> bytes:
        """The head of the Upgrade request just read, without Upgrade, for a new parser to read again.

        llhttp hands the connection over after an Upgrade request's headers (and would take its body for
        the next request). The router does not switch protocols (RFC 9110 §7.8 lets a server ignore the
        offer), so the request is read again as plain HTTP/1.1: this head, then the bytes after it.
        """
        self._upgrade_offer = False
        parser = self._parser
        lines = [b"%s %s HTTP/%s\r\n" % (parser.get_method(), self._url, self._version.encode("ascii"))]
        for name, value in self._headers:
            if name.lower() != "upgrade":
                lines.append(
                    b"%s: %s\r\n" % (name.encode("latin-1"), value.encode("utf-8", "surrogateescape"))
                )
        lines.append(b"\r\n")
        self._parser = httptools.HttpRequestParser(self)
        return b"".join(lines)

    # -- connection control --------------------------------------------------------------------------
    def _refuse(self, status: int, message: str, retry_later: bool = False) -> None:
        """Answer a request that could not be read (or a connection over the limit), then close."""
        if self._serving:
            # Earlier requests are still being answered, and answers go out in order (RFC 9112 §9.3.2):
            # read nothing more; _serve sends this answer after theirs.
            if self._refusal is None:
                self._refusal = (status, message)
                self.pause_reading()
            return
        self._close_after = True
        if self._transport is None:
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
        """Time out ``seconds`` from now. Moving the deadline costs no timer: the one timer fires no later
        than any deadline can be (the shortest timeout after it was set) and moves itself to the deadline."""
        now = self._loop.time()
        self._deadline = now + seconds
        if self._timer is None:
            self._timer = self._loop.call_at(now + self._server.shortest_timeout, self._check_deadline)

    def _disarm(self) -> None:
        self._deadline = 0.0

    def _check_deadline(self) -> None:
        self._timer = None
        if not self._deadline or self._closed:
            return
        now = self._loop.time()
        if now < self._deadline - _TIMER_SLACK_S:
            until = min(self._deadline, now + self._server.shortest_timeout)
            self._timer = self._loop.call_at(until, self._check_deadline)
            return
        self._deadline = 0.0
        self._timed_out()

    def _timed_out(self) -> None:
        if self._receiving and not self._serving:
            self._refuse(408, f"request not received within {self._server.receive_timeout:g} s")
        elif not self._serving:
            # Idle keep-alive: a client that has not taken the last answer by now stopped reading, and a close
            # would wait for it forever: drop it.
            if self.unsent:
                self.abort()
            else:
                self.close()

    def pause_reading(self) -> None:
        if not self._reading_paused and self._transport is not None and not self._closed:
            self._reading_paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if (
            self._reading_paused
            and self._refusal is None
            and self._transport is not None
            and not self._closed
        ):
            self._reading_paused = False
            self._transport.resume_reading()

    def close(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    def abort(self) -> None:
        """Drop the connection now, with whatever the client has not taken yet (``close`` would wait for a
        client that stopped reading to take it)."""
        if self._transport is not None:
            self._transport.abort()

    @property
    def unsent(self) -> int:
        """Bytes of the answer still buffered here: written, not yet taken by the client's socket."""
        transport = self._transport
        return 0 if transport is None or transport.is_closing() else transport.get_write_buffer_size()

    @property
    def idle(self) -> bool:
        return not self._serving and not self._receiving


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
        direct: Direct | None = None,
    ) -> None:
        self.handler = handler
        self.direct = direct
        self.max_connections = max_connections
        self.max_body = max_body
        self.keep_alive_timeout = keep_alive_timeout
        self.receive_timeout = receive_timeout
        self.default_headers = list(default_headers)
        # The default headers as they are sent, encoded once.
        self.default_lines = b"".join(
            f"{name}: {value}\r\n".encode("utf-8", "surrogateescape") for name, value in self.default_headers
        )
        self.clock = _Clock()
        self._connections: set[Connection] = set()
        self._server: asyncio.Server | None = None

    async def start(self, sock: socket.socket, backlog: int = 4096) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: Connection(self), sock=sock, backlog=backlog)

    @property
    def connections(self) -> int:
        return len(self._connections)

    @property
    def shortest_timeout(self) -> float:
        """No connection's deadline is nearer than this after it is set (each connection's timer step)."""
        return min(self.receive_timeout, self.keep_alive_timeout)

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
