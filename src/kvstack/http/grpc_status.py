"""gRPC status codes, the error a handler raises to end a call with one, and the trailers that carry them.

A status travels in the trailers as ``grpc-status`` (decimal) and ``grpc-message`` (UTF-8, percent-encoded
outside printable ASCII, as the gRPC HTTP/2 protocol says). Trailers are HPACK literals without indexing
(`kvstack.http.h2_frames`); the ones without a message are encoded once per status.
"""

from __future__ import annotations

from enum import IntEnum
from functools import lru_cache

from kvstack.http.h2_frames import STATIC_CONTENT_TYPE, STATUS_200, literal, literal_indexed_name

__all__ = ["RESPONSE_HEADERS", "GrpcError", "Status", "trailers"]


class Status(IntEnum):
    """gRPC status codes."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class GrpcError(Exception):
    """Ends a call with ``status`` and ``message`` (raised by a `kvstack.http.grpc_server.unary` function)."""

    def __init__(self, status: int, message: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.message = message


# :status 200 and content-type application/grpc: the response headers of every call.
RESPONSE_HEADERS = STATUS_200 + literal_indexed_name(STATIC_CONTENT_TYPE, b"application/grpc")


def percent_encode(message: str) -> bytes:
    """``grpc-message``'s encoding: bytes outside 0x20-0x7E, and ``%`` itself, as ``%XX``."""
    raw = message.encode("utf-8", "replace")
    if all(0x20 <= b <= 0x7E and b != 0x25 for b in raw):
        return raw
    return b"".join(b"%%%02X" % b if b < 0x20 or b > 0x7E or b == 0x25 else bytes((b,)) for b in raw)


@lru_cache(maxsize=64)
def _status_only(status: int) -> bytes:
    return literal(b"grpc-status", b"%d" % status)


def trailers(status: int, message: str = "") -> bytes:
    """The header block of the trailers: ``grpc-status`` and, when given, ``grpc-message``."""
    if not message:
        return _status_only(int(status))
    return _status_only(int(status)) + literal(b"grpc-message", percent_encode(message))
