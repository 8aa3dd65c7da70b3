"""The Redis tier against ``redis-benchmark`` at the same value size, against a redis-server started here.

``put_many`` (one pipeline of SETs) and ``get_many`` (one MGET) of B keys with C calls in flight, against
``redis-benchmark -d <record bytes> -c C -P B``; runs alternate and the best of each counts.
"""

# kvstack ships no py.typed marker, so mypy run on this file alone would refuse its (typed) modules.
# mypy: disable-error-code="import-untyped"
from __future__ import annotations

import contextlib
import csv
import shlex
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cache_tier_config import (
    BenchError,
    Child,
    Config,
    Deadline,
    async_passes,
    chunks_of,
    new_keys,
    size_label,
)
from cache_tier_report import Ceiling, Report, ratio_row
from procs import HOST, free_port

from kvstack.cache.tiers.record import HEADER_BYTES
from kvstack.cache.tiers.redis import RedisTier

REDIS_RUNS = 3  # redis-benchmark and tier runs per case, alternating; the best of each counts
REDIS_KEYSPACE = 64


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

        await async_passes(concurrency, spans[: max(1, REDIS_KEYSPACE // batch)], put)  # every key once
        out = {"SET": calls * batch / await async_passes(concurrency, spans, put)}
        out["GET"] = calls * batch / await async_passes(concurrency, spans, get)
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
