"""Server-sent events as vLLM's OpenAI server frames them, and an incremental parser for clients.

vLLM writes each chunk as ``data: <json>\\n\\n`` with compact JSON (``,`` and ``:`` separators, non-ASCII
left as UTF-8) and ends every stream, including one that failed, with ``data: [DONE]\\n\\n``. An error
raised after the 200 status went out is sent as one more event, ``data: {"error": {...}}``, encoded
with Python's default `json.dumps` (spaced separators, ASCII escapes): `encode_error_event` keeps that.

`SSEParser` accepts bytes in arbitrary pieces (a chunk may end inside a line, or between the CR and
LF of a CRLF) and returns the ``data`` payload of every complete event; comments and other fields
are skipped, multi-line data is joined with ``\\n`` as the SSE specification says.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from kvstack.openai.errors import OpenAIError

DONE = b"data: [DONE]\n\n"
DONE_PAYLOAD = b"[DONE]"

_encoder = msgspec.json.Encoder()


def encode_event(obj: Any) -> bytes:
    """One ``data:`` event carrying `obj` as compact JSON."""
    return b"data: " + _encoder.encode(obj) + b"\n\n"


def encode_error_event(err: OpenAIError) -> bytes:
    """The in-stream error event vLLM sends when a request fails after streaming began."""
    return b"data: " + json.dumps(err.body()).encode() + b"\n\n"


class SSEParser:
    """Incremental SSE decoder: `feed` bytes, get back the data payloads of completed events."""

    def __init__(self, max_event_bytes: int = 16 * 1024 * 1024) -> None:
        # Bounded so a peer that never ends an event cannot grow this buffer without limit.
        self.max_event_bytes = max_event_bytes
        self._buf = bytearray()
        self._data: list[bytes] = []
        self._data_size = 0
        # A chunk ending in CR may be the first half of CRLF; the LF must then not end another line.
        self._skip_lf = False

    @property
    def has_partial(self) -> bool:
        """True when bytes of an unfinished event are held (a stream cut here was truncated)."""
        return bool(self._buf) or bool(self._data)

    def feed(self, chunk: bytes) -> list[bytes]:
        """Consume `chunk`; return the data payloads of the events it completed, in order."""
        if not chunk:
            return []
        if self._skip_lf:
            self._skip_lf = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        self._buf += chunk
        out: list[bytes] = []
        start = 0
        buf = self._buf
        cr = buf.find(b"\r")
        lf = buf.find(b"\n")
        while cr >= 0 or lf >= 0:
            if cr < 0 or (0 <= lf < cr):
                end, nxt = lf, lf + 1
            elif cr + 1 < len(buf):
                end, nxt = cr, (cr + 2 if buf[cr + 1] == 0x0A else cr + 1)
            else:
                end, nxt = cr, cr + 1
                self._skip_lf = True
            self._line(bytes(buf[start:end]), out)
            start = nxt
            # Search again only for a terminator that was consumed: keeps feeding linear in size.
            if 0 <= cr < start:
                cr = buf.find(b"\r", start)
            if 0 <= lf < start:
                lf = buf.find(b"\n", start)
        del buf[:start]
        if len(buf) + self._data_size > self.max_event_bytes:
            raise ValueError(
                f"SSE event larger than {self.max_event_bytes} bytes without an end; "
                "the peer is not sending server-sent events (raise max_event_bytes if it is)"
            )
        return out

    def _line(self, line: bytes, out: list[bytes]) -> None:
        if not line:
            # Per the SSE spec an event whose data is empty is not dispatched.
            payload = b"\n".join(self._data)
            if payload:
                out.append(payload)
            self._data = []
            self._data_size = 0
            return
        if line.startswith(b":"):
            return
        name, sep, value = line.partition(b":")
        if name != b"data":
            return
        if sep and value.startswith(b" "):
            value = value[1:]
        self._data.append(value)
        self._data_size += len(value) + 1
