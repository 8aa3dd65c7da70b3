"""The stored form of one chunk in the disk and Redis tiers: a 64-byte header, then the payload.

Header (little-endian, 64 bytes)::

    offset size field
    0      4    magic b"KVSC"
    4      2    format version (1)
    6      2    reserved, 0
    8      8    payload length in bytes
    16     32   the chunk key
    48     16   xxh3_128 of the payload

Every byte of a record is checked on read: magic, version, reserved and key by comparison, the length
against the record's actual size, the payload by its checksum (so a flipped header byte is caught too).
xxh3_128 detects accidental corruption (torn writes, bit rot, a bad copy) at memory speed; it is not a
defence against someone who can write the cache's files or Redis keys.
"""

from __future__ import annotations

import struct

import xxhash

from kvstack.cache.keys import ChunkKey

__all__ = [
    "HEADER_BYTES",
    "CorruptRecord",
    "checksum",
    "checksum_pieces",
    "pack_header",
    "payload_length",
    "payload_of",
    "verify_record",
]

_HEADER = struct.Struct("<4sHHQ32s16s")
_HEADER_FIELDS = struct.Struct("<4sHHQ32s")  # the header up to its checksum
HEADER_BYTES = _HEADER.size
MAGIC = b"KVSC"
VERSION = 1


class CorruptRecord(ValueError):
    """A stored chunk failed verification; the message says which check."""


def checksum(payload: bytes | bytearray | memoryview) -> bytes:
    return xxhash.xxh3_128_digest(payload)


def checksum_pieces() -> xxhash.xxh3_128:
    """A hasher whose ``digest()``, after ``update`` with each consecutive piece of a payload, is the
    payload's `checksum`."""
    return xxhash.xxh3_128()


def pack_header(key: ChunkKey, payload: bytes | bytearray | memoryview, digest: bytes | None = None) -> bytes:
    """The header of ``payload``; ``digest``: its `checksum`, when the caller computed it already."""
    return _HEADER.pack(MAGIC, VERSION, 0, len(payload), key, checksum(payload) if digest is None else digest)


def payload_length(key: ChunkKey, header: bytes | bytearray | memoryview) -> int:
    """The payload length a header announces for ``key``, after checking everything but the checksum."""
    if len(header) < HEADER_BYTES:
        raise CorruptRecord(f"record of {len(header)} bytes is shorter than its {HEADER_BYTES}-byte header")
    magic, version, reserved, length, stored_key, _ = _HEADER.unpack_from(header)
    if magic != MAGIC:
        raise CorruptRecord(f"bad magic {magic!r} (expected {MAGIC!r})")
    if version != VERSION or reserved != 0:
        raise CorruptRecord(f"unknown record version {version}.{reserved} (this build reads {VERSION}.0)")
    if stored_key != key:
        raise CorruptRecord(f"record holds chunk {stored_key.hex()[:16]}…, not {key.hex()[:16]}…")
    return int(length)


def payload_of(key: ChunkKey, record: bytes | bytearray | memoryview) -> memoryview:
    """The payload of ``record`` (header and payload in one buffer) as a read-only view, once every byte of
    it is verified; raises `CorruptRecord`."""
    view = memoryview(record).toreadonly()
    payload = view[HEADER_BYTES:]
    verify_record(key, view[:HEADER_BYTES], payload)
    return payload


def verify_record(key: ChunkKey, header: bytes | bytearray | memoryview, payload: memoryview) -> None:
    """Raise `CorruptRecord` unless ``header`` + ``payload`` is a valid record of ``key``."""
    # The usual case in two comparisons: everything before the checksum as a sound record would have it,
    # then the checksum. Only a record that fails goes through the field-by-field checks, for the message.
    if header[:48] == _HEADER_FIELDS.pack(MAGIC, VERSION, 0, len(payload), key) and header[48:64] == checksum(
        payload
    ):
        return
    length = payload_length(key, header)
    if length != len(payload):
        raise CorruptRecord(f"header says {length} payload bytes, record has {len(payload)}")
    expected = bytes(header[48:64])
    if checksum(payload) != expected:
        raise CorruptRecord("payload checksum mismatch")
    raise CorruptRecord("record differs from its sound form")  # not reached: the checks above cover it all
