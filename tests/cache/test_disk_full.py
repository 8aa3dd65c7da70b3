"""The disk tier on a full file system, and when a chunk file cannot be deleted.

A full disk is injected, not mounted: `SmallFileSystem` makes the tier's real directory behave like a file
system of a fixed size (a record written past it fails with ENOSPC after writing what fits, and its free
space is the size less the bytes of every file under the root)."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import threading
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
from blake3 import blake3

from kvstack import logs
from kvstack.cache import ChunkKey
from kvstack.cache.tiers import DiskTier
from kvstack.cache.tiers import disk as disk_module
from kvstack.cache.tiers.record import HEADER_BYTES, payload_length, payload_of

CHUNK = 1000
FILE = HEADER_BYTES + CHUNK  # bytes of one chunk file without a note


def key(i: int) -> ChunkKey:
    return ChunkKey(blake3(b"full" + str(i).encode()).digest())


def payload(i: int, size: int = CHUNK) -> bytes:
    return blake3(b"payload" + str(i).encode()).digest(length=size)


def files_under(root: Path) -> list[Path]:
    """Every file in the tier's shard directories (os.scandir: a pathlib glob is ~10x slower here)."""
    return [Path(entry.path) for shard in os.scandir(root) for entry in os.scandir(shard.path)]


def chunk_files(root: Path, listed: list[Path] | None = None) -> dict[ChunkKey, Path]:
    listed = files_under(root) if listed is None else listed
    return {ChunkKey.from_hex(p.name[:64]): p for p in listed if p.name.endswith(".kv")}


def temp_files(root: Path) -> list[Path]:
    return [p for p in files_under(root) if p.name.endswith(".tmp")]


class SmallFileSystem:
    """The tier's directory as a file system of ``size`` bytes (settable: other data comes and goes)."""

    def __init__(self, root: Path, size: int, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self.size = size
        self.refused = 0
        self._lock = threading.Lock()  # a check and its write are one step, as in a real file system
        write_record = disk_module.write_record

        def write_or_fill(fd: int, k: ChunkKey, data: memoryview, tail: list[memoryview]) -> None:
            with self._lock:
                room = self.size - self.used()
                if HEADER_BYTES + data.nbytes + sum(part.nbytes for part in tail) > room:
                    os.write(fd, bytes(max(room, 0)))  # what fits, as a real one does before ENOSPC
                    self.refused += 1
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                write_record(fd, k, data, tail)

        monkeypatch.setattr(disk_module, "write_record", write_or_fill)
        monkeypatch.setattr(disk_module, "_free_bytes", lambda path: max(0, self.size - self.used()))

    def used(self) -> int:
        total = 0
        for shard in os.scandir(self.root):
            with os.scandir(shard.path) as files:
                for entry in files:
                    with contextlib.suppress(FileNotFoundError):  # deleted by a tier thread meanwhile
                        total += entry.stat().st_size
        return total


class FakeClock:
    """The monotonic clock of the disk tier and of its throttled warnings, moved by the test."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 1000.0
        clock = SimpleNamespace(monotonic=lambda: self.now)
        monkeypatch.setattr(disk_module, "time", clock)
        monkeypatch.setattr(logs, "time", clock)


class Listener:
    """Hears stored/removed in order; keeps a note with the chunks ``noted`` says should have one."""

    def __init__(self, noted: set[ChunkKey] | None = None) -> None:
        self.events: list[tuple[str, ChunkKey]] = []
        self.noted = noted or set()

    def stored(self, tier: object, keys: Sequence[ChunkKey]) -> None:
        self.events += [("stored", k) for k in keys]

    def removed(self, tier: object, keys: Sequence[ChunkKey]) -> None:
        self.events += [("removed", k) for k in keys]

    def annotation(self, k: ChunkKey) -> bytes | None:
        return b"note of " + k.hex().encode() if k in self.noted else None

    def restored(self, tier: object, items: Sequence[tuple[ChunkKey, bytes]], done: bool) -> None:
        pass

    def held(self) -> set[ChunkKey]:
        """What the tier holds as far as the events tell."""
        held: set[ChunkKey] = set()
        for what, k in self.events:
            (held.add if what == "stored" else held.discard)(k)
        return held

    def removed_keys(self) -> list[ChunkKey]:
        return [k for what, k in self.events if what == "removed"]


async def test_a_full_disk_makes_room_by_evicting_the_oldest_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    FakeClock(monkeypatch)  # no free-space re-check happens here
    fs = SmallFileSystem(tmp_path, 10 * FILE + FILE // 2, monkeypatch)
    tier = DiskTier(tmp_path, 100 << 20)  # a budget far larger than the file system
    await tier.start()
    heard = Listener()
    tier.listener = heard
    for i in range(10):
        assert await tier.put(key(i), payload(i))
    assert not await tier.put(key(10), payload(10))  # the disk is full: that write is dropped
    stats = tier.stats()
    assert (fs.refused, stats.write_drops, stats.errors, stats.evictions) == (1, 1, 1, 0)
    assert not temp_files(tmp_path)  # the partial file is gone

    assert await tier.get(key(0)) is not None  # 0 is now the most recently used: 1 goes first
    for i in range(11, 16):  # each new chunk takes the place of the oldest
        assert await tier.put(key(i), payload(i))
    assert heard.removed_keys() == [key(i) for i in (1, 2, 3, 4, 5)]
    held = [key(i) for i in (6, 7, 8, 9, 0, 11, 12, 13, 14, 15)]
    assert await tier.contains(held) == 10 and list(tier._index) == held
    assert set(chunk_files(tmp_path)) == set(held) == heard.held()
    got = await tier.get_many(held)
    assert [bytes(g or b"") for g in got] == [payload(i) for i in (6, 7, 8, 9, 0, 11, 12, 13, 14, 15)]
    stats = tier.stats()
    assert (fs.refused, stats.write_drops, stats.evictions, stats.entries) == (1, 1, 5, 10)
    assert stats.bytes == 10 * FILE == fs.used()
    assert tier.limit_bytes == 10 * FILE and stats.capacity_bytes == 100 << 20  # the budget as configured
    await tier.close()


@pytest.mark.slow
async def test_the_index_matches_the_files_through_a_random_workload_on_a_full_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(disk_module, "_ROOM_RECHECK_S", 0.0)  # every put re-checks the free space
    fs = SmallFileSystem(tmp_path, 40_000, monkeypatch)
    tier = DiskTier(tmp_path, 1 << 20)
    await tier.start()
    heard = Listener(noted={key(i) for i in range(0, 60, 3)})  # a third of the chunks carry a note
    tier.listener = heard
    rng = random.Random(7)
    latest: dict[ChunkKey, bytes] = {}  # the payload last stored under each key
    attempts = stored = 0  # puts since the disk first filled up

    async def put(items: list[tuple[ChunkKey, bytes]]) -> None:
        nonlocal attempts, stored
        full = fs.refused > 0
        await tier.put_many(items)
        for k, data in items:
            if k in tier._index:
                latest[k] = data
            else:
                latest.pop(k, None)
        if full:
            attempts += len(items)
            stored += sum(k in tier._index for k, _ in items)

    for step in range(200):
        op = rng.random()
        if op < 0.6:
            i = rng.randrange(60)
            await put([(key(i), payload(1000 * step + i, rng.randrange(200, 3000)))])
        elif op < 0.8:
            ids = rng.sample(range(60), rng.randrange(2, 5))
            await put([(key(i), payload(1000 * step + i, rng.randrange(200, 3000))) for i in ids])
        elif op < 0.9:
            await tier.get_many([key(rng.randrange(60)) for _ in range(3)])  # hits move chunks up the LRU
        elif latest:
            k = rng.choice(sorted(latest))
            assert await tier.delete(k) and k not in tier._index
            del latest[k]
        # What the index claims is exactly what is on the disk, each file verifies, the listener agrees.
        listed = files_under(tmp_path)
        files = chunk_files(tmp_path, listed)
        assert set(files) == set(tier._index) == heard.held() and len(files) == len(listed), step
        latest = {k: data for k, data in latest.items() if k in files}  # evicted ones are gone
        assert tier.stats().bytes == sum(p.stat().st_size for p in files.values()) == fs.used() <= fs.size
        for k, path in files.items():
            raw = path.read_bytes()
            record = raw[: HEADER_BYTES + payload_length(k, raw[:HEADER_BYTES])]
            assert bytes(payload_of(k, record)) == latest[k]
    assert fs.refused >= 1 and attempts > 150
    assert stored >= 0.95 * attempts  # after the first refusal, nearly every write finds room
    got = await tier.get_many(sorted(latest))
    assert [bytes(g or b"") for g in got] == [latest[k] for k in sorted(latest)]
    await tier.close()


async def test_the_tier_uses_more_of_its_budget_once_the_file_system_has_room_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock(monkeypatch)
    recheck_s = disk_module._ROOM_RECHECK_S
    fs = SmallFileSystem(tmp_path, 10 * FILE + FILE // 2, monkeypatch)
    tier = DiskTier(tmp_path, 15 * FILE)
    await tier.start()
    for i in range(10):
        assert await tier.put(key(i), payload(i))
    assert not await tier.put(key(10), payload(10))
    assert await tier.put(key(11), payload(11))  # in place of the oldest

    fs.size = 13 * FILE + FILE // 2  # other data was deleted: 3.5 chunks free
    clock.now += recheck_s / 2  # too early for a re-check: the tier still makes room by evicting
    assert await tier.put(key(12), payload(12))
    assert tier.stats().entries == 10 and tier.limit_bytes == 10 * FILE
    clock.now += recheck_s  # re-checked: what it holds plus what is free
    for i in range(13, 16):
        assert await tier.put(key(i), payload(i))
    assert tier.limit_bytes == 13 * FILE + FILE // 2
    assert tier.stats().entries == 13 and tier.stats().evictions == 2
    assert await tier.put(key(16), payload(16))  # a 14th does not fit: the oldest goes
    assert tier.stats().entries == 13 and tier.stats().evictions == 3

    fs.size = 100 * FILE  # plenty: the budget bounds the tier again, never more
    clock.now += recheck_s
    with caplog.at_level(logging.INFO, logger=disk_module.__name__):
        for i in range(17, 22):
            assert await tier.put(key(i), payload(i))
    assert tier.limit_bytes == tier.capacity_bytes == 15 * FILE
    assert tier.stats().entries == 15 and tier.stats().evictions == 3 + 3
    assert f"has room again: back to the full {15 * FILE}-byte budget" in caplog.text
    assert fs.refused == 1 and set(chunk_files(tmp_path)) == set(tier._index)
    await tier.close()


async def test_repeated_write_failures_log_one_warning_per_kind_and_count_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock(monkeypatch)
    monkeypatch.setattr(disk_module, "_ROOM_RECHECK_S", 0.0)
    # A file system that says it has room but refuses every write (an exhausted quota looks like this to
    # statvfs), and one that fails with EIO: every put reaches the disk and fails.
    failing = {errno.ENOSPC: range(0, 20), errno.EIO: range(100, 120)}

    def refuse(fd: int, k: ChunkKey, data: memoryview, tail: list[memoryview]) -> None:
        code = next(code for code, ids in failing.items() if k in {key(i) for i in ids})
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(disk_module, "write_record", refuse)
    monkeypatch.setattr(disk_module, "_free_bytes", lambda path: 1 << 30)
    tier = DiskTier(tmp_path, 1 << 20)
    await tier.start()
    with caplog.at_level(logging.WARNING, logger=disk_module.__name__):
        for i in [*range(0, 20), *range(100, 120)]:
            assert not await tier.put(key(i), payload(i))
        warnings = [r.getMessage() for r in caplog.records]
        assert len(warnings) == 2  # one per kind, not one per failed write
        assert f"cannot write chunk {key(0).hex()}: [Errno {errno.ENOSPC}]" in warnings[0]
        assert "evicting the oldest chunks for new ones" in warnings[0]
        assert f"cannot write chunk {key(100).hex()}: [Errno {errno.EIO}]" in warnings[1]
        stats = tier.stats()
        assert (stats.write_drops, stats.errors, stats.writes) == (40, 40, 0)

        caplog.clear()
        clock.now += disk_module._WARN_EVERY_S  # the next failure of a kind is logged with the count
        assert not await tier.put(key(5), payload(5))
        assert not await tier.put(key(105), payload(105))
    assert [r.getMessage().endswith("(and 19 similar since the last report)") for r in caplog.records] == [
        True,
        True,
    ]
    assert not chunk_files(tmp_path) and not temp_files(tmp_path)
    await tier.close()


async def test_delete_is_false_and_the_chunk_stays_indexed_when_its_file_cannot_be_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    await tier.start()
    heard = Listener()
    tier.listener = heard
    assert await tier.put_many([(key(i), payload(i)) for i in range(3)]) == 3
    stuck = chunk_files(tmp_path)[key(1)]
    unlink = os.unlink

    def read_only_unlink(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> None:
        if Path(path) == stuck:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
        unlink(path, dir_fd=dir_fd)

    with monkeypatch.context() as patch:
        patch.setattr(os, "unlink", read_only_unlink)
        assert not await tier.delete(key(1))  # the file is still there: so is its index entry
        assert await tier.delete(key(2))
    assert stuck.exists() and await tier.contains([key(0), key(1)]) == 2
    assert bytes(await tier.get(key(1)) or b"") == payload(1)
    assert heard.removed_keys() == [key(2)] and tier.stats().errors == 1
    assert set(chunk_files(tmp_path)) == set(tier._index) == {key(0), key(1)}
    assert await tier.delete(key(1)) and not stuck.exists()  # writable again
    assert heard.removed_keys() == [key(2), key(1)]
    await tier.close()
