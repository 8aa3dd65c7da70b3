"""Cache servers and tiers for tests: a server in this event loop (``serving``), one on a loop in a thread
for the synchronous client (``ThreadServer``), ``kvstack cache-server`` processes, a dict-backed shared
tier, a tier listener that records what it hears, and what the tier tests share: chunk keys and payloads,
a disk tier's chunk-file path and files, and a count of its thread jobs."""

from __future__ import annotations

import asyncio
import mmap
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from concurrent.futures import Future
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from blake3 import blake3

from kvstack.cache import ChunkKey, TieredStore
from kvstack.cache.client import CacheClient
from kvstack.cache.server import CacheServer
from kvstack.cache.tiers import DiskTier, MemoryTier, Payload, Tier, TierStats
from support.ports import free_port
from support.processes import kill_group, spawn, stop_group

T = TypeVar("T")


@asynccontextmanager
async def serving(
    tiers: Sequence[Tier] | None = None, *, chunk_size: int = 4, **options: Any
) -> AsyncIterator[CacheServer]:
    """A cache server on ``tiers`` (16 MiB of memory by default) in this event loop, on a free port
    unless ``bind`` says otherwise; ``options`` go to `CacheServer`."""
    store = TieredStore(tiers or [MemoryTier(16 << 20)])
    await store.start()
    server = CacheServer(store, options.pop("bind", "tcp://127.0.0.1:0"), chunk_size=chunk_size, **options)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
        await store.stop()


class ThreadServer:
    """A cache server on its own event loop in a thread, for the synchronous client."""

    def __init__(self, bind: str = "tcp://127.0.0.1:0", memory_bytes: int = 64 << 20, **kwargs: Any) -> None:
        self._bind = bind
        self._memory = memory_bytes
        self._kwargs = kwargs
        self._ready: Future[CacheServer] = Future()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        store = TieredStore([MemoryTier(self._memory)])
        await store.start()
        server = CacheServer(store, self._bind, **self._kwargs)
        try:
            await server.start()
        except BaseException as e:
            self._ready.set_exception(e)
            return
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._ready.set_result(server)
        await self._stop.wait()
        await server.stop()
        await store.stop()

    def __enter__(self) -> CacheServer:
        self._thread.start()
        return self._ready.result(timeout=10)

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)

    def run(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(make(), self._loop).result(timeout=10)


@dataclass
class CacheServerProcess:
    """A ``kvstack cache-server`` subprocess (in a process group of its own) and where to reach it."""

    endpoint: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    replay_endpoint: str = ""
    unix_endpoint: str = ""

    def client(self) -> CacheClient:
        return CacheClient(self.endpoint, shm=False, timeout_s=5.0)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM (SIGKILL after ``timeout_s``); the exit status."""
        return stop_group(self.proc, timeout_s)

    def kill(self) -> None:
        """kill -9."""
        kill_group(self.proc)


def start_cache_server(
    workdir: Path,
    *options: str,
    bind: str = "",
    unix_socket: Path | None = None,
    events: bool = False,
) -> CacheServerProcess:
    """``kvstack cache-server`` with ``options``, on ``bind`` (a free TCP port by default), a unix socket
    and KV events with replay on free ports if asked; logs to workdir/cache-server.log (appended, so a
    restarted server keeps one log). Returns at once: callers wait until it serves."""
    endpoint = bind or f"tcp://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "kvstack.cache.cli", "cache-server", "--bind", endpoint, *options]
    replay = ""
    if unix_socket is not None:
        cmd += ["--unix-socket", str(unix_socket)]
    if events:
        replay = f"tcp://127.0.0.1:{free_port()}"
        cmd += ["--events", f"tcp://127.0.0.1:{free_port()}", "--events-replay", replay]
    log_path = workdir / "cache-server.log"
    proc = spawn(cmd, log_path)
    unix_endpoint = f"unix://{unix_socket}" if unix_socket is not None else ""
    return CacheServerProcess(endpoint, proc, log_path, replay, unix_endpoint)


RESTART_SECRET = b"restart-secret"


def start_restartable_server(workdir: Path, port: int, *options: str) -> CacheServerProcess:
    """A small ``kvstack cache-server`` on a fixed ``port`` (a restart comes back at the same address), node
    ``proc``, its secret ``RESTART_SECRET`` read from a file (with whitespace around it)."""
    (workdir / "secret").write_text(f"  {RESTART_SECRET.decode()}\n")
    secret = ["--secret-file", str(workdir / "secret")]
    small = ["--memory-gb", "0.05", "--node", "proc", "--log-level", "warning"]
    return start_cache_server(workdir, *options, *small, *secret, bind=f"tcp://127.0.0.1:{port}")


class DictTier(Tier):
    """A shared tier stand-in (Redis-like: neither memory nor disk), reporting its writes."""

    def __init__(self) -> None:
        self.name = "shared"
        self.data: dict[ChunkKey, bytes] = {}

    async def contains(self, keys: Sequence[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.data:
            n += 1
        return n

    async def get(self, key: ChunkKey) -> bytes | None:
        return self.data.get(key)

    async def put(self, key: ChunkKey, data: Payload) -> bool:
        self.data[key] = bytes(data)
        if self.listener is not None:
            self.listener.stored(self, [key])
        return True

    async def delete(self, key: ChunkKey) -> bool:
        if self.data.pop(key, None) is None:
            return False
        if self.listener is not None:
            self.listener.removed(self, [key])
        return True

    async def clear(self) -> None:
        self.data.clear()

    def stats(self) -> TierStats:
        return TierStats(bytes=None, entries=len(self.data))


class TierRecorder:
    """A KV cache tier listener that records what it hears (the whole `TierListener` protocol)."""

    def __init__(self) -> None:
        self.stored_keys: list[ChunkKey] = []
        self.removed_keys: list[ChunkKey] = []

    def stored(self, tier: object, keys: Sequence[ChunkKey]) -> None:
        self.stored_keys += keys

    def removed(self, tier: object, keys: Sequence[ChunkKey]) -> None:
        self.removed_keys += keys

    def annotation(self, key: ChunkKey) -> bytes | None:
        return None

    def restored(self, tier: object, items: Sequence[tuple[ChunkKey, bytes]], done: bool) -> None:
        pass


PAGE = mmap.PAGESIZE


def key(i: int, ns: bytes = b"k") -> ChunkKey:
    return ChunkKey(blake3(ns + str(i).encode()).digest())


def payload(i: int, size: int) -> bytes:
    return blake3(b"payload" + str(i).encode()).digest(length=size)


def chunk_path(root: Path, k: ChunkKey) -> Path:
    text = k.hex()
    return root / text[:2] / f"{text}.kv"


def files(root: Path, pattern: str) -> list[Path]:
    return list(root.rglob(pattern))


def counting_jobs(tier: DiskTier) -> list[int]:
    """Count the tier's thread jobs: the returned list holds the count."""
    pool = tier._pool
    assert pool is not None
    submit, jobs = pool.submit, [0]

    def counting_submit(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        jobs[0] += 1
        return submit(fn, *args, **kwargs)

    pool.submit = counting_submit  # type: ignore[method-assign]  # counts, then submits as before
    return jobs
