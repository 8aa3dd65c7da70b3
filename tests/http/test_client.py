"""The proxy's HTTP/1.1 client (kvstack.http.client) against raw asyncio servers that misbehave on cue."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest

from kvstack.http.client import (
    BodyTooLarge,
    CannotSend,
    ConnectFailed,
    ConnectTimedOut,
    Origin,
    UpstreamBroken,
    UpstreamPool,
    UpstreamTimeout,
)

Handler = Callable[["_Conn", bytes], None]
ServerFactory = Callable[[Handler], "RawServer"]


@dataclass
class RawServer:
    """A TCP server on 127.0.0.1 whose connections answer each request through ``handler``."""

    handler: Handler
    server: asyncio.Server | None = None
    connections: list[_Conn] = field(default_factory=list)
    requests: list[bytes] = field(default_factory=list)

    @property
    def url(self) -> str:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"


class _Conn(asyncio.Protocol):
    def __init__(self, owner: RawServer) -> None:
        self.owner = owner
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.paused_writing = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.owner.connections.append(self)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while b"\r\n\r\n" in self.buffer:
            head, _, rest = self.buffer.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(rest) < length:
                return
            self.buffer = rest[length:]
            request = head + b"\r\n\r\n" + rest[:length]
            self.owner.requests.append(request)
            self.owner.handler(self, request)

    def pause_writing(self) -> None:
        self.paused_writing = True

    def resume_writing(self) -> None:
        self.paused_writing = False

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def close(self) -> None:
        assert self.transport is not None
        self.transport.close()


CHUNKED = b"Transfer-Encoding: chunked\r\n\r\n"


def sized(body: bytes, status: str = "200 OK", extra: str = "") -> bytes:
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n{extra}Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


@pytest.fixture
async def raw_server() -> AsyncIterator[Callable[[Handler], RawServer]]:
    servers: list[RawServer] = []

    def make(handler: Handler) -> RawServer:
        server = RawServer(handler)
        servers.append(server)
        return server

    yield make
    for server in servers:
        if server.server is not None:
            server.server.close()
            for conn in server.connections:
                if conn.transport is not None:
                    conn.transport.close()


async def serve(server: RawServer) -> RawServer:
    loop = asyncio.get_running_loop()
    server.server = await loop.create_server(lambda: _Conn(server), "127.0.0.1", 0)
    return server


async def test_a_sized_answer_is_read_whole_and_the_connection_is_reused(raw_server: ServerFactory) -> None:
    server = await serve(raw_server(lambda conn, req: conn.send(sized(b'{"ok":true}'))))
    pool = UpstreamPool()
    try:
        for _ in range(3):
            resp = await pool.request(
                server.url, "/v1/completions", [("X-Test", "1")], b'{"a":1}', connect_timeout=2
            )
            assert resp.status == 200
            assert resp.content_length == 11
            assert resp.header("content-type") == "application/json"
            assert await resp.read() == b'{"ok":true}'
            resp.release()
        assert len(server.connections) == 1  # kept alive and reused
        assert pool.idle_connections == 1
        first = server.requests[0]
        assert first.startswith(b"POST /v1/completions HTTP/1.1\r\n")
        assert b"\r\nX-Test: 1\r\n" in first and b"\r\nContent-Length: 7\r\n" in first
        assert first.endswith(b'\r\n\r\n{"a":1}')
        assert f"Host: {server.url[len('http://') :]}".encode() in first
    finally:
        await pool.close()


async def test_a_complete_answer_is_taken_without_waiting(raw_server: ServerFactory) -> None:
    server = await serve(raw_server(lambda conn, req: conn.send(sized(b'{"ok":true}'))))
    pool = UpstreamPool()
    try:
        resp = await pool.request(server.url, "/", [], b"", connect_timeout=2)
        for _ in range(100):  # (one small write: it arrives with the headers, or just after)
            if resp.complete:
                break
            await asyncio.sleep(0.01)
        assert resp.complete
        assert resp.received() == b'{"ok":true}'
        assert resp.received() == b""  # taken
        resp.release()
        assert pool.idle_connections == 1
    finally:
        await pool.close()


async def test_requests_on_a_pooled_connection_look_the_event_loop_up_once(
    raw_server: ServerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(Each asyncio.get_running_loop() is a getpid system call: the pool keeps the loop it runs on.)"""
    server = await serve(raw_server(lambda conn, req: conn.send(sized(b'{"ok":true}'))))
    pool = UpstreamPool()
    lookups = 0
    real = asyncio.get_running_loop

    def counted() -> asyncio.AbstractEventLoop:
        nonlocal lookups
        lookups += 1
        return real()

    monkeypatch.setattr(asyncio, "get_running_loop", counted)
    try:
        for _ in range(10):
            resp = await pool.request(server.url, "/", [], b"", connect_timeout=2, first_byte_timeout=5)
            assert resp.content_type == "application/json"
            assert await resp.read(within=5) == b'{"ok":true}'
            resp.release()
        assert lookups <= 1
    finally:
        await pool.close()


@pytest.mark.parametrize("first_byte_timeout", [None, 0.5, 5.0])  # the three ways through request()
async def test_the_method_is_sent_as_given(
    raw_server: ServerFactory, first_byte_timeout: float | None
) -> None:
    server = await serve(raw_server(lambda conn, req: conn.send(sized(b"ok"))))
    pool = UpstreamPool()
    try:
        for method in ("GET", "POST"):
            resp = await pool.request(
                server.url, "/metrics", [], b"", connect_timeout=2, first_byte_timeout=first_byte_timeout,
                method=method,
            )  # fmt: skip
            assert await resp.read() == b"ok"
            resp.release()
        assert [r.split(b" ", 1)[0] for r in server.requests] == [b"GET", b"POST"]
    finally:
        await pool.close()


async def test_a_chunked_stream_arrives_in_pieces(raw_server: ServerFactory) -> None:
    conns: list[_Conn] = []

    def start_stream(conn: _Conn, req: bytes) -> None:
        conns.append(conn)
        conn.send(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n" + CHUNKED)

    server = await serve(raw_server(start_stream))
    pool = UpstreamPool()
    try:
        resp = await pool.request(server.url, "/v1/completions", [], b"{}", connect_timeout=2)
        assert resp.content_length is None
        for i in range(3):
            event = f"data: {i}\n\n".encode()
            conns[0].send(f"{len(event):x}\r\n".encode() + event + b"\r\n")
            assert await resp.readany() == event
        conns[0].send(b"0\r\n\r\n")
        assert await resp.readany() == b""
        assert resp.complete
        resp.release()
        assert pool.idle_connections == 1
    finally:
        await pool.close()


async def test_an_answer_ended_by_closing_the_connection_is_complete(raw_server: ServerFactory) -> None:
    def answer(conn: _Conn, req: bytes) -> None:
        conn.send(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
        conn.close()

    server = await serve(raw_server(answer))
    pool = UpstreamPool()
    try:
        resp = await pool.request(server.url, "/x", [], b"", connect_timeout=2)
        assert await resp.read() == b"all of it"
        resp.release()
        assert pool.idle_connections == 0 and pool.open_connections == 0
    finally:
        await pool.close()


async def test_a_pooled_connection_the_engine_closed_is_replaced_once(raw_server: ServerFactory) -> None:
    server = await serve(raw_server(lambda conn, req: conn.send(sized(b"ok"))))
    pool = UpstreamPool()
    try:
        resp = await pool.request(server.url, "/x", [], b"", connect_timeout=2)
        await resp.read()
        resp.release()
        # The engine drops the idle connection; the pool does not know yet when the next request is sent.
        conn = server.connections[0]
        assert conn.transport is not None
        conn.transport.abort()
        await asyncio.sleep(0)  # the FIN may or may not have been seen: both paths must work
        resp = await pool.request(server.url, "/x", [], b"", connect_timeout=2)
        assert await resp.read() == b"ok"
        resp.release()
        assert len(server.connections) == 2
    finally:
        await pool.close()


async def test_a_broken_answer_is_an_error_not_a_hang(raw_server: ServerFactory) -> None:
    def half(conn: _Conn, req: bytes) -> None:
        conn.send(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly some")
        conn.close()

    server = await serve(raw_server(half))
    pool = UpstreamPool()
    try:
        resp = await pool.request(server.url, "/x", [], b"", connect_timeout=2)
        with pytest.raises(UpstreamBroken):
            await asyncio.wait_for(resp.read(), 5)
        resp.release()
        assert pool.open_connections == 0
    finally:
        await pool.close()


async def test_garbage_instead_of_http_is_upstream_broken(raw_server: ServerFactory) -> None:
    server = await serve(raw_server(lambda conn, req: conn.send(b"SSH-2.0-OpenSSH\r\n\r\n")))
    pool = UpstreamPool()
    try:
        with pytest.raises(UpstreamBroken):
            await asyncio.wait_for(pool.request(server.url, "/x", [], b"", connect_timeout=2), 5)
        assert pool.open_connections == 0
    finally:
        await pool.close()


async def test_nothing_listening_is_connect_failed() -> None:
    loop = asyncio.get_running_loop()
    probe = await loop.create_server(asyncio.Protocol, "127.0.0.1", 0)
    port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    pool = UpstreamPool()
    try:
        with pytest.raises(ConnectFailed) as info:
            await pool.request(f"http://127.0.0.1:{port}", "/x", [], b"", connect_timeout=2)
        assert info.value.reason == "connect_error"
    finally:
        await pool.close()


async def test_a_slow_reader_pauses_the_engine_instead_of_buffering(raw_server: ServerFactory) -> None:
    conns: list[_Conn] = []

    def start_big_body(conn: _Conn, req: bytes) -> None:
        conns.append(conn)
        conn.send(b"HTTP/1.1 200 OK\r\nContent-Length: 67108864\r\n\r\n")

    server = await serve(raw_server(start_big_body))
    pool = UpstreamPool()
    try:
        resp = await pool.request(server.url, "/x", [], b"", connect_timeout=2)
        block = b"x" * (1 << 20)
        for _ in range(64):  # 64 MiB offered; the pool must stop reading near its high-water mark
            conns[0].send(block)
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.2)
        assert resp._buffered < 8 << 20
        # What the router did not read waits in the engine's send buffer: back-pressure reached it.
        assert conns[0].transport is not None
        assert conns[0].transport.get_write_buffer_size() > 32 << 20
        received = 0
        while piece := await asyncio.wait_for(resp.readany(), 5):  # reading resumes
            received += len(piece)
        assert received == 64 << 20
        resp.close()
    finally:
        await pool.close()


async def test_idle_connections_are_bounded_per_engine(raw_server: ServerFactory) -> None:
    server = await serve(raw_server(lambda conn, req: conn.send(sized(b"ok"))))
    pool = UpstreamPool(max_idle_per_origin=2)
    try:
        responses = await asyncio.gather(
            *(pool.request(server.url, "/x", [], b"", connect_timeout=2) for _ in range(5))
        )
        for resp in responses:
            await resp.read()
            resp.release()
        assert pool.idle_connections == 2
        await asyncio.sleep(0.05)
        assert pool.open_connections == 2
    finally:
        await pool.close()


async def test_max_connections_reuses_an_idle_slot_for_another_engine(raw_server: ServerFactory) -> None:
    a = await serve(raw_server(lambda conn, req: conn.send(sized(b"a"))))
    b = await serve(raw_server(lambda conn, req: conn.send(sized(b"b"))))
    pool = UpstreamPool(max_connections=1)
    try:
        for server, expected in ((a, b"a"), (b, b"b"), (a, b"a")):
            resp = await pool.request(server.url, "/x", [], b"", connect_timeout=2)
            assert await resp.read() == expected
            resp.release()
        assert pool.open_connections == 1
    finally:
        await pool.close()


def test_origins_keep_a_base_path_and_the_host_header() -> None:
    origin = Origin.parse("https://user@engine.example:8443/prefix/")
    assert (origin.scheme, origin.host, origin.port, origin.base_path) == (
        "https",
        "engine.example",
        8443,
        "/prefix",
    )
    assert origin.host_header == "engine.example:8443"
    assert Origin.parse("http://10.0.0.1").port == 80
    with pytest.raises(ValueError):
        Origin.parse("ftp://x")


async def test_no_answer_in_time_is_a_first_byte_timeout_and_closes(raw_server: ServerFactory) -> None:
    server = await serve(raw_server(lambda conn, req: None))  # reads the request, never answers
    pool = UpstreamPool()
    try:
        with pytest.raises(UpstreamTimeout) as info:
            await pool.request(server.url, "/x", [], b"", connect_timeout=2, first_byte_timeout=0.2)
        assert info.value.reason == "first_byte_timeout"
        assert isinstance(info.value, TimeoutError)
        assert pool.open_connections == 0 and pool.idle_connections == 0
    finally:
        await pool.close()


async def test_first_byte_timeouts_hold_on_a_reused_connection(raw_server: ServerFactory) -> None:
    """Each request on a kept-alive connection gets its own first-byte deadline, later or earlier than the
    one before: an answer in time is never cut off, a late one always is. (Connect timeouts below the
    first-byte ones: the pool's own deadline bounds the wait, not an ``asyncio.timeout`` around it.)"""
    loop = asyncio.get_running_loop()

    def answer(conn: _Conn, request: bytes) -> None:
        delay = float(request.split(b"\r\n", 1)[0].split(b"/d/")[1].split(b" ")[0])
        if delay >= 0:
            loop.call_later(delay, conn.send, sized(b"{}"))

    server = await serve(raw_server(answer))
    pool = UpstreamPool()
    try:
        resp = await pool.request(server.url, "/d/0", [], b"", connect_timeout=0.2, first_byte_timeout=0.3)
        await resp.read()
        resp.release()
        # Answered 0.4 s in: past the first request's deadline, within this one's.
        resp = await pool.request(server.url, "/d/0.4", [], b"", connect_timeout=0.2, first_byte_timeout=3.0)
        await resp.read()
        resp.release()
        assert len(server.connections) == 1
        started = loop.time()
        with pytest.raises(UpstreamTimeout) as info:  # never answered, and a shorter deadline than before
            await pool.request(server.url, "/d/-1", [], b"", connect_timeout=0.1, first_byte_timeout=0.2)
        assert info.value.reason == "first_byte_timeout"
        assert 0.15 <= loop.time() - started < 2.0  # its own deadline, not the previous request's 3 s
        assert len(server.connections) == 1 and pool.open_connections == 0
    finally:
        await pool.close()


async def test_a_body_that_stalls_is_a_body_timeout(raw_server: ServerFactory) -> None:
    server = await serve(
        raw_server(lambda conn, req: conn.send(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"))
    )
    pool = UpstreamPool()
    try:
        resp = await pool.request(server.url, "/x", [], b"", connect_timeout=2, first_byte_timeout=2)
        with pytest.raises(UpstreamTimeout) as info:
            await resp.read(within=0.2)
        assert info.value.reason == "body_timeout"
        resp.release()
        assert pool.open_connections == 0
    finally:
        await pool.close()


async def test_an_interim_100_continue_is_skipped(raw_server: ServerFactory) -> None:
    server = await serve(
        raw_server(lambda conn, req: conn.send(b"HTTP/1.1 100 Continue\r\n\r\n" + sized(b"final")))
    )
    pool = UpstreamPool()
    try:
        resp = await pool.request(server.url, "/x", [], b"", connect_timeout=2, first_byte_timeout=2)
        assert resp.status == 200
        assert await resp.read(within=2) == b"final"
        resp.release()
        assert pool.idle_connections == 1
    finally:
        await pool.close()


# -- side calls (get / post_json): the whole answer, bounded in time and size ------------------------------


async def test_a_side_call_returns_status_headers_and_body_and_reuses_its_connection(
    raw_server: ServerFactory,
) -> None:
    server = await serve(
        raw_server(lambda conn, req: conn.send(sized(b'{"tokens":[1,2]}', extra="X-A: b\r\n")))
    )
    pool = UpstreamPool()
    try:
        reply = await pool.get(
            server.url, "/v1/models", headers=[("Accept", "text/plain")], within=2, max_bytes=100
        )
        assert (reply.status, reply.body, reply.header("x-a")) == (200, b'{"tokens":[1,2]}', "b")
        reply = await pool.post_json(server.url, "/tokenize", b'{"prompt":"hi"}', within=2, max_bytes=100)
        assert reply.json() == {"tokens": [1, 2]}
        get, post = server.requests
        assert get.startswith(b"GET /v1/models HTTP/1.1\r\n") and b"\r\nAccept: text/plain\r\n" in get
        assert post.startswith(b"POST /tokenize HTTP/1.1\r\n")
        assert b"\r\nContent-Type: application/json\r\n" in post and post.endswith(b'\r\n\r\n{"prompt":"hi"}')
        assert len(server.connections) == 1 and pool.idle_connections == 1
    finally:
        await pool.close()


async def test_a_side_call_answered_with_an_error_status_is_a_reply(raw_server: ServerFactory) -> None:
    server = await serve(raw_server(lambda conn, req: conn.send(sized(b"no such route", "404 Not Found"))))
    pool = UpstreamPool()
    try:
        reply = await pool.get(server.url, "/kv_event_sources", within=2, max_bytes=100)
        assert (reply.status, reply.body) == (404, b"no such route")
        with pytest.raises(ValueError):
            reply.json()
        assert pool.idle_connections == 1  # read to the end: kept
    finally:
        await pool.close()


async def test_a_side_call_with_nothing_listening_is_connect_failed() -> None:
    loop = asyncio.get_running_loop()
    probe = await loop.create_server(asyncio.Protocol, "127.0.0.1", 0)
    port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    pool = UpstreamPool()
    try:
        with pytest.raises(ConnectFailed):
            await pool.get(f"http://127.0.0.1:{port}", "/metrics", within=2, max_bytes=100)
        with pytest.raises(CannotSend):
            await pool.get("http://127.0.0.1:99999", "/metrics", within=2, max_bytes=100)
    finally:
        await pool.close()


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc",  # the body stalls
        b"",  # the headers never come
    ],
)
async def test_a_side_call_not_complete_in_time_times_out_and_closes(
    raw_server: ServerFactory, answer: bytes
) -> None:
    server = await serve(raw_server(lambda conn, req: conn.send(answer)))
    pool = UpstreamPool()
    try:
        started = asyncio.get_running_loop().time()
        with pytest.raises(UpstreamTimeout) as info:
            await pool.get(server.url, "/metrics", within=0.3, max_bytes=100)
        assert 0.3 <= asyncio.get_running_loop().time() - started < 2.0
        assert info.value.reason == "timeout" and isinstance(info.value, TimeoutError)
        assert str(info.value) == "no complete answer within 0.3 s"
        assert pool.open_connections == 0 and pool.idle_connections == 0
    finally:
        await pool.close()


async def test_a_side_call_that_cannot_connect_in_time_is_connect_timed_out() -> None:
    listener = socket.socket()  # an accept queue that is full and never drained: SYNs are dropped
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = [socket.socket() for _ in range(3)]
    for filler in fillers:
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
    pool = UpstreamPool()
    try:
        with pytest.raises(ConnectTimedOut):
            await pool.get(
                f"http://127.0.0.1:{port}", "/metrics", within=2, connect_timeout=0.2, max_bytes=100
            )
    finally:
        await pool.close()
        for s in (*fillers, listener):
            s.close()


@pytest.mark.parametrize(
    "answer",
    [
        sized(b"x" * 101),  # announced
        b"HTTP/1.1 200 OK\r\n" + CHUNKED + (b"40\r\n" + b"x" * 64 + b"\r\n") * 2 + b"0\r\n\r\n",  # sent
        sized(b"x" * 101, "503 Service Unavailable"),
    ],
)
async def test_a_side_call_answer_over_max_bytes_is_refused_and_closes(
    raw_server: ServerFactory, answer: bytes
) -> None:
    server = await serve(raw_server(lambda conn, req: conn.send(answer)))
    pool = UpstreamPool()
    try:
        with pytest.raises(BodyTooLarge) as info:
            await pool.get(server.url, "/metrics", within=2, max_bytes=100)
        assert info.value.reason == "too_large"
        assert info.value.status == int(answer.split(b" ")[1])
        assert pool.open_connections == 0 and pool.idle_connections == 0
        reply = await pool.get(server.url, "/metrics", within=2, max_bytes=200)  # within the bound: fine
        assert reply.body.count(b"x") >= 101
    finally:
        await pool.close()
