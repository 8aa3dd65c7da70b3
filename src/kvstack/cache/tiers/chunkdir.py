"""The disk tier's directory: 256 shard directories of chunk files (``kvstack.cache.tiers.chunkfile``), all
created by `scan`, so a write never creates a directory.

`scan` rebuilds the tier's index at start: temp files (left by a process killed mid-write) are deleted,
``.kv`` files whose name, directory, header or note footer is invalid are deleted, unreadable ones are
skipped, and the rest come back oldest mtime first (the LRU order: a hit bumps its file's mtime).
`remove_all` deletes every chunk and temp file (the tier's ``clear``). Both block: the tier runs them in its
I/O threads.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from kvstack.cache.keys import ChunkKey
from kvstack.cache.tiers.chunkfile import (
    NAME,
    SHARDS,
    SUFFIX,
    TEMP_SUFFIX,
    chunk_path,
    read_header,
    remove_file,
)
from kvstack.cache.tiers.record import CorruptRecord

__all__ = ["remove_all", "scan"]

log = logging.getLogger(__name__)


def scan(root: Path, tier: str) -> list[tuple[ChunkKey, int]]:
    """Creates the shard directories; returns every valid chunk file as (key, bytes), oldest mtime first;
    deletes temp and invalid files. ``tier``: the tier's name, for the log."""
    root.mkdir(parents=True, exist_ok=True)
    for name in SHARDS:
        (root / name).mkdir(exist_ok=True)
    found: list[tuple[int, ChunkKey, int]] = []
    for shard in _shard_dirs(root):
        with os.scandir(shard) as it:
            for entry in it:
                if entry.name.endswith(TEMP_SUFFIX):
                    remove_file(Path(entry.path))
                elif entry.name.endswith(SUFFIX) and entry.is_file(follow_symlinks=False):
                    chunk = _check_header(root, Path(entry.path), entry.name, shard, tier)
                    if chunk is not None:
                        found.append(chunk)
    found.sort(key=lambda item: item[0])
    return [(key, size) for _, key, size in found]


def remove_all(root: Path) -> None:
    """Delete every chunk file and temp file under ``root``."""
    for shard in _shard_dirs(root):
        with os.scandir(shard) as it:
            for entry in it:
                if entry.name.endswith((SUFFIX, TEMP_SUFFIX)):
                    remove_file(Path(entry.path))


def _check_header(
    root: Path, path: Path, name: str, shard: Path, tier: str
) -> tuple[int, ChunkKey, int] | None:
    key = ChunkKey.from_hex(name[:64]) if NAME.fullmatch(name) else None
    try:
        if key is None or os.path.dirname(chunk_path(os.fspath(root), key)) != os.fspath(shard):
            raise CorruptRecord("not a chunk file name, or in the wrong directory")
        with open(path, "rb", buffering=0) as f:
            file_bytes = read_header(f.fileno(), key, read_note=False)[2]
            mtime_ns = os.fstat(f.fileno()).st_mtime_ns
    except CorruptRecord as e:
        log.warning("disk tier %s: deleting invalid chunk file %s (%s)", tier, path, e)
        remove_file(path)
        return None
    except OSError as e:
        log.warning("disk tier %s: skipping unreadable %s (%s)", tier, path, e)
        return None
    return mtime_ns, key, file_bytes


def _shard_dirs(root: Path) -> list[Path]:
    try:
        with os.scandir(root) as it:
            return [Path(e.path) for e in it if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []
