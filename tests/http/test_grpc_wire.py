"""kvstack's gRPC server (kvstack.http.grpc_server) on the wire, frame by frame with a raw HTTP/2 client:
settings and pings, the peer's flow-control windows, header blocks in pieces and the HPACK table size,
protocol errors answered by GOAWAY with their code, stream errors, a garbage preface, the response and
trailer bytes themselves, a lost connection, and the server under uvloop with grpcio's sync client."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager

import grpc
import pytest
import uvloop

from kvstack.http.grpc_server import GrpcServer, GrpcStream, StreamHandler, unary
from support.h2_wire import (
    ACK,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    PING,
    PRIORITY,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    Frame,
    WireClient,
    grpc_message,
)
from support.waiting import eventually

PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, REFUSED_STREAM = 0x1, 0x3, 0x6, 0x7
COMPRESSION_ERROR, NO_ERROR, STREAM_CLOSED = 0x9, 0x0, 0x5
INITIAL_WINDOW_SIZE, MAX_CONCURRENT_STREAMS, HEADER_TABLE_SIZE = 0x4, 0x3, 0x1


class Echo:
    def __init__(self, stream: GrpcStream) -> None:
        self.stream = stream
        self.events: list[str] = []

    def on_message(self, data: bytes) -> None:
        self.events.append("message")
        self.stream.send(data)

    def on_end(self) -> None:
        self.events.append("end")
        self.stream.finish()

    def on_reset(self) -> None:
        self.events.append("reset")


class Holding(Echo):
    """Never finishes."""

    def on_end(self) -> None:
        self.events.append("end")


class Early(Echo):
    """Finishes at the first message, before the client half-closes."""

    def on_message(self, data: bytes) -> None:
        super().on_message(data)
        self.stream.finish(13, "stop: 100% done\n")


@asynccontextmanager
async def serving(
    methods: Mapping[str, Callable[[GrpcStream], StreamHandler]] | None = None, **kw: int
) -> AsyncIterator[tuple[GrpcServer, int, list[Echo]]]:
    handlers: list[Echo] = []

    def recorded(cls: type[Echo]) -> Callable[[GrpcStream], StreamHandler]:
        def make(stream: GrpcStream) -> StreamHandler:
            handlers.append(cls(stream))
            return handlers[-1]

        return make

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    sock.setblocking(False)
    server = GrpcServer(
        {
            "/t.S/Echo": recorded(Echo),
            "/t.S/Early": recorded(Early),
            "/t.S/Hold": recorded(Holding),
            **(methods or {}),
        },
        **kw,
    )
    await server.start(sock)
    try:
        yield server, sock.getsockname()[1], handlers
    finally:
        await server.close(0.5)


def data_bytes(frames: list[Frame], stream: int) -> bytes:
    return b"".join(f.payload for f in frames if f.kind == DATA and f.stream == stream)


def ends(stream: int) -> Callable[[Frame], bool]:
    return lambda f: (
        f.stream == stream and (f.kind == RST_STREAM or (f.kind == HEADERS and bool(f.flags & END_STREAM)))
    )


async def test_server_settings_acks_and_pings() -> None:
    async with serving(max_concurrent_streams=7) as (_, port, _h):
        c = await WireClient.open(port)
        assert c.server_settings[MAX_CONCURRENT_STREAMS] == 7
        assert c.server_settings[INITIAL_WINDOW_SIZE] >= 1 << 20
        frames = await c.read_until(lambda f: f.kind == SETTINGS and bool(f.flags & ACK))
        assert any(f.kind == WINDOW_UPDATE and f.stream == 0 for f in frames)  # the connection window, raised
        c.send(PING, 0, 0, b"12345678")
        pong = (await c.read_until(lambda f: f.kind == PING))[-1]
        assert (pong.flags, pong.payload) == (ACK, b"12345678")
        c.send(PING, ACK, 0, b"87654321")  # an ACK is not answered
        c.send(PING, 0, 0, b"abcdefgh")
        pong = (await c.read_until(lambda f: f.kind == PING))[-1]
        assert pong.payload == b"abcdefgh"
        await c.close()


async def test_response_headers_messages_and_trailers_on_the_wire() -> None:
    async with serving() as (_, port, handlers):
        c = await WireClient.open(port)
        c.request(1, "/t.S/Echo")
        c.message(1, b"one")
        c.send(DATA, END_STREAM, 1, grpc_message(b"two") + grpc_message(b"three"))  # two messages, one frame
        frames = await c.read_until(ends(1))
        heads = [f for f in frames if f.kind == HEADERS]
        assert c.headers(heads[0]) == [(":status", "200"), ("content-type", "application/grpc")]
        assert data_bytes(frames, 1) == grpc_message(b"one") + grpc_message(b"two") + grpc_message(b"three")
        assert c.headers(heads[1]) == [("grpc-status", "0")]
        assert heads[1].flags & END_STREAM
        assert handlers[0].events == ["message"] * 3 + ["end"]
        await c.close()


async def test_a_message_split_over_many_frames() -> None:
    async with serving() as (_, port, _h):
        c = await WireClient.open(port)
        c.request(1, "/t.S/Echo")
        wire = grpc_message(b"0123456789" * 1000) + grpc_message(b"")
        for i in range(0, len(wire), 7):  # the prefix itself split too
            c.send(DATA, 0, 1, wire[i : i + 7])
        c.send(DATA, END_STREAM, 1)
        frames = await c.read_until(ends(1))
        assert data_bytes(frames, 1) == wire
        await c.close()


async def test_finish_before_the_client_ends_is_followed_by_rst_no_error() -> None:
    async with serving() as (server, port, _h):
        c = await WireClient.open(port)
        c.request(1, "/t.S/Early")
        c.message(1, b"x")
        frames = await c.read_until(ends(1))
        trailer = next(f for f in frames if f.kind == HEADERS and f.flags & END_STREAM)
        status = dict(c.headers(trailer))
        assert status == {"grpc-status": "13", "grpc-message": "stop: 100%25 done%0A"}
        rst = (await c.read_until(lambda f: f.kind == RST_STREAM))[-1]
        assert (rst.stream, rst.error_code) == (1, NO_ERROR)
        c.message(1, b"late", end_stream=True)  # in flight after the reset: ignored
        c.send(PING, 0, 0, b"stillok!")
        await c.read_until(lambda f: f.kind == PING)
        assert server.open_streams == 0
        await c.close()


async def test_our_data_waits_for_the_peers_stream_window() -> None:
    async with serving() as (_, port, _h):
        c = await WireClient.open(port, {INITIAL_WINDOW_SIZE: 100})
        c.request(1, "/t.S/Echo")
        c.message(1, b"a" * 1000, end_stream=True)
        await asyncio.sleep(0.2)
        got = await c.read_until(lambda f: f.kind == DATA)
        assert len(got[-1].payload) == 100
        with pytest.raises(TimeoutError):
            await c.read(wait_s=0.3)  # nothing more until the window opens: not even the trailers
        c.send(WINDOW_UPDATE, 0, 1, (500).to_bytes(4, "big"))
        more = await c.read_until(lambda f: f.kind == DATA)
        assert len(more[-1].payload) == 500
        c.send(SETTINGS, 0, 0, struct.pack(">HI", INITIAL_WINDOW_SIZE, 100_000))  # opens it by the difference
        rest = await c.read_until(ends(1))
        assert data_bytes(got + more + rest, 1) == grpc_message(b"a" * 1000)
        assert rest[-1].kind == HEADERS
        await c.close()


async def test_our_data_waits_for_the_peers_connection_window() -> None:
    async with serving(max_message_bytes=1 << 20) as (_, port, _h):
        c = await WireClient.open(port, {INITIAL_WINDOW_SIZE: 1 << 20})
        c.request(1, "/t.S/Echo")
        c.message(1, b"b" * 100_000, end_stream=True)
        frames: list[Frame] = []
        while sum(len(f.payload) for f in frames if f.kind == DATA) < 65_535:
            frames.append((await c.read()) or Frame(0, 0, 0, b""))
        with pytest.raises(TimeoutError):
            await c.read(wait_s=0.3)
        assert all(len(f.payload) <= 16_384 for f in frames if f.kind == DATA)  # the peer's MAX_FRAME_SIZE
        c.send(WINDOW_UPDATE, 0, 0, (1 << 20).to_bytes(4, "big"))
        frames += await c.read_until(ends(1))
        assert data_bytes(frames, 1) == grpc_message(b"b" * 100_000)
        await c.close()


async def test_responses_the_client_leaves_unread_end_the_call() -> None:
    async with serving(max_message_bytes=1000, max_buffered_bytes=3000) as (server, port, handlers):
        c = await WireClient.open(port, {INITIAL_WINDOW_SIZE: 0})
        c.request(1, "/t.S/Echo")
        for _ in range(5):
            c.message(1, b"c" * 900)
        frames = await c.read_until(ends(1))
        status = dict(c.headers([f for f in frames if f.kind == HEADERS][-1]))
        assert status["grpc-status"] == "8" and "unread" in status["grpc-message"]
        assert handlers[0].events[-1] == "reset"
        assert server.open_streams == 0
        await c.close()


async def test_headers_in_continuation_frames_and_with_padding() -> None:
    async with serving() as (_, port, _h):
        c = await WireClient.open(port)
        block = c.header_block("/t.S/Echo", extra=[("x-long", "v" * 3000)])
        c.send(HEADERS, 0, 1, block[:10])
        c.send(CONTINUATION, 0, 1, block[10:2000])
        c.send(CONTINUATION, END_HEADERS, 1, block[2000:])
        c.send(DATA, 0x8 | END_STREAM, 1, b"\x03" + grpc_message(b"padded") + b"\x00\x00\x00")
        frames = await c.read_until(ends(1))
        assert data_bytes(frames, 1) == grpc_message(b"padded")
        await c.close()


async def test_streams_over_the_limit_are_refused() -> None:
    async with serving(max_concurrent_streams=2) as (server, port, _h):
        c = await WireClient.open(port)
        for sid in (1, 3, 5):
            c.request(sid, "/t.S/Echo")
        rst = (await c.read_until(lambda f: f.kind == RST_STREAM))[-1]
        assert (rst.stream, rst.error_code) == (5, REFUSED_STREAM)
        c.message(1, b"x", end_stream=True)
        await c.read_until(ends(1))
        c.request(7, "/t.S/Echo")  # a place is free again
        c.message(7, b"y", end_stream=True)
        frames = await c.read_until(ends(7))
        assert data_bytes(frames, 7) == grpc_message(b"y")
        assert server.open_streams == 1  # stream 3 is still open
        await c.close()


async def test_not_grpc_requests_are_answered_in_http() -> None:
    async with serving() as (_, port, _h):
        c = await WireClient.open(port)
        c.send(HEADERS, END_HEADERS | END_STREAM, 1, c.header_block("/t.S/Echo", method="GET"))
        head = (await c.read_until(lambda f: f.kind == HEADERS))[-1]
        assert c.headers(head) == [(":status", "405")] and head.flags & END_STREAM
        block = bytes(
            c.encoder.encode([(":method", "POST"), (":path", "/t.S/Echo"), ("content-type", "text/plain")])
        )
        c.send(HEADERS, END_HEADERS, 3, block)
        frames = await c.read_until(lambda f: f.kind == RST_STREAM)
        assert c.headers(frames[0]) == [(":status", "415")]
        assert (frames[-1].stream, frames[-1].error_code) == (3, NO_ERROR)
        await c.close()


async def test_compressed_flag_is_unimplemented() -> None:
    async with serving() as (_, port, handlers):
        c = await WireClient.open(port)
        c.request(1, "/t.S/Echo")
        c.message(1, b"zz", compressed=True, end_stream=True)
        frames = await c.read_until(ends(1))
        assert dict(c.headers(frames[-1]))["grpc-status"] == "12"
        assert handlers[0].events == ["reset"]
        await c.close()


async def test_stream_errors_reset_only_their_stream() -> None:
    async with serving() as (server, port, handlers):
        c = await WireClient.open(port)
        c.request(1, "/t.S/Echo", end_stream=True)
        await c.read_until(ends(1))
        c.request(3, "/t.S/Echo")
        c.message(3, b"x", end_stream=True)
        await c.read_until(ends(3))
        c.request(5, "/t.S/Hold", end_stream=True)
        c.message(5, b"after end")  # DATA after END_STREAM on a stream still open: STREAM_CLOSED
        rst = (await c.read_until(lambda f: f.kind == RST_STREAM))[-1]
        assert (rst.stream, rst.error_code) == (5, STREAM_CLOSED)
        assert handlers[2].events == ["end", "reset"]
        c.request(7, "/t.S/Echo")
        c.send(WINDOW_UPDATE, 0, 7, (0).to_bytes(4, "big"))  # a zero increment: PROTOCOL_ERROR on stream 7
        c.send(PRIORITY, 0, 9, b"\x00" * 5)  # ignored
        frames = await c.read_until(lambda f: f.kind == RST_STREAM and f.stream == 7)
        assert (7, PROTOCOL_ERROR) in [(f.stream, f.error_code) for f in frames if f.kind == RST_STREAM]
        c.request(11, "/t.S/Echo")
        c.message(11, b"ok", end_stream=True)
        assert data_bytes(await c.read_until(ends(11)), 11) == grpc_message(b"ok")
        assert server.connections == 1
        await c.close()


async def test_client_trailers_end_the_stream() -> None:
    async with serving() as (_, port, handlers):
        c = await WireClient.open(port)
        c.request(1, "/t.S/Echo")
        c.message(1, b"x")
        c.send(HEADERS, END_HEADERS | END_STREAM, 1, bytes(c.encoder.encode([("x-trailer", "1")])))
        await c.read_until(ends(1))
        assert handlers[0].events == ["message", "end"]
        await c.close()


async def test_a_stream_ending_inside_a_message_is_an_error() -> None:
    async with serving() as (_, port, handlers):
        c = await WireClient.open(port)
        c.request(1, "/t.S/Echo")
        c.send(DATA, END_STREAM, 1, grpc_message(b"whole")[:-2])
        frames = await c.read_until(ends(1))
        assert dict(c.headers(frames[-1]))["grpc-status"] == "13"
        assert handlers[0].events == ["reset"]
        await c.close()


@pytest.mark.parametrize(
    ("send", "code"),
    [
        (lambda c: c.send(DATA, 0, 0, b"x"), PROTOCOL_ERROR),
        (lambda c: c.send(DATA, 0, 1, grpc_message(b"x")), PROTOCOL_ERROR),  # an idle stream
        (lambda c: c.send(HEADERS, END_HEADERS, 2, c.header_block("/t.S/Echo")), PROTOCOL_ERROR),
        (
            lambda c: (c.send(HEADERS, 0, 1, c.header_block("/t.S/Echo")), c.send(PING, 0, 0, b"x" * 8)),
            PROTOCOL_ERROR,
        ),
        (lambda c: c.send(CONTINUATION, END_HEADERS, 1, b""), PROTOCOL_ERROR),
        (lambda c: c.send(HEADERS, END_HEADERS, 1, b"\xff\xff\xff\xff\x0f"), COMPRESSION_ERROR),
        (lambda c: c.send(WINDOW_UPDATE, 0, 0, (0x7FFFFFFF).to_bytes(4, "big")), FLOW_CONTROL_ERROR),
        (lambda c: c.send(WINDOW_UPDATE, 0, 0, (0).to_bytes(4, "big")), PROTOCOL_ERROR),
        (lambda c: c.send(SETTINGS, 0, 0, b"\x00\x04\x80\x00\x00\x00"), FLOW_CONTROL_ERROR),
        (lambda c: c.send(SETTINGS, 0, 0, b"\x00\x05\x00\x00\x00\x10"), PROTOCOL_ERROR),
        (lambda c: c.send(SETTINGS, 0, 0, b"\x00\x04\x00"), FRAME_SIZE_ERROR),
        (lambda c: c.send(SETTINGS, ACK, 0, b"\x00\x04\x00\x00\x00\x01"), FRAME_SIZE_ERROR),
        (lambda c: c.send(PING, 0, 0, b"short"), PROTOCOL_ERROR),
        (lambda c: c.send(RST_STREAM, 0, 9, b"\x00\x00\x00\x08"), PROTOCOL_ERROR),
        (lambda c: c.send(5, 0, 1, b"\x00\x00\x00\x02"), PROTOCOL_ERROR),  # PUSH_PROMISE from a client
        (lambda c: c.write(b"\x20\x00\x00\x00\x00\x00\x00\x00\x00"), FRAME_SIZE_ERROR),  # 2 MiB frame
    ],
    ids=[
        "data-on-0",
        "data-idle",
        "even-stream",
        "interrupted-headers",
        "lone-continuation",
        "bad-hpack",
        "window-overflow",
        "window-zero",
        "initial-window-too-big",
        "max-frame-too-small",
        "settings-length",
        "settings-ack-payload",
        "ping-length",
        "rst-idle",
        "push-promise",
        "frame-too-large",
    ],
)
async def test_protocol_errors_end_the_connection_with_goaway(
    send: Callable[[_Renumbered], object], code: int
) -> None:
    async with serving() as (server, port, handlers):
        other = await WireClient.open(port)
        other.request(1, "/t.S/Echo")
        other.message(1, b"open")
        await other.read_until(lambda f: f.kind == DATA)
        c = await WireClient.open(port)
        c.request(1, "/t.S/Echo")
        c.message(1, b"open")
        await c.read_until(lambda f: f.kind == DATA)
        send(_Renumbered(c))  # stream 1 of c is open; the error comes on top
        frames = await c.read_to_eof()
        goaway = [f for f in frames if f.kind == GOAWAY]
        assert goaway and goaway[-1].error_code == code, frames
        assert int.from_bytes(goaway[-1].payload[:4], "big") == 1  # the last stream the server took
        await eventually(lambda: server.connections == 1, what="only the other connection left")
        assert handlers[1].events[-1] == "reset"  # the call on the failed connection
        other.message(1, b"still", end_stream=True)
        assert data_bytes(await other.read_until(ends(1)), 1).endswith(grpc_message(b"still"))
        await other.close()
        await c.close()


class _Renumbered:
    """A client whose new streams start at 3 (stream 1 is taken by the test's open call)."""

    def __init__(self, c: WireClient) -> None:
        self._c = c

    def send(self, kind: int, flags: int, stream: int, payload: bytes = b"") -> None:
        self._c.send(
            kind,
            flags,
            stream + 2 if kind in (HEADERS, CONTINUATION, DATA) and stream % 2 else stream,
            payload,
        )

    def write(self, data: bytes) -> None:
        self._c.write(data)

    def header_block(self, path: str, **kw: object) -> bytes:
        return self._c.header_block(path, **kw)  # type: ignore[arg-type]


async def test_header_table_size_we_announce_holds_once_acked() -> None:
    async with serving(header_table_size=0) as (_, port, _h):
        c = await WireClient.open(port)  # reads our SETTINGS and ACKs them
        assert c.server_settings[HEADER_TABLE_SIZE] == 0
        c.encoder.header_table_size = 0  # the client's size update opens its next block
        c.request(1, "/t.S/Echo", extra=[("x-a", "1")])
        c.message(1, b"x", end_stream=True)
        await c.read_until(ends(1))
        await c.close()
        c = await WireClient.open(port)
        c.request(1, "/t.S/Echo", extra=[("x-b", "2")])  # indexes into a 4096-byte table after the ACK
        frames = await c.read_to_eof()
        assert [f.error_code for f in frames if f.kind == GOAWAY] == [COMPRESSION_ERROR]
        await c.close()


async def test_garbage_preface_closes_the_connection(caplog: pytest.LogCaptureFixture) -> None:
    async with serving() as (server, port, _h):
        for garbage in (
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
            b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n",
            b"\x00" * 100,
        ):
            c = await WireClient.open(port, preface=False)
            c.write(garbage)
            frames = await c.read_to_eof()
            assert [f.kind for f in frames] == [SETTINGS, WINDOW_UPDATE, GOAWAY]
            assert frames[-1].error_code == PROTOCOL_ERROR
            await c.close()
        await eventually(lambda: server.connections == 0, what="the connections closed")
        c = await WireClient.open(port)
        c.request(1, "/t.S/Echo")
        c.message(1, b"fine", end_stream=True)
        assert data_bytes(await c.read_until(ends(1)), 1) == grpc_message(b"fine")
        await c.close()
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "WARNING")]


async def test_a_lost_connection_resets_every_call() -> None:
    async with serving() as (server, port, handlers):
        c = await WireClient.open(port)
        for sid in (1, 3, 5):
            c.request(sid, "/t.S/Echo")
            c.message(sid, b"x")
        await c.read_until(lambda f: f.kind == DATA and f.stream == 5)
        c.writer.transport.abort()
        await eventually(lambda: server.connections == 0, what="the connection gone")
        assert [h.events for h in handlers] == [["message", "reset"]] * 3


async def test_client_goaway_closes_once_the_last_call_ends() -> None:
    async with serving() as (server, port, _h):
        c = await WireClient.open(port)
        c.request(1, "/t.S/Echo")
        c.send(GOAWAY, 0, 0, struct.pack(">II", 0, 0))
        c.message(1, b"last", end_stream=True)
        frames = await c.read_to_eof()
        assert data_bytes(frames, 1) == grpc_message(b"last")
        await eventually(lambda: server.connections == 0, what="the connection closed")


def test_under_uvloop_with_grpcios_sync_client() -> None:
    async def scenario() -> None:
        async with serving({"/t.S/Unary": unary(lambda data: data * 2)}) as (server, port, _h):
            loop = asyncio.get_running_loop()

            def calls() -> list[bytes]:
                with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                    single, bidi = ch.unary_unary("/t.S/Unary"), ch.stream_stream("/t.S/Echo")
                    out = [single(b"ab"), single(b"x" * 200_000)]
                    out += list(bidi(iter([b"1", b"2" * 100_000, b"3"])))
                    return out

            out = await loop.run_in_executor(None, calls)
            assert out == [b"abab", b"x" * 400_000, b"1", b"2" * 100_000, b"3"]
            assert server.open_streams == 0

    uvloop.run(scenario())


async def test_the_same_block_decodes_anew_once_the_dynamic_table_changed() -> None:
    async with serving() as (_, port, handlers):
        c = await WireClient.open(port)
        base = b"\x83\x86" + b"\x04\x09/t.S/Echo" + b"\x0f\x10\x10application/grpc"  # POST, http, path, type
        adds = [base + b"\x40\x03x-a\x01" + value for value in (b"1", b"2")]  # x-a indexed: table entry 62
        reads = base + b"\xbe"  # x-a from entry 62: the same bytes each time
        for sid, block in zip((1, 3, 5, 7, 9), (adds[0], reads, reads, adds[1], reads), strict=True):
            c.send(HEADERS, END_HEADERS | END_STREAM, sid, block)
            await c.read_until(ends(sid))
        assert [dict(h.stream.metadata).get("x-a") for h in handlers] == ["1", "1", "1", "2", "2"]
        await c.close()
