"""The router's HTTP/1.1 server (kvstack.http.server) over real sockets: framing, limits, timeouts,
keep-alive (HTTP/1.0's too), pipelining, interim 100 responses, Upgrade offers, back-pressure, bad
requests behind good ones, the RFC 9112 request checks and client disconnects. Raw sockets, so every byte
is checked."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from kvstack.http.server import Connection, HttpServer, Request, Response
from support.waiting import eventually

pytestmark = pytest.mark.asyncio

Handler = Callable[[Request, Connection], Awaitable[Response | None]]


class Served:
    def __init__(self, server: HttpServer, port: int) -> None:
        self.server = server
        self.port = port
        self.url = f"http://127.0.0.1:{port}"

    async def open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)


async def _serve(handler: Handler, **kwargs: Any) -> Served:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    sock.setblocking(False)
    server = HttpServer(handler, **{"max_body": 1 << 20, **kwargs})
    await server.start(sock)
    return Served(server, sock.getsockname()[1])


@pytest.fixture
async def echo() -> AsyncIterator[Served]:
    async def handler(request: Request, conn: Connection) -> Response | None:
        body = json.dumps(
            {
                "method": request.method,
                "path": request.path,
                "query": request.query,
                "body": request.body.decode(),
                "x": request.headers.get("X-Test"),
            }
        ).encode()
        return Response(200, body, [("Content-Type", "application/json")])

    served = await _serve(handler)
    yield served
    await served.server.close()


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One response: status, headers (lower-case names), the body (by length or chunks)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        pieces = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                break
            pieces.append(data[:-2])
        body = b"".join(pieces)
    else:
        body = await asyncio.wait_for(reader.read(), 10)
    return status, headers, body


def _post(path: str, body: bytes, extra: str = "") -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


async def test_keep_alive_and_pipelining_answer_in_order(echo: Served) -> None:
    reader, writer = await echo.open()
    writer.write(_post("/a?k=v&k=w", b"one") + _post("/b", b"two", "X-Test: 2\r\n") + _post("/c", b""))
    for path, body, x in (("/a", "one", None), ("/b", "two", "2"), ("/c", "", None)):
        status, headers, raw = await _read_response(reader)
        got = json.loads(raw)
        assert status == 200 and got["path"] == path and got["body"] == body and got["x"] == x
        assert "date" in headers and headers.get("connection") != "close"
    assert json.loads(raw)["method"] == "POST"
    writer.write(b"GET /q?k=v&k=w HTTP/1.1\r\nHost: x\r\n\r\n")
    _, _, raw = await _read_response(reader)
    assert json.loads(raw)["query"] == {"k": "v"}
    writer.close()


async def test_one_task_serves_a_keep_alive_connection_and_ends_when_the_client_leaves() -> None:
    tasks: list[asyncio.Task[Any] | None] = []

    async def handler(request: Request, conn: Connection) -> Response:
        tasks.append(asyncio.current_task())
        return Response(200, b"ok")

    served = await _serve(handler)
    try:
        reader, writer = await served.open()
        for _ in range(3):  # one after another: the connection is idle between them
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await _read_response(reader))[0] == 200
        assert len(tasks) == 3 and tasks[0] is not None and tasks.count(tasks[0]) == 3
        assert not tasks[0].done()  # waiting for the next request
        writer.close()
        await eventually(lambda: tasks[0] is not None and tasks[0].cancelled())
        await eventually(lambda: served.server.connections == 0)
    finally:
        await served.server.close()


async def test_chunked_request_body_and_expect_continue(echo: Served) -> None:
    reader, writer = await echo.open()
    writer.write(
        b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    )
    _, _, raw = await _read_response(reader)
    assert json.loads(raw)["body"] == "abcde"
    writer.write(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert interim.startswith(b"HTTP/1.1 100 Continue")
    writer.write(b"hello")
    status, _, raw = await _read_response(reader)
    assert status == 200 and json.loads(raw)["body"] == "hello"
    writer.close()


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
        (b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-Big: " + b"v" * 70000 + b"\r\n\r\n", 431),
        (b"GET / HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(200)) + b"\r\n", 431),
        (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\n", 413),
        (
            b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"100000\r\n"
            + b"z" * 0x100000
            + b"\r\n10\r\n",
            413,
        ),
        (b"NOT HTTP AT ALL\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", 400),
    ],
    ids=[
        "url-414",
        "header-bytes-431",
        "header-count-431",
        "length-413",
        "chunked-413",
        "garbage",
        "two-lengths",
    ],
)
async def test_limits_and_malformed_requests_get_json_errors_and_close(
    echo: Served, request_bytes: bytes, status: int
) -> None:
    reader, writer = await echo.open()
    writer.write(request_bytes + b"z" * 0x1000)
    got, headers, raw = await _read_response(reader)
    assert got == status and headers["connection"] == "close"
    assert json.loads(raw)["error"]["code"] == status
    assert await asyncio.wait_for(reader.read(), 10) == b""  # closed after the error
    writer.close()


async def test_receive_and_keep_alive_timeouts() -> None:
    async def handler(request: Request, conn: Connection) -> Response:
        return Response(200, b"ok")

    served = await _serve(handler, receive_timeout=0.3, keep_alive_timeout=0.3)
    try:
        reader, writer = await served.open()
        writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")  # and never the rest
        status, _, raw = await _read_response(reader)
        assert status == 408 and json.loads(raw)["error"]["code"] == 408
        writer.close()
        reader, writer = await served.open()
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await _read_response(reader))[2] == b"ok"
        assert await asyncio.wait_for(reader.read(), 10) == b""  # the idle connection is closed
        assert served.server.connections == 0
        writer.close()
    finally:
        await served.server.close()


async def test_timeouts_stay_on_time_as_a_keep_alive_connection_moves_its_deadline() -> None:
    async def handler(request: Request, conn: Connection) -> Response:
        return Response(200, b"ok")

    loop = asyncio.get_running_loop()
    served = await _serve(handler, receive_timeout=0.3, keep_alive_timeout=3.0)
    try:
        reader, writer = await served.open()
        for _ in range(3):  # each answer moves the deadline to the longer keep-alive timeout
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await _read_response(reader))[2] == b"ok"
            await asyncio.sleep(0.1)
        sent = loop.time()
        writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")  # never the rest
        assert (await _read_response(reader))[0] == 408
        assert 0.25 <= loop.time() - sent < 2.5  # the shorter receive timeout, not the keep-alive one
        writer.close()
        reader, writer = await served.open()
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await _read_response(reader))[2] == b"ok"
        answered = loop.time()
        assert await asyncio.wait_for(reader.read(), 10) == b""  # idle: closed after keep_alive_timeout
        assert loop.time() - answered >= 2.95
        writer.close()
    finally:
        await served.server.close()


async def test_a_client_that_never_takes_its_answer_is_dropped_at_the_keep_alive_timeout() -> None:
    async def handler(request: Request, conn: Connection) -> Response:
        return Response(200, b"x" * (8 << 20))  # far more than the sockets' buffers hold

    served = await _serve(handler, keep_alive_timeout=0.3)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        sock.connect(("127.0.0.1", served.port))
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # and never reads
        await eventually(lambda: served.server.connections == 1, timeout_s=5)
        # A close would wait for the client to take the rest; the keep-alive timeout drops it instead.
        await eventually(lambda: served.server.connections == 0, timeout_s=10)
    finally:
        sock.close()
        await served.server.close()


async def test_streams_chunked_close_delimited_for_http10_and_head_has_no_body() -> None:
    async def handler(request: Request, conn: Connection) -> Response | None:
        conn.start(200, [("Content-Type", "text/event-stream")])
        for i in range(3):
            await conn.write(b"data: %d\n\n" % i)
        conn.end()
        return None

    served = await _serve(handler)
    try:
        reader, writer = await served.open()
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n")
        for _ in range(2):  # still keep-alive after a chunked stream
            status, headers, body = await _read_response(reader)
            assert headers["transfer-encoding"] == "chunked"
            assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        writer.write(b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200")
        writer.write(b"GET / HTTP/1.0\r\n\r\n")
        status, headers, body = await _read_response(reader)  # no chunk size lines in the way: HEAD sent none
        assert status == 200 and "transfer-encoding" not in headers and headers["connection"] == "close"
        assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        writer.close()
    finally:
        await served.server.close()


@pytest.mark.parametrize("leave", ["close", "half-close"])
async def test_client_disconnect_cancels_the_handler(leave: str) -> None:
    """A close, or a half-close (its FIN is all the server sees of a close too: taken as leaving)."""
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def handler(request: Request, conn: Connection) -> Response:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return Response(200, b"late")

    served = await _serve(handler)
    try:
        _, writer = await served.open()
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.wait_for(started.wait(), 10)
        if leave == "close":
            writer.close()
        else:
            writer.write_eof()
        await asyncio.wait_for(cancelled.wait(), 10)
    finally:
        await served.server.close()


async def test_writes_wait_for_a_slow_client_and_fail_once_it_left() -> None:
    piece = b"x" * 65536
    total = 1024  # 64 MiB if nothing held the handler back
    progress: list[int] = [0]
    outcome: list[BaseException] = []

    async def handler(request: Request, conn: Connection) -> Response | None:
        conn.start(200, [])
        try:
            for _ in range(total):
                await conn.write(piece)
                progress[0] += 1
        except BaseException as exc:
            outcome.append(exc)
            raise
        conn.end()
        return None

    served = await _serve(handler)
    try:
        reader, writer = await served.open()
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(1.0)  # the client reads nothing meanwhile
        assert 0 < progress[0] < total // 4, progress  # held back by the socket buffers, not buffered
        await reader.readexactly(4 * len(piece))
        writer.close()
        for _ in range(100):
            if outcome:
                break
            await asyncio.sleep(0.05)
        assert outcome and isinstance(outcome[0], ConnectionResetError | asyncio.CancelledError)
        assert progress[0] < total
    finally:
        await served.server.close()


async def test_a_failing_handler_gives_500_json_and_the_server_keeps_serving() -> None:
    async def handler(request: Request, conn: Connection) -> Response:
        if request.path == "/boom":
            raise ValueError("bug")
        return Response(200, b"fine")

    served = await _serve(handler)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(served.url + "/boom") as r:
                assert r.status == 500 and (await r.json())["error"]["code"] == 500
            async with session.get(served.url + "/ok") as r:
                assert r.status == 200 and await r.read() == b"fine"
    finally:
        await served.server.close()


async def test_close_waits_for_busy_handlers_then_cancels() -> None:
    release = asyncio.Event()

    async def handler(request: Request, conn: Connection) -> Response:
        await release.wait()
        return Response(200, b"done")

    served = await _serve(handler)
    reader, writer = await served.open()
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    await asyncio.sleep(0.1)
    closing = asyncio.get_running_loop().create_task(served.server.close(grace=5.0))
    await asyncio.sleep(0.2)
    assert not closing.done()  # the busy handler is given time
    release.set()
    status, _, body = await _read_response(reader)
    assert status == 200 and body == b"done"
    await asyncio.wait_for(closing, 10)
    writer.close()


async def test_connections_over_the_limit_get_503_and_close(echo: Served) -> None:
    echo.server.max_connections = 2
    held = [await echo.open() for _ in range(2)]
    reader, writer = await echo.open()
    status, headers, raw = await _read_response(reader)
    assert status == 503 and headers["retry-after"] == "1" and json.loads(raw)["error"]["code"] == 503
    assert await asyncio.wait_for(reader.read(), 10) == b""
    writer.close()
    r0, w0 = held[0]
    w0.write(_post("/still", b"served"))
    assert json.loads((await _read_response(r0))[2])["body"] == "served"
    for _, w in held:
        w.close()


async def test_a_request_half_sent_behind_a_slow_answer_still_times_out() -> None:
    release = asyncio.Event()

    async def handler(request: Request, conn: Connection) -> Response:
        await release.wait()
        return Response(200, b"first")

    served = await _serve(handler, receive_timeout=0.3)
    try:
        reader, writer = await served.open()
        writer.write(
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\nPOST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nab"
        )
        await asyncio.sleep(0.6)  # the second request's receive timer ran out while the first was answered
        release.set()
        assert (await _read_response(reader))[2] == b"first"
        status, _, _ = await _read_response(reader)
        assert status == 408
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()
    finally:
        await served.server.close()


# -- protocol edge cases, against an echo that can also stream slowly ---------------------------------------
CURL_H2C_HEADERS = (
    "User-Agent: curl/7.88.1\r\nAccept: */*\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
    "HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
)


async def _streaming_echo(request: Request, conn: Connection) -> Response | None:
    """``/slow`` streams three pieces 0.15 s apart; ``/sleep`` answers after 0.3 s; else an echo."""
    if request.path == "/slow":
        conn.start(200, [("Content-Type", "text/event-stream")])
        for i in range(3):
            await conn.write(b"data: %d\n\n" % i)
            await asyncio.sleep(0.15)
        conn.end()
        return None
    if request.path == "/sleep":
        await asyncio.sleep(0.3)
    body = {
        "method": request.method,
        "path": request.path,
        "query": request.query_string,
        "body": request.body.decode(),
        "upgrade": request.headers.get("Upgrade"),
    }
    return Response(200, json.dumps(body).encode(), [("Content-Type", "application/json")])


@pytest.fixture
async def streaming_echo() -> AsyncIterator[Served]:
    served = await _serve(_streaming_echo)
    yield served
    await served.server.close()


async def _nothing_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    try:
        await asyncio.wait_for(reader.read(1), seconds)
    except TimeoutError:
        return True
    return False


# -- 100 Continue --------------------------------------------------------------------------------------------
async def test_continue_for_a_pipelined_request_waits_for_the_answer_before_it(
    streaming_echo: Served,
) -> None:
    reader, writer = await streaming_echo.open()
    writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
    await asyncio.sleep(0.1)  # the stream is under way
    writer.write(b"POST /x HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n")
    status, _, body = await _read_response(reader)  # chunk framing intact: no 100 in the middle
    assert status == 200 and body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"  # now it is this request's turn
    writer.write(b"hello")
    status, _, body = await _read_response(reader)
    assert status == 200 and json.loads(body)["body"] == "hello"
    # A body already on its way behind a busy connection needs no 100 at all.
    writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n" + _post("/y", b"again", "Expect: 100-continue\r\n"))
    assert (await _read_response(reader))[0] == 200
    status, _, body = await _read_response(reader)
    assert status == 200 and json.loads(body)["body"] == "again"
    writer.close()


async def test_continue_is_decided_after_all_headers_and_never_sent_to_http10(streaming_echo: Served) -> None:
    reader, writer = await streaming_echo.open()
    writer.write(b"POST /x HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2000000\r\n\r\n")
    status, headers, body = await _read_response(reader)  # the refusal, with no 100 before it
    assert status == 413 and headers["connection"] == "close" and json.loads(body)["error"]["code"] == 413
    writer.close()
    reader, writer = await streaming_echo.open()
    writer.write(b"POST /x HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n")
    assert await _nothing_within(reader, 0.3)  # RFC 9110 §15.2: no 1xx to an HTTP/1.0 client
    writer.write(b"hello")
    status, _, body = await _read_response(reader)
    assert status == 200 and json.loads(body)["body"] == "hello"
    writer.close()


# -- Upgrade offers: ignored, served as HTTP/1.1 -------------------------------------------------------------
async def test_an_upgrade_offer_is_ignored_and_the_body_read(streaming_echo: Served) -> None:
    reader, writer = await streaming_echo.open()
    writer.write(
        _post("/v1/completions", b'{"prompt":"Hi"}', CURL_H2C_HEADERS)
        + b"POST /chunked HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n"
        + b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
        + b"GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
        + b"GET /last?q=1 HTTP/1.1\r\nHost: x\r\n\r\n"
    )
    for path, body in (
        ("/v1/completions", '{"prompt":"Hi"}'),
        ("/chunked", "abc"),
        ("/ws", ""),
        ("/last", ""),
    ):
        status, headers, raw = await _read_response(reader)
        got = json.loads(raw)
        assert status == 200 and headers.get("connection") != "close"
        assert (got["path"], got["body"], got["upgrade"]) == (
            path,
            body,
            None,
        )  # served as plain HTTP/1.1
    assert got["query"] == "q=1"
    writer.close()


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
async def test_curl_http2_post_over_plain_http(streaming_echo: Served) -> None:
    args = ["curl", "-s", "--http2", "-d", '{"prompt":"Hi"}', streaming_echo.url + "/v1/completions"]
    proc = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(), 10)
    assert proc.returncode == 0 and json.loads(out)["body"] == '{"prompt":"Hi"}'


# -- back-pressure for whole answers -------------------------------------------------------------------------
async def test_a_client_that_pipelines_and_never_reads_cannot_grow_the_buffers() -> None:
    piece = b"y" * 4000

    async def handler(request: Request, conn: Connection) -> Response:
        return Response(200, request.path.encode() + b" " + piece)

    served = await _serve(handler)
    try:
        reader, writer = await served.open()
        count = 3000  # 12 MB of answers if nothing held the server back
        writer.write(b"".join(b"GET /%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(count)))
        (conn,) = served.server._connections
        transport = conn._transport
        assert transport is not None
        buffered = 0
        for _ in range(20):  # 1 s, reading nothing
            await asyncio.sleep(0.05)
            buffered = max(buffered, transport.get_write_buffer_size())
        assert buffered < 256 * 1024, buffered  # the high-water mark (64 KiB) plus one answer, not megabytes
        for i in range(count):  # everything arrives, in order, once the client reads
            status, _, body = await _read_response(reader)
            assert status == 200 and body == b"/%d " % i + piece
        writer.close()
    finally:
        await served.server.close()


# -- a bad request behind good ones --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("bad", "status"),
    [
        (b"GARBAGE\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\n", 413),
        (b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"v" * 70000 + b"\r\n\r\n", 431),
        (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n", 414),
    ],
    ids=["garbage-400", "length-413", "headers-431", "url-414"],
)
async def test_a_bad_pipelined_request_is_refused_after_the_answer_before_it(
    streaming_echo: Served, bad: bytes, status: int
) -> None:
    reader, writer = await streaming_echo.open()
    writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n" + _post("/next", b"queued"))
    await asyncio.sleep(0.1)  # the stream is under way
    writer.write(bad)
    got, _, body = await _read_response(reader)
    assert got == 200 and body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"  # complete, not cut
    got, _, body = await _read_response(reader)
    assert got == 200 and json.loads(body)["body"] == "queued"  # received before the bad one: answered
    got, headers, body = await _read_response(reader)
    assert got == status and headers["connection"] == "close" and json.loads(body)["error"]["code"] == status
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()


# -- HTTP/1.0 keep-alive -------------------------------------------------------------------------------------
async def test_http10_keep_alive_is_confirmed_and_kept(streaming_echo: Served) -> None:
    reader, writer = await streaming_echo.open()
    for path in ("/a", "/b"):
        writer.write(b"GET %s HTTP/1.0\r\nConnection: keep-alive\r\n\r\n" % path.encode())
        status, headers, body = await _read_response(reader)
        assert status == 200 and headers["connection"] == "keep-alive" and json.loads(body)["path"] == path
    writer.write(b"GET /c HTTP/1.0\r\n\r\n")
    status, headers, _ = await _read_response(reader)
    assert status == 200 and headers["connection"] == "close"
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()


# -- RFC 9112 request checks ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /health HTTP/1.1\r\n\r\n", 400),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", 400),
        (b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n", 505),
        (b"GET /health HTTP/1.2\r\nHost: x\r\n\r\n", 505),
        (
            b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
            501,
        ),
        (
            b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n",
            501,
        ),
    ],
    ids=["no-host", "two-hosts", "http2-505", "http12-505", "gzip-chunked-501", "two-te-headers-501"],
)
async def test_request_line_and_header_violations_are_refused(
    streaming_echo: Served, request_bytes: bytes, status: int
) -> None:
    reader, writer = await streaming_echo.open()
    writer.write(request_bytes)
    got, headers, raw = await _read_response(reader)
    assert got == status and headers["connection"] == "close"
    assert json.loads(raw)["error"]["code"] == status
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()


async def test_absolute_form_targets_and_http10_without_host_are_served(streaming_echo: Served) -> None:
    reader, writer = await streaming_echo.open()
    writer.write(
        b"GET http://127.0.0.1:8000/health?x=1 HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n\r\n"
        b"GET HTTP://example HTTP/1.1\r\nHost: example\r\n\r\n"
        b"GET /ten HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"
    )
    for path, query in (("/health", "x=1"), ("/", ""), ("/ten", "")):
        status, _, raw = await _read_response(reader)
        got = json.loads(raw)
        assert status == 200 and (got["path"], got["query"]) == (path, query)
    writer.close()
