"""HTTP/2 wire helpers (kvstack.http.h2_frames): HPACK integers and literals as RFC 7541 writes them, read
back by the hpack package, and which header blocks change the decoder's dynamic table."""

from __future__ import annotations

import hpack
import pytest

from kvstack.http import h2_frames as h2


@pytest.mark.parametrize(
    ("value", "bits", "wire"), [(10, 5, b"\x0a"), (1337, 5, b"\x1f\x9a\x0a"), (42, 8, b"\x2a")]
)
def test_hpack_integers_as_rfc_7541_c1(value: int, bits: int, wire: bytes) -> None:
    assert h2.hpack_int(value, bits) == wire


def test_literals_decode_with_hpack() -> None:
    block = h2.STATUS_200 + h2.literal_indexed_name(h2.STATIC_CONTENT_TYPE, b"application/grpc")
    block += h2.literal(b"grpc-message", b"x" * 300)  # a length over the 7-bit prefix
    decoder = hpack.Decoder()
    assert decoder.decode(block) == [
        (":status", "200"),
        ("content-type", "application/grpc"),
        ("grpc-message", "x" * 300),
    ]
    assert len(decoder.header_table.dynamic_entries) == 0  # literals without indexing: the table is untouched


def test_which_blocks_change_the_dynamic_table() -> None:
    encoder = hpack.Encoder()
    headers = [
        (":method", "POST"),
        (":path", "/a.B/C"),
        ("x-id", "v" * 200),
        ("content-type", "application/grpc"),
    ]
    first = encoder.encode(headers)  # adds the fields to the table
    again = encoder.encode(headers)  # the same fields, now indexed
    assert h2.changes_table(first)
    assert not h2.changes_table(again)
    assert not h2.changes_table(encoder.encode([hpack.NeverIndexedHeaderTuple("x-secret", "s")]))
    assert not h2.changes_table(b"\x04\x86" + b"\xff" * 6)  # a literal path without indexing, Huffman coded
    encoder.header_table_size = 0
    assert h2.changes_table(encoder.encode([(":method", "POST")]))  # a table size update
    long_name = b"\x00\x7f\x01" + b"n" * 128 + b"\x01v"  # a name longer than the 7-bit prefix
    assert not h2.changes_table(long_name)
    assert hpack.Decoder().decode(long_name) == [("n" * 128, "v")]
