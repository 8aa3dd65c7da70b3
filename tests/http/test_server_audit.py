"""The router's HTTP/1.1 server against the protocol cases of the router audit (findings F4, F5, F7, F8,
F12, F15): interim 100 responses and pipelining, Upgrade offers, back-pressure for whole answers, bad
requests behind good ones, HTTP/1.0 keep-alive, and the RFC 9112 request checks (a half-close, F6, is in
test_router_http1.py's disconnect test). Raw sockets throughout."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator

import pytest
from test_router_http1 import Served, _post, _read_response, _serve

from kvstack.http.server import Connection, Request, Response

pytestmark = pytest.mark.asyncio

CURL_H2C_HEADERS = (
    "User-Agent: curl/7.88.1\r\nAccept: */*\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
    "HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
)


async def _handler(request: Request, conn: Connection) -> Response | None:
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
async def served() -> AsyncIterator[Served]:
    served = await _serve(_handler)
    yield served
    await served.server.close()


async def _nothing_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    try:
        await asyncio.wait_for(reader.read(1), seconds)
    except TimeoutError:
        return True
    return False


# -- F4: 100 Continue -------------------------------------------------------------------------------
async def test_continue_for_a_pipelined_request_waits_for_the_answer_before_it(served: Served) -> None:
    reader, writer = await served.open()
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


async def test_continue_is_decided_after_all_headers_and_never_sent_to_http10(served: Served) -> None:
    reader, writer = await served.open()
    writer.write(b"POST /x HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2000000\r\n\r\n")
    status, headers, body = await _read_response(reader)  # the refusal, with no 100 before it
    assert status == 413 and headers["connection"] == "close" and json.loads(body)["error"]["code"] == 413
    writer.close()
    reader, writer = await served.open()
    writer.write(b"POST /x HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n")
    assert await _nothing_within(reader, 0.3)  # RFC 9110 §15.2: no 1xx to an HTTP/1.0 client
    writer.write(b"hello")
    status, _, body = await _read_response(reader)
    assert status == 200 and json.loads(body)["body"] == "hello"
    writer.close()


# -- F5: Upgrade offers ---------------------------------------------------------------------------
async def test_an_upgrade_offer_is_ignored_and_the_body_read(served: Served) -> None:
    reader, writer = await served.open()
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
        assert (got["path"], got["body"], got["upgrade"]) == (path, body, None)  # served as plain HTTP/1.1
    assert got["query"] == "q=1"
    writer.close()


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
async def test_curl_http2_post_over_plain_http(served: Served) -> None:
    args = ["curl", "-s", "--http2", "-d", '{"prompt":"Hi"}', served.url + "/v1/completions"]
    proc = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(), 10)
    assert proc.returncode == 0 and json.loads(out)["body"] == '{"prompt":"Hi"}'


# -- F7: back-pressure for whole answers ------------------------------------------------------------
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


# -- F8: a bad request behind a good one --------------------------------------------------------------
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
    served: Served, bad: bytes, status: int
) -> None:
    reader, writer = await served.open()
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


# -- F12: HTTP/1.0 keep-alive -----------------------------------------------------------------------
async def test_http10_keep_alive_is_confirmed_and_kept(served: Served) -> None:
    reader, writer = await served.open()
    for path in ("/a", "/b"):
        writer.write(b"GET %s HTTP/1.0\r\nConnection: keep-alive\r\n\r\n" % path.encode())
        status, headers, body = await _read_response(reader)
        assert status == 200 and headers["connection"] == "keep-alive" and json.loads(body)["path"] == path
    writer.write(b"GET /c HTTP/1.0\r\n\r\n")
    status, headers, _ = await _read_response(reader)
    assert status == 200 and headers["connection"] == "close"
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()


# -- F15: RFC 9112 request checks -----------------------------------------------------------------
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
    served: Served, request_bytes: bytes, status: int
) -> None:
    reader, writer = await served.open()
    writer.write(request_bytes)
    got, headers, raw = await _read_response(reader)
    assert got == status and headers["connection"] == "close"
    assert json.loads(raw)["error"]["code"] == status
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()


async def test_absolute_form_targets_and_http10_without_host_are_served(served: Served) -> None:
    reader, writer = await served.open()
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
