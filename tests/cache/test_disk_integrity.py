"""A disk tier never serves a corrupt chunk: flipped bytes, large chunks written in pieces, truncated,
temporary and invalid files at start, a writer killed with SIGKILL, and every byte of a record checked."""

from __future__ import annotations

import asyncio
import inspect
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from blake3 import blake3

from kvstack.cache import ChunkKey
from kvstack.cache.tiers import DiskTier
from kvstack.cache.tiers.record import HEADER_BYTES, CorruptRecord, pack_header, payload_of
from support.cache import chunk_path, files, key, payload


def truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


async def test_disk_flipped_bytes_are_a_miss_deleted_and_counted(disk: DiskTier) -> None:
    for i, offset in enumerate([HEADER_BYTES + 777, 9, 20, 50]):  # payload, length, key, checksum
        await disk.put(key(i), payload(i, 2000))
        path = chunk_path(disk.root, key(i))
        raw = bytearray(path.read_bytes())
        raw[offset] ^= 0x01
        path.write_bytes(raw)
        assert await disk.get(key(i)) is None
        assert not path.exists()
        assert await disk.contains([key(i)]) == 0
    assert disk.stats().corrupt == 4 and disk.stats().entries == 0 and disk.stats().bytes == 0


async def test_disk_large_chunks_written_in_pieces_verify_and_catch_flips(tmp_path: Path) -> None:
    import xxhash

    from kvstack.cache.tiers.chunkfile import WRITE_PIECE as _WRITE_PIECE

    tier = DiskTier(tmp_path, 64 << 20)
    await tier.start()
    sizes = [_WRITE_PIECE - 1, _WRITE_PIECE, _WRITE_PIECE + 1, 2 * _WRITE_PIECE + 12345]
    data = {i: blake3(bytes([i])).digest(length=size) for i, size in enumerate(sizes)}
    assert await tier.put_many([(key(i), d) for i, d in data.items()]) == len(sizes)
    for i, d in data.items():
        raw = chunk_path(tier.root, key(i)).read_bytes()
        assert raw[HEADER_BYTES:] == d and raw[48:64] == xxhash.xxh3_128_digest(d)  # one-shot == pieces
        assert bytes(await tier.get(key(i)) or b"") == d
    # A flip in the second piece of a large chunk is caught like any other.
    path = chunk_path(tier.root, key(3))
    flipped = bytearray(path.read_bytes())
    flipped[HEADER_BYTES + _WRITE_PIECE + 100] ^= 0x40
    path.write_bytes(flipped)
    assert await tier.get(key(3)) is None and not path.exists() and tier.stats().corrupt == 1
    await tier.close()


async def test_disk_truncated_file_is_a_miss_and_deleted(disk: DiskTier) -> None:
    await disk.put(key(1), payload(1, 4000))
    path = chunk_path(disk.root, key(1))
    truncate(path, HEADER_BYTES + 1000)
    assert await disk.get(key(1)) is None and not path.exists()
    assert disk.stats().corrupt == 1


async def test_disk_start_cleans_temp_and_invalid_files_and_keeps_others(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    await tier.start()
    await tier.put(key(1), payload(1, 100))
    await tier.put(key(2), payload(2, 100))
    await tier.close()
    shard = chunk_path(tmp_path, key(1)).parent
    tmp = shard / f".{key(1).hex()}.123.0.tmp"
    tmp.write_bytes(b"half a chunk")
    truncated = chunk_path(tmp_path, key(2))
    truncated.write_bytes(truncated.read_bytes()[:-1])
    garbage = chunk_path(tmp_path, key(3))
    garbage.parent.mkdir(parents=True, exist_ok=True)
    garbage.write_bytes(b"not a record")
    misplaced = shard / f"{key(4).hex()}.kv"  # a valid name in the wrong directory
    misplaced.write_bytes(b"x" * 100)
    foreign = tmp_path / "README"
    foreign.write_text("not ours")
    again = DiskTier(tmp_path, 1 << 20)
    await again.start()
    assert again.stats().entries == 1
    assert not tmp.exists() and not truncated.exists() and not garbage.exists() and not misplaced.exists()
    assert foreign.exists()
    assert bytes(await again.get(key(1)) or b"") == payload(1, 100)
    await again.close()


def kill_test_payload(i: int, bases: list[bytes]) -> bytes:
    return i.to_bytes(8, "little") + bases[i % len(bases)]


def kill_test_bases() -> list[bytes]:
    return [blake3(b"base" + bytes([n])).digest(length=n << 18) for n in (1, 2, 4)]


# The writer runs the same payload functions as the checks below (their source, not an import of this
# module: importing pytest would cost each writer a second).
_WRITER_IMPORTS = """
from __future__ import annotations
import asyncio, sys
from blake3 import blake3
from kvstack.cache.keys import ChunkKey
from kvstack.cache.tiers.disk import DiskTier
"""
_WRITER = "\n".join(
    [_WRITER_IMPORTS, *(inspect.getsource(f) for f in (key, kill_test_payload, kill_test_bases))]
) + textwrap.dedent(
    """
    bases = kill_test_bases()
    def payload(i): return kill_test_payload(i, bases)

    async def main(root, first):
        tier = DiskTier(root, 1 << 40, fsync="data")  # a write spends most time with its temp file open
        await tier.start()
        i = first
        while True:
            await tier.put_many([(key(j), payload(j)) for j in range(i, i + 4)])
            i += 4
            if i == first + 8:
                print("writing", flush=True)

    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
    """
)


async def test_disk_kill_9_during_writes_never_serves_a_corrupt_chunk(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    per_round = 100_000  # round r writes chunks r * per_round, r * per_round + 1, ...
    rounds = temp_files_at_kill = 0
    # At least 3 kills, and more until one lands mid-write (a temp file is left): almost always at once.
    while rounds < 3 or (temp_files_at_kill == 0 and rounds < 8):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _WRITER, str(root), str(rounds * per_round), stdout=subprocess.PIPE
        )
        assert proc.stdout is not None
        assert await asyncio.wait_for(proc.stdout.readline(), 20) == b"writing\n"
        await asyncio.sleep(random.uniform(0.05, 0.2))
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        temp_files_at_kill += len(files(root, "*.tmp"))
        rounds += 1
    assert temp_files_at_kill > 0

    tier = DiskTier(root, 1 << 40)
    await tier.start()
    assert not files(root, "*.tmp")
    bases = kill_test_bases()
    served = 0
    for r in range(rounds):
        for i in range(r * per_round, r * per_round + 5_000):
            got = await tier.get(key(i))
            if got is not None:
                assert bytes(got) == kill_test_payload(i, bases), f"chunk {i} served with wrong content"
                served += 1
    assert served == tier.stats().entries == len(files(root, "*.kv")) >= rounds * 8
    assert tier.stats().corrupt == 0
    await tier.close()


def test_payload_of_a_record_checks_every_byte_and_says_what_failed() -> None:
    key = ChunkKey(blake3(b"record").digest())
    payload = os.urandom(5000)
    record = pack_header(key, payload) + payload
    view = payload_of(key, bytearray(record))
    assert view.readonly and bytes(view) == payload
    assert bytes(payload_of(key, memoryview(record))) == payload
    flips = [
        (0, "bad magic"),
        (4, "unknown record version"),
        (8, "header says"),  # the payload length
        (16, "holds chunk"),  # the key
        (48, "payload checksum mismatch"),  # the stored checksum
        (HEADER_BYTES + 4321, "payload checksum mismatch"),  # a payload byte
    ]
    for at, reason in flips:
        broken = bytearray(record)
        broken[at] ^= 0x40
        with pytest.raises(CorruptRecord, match=reason):
            payload_of(key, broken)
    with pytest.raises(CorruptRecord, match="holds chunk"):
        payload_of(ChunkKey(blake3(b"another").digest()), record)
    with pytest.raises(CorruptRecord, match="shorter than its"):
        payload_of(key, record[:40])
    with pytest.raises(CorruptRecord, match="header says"):
        payload_of(key, record[:-1])
