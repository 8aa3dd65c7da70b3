"""Lookup of a 128-chunk prompt, from token ids to the answer, next to the round-trip floors of this machine.

Each iteration runs back to back: ``chunk_keys`` from a list and from packed ids plus a ``CacheClient.lookup``
over the unix socket (and ZMQ tcp), the async client's round trip, ``TieredStore.lookup`` in process, and
echo round trips of the same message size (`EchoFloor`: a sync and a zmq.asyncio ROUTER, a uvloop unix
socket server). Judged: from a list over the unix socket, p99 < 1 ms.
"""

# kvstack ships no py.typed marker, so mypy run on this file alone would refuse its (typed) modules.
# mypy: disable-error-code="import-untyped"
from __future__ import annotations

import random
import socket
import sys
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
from cache_tier_config import BenchError, Child, Config, MiB, pct
from cache_tier_report import Report, Row
from machine_info import process_cpu_seconds

from kvstack.cache.client import AsyncCacheClient, CacheClient
from kvstack.cache.keys import KVLayout, chunk_keys
from kvstack.cache.store import TieredStore
from kvstack.cache.tiers.memory import MemoryTier

LAYOUT = KVLayout(model="bench/llama-3-8b", num_layers=32, num_kv_heads=8, head_size=128, dtype="bfloat16")
CHUNK_TOKENS = 256
PROMPT_CHUNKS = 128
VOCAB = 128_000


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
