"""Request header blocks read for the gRPC server: decoded with ``hpack`` into a `RequestHead`.

One `HeaderReader` per connection holds the HPACK decoder and its dynamic table. A block that neither adds
to the table nor resizes it (`kvstack.http.h2_frames.changes_table`) decodes to the same fields for as long as
the table stays as it is, so such blocks are kept, decoded, until the table changes (Envoy sends the same
block for every ext_proc stream; hpack's decode would be most of a call's CPU). The table size we announce
(SETTINGS_HEADER_TABLE_SIZE) binds the peer from its SETTINGS ACK on (``settings_acked``); a larger size
than the default holds from the start.
"""

from __future__ import annotations

from typing import NamedTuple, cast

import hpack

from kvstack.http import h2_frames as h2

__all__ = ["HeaderReader", "RequestHead"]

MAX_HEADER_LIST = 64 << 10  # SETTINGS_MAX_HEADER_LIST_SIZE we announce (decoded size, as hpack counts it)
MAX_KEPT = 256  # decoded blocks kept per connection
# Headers that describe the call's transport rather than its metadata.
_NOT_METADATA = frozenset({"content-type", "te", "grpc-timeout", "grpc-encoding", "grpc-accept-encoding"})


class RequestHead(NamedTuple):
    """What a request's headers say."""

    path: str
    method: str  # the HTTP method
    content_type: str
    metadata: tuple[tuple[str, str], ...]  # every other field but the transport's own (te, grpc-timeout, ...)


class HeaderReader:
    """The connection's HPACK decoder, and the blocks it decoded that leave its table unchanged."""

    def __init__(self, table_size: int) -> None:
        self.table_size = table_size
        self._decoder = hpack.Decoder(MAX_HEADER_LIST)
        self._decoder.max_allowed_table_size = max(table_size, h2.DEFAULT_HEADER_TABLE)
        self._version = 0  # bumped whenever the table may have changed
        self._kept: dict[bytes, tuple[int, RequestHead]] = {}

    def read(self, block: bytes) -> RequestHead:
        """The fields of a complete header block (`h2_frames.ProtocolError` for a bad one)."""
        kept = self._kept.get(block)
        if kept is not None and kept[0] == self._version:
            return kept[1]
        try:
            fields = cast(list[tuple[str, str]], self._decoder.decode(block))
        except hpack.OversizedHeaderListError as exc:
            raise h2.ProtocolError(h2.ErrorCode.ENHANCE_YOUR_CALM, str(exc)) from exc
        except (hpack.HPACKError, ValueError, IndexError) as exc:
            raise h2.ProtocolError(h2.ErrorCode.COMPRESSION_ERROR, f"bad header block: {exc}") from exc
        head = _head(fields)
        if h2.changes_table(block):
            self._version += 1
        else:
            if len(self._kept) >= MAX_KEPT:
                self._kept.clear()
            self._kept[block] = (self._version, head)
        return head

    def settings_acked(self) -> None:
        """The peer took our SETTINGS: our table size binds it from now on."""
        self._decoder.max_allowed_table_size = self.table_size
        self._version += 1  # kept blocks are checked against the new size again


def _head(fields: list[tuple[str, str]]) -> RequestHead:
    path = method = content_type = ""
    metadata = []
    for name, value in fields:
        if name[0] == ":":
            if name == ":path":
                path = value
            elif name == ":method":
                method = value
        elif name == "content-type":
            content_type = value
        elif name not in _NOT_METADATA:
            metadata.append((name, value))
    return RequestHead(path, method, content_type, tuple(metadata))
