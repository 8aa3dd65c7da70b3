"""The cache server (``kvstack cache-server``, memory tier only) with its sync and async clients vs memcpy.

Per chunk size and client (sync or async, over shared memory or the socket): put(bytes), reserve + put
(only the server's copy; the fill is not timed), get (views) and get + copy out, each client's passes
followed by a memcpy pass, the server's CPU share read from /proc. Judged: reserve + put and get over
shared memory.
"""

# kvstack ships no py.typed marker, so mypy run on this file alone would refuse its (typed) modules.
# mypy: disable-error-code="import-untyped"
from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from cache_tier_config import (
    BenchError,
    Child,
    Config,
    Deadline,
    MiB,
    async_passes,
    chunks_of,
    gbps,
    median,
    new_keys,
)
from cache_tier_report import Ceiling, Report, ratio_row
from machine_info import process_cpu_seconds
from procs import HOST, KVSTACK

from kvstack.cache.client import AsyncCacheClient, CacheClient
from kvstack.cache.keys import ChunkKey


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

    return await async_passes(concurrency, batches, one)


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
