"""KV cache tier throughput and lookup latency, each a ratio to a ceiling this machine shows in the same run.

Targets (issue 5, deliverable 6):

- memory tier put and get >= 80% of a numpy memcpy's GB/s, chunks of 1-32 MiB;
- cache server over shared memory >= 50% of memcpy;
- lookup of a 128-chunk prompt (128 x 256 tokens): p99 < 1 ms;
- disk tier >= 70% of sequential ``dd`` on the same file system;
- Redis tier >= 70% of ``redis-benchmark`` GET/SET throughput at the same value size.

Ceilings:

- *memcpy*: ``np.copyto`` between preallocated, pre-touched uint8 arrays, one chunk at a time, over a working
  set (``--working-set-mib``, 256) well above the last-level cache, one thread. Each section runs its memcpy
  passes interleaved with the passes they are compared to (the machine is shared: a noisy moment hits both);
  the ceiling is the median pass.
- *dd* (``bs=4M``, ``--disk-mib`` per run, in the disk tier's directory): write with ``conv=fdatasync`` (the
  disk) and without (the page cache); read with ``iflag=direct`` (the device alone), buffered after dropping
  the file from the page cache with ``posix_fadvise(DONTNEED)`` (cold: the tier's own read path, readahead
  included) and buffered again (warm). The page cache is dropped per file, never machine-wide: writing
  ``/proc/sys/vm/drop_caches`` would also hit the other work on this machine. dd runs once beside each
  repetition of the tier's runs (``--disk-reps``, 3; before them in even repetitions, after them in odd
  ones), on the same bytes (``--disk-mib``) in the same directory, and each kind of I/O is judged by the
  median over repetitions of tier / dd within one repetition: both sides see the same minute of a machine
  whose disk and page-cache speeds move 2-5x within minutes. The tier writes distinct non-zero chunks, dd
  zeros: measured here, the content does not change dd's speed (zeros, random bytes and a constant byte
  copied from the page cache write alike).
- *redis-benchmark*: against a redis-server this script starts (127.0.0.1, free port, temp dir, no
  persistence): ``-t set,get -d <record bytes> -c C -P B -r 64``, i.e. the tier's stored value size (payload +
  64-byte record header), C connections each pipelining B commands, as the tier runs C concurrent
  ``put_many``/``get_many`` of B keys. Best of three runs, alternating with the tier's (best of three too):
  single runs of either moved by up to 2x between minutes on this VM.

Measured:

- `MemoryTier` in process: *put* into a full tier of equal-size chunks (each put evicts the LRU entry and
  reuses its mapping: the steady state) and *get + copy out* (the view ``get_sync`` returns, copied with
  ``np.copyto`` into the consumer's buffer: a consumer must move the bytes into its own KV cache, and one copy
  against one memcpy is the fair comparison) are judged; *put into fresh mappings* (first fill: mmap and page
  faults) and bare *get* (a read-only view, no copy: cost per call) are shown.
- `CacheServer` (a ``kvstack cache-server`` process, memory tier only) with `CacheClient` (sync) and
  `AsyncCacheClient` (``--async-concurrency`` requests in flight), over shared memory and over the socket
  (tcp 127.0.0.1); each request carries ``--request-mib`` of chunks. *put(bytes)* (the client copies each
  payload into its arena, the server copies it into its tier), *reserve + put* (``CacheClient.reserve``
  hands out arena regions, the producer writes into them, put sends their offsets: only the server's copy;
  the fill is not timed, since a producer writes its output somewhere anyway, here straight into shared
  memory, as the vLLM connector's save does), *get* (payloads delivered: views of the client's arena after
  the server's copy, or of the received frames) and *get + copy out*. Judged: reserve + put and get over
  shared memory (one copy each, the paths a producer and a consumer use); put(bytes) and get + copy (two
  copies by design) and the socket are shown.
- Lookup, from token ids to the answer: ``chunk_keys`` of a 32,768-token prompt given as a Python list (as
  vLLM hands a request's prompt to the connector) plus a ``CacheClient.lookup`` round trip to the running
  server (128 chunks, all held), judged; the same from packed uint32 ids (``array('I')``, hashed in place),
  each part alone, the async client's round trip, ``TieredStore.lookup`` in process, and the floor any ZMQ
  server has here: the round trip of a 4 KiB message to a ROUTER that only echoes it (sync, and
  zmq.asyncio on uvloop), are shown. Every measurement of an iteration runs back to back (the echo floors
  too), so all see the same moments of the machine; the server's CPU per lookup is read from /proc.
- `DiskTier` (2 I/O threads, ``put_many``/``get_many`` batches of 8 like the store's writer), each against the
  dd run of the same kind in the same repetition: put with fsync ``never`` vs dd's page-cache write, put
  with fsync ``data`` vs dd ``conv=fdatasync``, get cold (the tier's files dropped from the page cache
  first) vs dd's cold read, get warm vs dd's warm read. Shown: put ``never`` + ``sync -f`` vs dd
  ``conv=fdatasync``, cold get vs dd ``iflag=direct``.
- `RedisTier`: ``put_many`` (one pipeline of SETs) vs SET and ``get_many`` (one MGET) vs GET, keys/s.

The async parts (client, disk and Redis tiers) run on uvloop when it is installed, as ``kvstack
cache-server`` runs its tiers.

GB/s is 10^9 payload bytes per second. Bounded: 127.0.0.1 only, every subprocess and request has a timeout
and sections left are skipped past ``--deadline``; temp files, shared-memory arenas and processes (stopped by
PID) are cleaned up. Results: tables on stdout, ``.cache/bench/cache_tier/<UTC timestamp>.json``.

    .venvs/dev/bin/python benchmarks/cache_tier.py                # ~5 min
    .venvs/dev/bin/python benchmarks/cache_tier.py --quick        # ~30 s: smaller sets, fewer rounds
    .venvs/dev/bin/python benchmarks/cache_tier.py --only disk,redis --disk-mib 1024
"""

# kvstack ships no py.typed marker, so mypy run on this file alone would refuse its (typed) modules.
# mypy: disable-error-code="import-untyped"
from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import glob
import inspect
import json
import os
import random
import re
import select
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import zmq
from machine_info import machine, process_cpu_seconds
from rich.console import Console
from rich.table import Table

from kvstack.cache.client import AsyncCacheClient, CacheClient
from kvstack.cache.keys import ChunkKey, KVLayout, chunk_keys
from kvstack.cache.store import TieredStore
from kvstack.cache.tiers.disk import DiskTier, FsyncPolicy
from kvstack.cache.tiers.memory import MemoryTier
from kvstack.cache.tiers.record import HEADER_BYTES
from kvstack.cache.tiers.redis import RedisTier

REPO = Path(__file__).resolve().parents[1]
KVSTACK = REPO / ".venvs" / "dev" / "bin" / "kvstack"
OUT_DIR = REPO / ".cache" / "bench" / "cache_tier"
HOST = "127.0.0.1"
MiB = 1 << 20
SECTIONS = ("memory", "server", "lookup", "disk", "redis")
LAYOUT = KVLayout(model="bench/llama-3-8b", num_layers=32, num_kv_heads=8, head_size=128, dtype="bfloat16")
CHUNK_TOKENS = 256
PROMPT_CHUNKS = 128
VOCAB = 128_000
DD_BS = 4 * MiB
DISK_BATCH = 8  # the store's default write_batch
REDIS_RUNS = 3  # redis-benchmark and tier runs per case, alternating; the best of each counts
REDIS_KEYSPACE = 64
TARGETS = {
    "memory": "memory tier put/get >= 80% of memcpy (1-32 MiB chunks)",
    "server": "server over shared memory >= 50% of memcpy",
    "lookup": "lookup of a 128-chunk prompt: p99 < 1 ms",
    "disk": "disk tier >= 70% of sequential dd",
    "redis": "Redis tier >= 70% of redis-benchmark GET/SET",
}


class BenchError(Exception):
    """A measurement that could not be made as intended (a miss, a dropped write, a tool that failed)."""


@dataclass
class Config:
    sizes_mib: tuple[int, ...] = (1, 4, 16, 32)
    working_set: int = 256 * MiB
    memory_rounds: int = 9
    server_rounds: int = 4
    request_bytes: int = 32 * MiB
    async_concurrency: int = 2
    lookup_iterations: int = 2000
    lookup_prompts: int = 16
    disk_bytes: int = 512 * MiB
    disk_sizes_mib: tuple[int, ...] = (1, 4, 16, 32)
    disk_reps: int = 3
    redis_cases: tuple[tuple[int, int], ...] = ((64 * 1024, 16), (1 * MiB, 4))  # (payload bytes, batch)
    redis_concurrency: tuple[int, ...] = (1, 4)
    redis_bytes: int = 512 * MiB  # per measurement (each of SET, GET; tier and redis-benchmark)
    deadline_s: float = 480.0


def quick_config() -> Config:
    return Config(
        working_set=128 * MiB,
        memory_rounds=3,
        server_rounds=1,
        lookup_iterations=500,
        lookup_prompts=8,
        disk_bytes=128 * MiB,
        disk_sizes_mib=(1, 16),
        disk_reps=1,
        redis_concurrency=(1,),
        redis_bytes=128 * MiB,
        deadline_s=75.0,
    )


# -- results ----------------------------------------------------------------------------------------
@dataclass
class Row:
    """One line of the results table; ``verdict`` is PASS/FAIL when judged against a target, else info."""

    target: str
    what: str
    size: str
    result: str
    ceiling: str = "-"
    ratio: float | None = None
    needed: str = "-"
    verdict: str = "info"
    data: dict[str, Any] = field(default_factory=dict)


def ratio_row(
    target: str,
    what: str,
    size: str,
    value: float,
    unit: str,
    ceiling_name: str,
    ceiling: float | None,
    needed: float | None,
    data: dict[str, Any] | None = None,
) -> Row:
    """A row comparing ``value`` with ``ceiling`` (same unit); judged when ``needed`` is a ratio."""
    ratio = None if not ceiling else value / ceiling
    verdict = "info" if needed is None else ("FAIL" if ratio is None or ratio < needed else "PASS")
    return Row(
        target,
        what,
        size,
        f"{value:,.{2 if value < 100 else 0}f} {unit}",
        "-" if ceiling is None else f"{ceiling_name} {ceiling:,.{2 if ceiling < 100 else 0}f}",
        ratio,
        "-" if needed is None else f">= {needed:.2f}",
        verdict,
        {"value": value, "unit": unit, "ceiling_name": ceiling_name, "ceiling": ceiling, **(data or {})},
    )


@dataclass
class Ceiling:
    name: str
    size: str
    value: float
    unit: str
    how: str
    samples: list[float] = field(default_factory=list)


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    ceilings: list[Ceiling] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)


# -- small helpers --------------------------------------------------------------------------------------
def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def pct(values_ns: Sequence[int], q: float) -> float:
    """The q-th percentile of ``values_ns`` in µs (nearest rank)."""
    ordered = sorted(values_ns)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))] / 1e3


def new_keys(n: int) -> list[ChunkKey]:
    return [ChunkKey(os.urandom(32)) for _ in range(n)]


def chunks_of(size: int, n: int) -> list[np.ndarray]:
    """``n`` distinct, pre-touched chunks of ``size`` bytes (the content does not change any cost here)."""
    return [np.full(size, 1 + i % 251, dtype=np.uint8) for i in range(n)]


def size_label(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // 1024} KiB"


def run_async(coro: Any) -> None:
    """Run ``coro`` as the cache server runs its tiers: on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


@dataclass
class Child:
    """A process started in its own session, stopped by its PID."""

    name: str
    proc: subprocess.Popen[bytes]

    @classmethod
    def start(cls, name: str, cmd: list[str], log_path: Path, *, stdout_pipe: bool = False) -> Child:
        log = log_path.open("ab")
        try:
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE if stdout_pipe else log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=str(REPO),
            )
        finally:
            log.close()
        return cls(name, proc)

    def read_line(self, timeout_s: float) -> str:
        """The next stdout line (needs ``stdout_pipe``); raises BenchError on timeout or exit."""
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            raise BenchError(f"{self.name} printed nothing within {timeout_s}s")
        line = self.proc.stdout.readline().decode(errors="replace")
        if not line:
            raise BenchError(f"{self.name} exited with {self.proc.wait(timeout=5)} before it was ready")
        return line.strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


# -- memory tier ----------------------------------------------------------------------------------------
def bench_memory(cfg: Config, report: Report, say: Callable[[str], None], deadline: Deadline) -> None:
    for mib in cfg.sizes_mib:
        if deadline.left() < 5:
            report.skipped.append(f"memory {mib} MiB: deadline")
            continue
        size = mib * MiB
        n = max(2, cfg.working_set // size)
        src, dst = chunks_of(size, n), chunks_of(size, n)
        tier = MemoryTier(n * size, name="bench")  # page-multiple chunks: exactly n entries fit
        a, b = new_keys(n), new_keys(n)
        passes: dict[str, list[float]] = {k: [] for k in ("memcpy", "put_fresh", "put_full", "get_copy")}
        get_us: list[float] = []
        get_reps = max(1, 1000 // n)  # bare gets are cheap: enough calls for a steady per-call figure
        for r in range(cfg.memory_rounds + 1):  # round 0 warms up
            tier.clear_sync()
            t0 = time.perf_counter()
            fresh = sum(tier.put_sync(a[i], src[i].data) for i in range(n))
            t1 = time.perf_counter()
            full = sum(tier.put_sync(b[i], src[i].data) for i in range(n))  # each evicts an `a` entry
            t2 = time.perf_counter()
            for _ in range(get_reps):
                for key in b:
                    tier.get_sync(key)
            t3 = time.perf_counter()
            for i, key in enumerate(b):
                view = tier.get_sync(key)
                assert view is not None
                np.copyto(dst[i], np.frombuffer(view, dtype=np.uint8))
            t4 = time.perf_counter()
            del view  # a live view pins its mapping: the next round's puts would evict around it
            for i in range(n):
                np.copyto(dst[i], src[i])
            t5 = time.perf_counter()
            if fresh != n or full != n or tier.held_bytes:
                raise BenchError(
                    f"memory tier kept {fresh}, {full} of {n} {mib} MiB puts, {tier.held_bytes} bytes held"
                )
            if r:
                passes["put_fresh"].append(gbps(n * size, t1 - t0))
                passes["put_full"].append(gbps(n * size, t2 - t1))
                get_us.append((t3 - t2) / (n * get_reps) * 1e6)
                passes["get_copy"].append(gbps(n * size, t4 - t3))
                passes["memcpy"].append(gbps(n * size, t5 - t4))
        stats = tier.stats()
        tier.clear_sync()
        del src, dst
        label = f"{mib} MiB"
        memcpy = median(passes["memcpy"])
        report.ceilings.append(
            Ceiling(
                "memcpy (memory section)",
                label,
                memcpy,
                "GB/s",
                f"np.copyto, {n} chunks, median of {cfg.memory_rounds} "
                f"({min(passes['memcpy']):.2f}-{max(passes['memcpy']):.2f})",
                passes["memcpy"],
            )
        )
        common = {"chunks": n, "rounds": cfg.memory_rounds, "evictions": stats.evictions}
        for name, what, judged in (
            ("put_full", "put, full tier (evict LRU + reuse its mapping)", True),
            ("get_copy", "get + copy out (view -> consumer buffer)", True),
            ("put_fresh", "put, fresh mapping (first fill)", False),
        ):
            report.rows.append(
                ratio_row(
                    "memory",
                    what,
                    label,
                    median(passes[name]),
                    "GB/s",
                    "memcpy",
                    memcpy,
                    0.8 if judged else None,
                    {**common, "samples": passes[name], "memcpy_samples": passes["memcpy"]},
                )
            )
        get_call = median(get_us)
        report.rows.append(
            Row(
                "memory",
                "get (read-only view, no copy)",
                label,
                f"{get_call:.2f} µs/call",
                data={"us_per_call": get_call, "samples_us": get_us, **common},
            )
        )
        say(
            f"memory {label}: memcpy {memcpy:.2f}, put full {median(passes['put_full']):.2f}, get+copy "
            f"{median(passes['get_copy']):.2f}, put fresh {median(passes['put_fresh']):.2f} GB/s"
        )


# -- cache server -----------------------------------------------------------------------------------
def start_cache_server(memory_bytes: int, log_path: Path) -> tuple[Child, str, str]:
    """The server (memory tier only), its ZMQ endpoint and its unix-socket endpoint."""
    cmd = [
        str(KVSTACK),
        "cache-server",
        "--bind",
        f"tcp://{HOST}:0",
        "--unix-socket",
        str(log_path.parent / "cache-server.sock"),
        "--memory-gb",
        repr(memory_bytes / (1 << 30)),
        "--node",
        "bench",
        "--log-level",
        "warning",
    ]
    child = Child.start("kvstack cache-server", cmd, log_path, stdout_pipe=True)
    try:
        line = child.read_line(30.0)
        found = re.search(r" on (tcp://\S+) and (unix://\S+?)(,|$)", line)
        if found is None:
            raise BenchError(f"cannot read the endpoints from the server's first line: {line!r}")
    except BaseException:
        child.stop()
        raise
    return child, found.group(1), found.group(2)


ClientKind = tuple[str, CacheClient | AsyncCacheClient]


async def _async_passes(concurrency: int, batches: Sequence[tuple[int, int]], one: Any) -> float:
    """Time ``one(lo, hi)`` over every batch, ``concurrency`` at a time."""
    it = iter(batches)

    async def worker() -> None:
        for lo, hi in it:  # shared: each batch is taken by one worker
            await one(lo, hi)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - t0


async def server_pass(
    client: CacheClient | AsyncCacheClient,
    op: str,
    keys: Sequence[ChunkKey],
    src: Sequence[np.ndarray],
    dst: Sequence[np.ndarray],
    batches: Sequence[tuple[int, int]],
    concurrency: int,
) -> float:
    """Seconds for one pass of ``op`` (put, reserve_put, get, get_copy) over every batch of ``keys``.

    ``reserve_put``: ``reserve`` arena regions, fill them from ``src`` (not timed: a producer writes its
    output somewhere anyway, here straight into shared memory), ``put`` the reserved views; reserve and put
    are timed. The async client reserves ``concurrency`` batches, fills them, then puts them concurrently.
    """
    payloads = [a.data for a in src]
    if op == "reserve_put":
        return await reserve_put_pass(client, keys, src, batches, concurrency)

    def check_get(chunks: Any, lo: int, hi: int) -> None:
        if chunks is None or len(chunks) != hi - lo:
            got = "failed" if chunks is None else f"{len(chunks)} chunks"
            raise BenchError(f"get of {hi - lo} held chunks: {got} ({client.stats.failures})")
        if op == "get_copy":
            for j, view in enumerate(chunks):
                np.copyto(dst[lo + j], np.frombuffer(view, dtype=np.uint8))
        chunks.release()

    if isinstance(client, CacheClient):
        t0 = time.perf_counter()
        for lo, hi in batches:
            if op == "put":
                if not client.put(keys[lo:hi], payloads[lo:hi]):
                    raise BenchError(f"put failed: {client.stats.failures}")
            else:
                check_get(client.get(keys[lo:hi]), lo, hi)
        return time.perf_counter() - t0

    async_client = client

    async def one(lo: int, hi: int) -> None:
        if op == "put":
            if not await async_client.put(keys[lo:hi], payloads[lo:hi]):
                raise BenchError(f"put failed: {async_client.stats.failures}")
        else:
            check_get(await async_client.get(keys[lo:hi]), lo, hi)

    return await _async_passes(concurrency, batches, one)


async def reserve_put_pass(
    client: CacheClient | AsyncCacheClient,
    keys: Sequence[ChunkKey],
    src: Sequence[np.ndarray],
    batches: Sequence[tuple[int, int]],
    concurrency: int,
) -> float:
    """Timed seconds of reserve + put over every batch; the fill of the reserved views is not timed."""
    timed = 0.0

    def fill(reserved: Any, lo: int) -> None:
        for j, view in enumerate(reserved):
            np.copyto(np.frombuffer(view, dtype=np.uint8), src[lo + j])

    def sizes(lo: int, hi: int) -> list[int]:
        return [src[j].nbytes for j in range(lo, hi)]

    if isinstance(client, CacheClient):
        for lo, hi in batches:
            t0 = time.perf_counter()
            reserved = client.reserve(sizes(lo, hi))
            timed += time.perf_counter() - t0
            if reserved is None:
                raise BenchError(f"reserve of {hi - lo} chunks failed: {client.stats.failures}")
            fill(reserved, lo)
            t0 = time.perf_counter()
            ok = client.put(keys[lo:hi], list(reserved))
            timed += time.perf_counter() - t0
            if not ok:
                raise BenchError(f"put of reserved views failed: {client.stats.failures}")
        return timed

    async_client = client
    for g in range(0, len(batches), concurrency):
        group = batches[g : g + concurrency]
        views = []
        for lo, hi in group:
            t0 = time.perf_counter()
            reserved = await async_client.reserve(sizes(lo, hi))
            timed += time.perf_counter() - t0
            if reserved is None:
                raise BenchError(f"reserve of {hi - lo} chunks failed: {async_client.stats.failures}")
            fill(reserved, lo)
            views.append(list(reserved))
        t0 = time.perf_counter()
        done = await asyncio.gather(
            *(async_client.put(keys[lo:hi], v) for (lo, hi), v in zip(group, views, strict=True))
        )
        timed += time.perf_counter() - t0
        if not all(done):
            raise BenchError(f"put of reserved views failed: {async_client.stats.failures}")
    return timed


async def bench_server(
    cfg: Config,
    endpoint: str,
    server_pid: int,
    report: Report,
    say: Callable[[str], None],
    deadline: Deadline,
) -> None:
    arena = max(128 * MiB, (cfg.async_concurrency + 2) * cfg.request_bytes)
    c = cfg.async_concurrency
    clients: list[ClientKind] = [
        ("sync shm", CacheClient(endpoint, timeout_s=10.0, arena_bytes=arena, name="bench-sync-shm")),
        (
            f"async x{c} shm",
            AsyncCacheClient(endpoint, timeout_s=10.0, arena_bytes=arena, name="bench-async"),
        ),
        ("sync socket", CacheClient(endpoint, timeout_s=10.0, shm=False, name="bench-sync-socket")),
        (
            f"async x{c} socket",
            AsyncCacheClient(endpoint, timeout_s=10.0, shm=False, name="bench-async-sock"),
        ),
    ]
    try:
        await _bench_server_sizes(cfg, clients, server_pid, report, say, deadline)
    finally:
        for _, client in clients:
            if isinstance(client, CacheClient):
                client.close()
            else:
                await client.aclose()


async def _bench_server_sizes(
    cfg: Config,
    clients: list[ClientKind],
    server_pid: int,
    report: Report,
    say: Callable[[str], None],
    deadline: Deadline,
) -> None:
    control = clients[0][1]
    assert isinstance(control, CacheClient)
    for mib in cfg.sizes_mib:
        if deadline.left() < 10:
            report.skipped.append(f"server {mib} MiB: deadline")
            continue
        if not control.clear():
            raise BenchError(f"clear failed: {control.stats.failures}")
        size = mib * MiB
        n = max(2, cfg.working_set // size)
        per_request = max(1, cfg.request_bytes // size)
        batches = [(lo, min(n, lo + per_request)) for lo in range(0, n, per_request)]
        src, dst = chunks_of(size, n), chunks_of(size, n)
        key_sets = (new_keys(n), new_keys(n))
        samples: dict[tuple[str, str], list[float]] = {}
        server_cpu: dict[tuple[str, str], list[float]] = {}
        memcpy: list[float] = []
        routes: dict[str, dict[str, int]] = {}
        toggle = 0
        for r in range(cfg.server_rounds + 1):  # round 0 warms up (and fills the server's tier)
            for kind, client in clients:
                keys = key_sets[toggle]
                toggle ^= 1
                before = (client.stats.shm_bytes, client.stats.socket_bytes)
                ops = SHM_OPS if kind.endswith("shm") else SOCKET_OPS
                for op in ops:
                    cpu0 = process_cpu_seconds(server_pid)
                    seconds = await server_pass(client, op, keys, src, dst, batches, c_of(kind, cfg))
                    cpu = process_cpu_seconds(server_pid) - cpu0
                    if op.endswith("put") and control.lookup(keys) != n:
                        raise BenchError(f"{kind}: the server holds {control.lookup(keys)} of {n} chunks put")
                    if r:
                        samples.setdefault((kind, op), []).append(gbps(n * size, seconds))
                        server_cpu.setdefault((kind, op), []).append(cpu / seconds)
                route = routes.setdefault(kind, {"shm_bytes": 0, "socket_bytes": 0})
                route["shm_bytes"] += client.stats.shm_bytes - before[0]
                route["socket_bytes"] += client.stats.socket_bytes - before[1]
                t0 = time.perf_counter()  # a memcpy pass after each client's passes: the ceiling, interleaved
                for i in range(n):
                    np.copyto(dst[i], src[i])
                if r:
                    memcpy.append(gbps(n * size, time.perf_counter() - t0))
        del src, dst
        label = f"{mib} MiB"
        ceiling = median(memcpy)
        report.ceilings.append(
            Ceiling(
                "memcpy (server section)",
                label,
                ceiling,
                "GB/s",
                f"np.copyto, {n} chunks, median of {len(memcpy)} ({min(memcpy):.2f}-{max(memcpy):.2f})",
                memcpy,
            )
        )
        for (kind, op), values in samples.items():
            shm = kind.endswith("shm")
            route = routes[kind]
            if shm and route["socket_bytes"]:
                raise BenchError(f"{kind}: {route['socket_bytes']} bytes went through the socket, not shm")
            what = {
                "put": "put(bytes)",
                "reserve_put": "reserve + put (fill untimed)",
                "get": "get (views)",
                "get_copy": "get + copy out",
            }[op]
            report.rows.append(
                ratio_row(
                    "server",
                    f"{kind} {what}",
                    label,
                    median(values),
                    "GB/s",
                    "memcpy",
                    ceiling,
                    0.5 if shm and op in ("reserve_put", "get") else None,
                    {
                        "samples": values,
                        "memcpy_samples": memcpy,
                        "server_cpu_share": server_cpu[(kind, op)],
                        "chunks_per_request": per_request,
                        "bytes_route": route,
                    },
                )
            )
        say(
            f"server {label}: memcpy {ceiling:.2f}; "
            + ", ".join(f"{k} {o} {median(v):.2f}" for (k, o), v in samples.items() if o != "get_copy")
            + " GB/s"
        )


SOCKET_OPS = ("put", "get", "get_copy")
SHM_OPS = ("put", "reserve_put", "get", "get_copy")  # reserve only hands out shared memory


def c_of(kind: str, cfg: Config) -> int:
    return cfg.async_concurrency if kind.startswith("async") else 1


# -- lookup ---------------------------------------------------------------------------------------------
# A ROUTER that sends every message back: the round-trip floor of ZMQ on this machine, without kvstack.
ECHO_SERVER = r"""
import asyncio, sys, zmq
if sys.argv[1] == "unix":
    import uvloop
    class Echo(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport = transport
        def data_received(self, data):
            self.transport.write(data)
    async def main():
        await asyncio.get_running_loop().create_unix_server(Echo, sys.argv[2])
        print(sys.argv[2], flush=True)
        await asyncio.Event().wait()
    uvloop.run(main())
elif sys.argv[1] == "sync":
    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind("tcp://127.0.0.1:0")
    print(sock.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
    while True:
        sock.send_multipart(sock.recv_multipart(copy=False), copy=False)
else:
    import uvloop, zmq.asyncio
    async def main():
        sock = zmq.asyncio.Context().socket(zmq.ROUTER)
        sock.bind("tcp://127.0.0.1:0")
        print(sock.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
        while True:
            await sock.send_multipart(await sock.recv_multipart(copy=False), copy=False)
    uvloop.run(main())
"""
ECHO_KINDS = ("sync", "asyncio", "unix")


class EchoFloor:
    """Round trips of a 4 KiB message (the size of 128 keys) to an echo server in its own process: a ZMQ
    ROUTER (sync or zmq.asyncio) with a DEALER client, or a uvloop unix-socket server with a blocking
    socket client."""

    def __init__(self, kind: str, work: Path) -> None:
        cmd = [sys.executable, "-c", ECHO_SERVER, kind, str(work / "echo.sock")]
        self.child = Child.start(f"echo ({kind})", cmd, work / f"echo-{kind}.log", stdout_pipe=True)
        where = self.child.read_line(10.0)
        self.message = [bytes(PROMPT_CHUNKS * 32), b""]
        self.ctx: zmq.Context[Any] | None = None
        self.unix: socket.socket | None = None
        if kind == "unix":
            self.unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.unix.settimeout(2.0)
            self.unix.connect(where)
        else:
            self.ctx = zmq.Context()
            self.sock = self.ctx.socket(zmq.DEALER)
            self.sock.connect(where)

    def round_trip(self) -> int:
        t0 = time.perf_counter_ns()
        if self.unix is not None:
            message = self.message[0]
            self.unix.sendall(message)
            got = 0
            while got < len(message):
                got += len(self.unix.recv(65536))
            return time.perf_counter_ns() - t0
        self.sock.send_multipart(self.message)
        if not self.sock.poll(2000):
            raise BenchError(f"{self.child.name} did not answer within 2 s")
        self.sock.recv_multipart()
        return time.perf_counter_ns() - t0

    def close(self) -> None:
        if self.unix is not None:
            self.unix.close()
        if self.ctx is not None:
            self.sock.close(linger=0)
            self.ctx.term()
        self.child.stop()


# name, what the row shows, judged
LOOKUP_ROWS = (
    ("list", "token ids (list) -> chunk_keys -> CacheClient.lookup, unix socket", True),
    ("list_zmq", "token ids (list) -> chunk_keys -> CacheClient.lookup, ZMQ tcp", False),
    ("packed", "token ids (packed uint32 array) -> chunk_keys -> CacheClient.lookup, unix socket", False),
    ("keys_list", "chunk_keys, ids from a list", False),
    ("keys_packed", "chunk_keys, ids packed", False),
    ("round_trip", "CacheClient.lookup round trip, unix socket (keys given)", False),
    ("round_trip_zmq", "CacheClient.lookup round trip, ZMQ tcp (keys given)", False),
    ("async_round_trip", "AsyncCacheClient.lookup round trip, unix socket (keys given)", False),
    ("store", "TieredStore.lookup in process (keys given)", False),
    ("echo_unix", "floor: unix socket echo round trip, uvloop server", False),
    ("echo_sync", "floor: ZMQ echo round trip, sync ROUTER", False),
    ("echo_asyncio", "floor: ZMQ echo round trip, zmq.asyncio ROUTER (uvloop)", False),
)


async def bench_lookup(
    cfg: Config,
    endpoint: str,
    unix_endpoint: str,
    server_pid: int,
    work: Path,
    report: Report,
    say: Callable[[str], None],
) -> None:
    """Every measurement of one iteration runs back to back, so each sees the same moment of this shared
    machine: a lookup from a list, one from packed ids, the parts, and the echo floors."""
    rng = random.Random(7)
    prompts = [
        [rng.randrange(VOCAB) for _ in range(PROMPT_CHUNKS * CHUNK_TOKENS)] for _ in range(cfg.lookup_prompts)
    ]
    packed = [array("I", p) for p in prompts]
    prompt_keys = [chunk_keys(p, LAYOUT, CHUNK_TOKENS) for p in prompts]
    payload = bytes(4096)  # the lookup reads no payload; its size does not matter
    client = CacheClient(unix_endpoint, timeout_s=2.0, name="bench-lookup")
    zmq_client = CacheClient(endpoint, timeout_s=2.0, name="bench-lookup-zmq")
    async_client = AsyncCacheClient(unix_endpoint, timeout_s=2.0, shm=False, name="bench-lookup-async")
    store = TieredStore([MemoryTier(64 * MiB)])
    floors: dict[str, EchoFloor] = {}
    await store.start()
    try:
        for kind in ECHO_KINDS:
            floors[f"echo_{kind}"] = EchoFloor(kind, work)
        client.clear()
        for keys in prompt_keys:
            if not client.put(keys, [payload] * len(keys)):
                raise BenchError(f"lookup setup: put failed ({client.stats.failures})")
            store.put(keys, [payload] * len(keys))
        times: dict[str, list[int]] = {name: [] for name, _, _ in LOOKUP_ROWS}
        warmup = min(100, cfg.lookup_iterations // 5)
        clock = time.perf_counter_ns
        cpu0 = 0.0
        for i in range(warmup + cfg.lookup_iterations):
            if i == warmup:
                cpu0 = process_cpu_seconds(server_pid)
            n = i % len(prompts)
            t0 = clock()
            keys = chunk_keys(prompts[n], LAYOUT, CHUNK_TOKENS)
            t1 = clock()
            held = client.lookup(keys)
            t2 = clock()
            keys = chunk_keys(packed[n], LAYOUT, CHUNK_TOKENS)
            t3 = clock()
            held_packed = client.lookup(keys)
            t4 = clock()
            async_held = await async_client.lookup(keys)
            t5 = clock()
            local, _ = await store.lookup(keys)
            t6 = clock()
            keys = chunk_keys(prompts[n], LAYOUT, CHUNK_TOKENS)
            t7 = clock()
            zmq_held = zmq_client.lookup(keys)
            t8 = clock()
            found = (held, held_packed, async_held, local, zmq_held)
            if found != (PROMPT_CHUNKS,) * 5:
                raise BenchError(f"lookups found {found} of {PROMPT_CHUNKS} held chunks")
            echoes = {name: floor.round_trip() for name, floor in floors.items()}
            if i < warmup:
                continue
            for name, ns in (
                ("list", t2 - t0),
                ("list_zmq", t8 - t6),
                ("round_trip_zmq", t8 - t7),
                ("packed", t4 - t2),
                ("keys_list", t1 - t0),
                ("keys_packed", t3 - t2),
                ("round_trip", t2 - t1),
                ("async_round_trip", t5 - t4),
                ("store", t6 - t5),
                *echoes.items(),
            ):
                times[name].append(ns)
        # four lookups reach the server per iteration: from a list and from packed ids over the unix socket,
        # the async client, from a list through ZMQ
        server_cpu_us = (process_cpu_seconds(server_pid) - cpu0) / (4 * cfg.lookup_iterations) * 1e6
    finally:
        client.close()
        zmq_client.close()
        await async_client.aclose()
        await store.stop()
        for floor in floors.values():
            floor.close()
    label = f"{PROMPT_CHUNKS} x {CHUNK_TOKENS} tok"
    report.raw["lookup"] = {"server_cpu_us_per_lookup": round(server_cpu_us, 1)}
    for name, what, judged in LOOKUP_ROWS:
        p50, p99, worst = pct(times[name], 50), pct(times[name], 99), max(times[name]) / 1e3
        verdict = ("PASS" if p99 < 1000 else "FAIL") if judged else "info"
        report.rows.append(
            Row(
                "lookup",
                what,
                label,
                f"p50 {p50:,.0f} / p99 {p99:,.0f} µs",
                needed="p99 < 1,000 µs" if judged else "-",
                verdict=verdict,
                data={"p50_us": p50, "p99_us": p99, "max_us": worst, "n": len(times[name])},
            )
        )
    say(
        f"lookup: from a list p50 {pct(times['list'], 50):.0f} / p99 {pct(times['list'], 99):.0f} µs "
        f"(ZMQ {pct(times['list_zmq'], 50):.0f} / {pct(times['list_zmq'], 99):.0f}), "
        f"packed p50 {pct(times['packed'], 50):.0f} / p99 {pct(times['packed'], 99):.0f} µs, "
        f"echo p50 {pct(times['echo_sync'], 50):.0f} / p99 {pct(times['echo_sync'], 99):.0f} µs; "
        f"server CPU {server_cpu_us:.0f} µs per lookup"
    )


# -- disk tier ------------------------------------------------------------------------------------------
_DD_LINE = re.compile(r"^(\d+) bytes .* copied, ([0-9.e+-]+) s", re.M)


def dd(*args: str) -> float:
    """GB/s of one dd run, from its own byte count and seconds."""
    done = subprocess.run(
        ["dd", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "LC_ALL": "C"},
    )
    found = _DD_LINE.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise BenchError(f"dd {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()[-300:]}")
    return gbps(int(found.group(1)), float(found.group(2)))


def sync_fs(path: Path) -> float:
    """Seconds to write back every dirty page of ``path``'s file system (``sync -f``: syncfs(2))."""
    t0 = time.perf_counter()
    subprocess.run(["sync", "-f", str(path)], check=True, timeout=300)
    return time.perf_counter() - t0


def drop_cached(root: Path) -> int:
    """Drop every file under ``root`` from the page cache (clean pages only: sync first); returns bytes."""
    dropped = 0
    paths = [root] if root.is_file() else [Path(d) / f for d, _, files in os.walk(root) for f in files]
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            dropped += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return dropped


def describe_fs(path: Path) -> str:
    """``path (fs type on device)``; creates ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    df = subprocess.run(
        ["df", "--output=fstype,source", str(path)], capture_output=True, text=True, timeout=10
    )
    words = df.stdout.split()
    return f"{path} ({words[-2]} on {words[-1]})" if len(words) >= 4 else str(path)


def dd_ceilings(directory: Path, nbytes: int) -> dict[str, float | None]:
    path = directory / "dd.bin"
    count = str(max(1, nbytes // DD_BS))
    out: dict[str, float | None] = {}
    try:
        sync_fs(directory)
        out["write_fdatasync"] = dd("if=/dev/zero", f"of={path}", "bs=4M", f"count={count}", "conv=fdatasync")
        path.unlink()
        sync_fs(directory)
        out["write_page_cache"] = dd("if=/dev/zero", f"of={path}", "bs=4M", f"count={count}")
        sync_fs(directory)
        drop_cached(path)
        try:
            out["read_direct"] = dd(f"if={path}", "of=/dev/null", "bs=4M", "iflag=direct")
        except BenchError:
            out["read_direct"] = None  # O_DIRECT unsupported on this file system
        drop_cached(path)
        out["read_cold"] = dd(f"if={path}", "of=/dev/null", "bs=4M")
        out["read_warm"] = dd(f"if={path}", "of=/dev/null", "bs=4M")
    finally:
        path.unlink(missing_ok=True)
    return out


async def disk_run(root: Path, size: int, nbytes: int, fsync: FsyncPolicy) -> dict[str, float]:
    n = max(1, nbytes // size)
    keys = new_keys(n)
    src = [a.data for a in chunks_of(size, n)]
    batches = [(lo, min(n, lo + DISK_BATCH)) for lo in range(0, n, DISK_BATCH)]
    tier = DiskTier(root, n * (size + HEADER_BYTES) + MiB, fsync=fsync, name=f"bench-{fsync}")
    await tier.start()
    out: dict[str, float] = {}
    try:
        sync_fs(root)
        t0 = time.perf_counter()
        for lo, hi in batches:
            if await tier.put_many(list(zip(keys[lo:hi], src[lo:hi], strict=True))) != hi - lo:
                raise BenchError(f"disk tier ({fsync}) dropped writes: {tier.stats()}")
        out["put"] = gbps(n * size, time.perf_counter() - t0)
        out["put_then_sync"] = gbps(n * size, time.perf_counter() - t0 + sync_fs(root))
        if fsync == "never":
            drop_cached(root)
            for name in ("get_cold", "get_warm"):
                t0 = time.perf_counter()
                for lo, hi in batches:
                    got = await tier.get_many(keys[lo:hi])
                    if any(g is None for g in got):
                        raise BenchError(f"disk tier missed chunks it holds: {tier.stats()}")
                    del got
                out[name] = gbps(n * size, time.perf_counter() - t0)
    finally:
        await tier.close()
        shutil.rmtree(root, ignore_errors=True)
    return out


# Each judged (and shown) disk measurement: what the tier does, the dd run it is compared with, judged.
DISK_PAIRS = (
    ("put, fsync never (page cache)", "never", "put", "write_page_cache", True),
    ("put, fsync data (disk)", "data", "put", "write_fdatasync", True),
    ("get cold (disk: files dropped first)", "never", "get_cold", "read_cold", True),
    ("get warm (page cache)", "never", "get_warm", "read_warm", True),
    ("put, fsync never, + sync -f (disk)", "never", "put_then_sync", "write_fdatasync", False),
    ("get cold vs dd iflag=direct", "never", "get_cold", "read_direct", False),
)
POLICIES: tuple[FsyncPolicy, ...] = ("never", "data")
DD_HOWS = {
    "write_fdatasync": "dd if=/dev/zero bs=4M conv=fdatasync",
    "write_page_cache": "dd if=/dev/zero bs=4M (no sync: page cache)",
    "read_direct": "dd bs=4M iflag=direct",
    "read_cold": "dd bs=4M after posix_fadvise(DONTNEED)",
    "read_warm": "dd bs=4M, file in the page cache",
}


async def bench_disk(
    cfg: Config, work: Path, report: Report, say: Callable[[str], None], deadline: Deadline
) -> None:
    """Paired runs: each repetition runs the tier (fsync never, then data) and a dd set back to back, in
    alternating order, and each kind of I/O is judged by the median over repetitions of tier / dd within a
    repetition: both sides see the same minute of this machine, whose disk and page-cache speeds move a lot
    within one."""
    where = describe_fs(work)
    say(f"disk: tier and dd in {where}, {cfg.disk_reps} paired repetitions per chunk size")
    dd_runs: list[dict[str, float | None]] = []
    runs: dict[int, list[dict[str, Any]]] = {}
    for mib in cfg.disk_sizes_mib:
        if deadline.left() < 25:
            report.skipped.append(f"disk {mib} MiB: deadline")
            continue
        runs[mib] = []
        for rep in range(cfg.disk_reps):
            pair: dict[str, Any] = {}
            if rep % 2:
                pair["dd"] = dd_ceilings(work, cfg.disk_bytes)
            for policy in POLICIES:
                root = work / f"tier-{policy}-{mib}"
                pair[policy] = await disk_run(root, mib * MiB, cfg.disk_bytes, policy)
            if not rep % 2:
                pair["dd"] = dd_ceilings(work, cfg.disk_bytes)
            dd_runs.append(pair["dd"])
            runs[mib].append(pair)
        say(f"disk {mib} MiB: {runs[mib]}")
    for name, how in DD_HOWS.items():
        samples = [v for run in dd_runs if (v := run[name]) is not None]
        if samples:
            report.ceilings.append(
                Ceiling(
                    f"dd {name}",
                    size_label(cfg.disk_bytes),
                    median(samples),
                    "GB/s",
                    f"{how}; median of {len(samples)} runs, one beside each repetition of each chunk size",
                    samples,
                )
            )
    report.raw["disk"] = {"where": where, "paired_runs": runs}
    for mib, pairs in runs.items():
        for what, run_of, kind, dd_kind, judged in DISK_PAIRS:
            ratios = [
                (pair[run_of][kind] / ceiling, pair[run_of][kind], ceiling)
                for pair in pairs
                if (ceiling := pair["dd"][dd_kind])
            ]
            if not ratios:
                continue
            _, value, ceiling = sorted(ratios)[(len(ratios) - 1) // 2]  # the median pair (lower middle)
            row = ratio_row(
                "disk",
                what,
                f"{mib} MiB",
                value,
                "GB/s",
                f"dd {dd_kind}",
                ceiling,
                0.7 if judged else None,
                {
                    "bytes": cfg.disk_bytes,
                    "pairs": [{"tier": v, "dd": c, "ratio": r} for r, v, c in ratios],
                },
            )
            report.rows.append(row)


# -- redis tier -------------------------------------------------------------------------------------
def start_redis(work: Path) -> tuple[Child, int]:
    port = free_port()
    data_dir = work / "redis"
    data_dir.mkdir()
    cmd = [
        "redis-server",
        "--port",
        str(port),
        "--bind",
        HOST,
        "--protected-mode",
        "yes",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(data_dir),
        "--maxmemory",
        "2gb",
        "--maxmemory-policy",
        "allkeys-lru",
    ]
    child = Child.start("redis-server", cmd, work / "redis.log")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            raise BenchError(f"redis-server exited with {child.proc.returncode}; see {work / 'redis.log'}")
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            if s.recv(16).startswith(b"+PONG"):
                return child, port
        time.sleep(0.1)
    child.stop()
    raise BenchError("redis-server did not answer PING within 10 s")


def redis_benchmark(
    port: int, value_bytes: int, requests: int, clients: int, pipeline: int
) -> dict[str, float]:
    """requests/s of SET and GET (in that order: GET reads what SET wrote) from one redis-benchmark run."""
    cmd = [
        "redis-benchmark",
        "-h",
        HOST,
        "-p",
        str(port),
        "-t",
        "set,get",
        "-d",
        str(value_bytes),
        "-n",
        str(requests),
        "-c",
        str(clients),
        "-P",
        str(pipeline),
        "-r",
        str(REDIS_KEYSPACE),
        "--csv",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    rows = {r[0]: r[1] for r in csv.reader(done.stdout.splitlines()) if len(r) > 1}
    if done.returncode != 0 or "SET" not in rows or "GET" not in rows:
        raise BenchError(f"{shlex.join(cmd)} failed ({done.returncode}): {done.stderr.strip()[-300:]}")
    return {"SET": float(rows["SET"]), "GET": float(rows["GET"])}


async def redis_tier_run(
    url: str, payload_bytes: int, batch: int, concurrency: int, requests: int
) -> dict[str, float]:
    """keys/s of put_many and get_many of ``batch`` keys, ``concurrency`` calls in flight."""
    tier = RedisTier(url, prefix="kvstack-bench:", socket_timeout_s=10.0, name="bench-redis")
    await tier.start()
    try:
        if not tier.up:
            raise BenchError(f"redis tier cannot reach {url}")
        keys = new_keys(REDIS_KEYSPACE)
        payloads = [a.data for a in chunks_of(payload_bytes, REDIS_KEYSPACE)]
        calls = max(concurrency, requests // batch)
        spans = [(i * batch, i * batch + batch) for i in range(calls)]

        def pick(lo: int, hi: int) -> list[int]:
            return [j % REDIS_KEYSPACE for j in range(lo, hi)]

        async def put(lo: int, hi: int) -> None:
            items = [(keys[j], payloads[j]) for j in pick(lo, hi)]
            if await tier.put_many(items) != len(items):
                raise BenchError(f"redis tier dropped writes: {tier.stats()}")

        async def get(lo: int, hi: int) -> None:
            got = await tier.get_many([keys[j] for j in pick(lo, hi)])
            if any(g is None for g in got):
                raise BenchError(f"redis tier missed keys it holds: {tier.stats()}")

        await _async_passes(concurrency, spans[: max(1, REDIS_KEYSPACE // batch)], put)  # every key once
        out = {"SET": calls * batch / await _async_passes(concurrency, spans, put)}
        out["GET"] = calls * batch / await _async_passes(concurrency, spans, get)
        await tier.clear()
        return out
    finally:
        await tier.close()


async def bench_redis(
    cfg: Config, work: Path, report: Report, say: Callable[[str], None], deadline: Deadline
) -> None:
    child, port = start_redis(work)
    url = f"redis://{HOST}:{port}/0"
    results: list[dict[str, Any]] = []
    try:
        for payload_bytes, batch in cfg.redis_cases:
            for concurrency in cfg.redis_concurrency:
                if deadline.left() < 15:
                    report.skipped.append(f"redis {size_label(payload_bytes)} c{concurrency}: deadline")
                    continue
                value_bytes = payload_bytes + HEADER_BYTES
                requests = max(REDIS_KEYSPACE * 4, cfg.redis_bytes // payload_bytes)
                bench, tier = [], []
                for _ in range(REDIS_RUNS):  # alternate, best of each
                    bench.append(redis_benchmark(port, value_bytes, requests, concurrency, batch))
                    tier.append(await redis_tier_run(url, payload_bytes, batch, concurrency, requests))
                results.append(
                    {
                        "payload_bytes": payload_bytes,
                        "value_bytes": value_bytes,
                        "batch": batch,
                        "concurrency": concurrency,
                        "requests": requests,
                        "redis_benchmark": bench,
                        "tier": tier,
                    }
                )
                say(f"redis {size_label(payload_bytes)} c{concurrency} P{batch}: bench {bench}, tier {tier}")
    finally:
        child.stop()
    report.raw["redis"] = results
    for res in results:
        label = f"{size_label(res['payload_bytes'])} c{res['concurrency']} x{res['batch']}"
        for op, what in (("SET", "put_many (pipelined SET)"), ("GET", "get_many (MGET)")):
            ceiling = max(run[op] for run in res["redis_benchmark"])
            value = max(run[op] for run in res["tier"])
            mb = res["payload_bytes"] / 1e6
            report.ceilings.append(
                Ceiling(
                    f"redis-benchmark {op}",
                    label,
                    ceiling,
                    "req/s",
                    f"-d {res['value_bytes']} -c {res['concurrency']} -P {res['batch']} -r {REDIS_KEYSPACE}, "
                    f"{ceiling * res['value_bytes'] / 1e6:,.0f} MB/s; best of {REDIS_RUNS}",
                    [run[op] for run in res["redis_benchmark"]],
                )
            )
            report.rows.append(
                ratio_row(
                    "redis",
                    f"{what}, {value * mb:,.0f} MB/s",
                    label,
                    value,
                    "keys/s",
                    f"{op}",
                    ceiling,
                    0.7,
                    {"samples": [run[op] for run in res["tier"]], "payload_mb_per_s": value * mb},
                )
            )


# -- output ---------------------------------------------------------------------------------------------
def ceilings_table(ceilings: list[Ceiling]) -> Table:
    table = Table(title="Ceilings measured in this run")
    for column in ("ceiling", "size", "value", "how"):
        table.add_column(column, justify="right" if column == "value" else "left")
    for c in ceilings:
        table.add_row(c.name, c.size, f"{c.value:,.2f} {c.unit}", c.how)
    return table


def results_table(rows: list[Row]) -> Table:
    table = Table(title="KV cache tier against this machine's ceilings")
    for c in ("target", "measurement", "size", "result", "ceiling", "ratio", "needed", "verdict"):
        table.add_column(c, justify="right" if c in ("result", "ceiling", "ratio") else "left")
    style = {"PASS": "[green]PASS[/]", "FAIL": "[red]FAIL[/]", "info": "[dim]info[/]"}
    for r in rows:
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}"
        table.add_row(r.target, r.what, r.size, r.result, r.ceiling, ratio, r.needed, style[r.verdict])
    return table


def verdicts(report: Report, ran: Sequence[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for target, text in TARGETS.items():
        judged = [r for r in report.rows if r.target == target and r.verdict != "info"]
        failed = [f"{r.what} {r.size}" for r in judged if r.verdict == "FAIL"]
        if target in report.errors:
            verdict = "ERROR"
        elif not judged:
            verdict = "not run" if target not in ran else "no result"
        else:
            verdict = "FAIL" if failed else "PASS"
        out[target] = {"target": text, "verdict": verdict, "rows": len(judged), "failed": failed}
    return out


def markdown(report: Report) -> str:
    """The results as markdown tables (for docs/benchmarks/cache-tier.md)."""
    lines = ["| ceiling | size | value | how |", "|---|--:|--:|---|"]
    lines += [f"| {c.name} | {c.size} | {c.value:,.2f} {c.unit} | {c.how} |" for c in report.ceilings]
    lines += ["", "| target | measurement | size | result | ceiling | ratio | needed | verdict |"]
    lines += ["|---|---|--:|--:|--:|--:|---|---|"]
    for r in report.rows:
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}"
        verdict = f"**{r.verdict}**" if r.verdict == "FAIL" else r.verdict
        cells = (r.target, r.what, r.size, r.result, r.ceiling, ratio, r.needed, verdict)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# -- main ---------------------------------------------------------------------------------------------
def run(cfg: Config, sections: Sequence[str], work: Path, report: Report, console: Console) -> None:
    deadline = Deadline(cfg.deadline_s)

    def say(text: str) -> None:
        console.print(f"[dim]{time.strftime('%H:%M:%S')}[/] {text}")

    def section(name: str, body: Callable[[], Any]) -> None:
        if deadline.left() < 5:
            report.skipped.append(f"{name}: deadline")
            return
        t0 = time.monotonic()
        try:
            result = body()
            if inspect.iscoroutine(result):
                run_async(result)
        except BenchError as e:
            report.errors[name] = str(e)
            console.print(f"[red]{name}: {e}[/]")
        report.raw.setdefault("section_seconds", {})[name] = round(time.monotonic() - t0, 1)

    if "memory" in sections:
        section("memory", lambda: bench_memory(cfg, report, say, deadline))
    if "server" in sections or "lookup" in sections:
        # room for every chunk of the working set plus the lookup's prompts (4 KiB payloads)
        memory = cfg.working_set + 16 * MiB
        server, endpoint, unix_endpoint = start_cache_server(memory, work / "cache-server.log")
        say(f"cache server pid {server.proc.pid} on {endpoint} and {unix_endpoint}")
        try:
            if "server" in sections:
                section("server", lambda: bench_server(cfg, endpoint, server.proc.pid, report, say, deadline))
            if "lookup" in sections:
                section(
                    "lookup",
                    lambda: bench_lookup(cfg, endpoint, unix_endpoint, server.proc.pid, work, report, say),
                )
        finally:
            server.stop()
            report.raw["server_log_tail"] = (work / "cache-server.log").read_text(errors="replace")[-2000:]
    if "disk" in sections:
        section("disk", lambda: bench_disk(cfg, work / "disk", report, say, deadline))
    if "redis" in sections:
        section("redis", lambda: bench_redis(cfg, work, report, say, deadline))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="smaller working sets, fewer rounds (< 1 min)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument(
        "--disk-parent", type=Path, default=OUT_DIR, help="where the temp dir (disk tier, dd, redis) goes"
    )
    parser.add_argument("--results", type=Path, help="JSON path (default .cache/bench/cache_tier/<UTC>.json)")
    parser.add_argument("--working-set-mib", type=int, help="bytes per memcpy/memory/server pass (256)")
    parser.add_argument("--request-mib", type=int, help="chunk bytes per server request (32)")
    parser.add_argument("--async-concurrency", type=int, help="AsyncCacheClient requests in flight (2)")
    parser.add_argument("--disk-mib", type=int, help="bytes per dd and disk tier run (512)")
    parser.add_argument("--disk-reps", type=int, help="paired tier/dd repetitions per chunk size (3)")
    parser.add_argument("--deadline", type=float, help="seconds before remaining parts are skipped (480)")
    args = parser.parse_args(argv)
    sections = [s for s in args.only.split(",") if s]
    if unknown := set(sections) - set(SECTIONS):
        parser.error(f"unknown sections {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    cfg = quick_config() if args.quick else Config()
    for flag, attr, scale in (
        ("working_set_mib", "working_set", MiB),
        ("request_mib", "request_bytes", MiB),
        ("async_concurrency", "async_concurrency", 1),
        ("disk_mib", "disk_bytes", MiB),
        ("disk_reps", "disk_reps", 1),
        ("deadline", "deadline_s", 1),
    ):
        if (value := getattr(args, flag)) is not None:
            setattr(cfg, attr, value * scale)
    console = Console() if sys.stdout.isatty() else Console(width=200)
    command = shlex.join([sys.executable, *sys.argv])
    console.print(f"command: {command}")
    if not KVSTACK.exists():
        raise SystemExit(f"{KVSTACK} not found: run `make dev` first")
    for tool in ("dd", "sync", "redis-server", "redis-benchmark"):
        if shutil.which(tool) is None and (tool in ("dd", "sync") or "redis" in sections):
            raise SystemExit(f"{tool} not found (apt-get install redis-server brings redis-benchmark)")
    started = datetime.now(UTC)
    host, t0 = machine(), time.monotonic()
    console.print(
        f"machine: {host['cpus']} cores ({host['cpu_model']}), kernel {host['kernel']}, busy "
        f"{host['busy_pct_before_start']:.0f}% before the run (load {' '.join(host['loadavg_at_start'])}); "
        "client, server, redis and dd share these cores"
    )
    args.disk_parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="run-", dir=args.disk_parent))
    report = Report()
    stopped = None
    try:
        run(cfg, sections, work, report, console)
    except KeyboardInterrupt:
        stopped = "interrupted; results are partial"
    except Exception as exc:  # keep and report what was measured before the failure
        stopped = f"run failed: {type(exc).__name__}: {exc}"
        console.print_exception()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for path in glob.glob(f"/dev/shm/kvstack-arena-{os.getpid()}-*"):  # this process's arenas only
            with contextlib.suppress(OSError):
                os.unlink(path)

    verdict = verdicts(report, sections)
    console.print(ceilings_table(report.ceilings))
    console.print(results_table(report.rows))
    for target, v in verdict.items():
        colour = {"PASS": "green", "FAIL": "red"}.get(v["verdict"], "yellow")
        detail = f" ({len(v['failed'])} of {v['rows']} rows fail)" if v["failed"] else f" ({v['rows']} rows)"
        detail = detail if v["rows"] else ""
        console.print(f"target {target}: [{colour}]{v['verdict']}[/]{detail}: {v['target']}")
    for name, error in report.errors.items():
        console.print(f"[red]error in {name}: {error}[/]")
    if report.skipped:
        console.print(f"[yellow]skipped: {', '.join(report.skipped)}[/]")
    elapsed = round(time.monotonic() - t0, 1)
    results = args.results or OUT_DIR / f"{started.strftime('%Y%m%d-%H%M%S')}.json"
    results.parent.mkdir(parents=True, exist_ok=True)
    out = {
        "command": command,
        "started_utc": started.isoformat(timespec="seconds"),
        "machine": host,
        "config": asdict(cfg),
        "sections": sections,
        "ceilings": [asdict(c) for c in report.ceilings],
        "rows": [{**asdict(r)} for r in report.rows],
        "verdict": verdict,
        "raw": report.raw,
        "errors": report.errors,
        "skipped": report.skipped,
        "stopped": stopped,
        "elapsed_s": elapsed,
        "markdown": markdown(report),
    }
    results.write_text(json.dumps(out, indent=2, default=str) + "\n")
    console.print(f"results: {results} ({elapsed} s)")
    return 1 if stopped or report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
