"""The server's ``direct`` path (kvstack.http.server): requests answered from callbacks with no coroutine,
mixed with declined ones (the handler's) and ones handed to ``serve_rest``, on one connection: answers in
order, pipelining, a direct path that fails, a client that leaves, one that never reads, HTTP/1.0."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvstack.http.server import Connection, HttpServer, Request, Response
from support.waiting import eventually

pytestmark = pytest.mark.asyncio


class Directed:
    """A server whose direct path answers /direct/* from a timer callback, hands /rest/* to ``serve_rest``,
    fails on /bug and declines everything else (the handler answers it)."""

    def __init__(self) -> None:
        self.server = HttpServer(self.handler, max_body=1 << 20, direct=self.direct)
        self.port = 0
        self.taken: list[str] = []
        self.lost: list[str] = []
        self.pending: list[asyncio.TimerHandle] = []

    async def handler(self, request: Request, conn: Connection) -> Response:
        return Response(200, b"handler " + request.path.encode())

    def direct(self, request: Request, conn: Connection) -> bool:
        path = request.path
        if path == "/bug":
            raise RuntimeError("direct path bug")
        if path.startswith("/rest/"):
            self.taken.append(path)
            conn.serve_rest(self._rest(request))
            return True
        if not path.startswith("/direct/"):
            return False
        self.taken.append(path)
        delay = float(request.query.get("after", "0.01"))

        def answer() -> None:
            conn.on_lost = None
            conn.send(200, [("X-Path", path)], b"direct " + request.body)
            conn.finish()

        handle = asyncio.get_running_loop().call_later(delay, answer)
        self.pending.append(handle)

        def lost() -> None:
            handle.cancel()
            self.lost.append(path)
            conn.finish()

        conn.on_lost = lost
        return True

    async def _rest(self, request: Request) -> Response:
        await asyncio.sleep(0.01)
        return Response(200, b"rest " + request.path.encode())

    async def open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)


@pytest.fixture
async def directed() -> AsyncIterator[Directed]:
    served = Directed()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    sock.setblocking(False)
    await served.server.start(sock)
    served.port = sock.getsockname()[1]
    yield served
    await served.server.close()


async def _response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", "0"))), 10)
    return int(lines[0].split()[1]), headers, body


def _post(path: str, body: bytes = b"", version: str = "1.1") -> bytes:
    return f"POST {path} HTTP/{version}\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


async def test_direct_declined_and_rest_requests_are_answered_in_order(directed: Directed) -> None:
    reader, writer = await directed.open()
    # The first direct answer is held longest: the ones behind it wait for it. Requests pipelined behind
    # one the handler answers are the handler's too (its task serves them).
    writer.write(
        _post("/direct/1?after=0.2", b"a")
        + _post("/rest/2")
        + _post("/direct/3", b"c")
        + _post("/other", b"")
        + _post("/direct/4?after=0", b"d")
    )
    expected = [b"direct a", b"rest /rest/2", b"direct c", b"handler /other", b"handler /direct/4"]
    for body in expected:
        status, headers, got = await _response(reader)
        assert status == 200 and got == body and headers.get("connection") != "close"
    # Idle, then more, one at a time: the connection keeps serving both ways.
    for path, body in (("/direct/5", b"direct e"), ("/x", b"handler /x"), ("/direct/6", b"direct f")):
        writer.write(_post(path, body[-1:] if path.startswith("/direct") else b""))
        assert (await _response(reader))[2] == body
    assert directed.taken == ["/direct/1", "/rest/2", "/direct/3", "/direct/5", "/direct/6"]
    writer.close()


async def test_a_failing_direct_path_answers_500_and_closes(
    directed: Directed, caplog: pytest.LogCaptureFixture
) -> None:
    reader, writer = await directed.open()
    writer.write(_post("/bug") + _post("/direct/never"))
    status, headers, body = await _response(reader)
    assert status == 500 and headers["connection"] == "close"
    assert json.loads(body)["error"]["type"] == "InternalServerError"
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed: the pipelined one is not served
    assert "direct path bug" in caplog.text and directed.taken == []
    # The server goes on serving other connections.
    reader, writer = await directed.open()
    writer.write(_post("/direct/ok", b"k"))
    assert (await _response(reader))[2] == b"direct k"
    writer.close()


async def test_a_client_that_leaves_a_direct_request_is_told_once(directed: Directed) -> None:
    _, writer = await directed.open()
    writer.write(_post("/direct/slow?after=30"))
    await eventually(lambda: directed.taken == ["/direct/slow"])
    writer.close()
    await eventually(lambda: directed.lost == ["/direct/slow"])
    await eventually(lambda: directed.server.connections == 0)
    assert all(h.cancelled() for h in directed.pending)


async def test_http10_and_connection_close_end_after_a_direct_answer(directed: Directed) -> None:
    for request in (
        _post("/direct/10", b"x", version="1.0"),
        b"POST /direct/close HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 1\r\n\r\ny",
    ):
        reader, writer = await directed.open()
        writer.write(request)
        status, _, body = await _response(reader)
        assert status == 200 and body in (b"direct x", b"direct y")
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()


async def test_pipelined_direct_requests_that_are_never_read_cannot_grow_the_buffers(
    directed: Directed,
) -> None:
    reader, writer = await directed.open()
    piece = b"z" * 4000
    count = 3000  # 12 MB of answers if nothing held the server back
    writer.write(b"".join(_post(f"/direct/{i}?after=0", piece) for i in range(count)))
    (conn,) = directed.server._connections
    transport: Any = conn._transport
    buffered = 0
    for _ in range(20):  # 1 s, reading nothing
        await asyncio.sleep(0.05)
        buffered = max(buffered, transport.get_write_buffer_size())
    assert buffered < 256 * 1024, buffered
    for _ in range(count):  # everything arrives, in order, once the client reads
        status, _, body = await _response(reader)
        assert status == 200 and body == b"direct " + piece
    assert len(directed.taken) == count
    assert directed.taken == [f"/direct/{i}" for i in range(count)]
    writer.close()
