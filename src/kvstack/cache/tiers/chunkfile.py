"""One chunk file of the disk tier: where it lives, what it holds, how it is written and read back.

Path: ``root/ab/<64 hex digits>.kv``, ``ab`` the key's first byte (256 shard directories). Content: one
`record` (64-byte header with magic, version, length, key and xxh3_128 of the payload, then the payload),
optionally followed by a note (the tier listener's ``annotation`` of the chunk: for the cache server, its
parent key and token ids) and a 16-byte footer (the note's length, its xxh3_64, ``b"KVNT"``). A note that
fails its checksum only keeps the chunk from being announced; a broken footer makes the file invalid.

`write_record` writes a record into a new file, checksumming a large payload piece by piece as it copies it
out (the header, which holds the checksum, last). `map_payload` maps a file read-only and verifies header,
length, footer framing and checksum on the mapping: the payload comes back as a read-only view that keeps
the mapping alive, so it holds the verified bytes even after the file is replaced or deleted (something
truncating the file in place while a view is held would make reading the view fault with SIGBUS).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import mmap
import os
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import cast

import xxhash

from kvstack.cache.keys import ChunkKey
from kvstack.cache.tiers.record import (
    HEADER_BYTES,
    CorruptRecord,
    checksum_pieces,
    pack_header,
    payload_length,
    verify_record,
)

__all__ = [
    "NAME",
    "SHARDS",
    "SUFFIX",
    "TEMP_SUFFIX",
    "WRITE_PIECE",
    "chunk_path",
    "file_bytes_of",
    "fsync_dir",
    "map_payload",
    "note_footer",
    "read_header",
    "remove_file",
    "start_writeback",
    "temp_path",
    "write_record",
]

log = logging.getLogger(__name__)

SUFFIX = ".kv"
TEMP_SUFFIX = ".tmp"
NAME = re.compile(r"[0-9a-f]{64}\.kv")
SHARDS = [f"{n:02x}" for n in range(256)]
WRITE_PIECE = 1 << 20  # fits the L2 cache with room to spare
_NOTE_FOOTER = struct.Struct("<I8s4s")  # note length, xxh3_64 of the note, magic
_NOTE_MAGIC = b"KVNT"
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux
_SYNC_FILE_RANGE_WRITE = 2


def chunk_path(root: str, key: ChunkKey) -> str:
    # A plain string: building a pathlib.Path costs as much as opening the file.
    text = key.hex()
    return f"{root}/{text[:2]}/{text}{SUFFIX}"


def temp_path(root: str, key: ChunkKey, n: int) -> str:
    """Where a write of ``key`` goes before its rename: ``.<hex>.<pid>.<n>.tmp`` in the chunk's directory."""
    text = key.hex()
    return f"{root}/{text[:2]}/.{text}.{os.getpid()}.{n}{TEMP_SUFFIX}"


def file_bytes_of(payload_bytes: int, note: bytes | None) -> int:
    """The size of the chunk file of a ``payload_bytes`` payload with ``note``."""
    return HEADER_BYTES + payload_bytes + (0 if note is None else len(note) + _NOTE_FOOTER.size)


def remove_file(path: str | Path) -> bool:
    """Delete ``path``; False (logged) when it is still there."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("cannot delete %s: %s", path, e)
        return False
    return True


def read_header(fd: int, key: ChunkKey, *, read_note: bool = True) -> tuple[bytes, int, int, bytes | None]:
    """(header, payload length, file bytes, note) of an open chunk file; raises `CorruptRecord` when the
    header or the note's footer is invalid or the file size disagrees with them. The note is read (and its
    checksum checked) only with ``read_note``."""
    file_bytes = os.fstat(fd).st_size
    header = os.pread(fd, HEADER_BYTES, 0)
    length = payload_length(key, header)
    record_end = HEADER_BYTES + length
    if file_bytes < record_end:
        raise CorruptRecord(f"header says {length} payload bytes, the file holds {file_bytes - HEADER_BYTES}")
    if record_end == file_bytes:
        return header, length, file_bytes, None
    footer = os.pread(fd, _NOTE_FOOTER.size, file_bytes - _NOTE_FOOTER.size)
    note_bytes = _note_bytes(footer, file_bytes - record_end)
    if not read_note:
        return header, length, file_bytes, None
    note = os.pread(fd, note_bytes, record_end)
    if note_footer(note) != footer:
        raise CorruptRecord("the chunk's note fails its checksum")
    return header, length, file_bytes, note


def note_footer(note: bytes) -> bytes:
    return _NOTE_FOOTER.pack(len(note), xxhash.xxh3_64_digest(note), _NOTE_MAGIC)


def _note_bytes(footer: bytes | memoryview, trailing: int) -> int:
    """The length of the note whose footer is ``footer``, given ``trailing`` bytes after the record;
    raises `CorruptRecord` unless they are exactly a note and its footer."""
    if trailing < _NOTE_FOOTER.size or len(footer) != _NOTE_FOOTER.size:
        raise CorruptRecord(f"{trailing} bytes after the record, not a note")
    length, _, magic = _NOTE_FOOTER.unpack(footer)
    if magic != _NOTE_MAGIC or length + _NOTE_FOOTER.size != trailing:
        raise CorruptRecord(f"{trailing} bytes after the record are not a note (magic {magic!r}, {length})")
    return int(length)


def map_payload(key: ChunkKey, fd: int, *, cached: bool = False) -> tuple[memoryview, int]:
    """The verified payload of ``key``'s open file ``fd`` as a read-only view of a mapping, and the file's
    size; raises `CorruptRecord` or `OSError`. ``cached``: all its pages are in the page cache, so the
    mapping's page table is filled in the map call (``MAP_POPULATE``) instead of by one fault per few pages
    during the checksum pass."""
    flags = mmap.MAP_SHARED | (_MAP_POPULATE if cached else 0)
    file_bytes = os.lseek(fd, 0, os.SEEK_END)  # the size, without building a stat result
    if file_bytes < HEADER_BYTES:
        raise CorruptRecord(f"file of {file_bytes} bytes, shorter than a {HEADER_BYTES}-byte header")
    mapping = mmap.mmap(fd, file_bytes, flags=flags, prot=mmap.PROT_READ)
    return _verified_payload(key, mapping), file_bytes


def _verified_payload(key: ChunkKey, mapping: mmap.mmap) -> memoryview:
    """The payload of a mapped chunk file as a read-only view that keeps the mapping alive; raises
    `CorruptRecord` (after unmapping) unless the whole record verifies (a note after it must be framed
    right; its own checksum is checked when it is read, by ``announce_held``)."""
    with memoryview(mapping) as record:
        payload: memoryview | None = None
        try:
            with record[:HEADER_BYTES] as header:
                record_end = HEADER_BYTES + payload_length(key, header)
                if record_end < len(record):
                    with record[-_NOTE_FOOTER.size :] as footer:
                        _note_bytes(footer, len(record) - record_end)
                payload = record[HEADER_BYTES:record_end]
                verify_record(key, header, payload)
        except BaseException:
            if payload is not None:
                payload.release()
            record.release()
            mapping.close()
            raise
        return payload


def write_record(fd: int, key: ChunkKey, payload: memoryview, tail: list[memoryview]) -> None:
    """Write the record of ``payload`` (header, payload) and ``tail`` into the new file ``fd``. A payload over
    ``WRITE_PIECE`` is checksummed and written piece by piece, each piece hashed just before it is copied
    out, while it is in the CPU cache: one pass over the payload from memory instead of two; the header,
    which holds the checksum, is written last, at offset 0."""
    if payload.nbytes <= WRITE_PIECE:
        _write_all(fd, [memoryview(pack_header(key, payload)), payload, *tail])
        return
    hasher = checksum_pieces()
    os.lseek(fd, HEADER_BYTES, os.SEEK_SET)
    for start in range(0, payload.nbytes, WRITE_PIECE):
        piece = payload[start : start + WRITE_PIECE]
        hasher.update(piece)
        _write_all(fd, [piece])
    _write_all(fd, tail)
    header = pack_header(key, payload, hasher.digest())
    if os.pwrite(fd, header, 0) != len(header):  # 64 bytes into a regular file: short only on a fault
        raise OSError(errno.EIO, "short write of a chunk header")


def _write_all(fd: int, parts: list[memoryview]) -> None:
    while parts:
        written = os.writev(fd, parts)
        while parts and written >= parts[0].nbytes:
            written -= parts[0].nbytes
            parts = parts[1:]
        if written:
            parts[0] = parts[0][written:]


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's sync_file_range (Linux), or None where there is none."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return cast(Callable[[int, int, int, int], int], call)


def start_writeback(fd: int) -> None:
    """Start writing the file's dirty pages to the disk without waiting (a hint: fdatasync still decides)."""
    call = _sync_file_range()
    if call is not None:
        call(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
