"""Cache clients against a real cache server: the synchronous client (server on its own loop in a thread,
since the client blocks its caller), the asynchronous one, shared memory and its fallbacks, timeouts, a
dead server, a killed and restarted server process, and the arena allocator."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio
from blake3 import blake3

from kvstack.cache import ChunkKey, TieredStore
from kvstack.cache.client import AsyncCacheClient, CacheClient
from kvstack.cache.server import CacheServer
from kvstack.cache.shm import HEADER_BYTES, ArenaAllocator, ClientArena, sweep_orphan_arenas
from kvstack.cache.tiers import MemoryTier
from support.cache import RESTART_SECRET, ThreadServer, start_restartable_server
from support.ports import free_port
from support.waiting import wait_until


def key(i: int, ns: bytes = b"client") -> ChunkKey:
    return ChunkKey(blake3(ns + str(i).encode()).digest())


def payload(i: int, size: int = 20_000) -> bytes:
    return blake3(b"payload" + str(i).encode()).digest(length=size)


@pytest.fixture(scope="module")
def server() -> Iterator[CacheServer]:
    with ThreadServer(node="node-a") as srv:
        yield srv


# -- synchronous client


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "socket"])
def test_sync_round_trips(server: CacheServer, shm: bool) -> None:
    keys = [key(i, f"sync-{shm}".encode()) for i in range(6)]
    data = [payload(i, 10_000 + i) for i in range(6)]
    with CacheClient(server.endpoint or "", shm=shm, timeout_s=2) as client:
        assert client.lookup(keys) == 0 and client.get(keys) is not None
        assert client.put(keys[:4], data[:4])
        assert client.node == "node-a" and client.shm_active is shm
        assert client.lookup(keys) == 4
        assert client.locate(keys) == ["memory"] * 4
        assert client.exists([keys[5], keys[1], keys[3]]) == [False, True, True]
        chunks = client.get(keys)
        assert chunks is not None
        with chunks:
            assert [bytes(c) for c in chunks] == data[:4]
            assert all(c.readonly for c in chunks)
        if shm:
            assert client.stats.shm_bytes >= sum(map(len, data[:4])) * 2 and client.stats.socket_bytes == 0
        else:
            assert client.stats.shm_bytes == 0 and client.stats.socket_bytes > 0
        assert client.evict([keys[1], keys[5]]) == 1
        assert client.lookup(keys) == 1
        stats = client.server_stats()
        assert stats is not None and stats["node"] == "node-a" and "memory" in stats["tiers"]
        assert client.clear() and client.lookup(keys) == 0
        assert client.stats.failures == {}
        assert client.stats.chunks_hit == 4 and client.stats.chunks_missed == 6 + 2


def test_sync_get_views_point_into_the_arena_and_space_is_reused(server: CacheServer) -> None:
    keys = [key(i, b"arena") for i in range(8)]
    with CacheClient(server.endpoint or "", arena_bytes=1 << 20) as client:
        assert client.put(keys, [payload(i, 100_000) for i in range(8)])
        arena = client._core.arena
        assert arena is not None and arena.allocator.used_bytes == 0  # put regions are freed on reply
        for _ in range(20):  # 800 KB per get through a 1 MiB arena: only works if released space is reused
            chunks = client.get(keys)
            assert chunks is not None and len(chunks) == 8
            assert arena.allocator.used_bytes >= 800_000
            assert bytes(chunks[7]) == payload(7, 100_000)
            chunks.release()
            assert arena.allocator.used_bytes == 0
        # An arena too small for the whole reply: the rest comes through the socket, still in order.
        first = client.get(keys)
        second = client.get(keys)
        assert first is not None and second is not None
        assert [bytes(c) for c in second] == [payload(i, 100_000) for i in range(8)]
        assert client.stats.socket_bytes > 0
        first.release()
        second.release()


def test_reserve_fill_put_is_one_copy_and_space_is_reused(server: CacheServer) -> None:
    with CacheClient(server.endpoint or "", arena_bytes=1 << 20) as client:
        arena = client._core.arena
        for round_ in range(20):  # 400 KB reserved per round in a 1 MiB arena: only works if space is reused
            keys = [key(round_ * 10 + i, b"reserve") for i in range(4)]
            data = [payload(round_ * 10 + i, 100_000) for i in range(4)]
            regions = client.reserve([len(d) for d in data])
            assert regions is not None and len(regions) == 4
            arena = client._core.arena
            assert arena is not None and arena.allocator.used_bytes >= 400_000
            for view, d in zip(regions, data, strict=True):
                assert not view.readonly and len(view) == len(d)
                view[:] = d  # produced in place, as the connector's device-to-host copy would
            shm_before = client.stats.shm_bytes
            alloc = arena.allocator.alloc
            arena.allocator.alloc = None  # type: ignore[assignment,method-assign]  # a copy would allocate
            assert client.put(keys, list(regions))
            arena.allocator.alloc = alloc  # type: ignore[method-assign]  # the allocator restored
            assert client.stats.shm_bytes - shm_before == 400_000
            assert arena.allocator.used_bytes == 0  # the put freed what it sent
            chunks = client.get(keys)
            assert chunks is not None
            with chunks:
                assert [bytes(c) for c in chunks] == data
        assert arena is not None and client._core.arena is arena  # never retired: no copy path was needed

        # Explicit release: nothing put, everything back.
        regions = client.reserve([1000, 2000])
        assert regions is not None and arena.allocator.used_bytes > 0
        regions.release()
        assert arena.allocator.used_bytes == 0 and not client._core._reserved

        # A slice of a reserved view (or any other buffer) is copied like an ordinary payload.
        regions = client.reserve([1000])
        assert regions is not None
        regions[0][:] = b"x" * 1000
        assert client.put([key(900, b"reserve")], [regions[0][:500]])
        chunks = client.get([key(900, b"reserve")])
        assert chunks is not None
        with chunks:
            assert bytes(chunks[0]) == b"x" * 500
        assert arena.allocator.used_bytes > 0  # the reservation itself was not sent: still held
        regions.release()
        assert arena.allocator.used_bytes == 0

        # More than the arena holds: None, nothing left taken.
        assert client.reserve([600_000, 600_000]) is None and arena.allocator.used_bytes == 0
        assert client.stats.failures == {}


def test_reserve_without_shared_memory_is_none_and_put_still_works(server: CacheServer) -> None:
    with CacheClient(server.endpoint or "", shm=False) as client:
        assert client.reserve([1000]) is None
        assert client.put([key(1, b"noshm")], [payload(1)])
    with CacheClient(server.endpoint or "", arena_bytes=1 << 20) as client:
        assert client.reserve([0]) is None and client.stats.failures == {"bug": 1}  # a miss, not a raise


def test_reserved_views_survive_a_fallback_to_the_socket() -> None:
    with ThreadServer() as srv, CacheClient(srv.endpoint or "", arena_bytes=1 << 20) as client:
        regions = client.reserve([50_000])
        assert regions is not None and client.shm_active
        regions[0][:] = payload(7, 50_000)
        arena = client._core.arena
        assert arena is not None
        os.unlink(arena.path)  # the server cannot read the offset any more: error "arena", then the socket
        srv.arenas.sweep()
        assert client.put([key(7, b"fallback")], list(regions))
        assert not client.shm_active and client.stats.failures == {"error:arena": 1}
        with client.get([key(7, b"fallback")]) as chunks:
            assert bytes(chunks[0]) == payload(7, 50_000)
        assert arena.allocator.used_bytes == 0


def test_shm_fallback_when_the_server_cannot_open_the_arena(server: CacheServer, tmp_path: Path) -> None:
    # The arena lives where the server does not look: as if the client were on another host.
    with CacheClient(server.endpoint or "", shm_dir=str(tmp_path)) as client:
        keys = [key(i, b"fallback") for i in range(3)]
        assert client.put(keys, [payload(i) for i in range(3)])
        assert not client.shm_active
        chunks = client.get(keys)
        assert chunks is not None and [bytes(c) for c in chunks] == [payload(i) for i in range(3)]
        assert client.stats.shm_bytes == 0 and client.stats.failures == {}


def test_arena_lost_mid_session_falls_back_to_the_socket(tmp_path: Path) -> None:
    with ThreadServer() as srv, CacheClient(srv.endpoint or "") as client:
        keys = [key(i, b"lost") for i in range(3)]
        assert client.put(keys, [payload(i) for i in range(3)]) and client.shm_active
        arena = client._core.arena
        assert arena is not None
        os.unlink(arena.path)  # the server's mapping goes at its next sweep; force it now
        srv.arenas.sweep()
        chunks = client.get(keys)  # error "arena" -> the same get again through the socket
        assert chunks is not None and [bytes(c) for c in chunks] == [payload(i) for i in range(3)]
        assert not client.shm_active and client.stats.failures == {"error:arena": 1}
        assert client.put(keys, [payload(i) for i in range(3)])


def test_dead_server_is_a_counted_miss_within_the_timeout_then_fails_fast() -> None:
    client = CacheClient(f"tcp://127.0.0.1:{free_port()}", timeout_s=0.2, retry_initial_s=5, retry_max_s=5)
    keys = [key(1)]
    started = time.monotonic()
    assert client.lookup(keys) == 0
    assert time.monotonic() - started < 1.0
    started = time.monotonic()
    assert client.get(keys) is None
    assert client.put(keys, [b"x"]) is False
    assert client.exists(keys) == [False] and client.evict(keys) == 0
    assert client.clear() is False and client.server_stats() is None and client.locate(keys) == []
    assert time.monotonic() - started < 0.05  # considered down: nothing sent
    assert client.stats.failures == {"unreachable": 1, "down": 7}  # nothing connected: the send timed out
    assert client.stats.chunks_missed == 1
    client.close()


def test_bad_arguments_are_misses_not_exceptions(server: CacheServer) -> None:
    with CacheClient(server.endpoint or "") as client:
        assert client.lookup([b"short"]) == 0
        assert client.put([key(1)], [b"a", b"b"]) is False
        assert client.put([key(1)], [b"a"], token_ids=[[1], [2]]) is False
        assert client.get([b"x" * 31]) is None
        assert client.stats.failures == {"bug": 4}
        assert client.lookup([key(1)]) == 0 and client.stats.failures == {"bug": 4}


def test_constructor_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="ZMQ endpoint"):
        CacheClient("localhost:5560")
    with pytest.raises(ValueError, match="timeout_s"):
        CacheClient("tcp://127.0.0.1:1", timeout_s=0)
    with pytest.raises(ValueError, match="secret"):
        AsyncCacheClient("tcp://127.0.0.1:1", secret=b"")


def test_a_timed_out_request_retires_its_arena() -> None:
    # A ROUTER that answers hello and then goes silent: the get that lent arena space times out.
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    from kvstack.cache.protocol import HelloReply, decode_request, encode

    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not router.poll(50):
                continue
            identity, header, *_ = router.recv_multipart()
            request = decode_request(header)
            if request.__struct_config__.tag == "hello":
                reply = HelloReply(id=request.id, node="mute", server="test", arena_ok=True, max_keys=10)
                router.send_multipart([identity, encode(reply)])

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        client = CacheClient(f"tcp://127.0.0.1:{port}", timeout_s=0.2, retry_initial_s=0.01, retry_max_s=0.01)
        assert client.get([key(1)]) is None
        arena = client._core.arena
        assert arena is not None and arena.retired and not os.path.exists(arena.path)
        time.sleep(0.02)
        assert client.lookup([key(1)]) == 0  # a new connect makes a new arena
        assert client._core.arena is not None and client._core.arena is not arena
        assert client.stats.failures == {"timeout": 2}
        client.close()
    finally:
        stop.set()
        thread.join()
        router.close(linger=0)
        ctx.term()


def test_large_puts_and_gets_are_split_to_the_server_limits() -> None:
    with ThreadServer(max_message_bytes=200_000, max_keys=3) as srv:
        keys = [key(i, b"split") for i in range(10)]
        data = [payload(i, 60_000) for i in range(10)]
        with CacheClient(srv.endpoint or "", shm=False) as client:
            assert client.put(keys, data)
            requests = client.stats.requests
            chunks = client.get(keys)
            assert chunks is not None and [bytes(c) for c in chunks] == data
            assert client.stats.requests - requests >= 4  # 10 keys, 3 per request, <= 200 kB per reply
            assert client.lookup(keys) == 10 and client.exists(keys) == [True] * 10
            assert client.evict(keys) == 10


@pytest.mark.parametrize("shm", [False, True])
def test_a_chunk_alone_over_the_message_limit_is_refused_here_not_sent(shm: bool) -> None:
    with ThreadServer(max_message_bytes=200_000) as srv:
        keys = [key(i, b"oversize") for i in range(3)]
        with CacheClient(srv.endpoint or "", shm=shm, arena_bytes=1 << 20) as client:
            assert client.put(keys[:1], [payload(0, 1000)])
            # Over the limit, and too large for the client's 1 MiB arena: it would have to go in a frame.
            assert not client.put(keys[1:], [payload(1, 1000), payload(2, 2 << 20)])
            assert client.stats.failures == {"too_large": 1}  # not sent: no timeout
            assert client.lookup(keys) == 2  # the chunk before it went; the server is not taken for down


def test_secret(tmp_path: Path) -> None:
    with ThreadServer(secret=b"s3cret") as srv:
        endpoint = srv.endpoint or ""
        with CacheClient(endpoint, secret=b"s3cret") as good:
            assert good.put([key(1, b"auth")], [b"data"]) and good.lookup([key(1, b"auth")]) == 1
        with CacheClient(endpoint, secret=b"wrong") as wrong:
            assert wrong.lookup([key(1, b"auth")]) == 0
            assert wrong.stats.failures == {"error:auth": 1}
        with CacheClient(endpoint) as missing:
            assert missing.get([key(1, b"auth")]) is None
            assert missing.stats.failures == {"error:auth": 1}


# -- asynchronous client (server in this loop)


@pytest.fixture
async def async_server(tmp_path: Path) -> Any:
    """Served on ZMQ tcp and on a unix socket."""
    store = TieredStore([MemoryTier(32 << 20)])
    await store.start()
    server = CacheServer(store, "tcp://127.0.0.1:0", node="async", unix_path=str(tmp_path / "cache.sock"))
    await server.start()
    yield server
    await server.stop()
    await store.stop()


@pytest.mark.parametrize("transport", ["zmq", "unix"])
@pytest.mark.parametrize("shm", [True, False], ids=["shm", "socket"])
async def test_async_concurrent_round_trips(async_server: CacheServer, shm: bool, transport: str) -> None:
    endpoint = async_server.endpoint if transport == "zmq" else async_server.unix_endpoint
    async with AsyncCacheClient(endpoint or "", shm=shm) as client:
        groups = [[key(g * 10 + i, b"async") for i in range(4)] for g in range(8)]
        puts = await asyncio.gather(
            *(
                client.put(keys, [payload(g * 10 + i, 5_000) for i in range(4)])
                for g, keys in enumerate(groups)
            )
        )
        assert all(puts)
        results = await asyncio.gather(*(client.get(keys) for keys in groups * 3))
        for n, chunks in enumerate(results):
            g = n % 8
            assert chunks is not None and [bytes(c) for c in chunks] == [
                payload(g * 10 + i, 5_000) for i in range(4)
            ]
            chunks.release()
        assert await client.lookup(groups[0]) == 4 and await client.locate(groups[0][:2]) == ["memory"] * 2
        assert await client.exists([groups[0][0], key(999)]) == [True, False]
        assert await client.evict(groups[1]) == 4
        stats = await client.server_stats()
        assert stats is not None and stats["node"] == "async"
        assert await client.clear() and await client.lookup(groups[0]) == 0
        assert client.stats.failures == {} and client.shm_active is shm and client.stats.connects == 1
        if shm:
            assert client._core.arena is not None and client._core.arena.allocator.used_bytes == 0


async def test_async_reserve_fill_put(async_server: CacheServer) -> None:
    async with AsyncCacheClient(async_server.endpoint or "", arena_bytes=1 << 20) as client:
        keys = [key(i, b"async-reserve") for i in range(3)]
        data = [payload(i, 30_000) for i in range(3)]
        regions = await client.reserve([len(d) for d in data])
        assert regions is not None
        for view, d in zip(regions, data, strict=True):
            view[:] = d
        assert await client.put(keys, list(regions))
        assert client._core.arena is not None and client._core.arena.allocator.used_bytes == 0
        chunks = await client.get(keys)
        assert chunks is not None and [bytes(c) for c in chunks] == data
        chunks.release()
        assert client.stats.failures == {}


async def test_async_dead_server_and_timeouts() -> None:
    # A ROUTER that never answers: every request times out, concurrently, within the timeout.
    ctx = zmq.asyncio.Context()
    mute = ctx.socket(zmq.ROUTER)
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    client = AsyncCacheClient(
        f"tcp://127.0.0.1:{port}", timeout_s=0.2, retry_initial_s=0.05, retry_max_s=0.05
    )
    started = asyncio.get_running_loop().time()
    results = await asyncio.gather(*(client.lookup([key(i)]) for i in range(5)), client.get([key(9)]))
    assert results == [0, 0, 0, 0, 0, None]
    assert asyncio.get_running_loop().time() - started < 1.0
    assert sum(client.stats.failures.values()) == 6 and "timeout" in client.stats.failures
    await client.aclose()
    mute.close(linger=0)
    ctx.term()


# -- a server process killed and restarted


def test_server_killed_and_restarted_client_recovers(tmp_path: Path) -> None:
    port = free_port()
    server = start_restartable_server(tmp_path, port)
    client = CacheClient(
        f"tcp://127.0.0.1:{port}",
        secret=RESTART_SECRET,
        timeout_s=0.5,
        retry_initial_s=0.05,
        retry_max_s=0.2,
    )
    keys = [key(i, b"restart") for i in range(3)]
    try:
        wait_until(lambda: client.put(keys, [payload(i) for i in range(3)]), what="a first put", timeout_s=15)
        assert client.node == "proc" and client.lookup(keys) == 3
        server.kill()
        started = time.monotonic()
        assert client.lookup(keys) == 0 and client.get(keys) is None
        assert time.monotonic() - started < 1.5
        server = start_restartable_server(tmp_path, port)
        # A new process: an empty cache.
        wait_until(lambda: client.put(keys[:1], [payload(0)]), what="a put after the restart", timeout_s=15)
        assert client.lookup(keys) == 1
        chunks = client.get(keys)
        assert chunks is not None and [bytes(c) for c in chunks] == [payload(0)]
        assert client.stats.failures.get("timeout", 0) + client.stats.failures.get("unreachable", 0) >= 1
    finally:
        client.close()
        assert server.stop(10) in (0, -signal.SIGTERM), server.log()


# -- the arena allocator (pure)


def test_allocator_first_fit_alignment_shrink_and_coalescing() -> None:
    alloc = ArenaAllocator(HEADER_BYTES, HEADER_BYTES + 1024)
    a = alloc.alloc(100)
    b = alloc.alloc(100)
    c = alloc.alloc(100)
    assert a == HEADER_BYTES and b == a + 128 and c == b + 128  # 64-byte aligned
    assert alloc.alloc(1024) is None
    alloc.free(b)
    assert alloc.alloc(128) == b  # first fit reuses the hole
    alloc.free(a)
    alloc.free(b)
    assert alloc.largest_free() == 1024 - 384 and alloc.alloc(256) == a  # a and b merged
    alloc.shrink(a, 64)
    assert alloc.used_bytes == 64 + 128
    alloc.free(a)
    alloc.free(c)
    assert alloc.used_bytes == 0 and alloc.largest_free() == 1024


def test_client_arena_file_lifecycle(tmp_path: Path) -> None:
    arena = ClientArena(1 << 20, directory=str(tmp_path))
    assert os.stat(arena.path).st_mode & 0o777 == 0o600
    view = arena.view[HEADER_BYTES : HEADER_BYTES + 10]
    arena.retire()
    assert not os.path.exists(arena.path)
    view[:3] = b"abc"  # a view still held keeps its mapping valid after retirement
    assert bytes(view[:3]) == b"abc"


def test_arenas_of_exited_processes_are_swept_and_no_others(tmp_path: Path) -> None:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(gone.stdout)  # exited (a pid reused this fast is unlikely; then the file just stays)
    namespace = str(os.stat("/proc/self/ns/pid").st_ino)
    orphan = tmp_path / f"kvstack-arena-{namespace}-{dead_pid}-{'0' * 16}"
    alive = tmp_path / f"kvstack-arena-{namespace}-{os.getpid()}-{'1' * 16}"
    other_namespace = tmp_path / f"kvstack-arena-{int(namespace) + 1}-{dead_pid}-{'2' * 16}"
    unrelated = tmp_path / "kvstack-arena-not-ours"
    for path in (orphan, alive, other_namespace, unrelated):
        path.write_bytes(b"x")
    assert sweep_orphan_arenas(str(tmp_path)) == (0 if os.path.exists(f"/proc/{dead_pid}") else 1)
    assert not orphan.exists() or os.path.exists(f"/proc/{dead_pid}")
    assert alive.exists() and other_namespace.exists() and unrelated.exists()
    # A client process sweeps before its first arena: a new arena's name carries the namespace and pid.
    arena = ClientArena(1 << 20, directory=str(tmp_path))
    assert arena.name.startswith(f"kvstack-arena-{namespace}-{os.getpid()}-")
    arena.retire()


def test_cli_rejects_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvstack.cache.cli import main

    (tmp_path / "empty").write_text("\n")
    assert main(["cache-server", "--secret-file", str(tmp_path / "empty")]) == 2
    assert "secret file" in capsys.readouterr().err
    assert main(["cache-server", "--memory-gb", "0"]) == 2
    assert (
        main(["cache-server", "--bind", "tcp://127.0.0.1:0", "--secret-file", str(tmp_path / "missing")]) == 2
    )
    assert main(["cache-server", "--redis-url", "redis://127.0.0.1:1/0", "--redis-timeout-s", "0"]) == 2
    assert "timeouts must be > 0" in capsys.readouterr().err
    assert main(["cache-server", "--disk-dir", str(tmp_path / "d"), "--disk-inline-read-mib", "nan"]) == 2
    assert "--disk-inline-read-mib must be >= 0" in capsys.readouterr().err
