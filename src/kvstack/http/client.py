"""kvstack's HTTP/1.1 client to engines: pooled keep-alive connections, parsed by llhttp (``httptools``).

- ``UpstreamPool.request`` sends one request (one pre-built header block and the body) and returns an
  ``UpstreamResponse`` once its headers arrived; the body is read with ``read()`` or ``readany()`` (or taken
  with ``received()`` once ``complete``), and reading pauses while more than ``READ_HIGH_WATER`` bytes wait
  for the caller. The proxy relays with it. ``UpstreamPool.send_now`` sends on an idle pooled connection
  without waiting and calls back once the headers (or a failure) came: a plain request's path with no
  coroutine.
- ``UpstreamPool.get`` / ``post_json``: a side call (/metrics, /v1/models, /tokenize, /kv_event_sources)
  returning the whole ``Reply`` (status, headers, body) within a total time ``within``, the body at most
  ``max_bytes``. Any status is a reply; the caller judges it.
- Errors (``UpstreamError``, ``reason`` a metric label): ``ConnectFailed`` (nothing sent; ``ConnectTimedOut``,
  ``CannotSend`` for an unusable engine URL), ``UpstreamBroken``, ``UpstreamTimeout``, ``BodyTooLarge``.
- A pooled connection the engine closed while idle is replaced once (the engine never saw the request).
  ``release()`` pools a connection whose answer was read to the end; ``close()`` closes it, which is how an
  engine learns a client left. At most ``max_idle_per_origin`` idle connections per engine, each idle at
  most ``idle_timeout`` s; ``max_connections`` in use and idle together (0 = unlimited).
"""

from __future__ import annotations

import asyncio
import collections
import json
import ssl
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, cast

import httptools

from kvstack.http.errors import (
    BodyTooLarge,
    CannotSend,
    ConnectFailed,
    ConnectTimedOut,
    UpstreamBroken,
    UpstreamError,
    UpstreamTimeout,
)
from kvstack.http.origin import Origin

__all__ = [
    "BodyTooLarge",
    "CannotSend",
    "ConnectFailed",
    "ConnectTimedOut",
    "Origin",
    "Reply",
    "UpstreamBroken",
    "UpstreamError",
    "UpstreamPool",
    "UpstreamResponse",
    "UpstreamTimeout",
]

# An origin's fields (scheme, host, port, base path, Host header): what pooled connections are keyed by.
_PoolKey = tuple[str, str, int, str, str]
READ_HIGH_WATER = 1 << 20
READ_LOW_WATER = READ_HIGH_WATER // 4
# A deadline this close counts as reached (the loop's timers fire on whole milliseconds).
_TIMER_SLACK_S = 0.001


@dataclass(frozen=True, slots=True)
class Reply:
    """A side call's whole answer."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        """The first header named ``name`` (lower case)."""
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    def json(self) -> Any:
        """The body as JSON; ``ValueError`` (or ``RecursionError``) when it is not."""
        return json.loads(self.body)


class UpstreamResponse:
    """An engine's answer: status and headers at once, the body as it arrives."""

    __slots__ = (
        "_buffered",
        "_conn",
        "_done",
        "_error",
        "_paused",
        "_pieces",
        "_waiter",
        "content_length",
        "content_type",
        "headers",
        "keep_alive",
        "status",
        "url",
    )

    def __init__(self, conn: _Connection, url: str) -> None:
        self._conn = conn
        self._pieces: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._done = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.content_length: int | None = None
        self.content_type = ""  # the first Content-Type header's value ("" without one)
        self.keep_alive = False
        self.url = url

    def header(self, name: str) -> str | None:
        """The first header named ``name`` (lower case)."""
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    @property
    def complete(self) -> bool:
        return self._done

    @property
    def unanswered(self) -> bool:
        """The engine sent nothing back on this request's connection (a request that failed so was never
        seen by it: sending it again is safe)."""
        return not self._conn.got_bytes

    # -- fed by the connection -----------------------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        self._pieces.append(data)
        self._buffered += len(data)
        if self._buffered > READ_HIGH_WATER and not self._paused:
            self._paused = True
            self._conn.pause()
        self._wake()

    def _finish(self) -> None:
        self._done = True
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        if not self._done and self._error is None:
            self._error = error
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def _wait(self) -> None:
        waiter = self._waiter = self._conn.loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    # -- read by the proxy ---------------------------------------------------------------------------
    async def readany(self) -> bytes:
        """The next body piece; ``b""`` once the body ended. Raises ``UpstreamBroken`` if it broke."""
        while not self._pieces:
            if self._error is not None:
                raise self._error
            if self._done:
                return b""
            await self._wait()
        if len(self._pieces) == 1:
            data = self._pieces.popleft()
        else:
            data = b"".join(self._pieces)
            self._pieces.clear()
        self._buffered = 0
        if self._paused:
            self._paused = False
            self._conn.resume()
        return data

    async def read(self, within: float | None = None) -> bytes:
        """The whole body; ``UpstreamTimeout("body_timeout")`` (connection closed) after ``within`` seconds.

        (A timer handle rather than ``asyncio.timeout``: this is every plain request's path.)
        """
        timer = None
        if within is not None and not self._done:
            timer = self._conn.loop.call_later(within, self._time_out)
        try:
            while not self._done:
                if self._error is not None:
                    raise self._error
                if self._paused:  # the caller wants it all: keep reading
                    self._paused = False
                    self._conn.resume()
                await self._wait()
        finally:
            if timer is not None:
                timer.cancel()
        return self.received()

    def received(self) -> bytes:
        """The body bytes buffered so far, taken (once ``complete``, the whole body: no wait needed)."""
        data = b"".join(self._pieces)
        self._pieces.clear()
        self._buffered = 0
        return data

    def _time_out(self) -> None:
        self._fail(UpstreamTimeout("body_timeout", "the engine's answer did not complete in time"))
        self._conn.close()

    def release(self) -> None:
        """Done with this answer: the connection goes back to the pool if it can be reused, else closes."""
        self._conn.release(self)

    def close(self) -> None:
        """Close the connection (the engine sees the request end)."""
        self._conn.close()


Answered = Callable[[UpstreamResponse, "UpstreamError | None"], None]


class _Connection(asyncio.Protocol):
    """One keep-alive connection to an engine; parses one answer at a time."""

    def __init__(
        self, pool: UpstreamPool, origin: Origin, key: _PoolKey, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.pool = pool
        self.loop = loop
        self.origin = origin
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.headers_ready: asyncio.Future[None] | None = None
        # `UpstreamPool.send_now`'s callback: called once, soon after the headers or a failure before them.
        self.on_answer: Answered | None = None
        self.got_bytes = False
        self.interim = False
        self.closed = False
        self.uses = 0
        self.idle_since = 0.0
        self._header_name = ""
        # When the answer's headers are due (0: none awaited), and the timer that checks it. Requests on a
        # kept-alive connection move the deadline later, which costs no new timer (see expect_headers_by).
        self.headers_due = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    # -- asyncio.Protocol --------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport; they have its methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        if self.response is None:  # bytes nobody asked for: the connection is not usable
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._broken("the engine switched protocols")
        except httptools.HttpParserError as exc:
            self._broken(f"malformed HTTP from the engine: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._stop_timer()
        self.pool._forget(self)
        error = UpstreamBroken(f"connection to the engine lost{f': {exc}' if exc else ''}")
        self._no_headers(error)
        response = self.response
        if response is None or response.complete:
            return
        if (
            exc is None
            and response.status
            and response.content_length is None
            and response.header("transfer-encoding") is None
        ):
            response._finish()  # an answer without a length or chunks ends with the connection
        else:
            response._fail(error)

    # -- httptools callbacks -----------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.response is not None
        self.response.headers.append((name.decode("latin-1"), value.decode("utf-8", "surrogateescape")))

    def on_headers_complete(self) -> None:
        response = self.response
        assert response is not None
        status = self.parser.get_status_code()
        if status < 200:  # "100 Continue" and other interim answers: the real one follows
            self.interim = True
            response.headers.clear()
            return
        response.status = status
        response.keep_alive = self.parser.should_keep_alive()
        length = content_type = None
        for key, value in response.headers:  # the first of each, in one pass
            lk = key.lower()
            if lk == "content-length":
                if length is None:
                    length = value
            elif lk == "content-type" and content_type is None:
                content_type = response.content_type = value
        if length is not None and length.isdigit():
            response.content_length = int(length)
        if self.headers_ready is not None and not self.headers_ready.done():
            self.headers_ready.set_result(None)
        answered = self.on_answer
        if answered is not None:
            # Called soon, not now: the body that came with the headers is parsed first, and the caller's
            # writes go out after the loop has read every socket that was ready.
            self.on_answer = None
            self.headers_due = 0.0
            self.loop.call_soon(answered, response, None)

    def on_body(self, body: bytes) -> None:
        assert self.response is not None
        self.response._feed(body)

    def on_message_complete(self) -> None:
        assert self.response is not None
        if self.interim:
            self.interim = False
            return
        self.response._finish()

    # -- used by the pool and the response ----------------------------------------------------------
    def _no_headers(self, error: UpstreamError) -> None:
        """The request failed before its answer's headers: tell whoever waits for them."""
        if self.headers_ready is not None and not self.headers_ready.done():
            self.headers_ready.set_exception(error)
        answered = self.on_answer
        if answered is not None and self.response is not None:
            self.on_answer = None
            self.headers_due = 0.0
            self.loop.call_soon(answered, self.response, error)

    def _broken(self, why: str) -> None:
        error = UpstreamBroken(why)
        self._no_headers(error)
        if self.response is not None:
            self.response._fail(error)
        self.close()

    def expect_headers_by(self, deadline: float, loop: asyncio.AbstractEventLoop) -> None:
        """Time the answer out (``headers_timed_out``) unless its headers arrive by ``deadline`` (loop time).

        The timer is kept while deadlines move later; when it fires before the deadline it moves itself."""
        self.headers_due = deadline
        if self._timer is not None and self._timer_at <= deadline:
            return
        self._stop_timer()
        self._timer_at = deadline
        self._timer = loop.call_at(deadline, self._check_deadline, loop)

    def _check_deadline(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        due = self.headers_due
        if not due or self.closed:
            return
        if loop.time() < due - _TIMER_SLACK_S:
            self.expect_headers_by(due, loop)
            return
        self.headers_due = 0.0
        self.headers_timed_out()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def headers_timed_out(self) -> None:
        self._no_headers(UpstreamTimeout("first_byte_timeout", "no answer from the engine in time"))
        self.close()

    def pause(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def close(self) -> None:
        self._stop_timer()
        if not self.closed:
            self.closed = True
            self.pool._forget(self)
            if self.transport is not None:
                self.transport.close()

    def release(self, response: UpstreamResponse) -> None:
        if response is not self.response:
            return
        if self.closed or not response.complete or not response.keep_alive or response._paused:
            self.close()
            return
        self.response = None
        self.headers_ready = None
        self.on_answer = None
        self.pool._idle(self)


async def _connecting_within(
    sending: Coroutine[Any, Any, UpstreamResponse], deadline: float
) -> UpstreamResponse:
    """``sending`` with connecting bounded by the first-byte ``deadline`` too (it comes before the
    connect timeout)."""
    try:
        async with asyncio.timeout_at(deadline):
            return await sending
    except UpstreamTimeout:
        raise
    except TimeoutError:
        raise UpstreamTimeout("first_byte_timeout", "no answer from the engine in time") from None


class UpstreamPool:
    def __init__(
        self,
        *,
        max_idle_per_origin: int = 256,
        idle_timeout: float = 30.0,
        max_connections: int = 0,
        ssl_context: ssl.SSLContext | None = None,
        clock: Any = time.monotonic,
    ) -> None:
        self.max_idle_per_origin = max_idle_per_origin
        self.idle_timeout = idle_timeout
        self.max_connections = max_connections
        self._ssl = ssl_context
        self._clock = clock
        self._origins: dict[str, tuple[Origin, _PoolKey]] = {}
        self._idle_conns: dict[_PoolKey, collections.deque[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._slots: asyncio.Semaphore | None = (
            asyncio.Semaphore(max_connections) if max_connections > 0 else None
        )
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the pool's connections live on, looked up once: every asyncio.get_running_loop()
        is a getpid system call, and this is on every request's path."""
        loop = self._loop
        if loop is None or loop.is_closed():
            loop = self._loop = asyncio.get_running_loop()
        return loop

    def origin(self, base_url: str) -> Origin:
        return self._origin(base_url)[0]

    def _origin(self, base_url: str) -> tuple[Origin, _PoolKey]:
        """The origin of ``base_url`` and the key of its idle connections (a tuple: its hash is computed
        in C, where the frozen dataclass's would run Python on every lookup)."""
        known = self._origins.get(base_url)
        if known is None:
            origin = Origin.parse(base_url)
            if len(self._origins) > 4096:  # engines come and go: keep the memo bounded
                self._origins.clear()
            key = (origin.scheme, origin.host, origin.port, origin.base_path, origin.host_header)
            known = self._origins[base_url] = (origin, key)
        return known

    @property
    def open_connections(self) -> int:
        return len(self._open)

    @property
    def idle_connections(self) -> int:
        return sum(len(q) for q in self._idle_conns.values())

    def request(
        self,
        base_url: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes,
        *,
        connect_timeout: float,
        first_byte_timeout: float | None = None,
        method: str = "POST",
    ) -> Coroutine[Any, Any, UpstreamResponse]:
        """Send one request (await it); done when the answer's headers arrived.

        ``first_byte_timeout`` bounds connecting and waiting for the headers together
        (``UpstreamTimeout("first_byte_timeout")``, the connection is closed); ``connect_timeout`` bounds
        connecting alone (``ConnectFailed``). (A plain function handing back the coroutine that does the
        work: every proxied request comes this way, and a coroutine around it would be one more per request.)
        """
        if first_byte_timeout is None:
            return self._request(base_url, path, headers, body, connect_timeout, None, method)
        deadline = self._running_loop().time() + first_byte_timeout
        sending = self._request(base_url, path, headers, body, connect_timeout, deadline, method)
        if first_byte_timeout < connect_timeout:
            return _connecting_within(sending, deadline)
        return sending

    async def _request(
        self,
        base_url: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes,
        connect_timeout: float,
        deadline: float | None,
        method: str,
    ) -> UpstreamResponse:
        try:
            origin, key = self._origin(base_url)
            head = _request_head(method, origin, path, headers, len(body))
        except ValueError as exc:
            raise CannotSend(str(exc)) from None
        for fresh_only in (False, True):
            conn = None if fresh_only else self._take_idle(key)
            reused = conn is not None
            if conn is None:
                conn = await self._connect(origin, key, connect_timeout)
            response = UpstreamResponse(conn, base_url)
            loop = conn.loop
            conn.response = response
            conn.headers_ready = loop.create_future()
            conn.got_bytes = False
            conn.uses += 1
            assert conn.transport is not None
            if conn.closed:
                if reused:
                    continue
                raise UpstreamBroken("connection to the engine closed before the request was sent")
            conn.transport.writelines((head, body) if body else (head,))
            if deadline is not None:
                conn.expect_headers_by(deadline, loop)
            try:
                await conn.headers_ready
            except UpstreamBroken:
                if not reused or conn.got_bytes:
                    raise
                # An idle keep-alive connection the engine had closed: the next turn tries a new one
                # (falling through, not ``continue``: mypyc compiles no continue inside try/finally).
            except BaseException:
                conn.close()
                raise
            else:
                return response
            finally:
                conn.headers_due = 0.0
        raise UpstreamBroken("connection to the engine lost")  # pragma: no cover - the loop returns or raises

    def send_now(
        self,
        base_url: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes,
        *,
        first_byte_timeout: float,
        on_answer: Answered,
        method: str = "POST",
    ) -> UpstreamResponse | None:
        """Send one request on an idle pooled connection, without waiting; None (nothing sent) when the
        engine has no idle connection or its URL is unusable: ``request`` connects.

        ``on_answer(response, error)`` is called once, from the event loop: soon after the answer's headers
        (error None; a body that came with them is in ``response`` by then) or after a failure before them
        (an ``UpstreamError``: ``UpstreamTimeout("first_byte_timeout")`` after ``first_byte_timeout`` s,
        ``UpstreamBroken``; the connection is closed; ``response.unanswered`` says whether the engine
        sent nothing at all, as when it had closed the idle connection)."""
        try:
            origin, key = self._origin(base_url)
            head = _request_head(method, origin, path, headers, len(body))
        except ValueError:
            return None
        conn = self._take_idle(key)
        if conn is None:
            return None
        response = UpstreamResponse(conn, base_url)
        conn.response = response
        conn.got_bytes = False
        conn.uses += 1
        conn.on_answer = on_answer
        assert conn.transport is not None  # (pooled connections are connected)
        conn.transport.writelines((head, body) if body else (head,))
        loop = conn.loop
        conn.expect_headers_by(loop.time() + first_byte_timeout, loop)
        return response

    async def get(
        self,
        base_url: str,
        path: str,
        *,
        within: float,
        max_bytes: int,
        headers: Sequence[tuple[str, str]] = (),
        connect_timeout: float | None = None,
    ) -> Reply:
        """GET ``path`` of an engine, the whole answer within ``within`` s (see ``side_call``)."""
        return await self.side_call(
            "GET",
            base_url,
            path,
            b"",
            headers,
            within=within,
            max_bytes=max_bytes,
            connect_timeout=connect_timeout,
        )

    async def post_json(
        self,
        base_url: str,
        path: str,
        body: bytes,
        *,
        within: float,
        max_bytes: int,
        headers: Sequence[tuple[str, str]] = (),
        connect_timeout: float | None = None,
    ) -> Reply:
        """POST an encoded JSON ``body`` to ``path`` of an engine (see ``side_call``)."""
        return await self.side_call(
            "POST",
            base_url,
            path,
            body,
            [("Content-Type", "application/json"), *headers],
            within=within,
            max_bytes=max_bytes,
            connect_timeout=connect_timeout,
        )

    async def side_call(
        self,
        method: str,
        base_url: str,
        path: str,
        body: bytes,
        headers: Sequence[tuple[str, str]],
        *,
        within: float,
        max_bytes: int,
        connect_timeout: float | None = None,
    ) -> Reply:
        """One request and its whole answer, any status.

        ``within`` (seconds) bounds everything, connecting to the last byte (``UpstreamTimeout("timeout")``);
        ``connect_timeout`` (default ``within``) connecting alone (``ConnectTimedOut``). An answer announcing
        or sending more than ``max_bytes`` is ``BodyTooLarge``. A failed call closes its connection.
        """
        try:
            async with asyncio.timeout(within):
                resp = await self.request(
                    base_url,
                    path,
                    list(headers),
                    body,
                    connect_timeout=within if connect_timeout is None else connect_timeout,
                    method=method,
                )
                try:
                    data = await _read_capped(resp, max_bytes)
                except BaseException:
                    resp.close()
                    raise
        except UpstreamError:
            raise
        except TimeoutError:
            raise UpstreamTimeout("timeout", f"no complete answer within {within:g} s") from None
        resp.release()
        return Reply(resp.status, resp.headers, data)

    def _take_idle(self, key: _PoolKey) -> _Connection | None:
        queue = self._idle_conns.get(key)
        if not queue:
            return None
        oldest_ok = self._clock() - self.idle_timeout
        while queue:
            conn = queue.pop()  # the most recently used: warm, least likely timed out by the engine
            if conn.closed:
                continue
            if conn.idle_since < oldest_ok:
                conn.close()
                continue
            return conn
        return None

    async def _connect(self, origin: Origin, key: _PoolKey, connect_timeout: float) -> _Connection:
        if self._closed:
            raise ConnectFailed("the router is shutting down")
        if self._slots is not None:
            if self._slots.locked():
                self._close_oldest_idle()
            try:
                async with asyncio.timeout(connect_timeout):
                    await self._slots.acquire()
            except TimeoutError:
                raise ConnectTimedOut(f"no free connection slot in {connect_timeout:g} s") from None
        loop = self._running_loop()
        conn = _Connection(self, origin, key, loop)
        ssl_ctx: ssl.SSLContext | None = None
        if origin.scheme == "https":
            ssl_ctx = self._ssl or ssl.create_default_context()
        try:
            async with asyncio.timeout(connect_timeout):
                await loop.create_connection(
                    lambda: conn,
                    origin.host,
                    origin.port,
                    ssl=ssl_ctx,
                    server_hostname=origin.host if ssl_ctx else None,
                )
        except TimeoutError:
            self._release_slot()
            where = f"{origin.host}:{origin.port}"
            raise ConnectTimedOut(f"connect to {where} timed out after {connect_timeout:g} s") from None
        except OSError as exc:
            self._release_slot()
            raise ConnectFailed(f"cannot connect to {origin.host}:{origin.port}: {exc}") from None
        except BaseException:
            self._release_slot()
            conn.close()
            raise
        self._open.add(conn)
        return conn

    def _close_oldest_idle(self) -> None:
        """Free a connection slot held by an idle connection (whichever engine's waited longest)."""
        oldest: collections.deque[_Connection] | None = None
        for queue in self._idle_conns.values():
            if queue and (oldest is None or queue[0].idle_since < oldest[0].idle_since):
                oldest = queue
        if oldest is not None:
            oldest.popleft().close()

    def _release_slot(self) -> None:
        if self._slots is not None:
            self._slots.release()

    def _idle(self, conn: _Connection) -> None:
        queue = self._idle_conns.get(conn.key)
        if queue is None:
            queue = self._idle_conns[conn.key] = collections.deque()
        conn.idle_since = self._clock()
        queue.append(conn)
        while len(queue) > self.max_idle_per_origin:
            queue.popleft().close()
        # Engines that went away leave their idle connections behind; sweep the stale ones from the front.
        oldest_ok = conn.idle_since - self.idle_timeout
        while queue and (queue[0].closed or queue[0].idle_since < oldest_ok):
            queue.popleft().close()

    def _forget(self, conn: _Connection) -> None:
        if conn in self._open:
            self._open.discard(conn)
            self._release_slot()

    async def close(self) -> None:
        self._closed = True
        for conn in list(self._open):
            conn.close()
        self._idle_conns.clear()


async def _read_capped(resp: UpstreamResponse, max_bytes: int) -> bytes:
    if (resp.content_length or 0) > max_bytes:
        raise BodyTooLarge(resp.status, f"answer of {resp.content_length} bytes (at most {max_bytes} taken)")
    body = bytearray()
    while chunk := await resp.readany():
        body += chunk
        if len(body) > max_bytes:
            raise BodyTooLarge(resp.status, f"answer over {max_bytes} bytes")
    return bytes(body)


def _request_head(
    method: str, origin: Origin, path: str, headers: list[tuple[str, str]], length: int
) -> bytes:
    head = f"{method} {origin.base_path}{path} HTTP/1.1\r\nHost: {origin.host_header}\r\n"
    for name, value in headers:  # (a loop: a comprehension would cost a function object per call)
        head += f"{name}: {value}\r\n"
    return f"{head}Content-Length: {length}\r\n\r\n".encode("utf-8", "surrogateescape")
