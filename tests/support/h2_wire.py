"""A raw HTTP/2 client for wire-level tests of kvstack's gRPC server: frames written and read as bytes,
request headers encoded with ``hpack``, gRPC messages framed by hand: every byte the server sends is seen."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import Callable, Iterable
from typing import NamedTuple

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = (
    range(10)
)
END_STREAM = ACK = 0x1
END_HEADERS = 0x4


class Frame(NamedTuple):
    kind: int
    flags: int
    stream: int
    payload: bytes

    @property
    def error_code(self) -> int:
        """RST_STREAM's or GOAWAY's error code."""
        return int.from_bytes(self.payload[:4] if self.kind == RST_STREAM else self.payload[4:8], "big")


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return struct.pack(">BHBBI", n >> 16, n & 0xFFFF, kind, flags, stream) + payload


def grpc_message(data: bytes, compressed: bool = False) -> bytes:
    return struct.pack(">BI", int(compressed), len(data)) + data


class WireClient:
    """One HTTP/2 connection to the server under test."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()

    @classmethod
    async def open(
        cls, port: int, settings: dict[int, int] | None = None, preface: bool = True
    ) -> WireClient:
        """Connect; with ``preface``, send the client preface and SETTINGS, read the server's, and ACK it."""
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        client = cls(reader, writer)
        if preface:
            payload = b"".join(struct.pack(">HI", k, v) for k, v in (settings or {}).items())
            client.write(PREFACE + frame(SETTINGS, 0, 0, payload))
            first = await client.read()
            assert first is not None and first.kind == SETTINGS and not first.flags & ACK, first
            client.server_settings = dict(
                struct.unpack_from(">HI", first.payload, i) for i in range(0, len(first.payload), 6)
            )
            client.send(SETTINGS, ACK, 0)
        return client

    server_settings: dict[int, int] = {}

    def write(self, data: bytes) -> None:
        self.writer.write(data)

    def send(self, kind: int, flags: int, stream: int, payload: bytes = b"") -> None:
        self.writer.write(frame(kind, flags, stream, payload))

    def header_block(self, path: str, extra: Iterable[tuple[str, str]] = (), method: str = "POST") -> bytes:
        headers = [
            (":method", method),
            (":scheme", "http"),
            (":path", path),
            (":authority", "test"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *extra,
        ]
        return bytes(self.encoder.encode(headers))

    def request(self, stream: int, path: str, *, end_stream: bool = False, **kw: object) -> None:
        block = self.header_block(path, **kw)  # type: ignore[arg-type]
        self.send(HEADERS, END_HEADERS | (END_STREAM if end_stream else 0), stream, block)

    def message(
        self, stream: int, data: bytes, *, end_stream: bool = False, compressed: bool = False
    ) -> None:
        self.send(DATA, END_STREAM if end_stream else 0, stream, grpc_message(data, compressed))

    async def read(self, wait_s: float = 5.0) -> Frame | None:
        """The next frame; None at EOF."""
        try:
            head = await asyncio.wait_for(self.reader.readexactly(9), wait_s)
        except asyncio.IncompleteReadError:
            return None
        hi, lo, kind, flags, stream = struct.unpack(">BHBBI", head)
        payload = await asyncio.wait_for(self.reader.readexactly((hi << 16) | lo), wait_s)
        return Frame(kind, flags, stream & 0x7FFFFFFF, payload)

    async def read_until(self, done: Callable[[Frame], bool], wait_s: float = 5.0) -> list[Frame]:
        """Frames up to and including the first for which ``done`` holds (AssertionError at EOF)."""
        frames: list[Frame] = []
        while True:
            f = await self.read(wait_s)
            assert f is not None, f"connection closed; frames so far: {frames}"
            frames.append(f)
            if done(f):
                return frames

    async def read_to_eof(self, wait_s: float = 5.0) -> list[Frame]:
        frames: list[Frame] = []
        while (f := await self.read(wait_s)) is not None:
            frames.append(f)
        return frames

    def headers(self, f: Frame) -> list[tuple[str, str]]:
        """A HEADERS frame's fields (the server never splits its blocks)."""
        return [(str(k), str(v)) for k, v in self.decoder.decode(f.payload)]

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.wait_closed()
