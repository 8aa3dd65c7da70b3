"""HTTP/2 on the wire (RFC 9113) as kvstack's gRPC server writes it: frame types, flags, error codes,
settings, the control frames, and the HPACK literals (RFC 7541) of the header blocks it sends.

Header blocks written here use only the static table and literals *without indexing*: they never add to the
peer's dynamic table, so any SETTINGS_HEADER_TABLE_SIZE the peer sets (0 included) holds without a table
size update. Request header blocks are decoded with the ``hpack`` package (`kvstack.http.grpc_server`).
"""

from __future__ import annotations

import struct
from enum import IntEnum

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# The 9-byte frame header: a 24-bit length (as 8 + 16 bits), type, flags, stream id (top bit reserved).
FRAME_HEADER = struct.Struct(">BHBBI")

# Frame types.
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = (
    range(10)
)
# Flags.
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

# Settings identifiers.
HEADER_TABLE_SIZE = 0x1
ENABLE_PUSH = 0x2
MAX_CONCURRENT_STREAMS = 0x3
INITIAL_WINDOW_SIZE = 0x4
MAX_FRAME_SIZE = 0x5
MAX_HEADER_LIST_SIZE = 0x6

DEFAULT_WINDOW = 65_535
DEFAULT_HEADER_TABLE = 4_096
DEFAULT_MAX_FRAME = 16_384
LARGEST_FRAME = (1 << 24) - 1
MAX_WINDOW = (1 << 31) - 1


class ErrorCode(IntEnum):
    """RST_STREAM and GOAWAY error codes (RFC 9113 §7)."""

    NO_ERROR = 0x0
    PROTOCOL_ERROR = 0x1
    INTERNAL_ERROR = 0x2
    FLOW_CONTROL_ERROR = 0x3
    SETTINGS_TIMEOUT = 0x4
    STREAM_CLOSED = 0x5
    FRAME_SIZE_ERROR = 0x6
    REFUSED_STREAM = 0x7
    CANCEL = 0x8
    COMPRESSION_ERROR = 0x9
    CONNECT_ERROR = 0xA
    ENHANCE_YOUR_CALM = 0xB
    INADEQUATE_SECURITY = 0xC
    HTTP_1_1_REQUIRED = 0xD


class ProtocolError(Exception):
    """The peer broke HTTP/2: the connection ends with GOAWAY ``code``."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def frame_header(kind: int, flags: int, stream_id: int, length: int) -> bytes:
    return FRAME_HEADER.pack(length >> 16, length & 0xFFFF, kind, flags, stream_id)


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return FRAME_HEADER.pack(n >> 16, n & 0xFFFF, kind, flags, stream_id) + payload


def settings(pairs: dict[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", key, value) for key, value in pairs.items()))


SETTINGS_ACK = frame(SETTINGS, ACK, 0)


def parse_settings(payload: bytes) -> list[tuple[int, int]]:
    if len(payload) % 6:
        raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, f"SETTINGS payload of {len(payload)} bytes")
    return [struct.unpack_from(">HI", payload, i) for i in range(0, len(payload), 6)]


def window_update(stream_id: int, increment: int) -> bytes:
    return FRAME_HEADER.pack(0, 4, WINDOW_UPDATE, 0, stream_id) + increment.to_bytes(4, "big")


def rst_stream(stream_id: int, code: ErrorCode) -> bytes:
    return FRAME_HEADER.pack(0, 4, RST_STREAM, 0, stream_id) + int(code).to_bytes(4, "big")


def goaway(last_stream_id: int, code: ErrorCode, debug: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, struct.pack(">II", last_stream_id, int(code)) + debug)


# -- HPACK literals -----------------------------------------------------------------------------------
def hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """An HPACK integer with a ``prefix_bits`` prefix; ``first`` holds the first byte's other bits."""
    top = (1 << prefix_bits) - 1
    if value < top:
        return bytes((first | value,))
    out = bytearray((first | top,))
    value -= top
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _string(raw: bytes) -> bytes:
    return hpack_int(len(raw), 7) + raw


def literal(name: bytes, value: bytes) -> bytes:
    """A header field as a literal without indexing, its name given as a literal too."""
    return b"\x00" + _string(name) + _string(value)


def literal_indexed_name(index: int, value: bytes) -> bytes:
    """A header field as a literal without indexing, its name a static-table index."""
    return hpack_int(index, 4) + _string(value)


STATUS_200 = b"\x88"  # :status 200, static table index 8
STATIC_STATUS = 8  # the static-table index of the :status name
STATIC_CONTENT_TYPE = 31


def changes_table(block: bytes) -> bool:
    """Whether an HPACK header block (well formed) adds to the dynamic table or resizes it: a block that
    does neither decodes to the same fields for as long as the table stays as it is."""
    i, n = 0, len(block)
    while i < n:
        first = block[i]
        if first & 0x80:  # indexed field
            i = _integer_end(block, i, 0x7F)
        elif first & 0x40 or first & 0x20:  # literal with incremental indexing; table size update
            return True
        else:  # literal without indexing or never indexed: a name (index or string), then a value string
            i = _integer_end(block, i, 0x0F) if first & 0x0F else _string_end(block, i + 1)
            i = _string_end(block, i)
    return False


def _integer_value(block: bytes, i: int, mask: int) -> tuple[int, int]:
    """The HPACK integer at ``i`` (``mask``: its prefix bits) and the offset after it."""
    value = block[i] & mask
    i += 1
    if value < mask:
        return value, i
    shift = 0
    while True:
        byte = block[i]
        i += 1
        value += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, i


def _integer_end(block: bytes, i: int, mask: int) -> int:
    return _integer_value(block, i, mask)[1]


def _string_end(block: bytes, i: int) -> int:
    length, i = _integer_value(block, i, 0x7F)
    return i + length
