"""The Redis tier against a real redis-server started here: round trips, pipelining, TTL, prefixes,
corruption, and the server going away and coming back while a tiered store keeps serving.

The server is ``redis-server`` from PATH (Debian package redis-server), on a free 127.0.0.1 port with no
persistence, stopped by PID. Without the binary these tests skip, except under CI (CI=true), where they fail.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import time
import tracemalloc
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import uvloop
from blake3 import blake3
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from kvstack.cache import ChunkKey, TieredStore
from kvstack.cache.client import AsyncCacheClient
from kvstack.cache.server import CacheServer
from kvstack.cache.tiers import DiskTier, MemoryTier
from kvstack.cache.tiers.buffers import BufferPool
from kvstack.cache.tiers.record import HEADER_BYTES
from kvstack.cache.tiers.redis import RedisTier
from kvstack.cache.tiers.resp import ARENA_VALUE_MAX, RespAddress, RespConnection, pack_command
from support.cache import TierRecorder
from support.ports import free_port
from support.processes import spawn, stop_group
from support.waiting import eventually


def key(i: int) -> ChunkKey:
    return ChunkKey(blake3(b"redis-test" + str(i).encode()).digest())


def payload(i: int, size: int = 3000) -> bytes:
    return blake3(b"payload" + str(i).encode()).digest(length=size)


pytestmark = pytest.mark.redis


class RedisServer:
    """One redis-server process on a fixed port that can be stopped and started again."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cmd = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        cmd += ["--dir", str(self.workdir), "--logfile", str(self.workdir / "redis.log")]
        self.proc = spawn(cmd)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        log = (self.workdir / "redis.log").read_text(errors="replace")[-2000:]
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING; its log ends:\n{log}")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_group(proc, timeout_s=5)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    binary = shutil.which("redis-server")
    if binary is None:
        reason = (
            "redis-server is not installed (Debian: apt-get install redis-server; `make test` installs it)"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the Redis tier tests, but {reason}")
        pytest.skip(reason)
    server = RedisServer(binary, tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def raw(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    """A plain client, to look at and tamper with what the tier stored."""
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


@pytest.fixture
async def tier(redis_server: RedisServer, request: pytest.FixtureRequest) -> AsyncIterator[RedisTier]:
    tier = RedisTier(redis_server.url, prefix=f"t:{request.node.name}:", ttl_s=60)
    await tier.start()
    assert tier.up
    yield tier
    await tier.clear()
    await tier.close()


async def test_round_trip_contains_delete_and_stats(tier: RedisTier, raw: aioredis.Redis) -> None:
    assert await tier.put(key(1), payload(1))
    got = await tier.get(key(1))
    assert got is not None and bytes(got) == payload(1)
    assert await tier.get(key(2)) is None
    stored = await raw.get(f"{tier.prefix}{key(1).hex()}")
    assert stored is not None and len(stored) == HEADER_BYTES + 3000 and stored[:4] == b"KVSC"
    assert await tier.contains([key(1), key(2)]) == 1 and await tier.contains([]) == 0
    assert await tier.delete(key(1)) and not await tier.delete(key(1))
    stats = tier.stats()
    assert (stats.hits, stats.misses, stats.writes, stats.up) == (1, 1, 1, True)
    assert stats.bytes is None  # Redis holds the bytes: the tier does not know them


async def test_pipelined_multi_set_and_one_mget(tier: RedisTier, raw: aioredis.Redis) -> None:
    items = [(key(i), payload(i, 500 + i)) for i in range(20)]
    assert await tier.put_many(items) == 20
    before = (await raw.info("commandstats")).get("cmdstat_mget", {}).get("calls", 0)
    keys = [key(i) for i in range(20)]
    keys.insert(5, key(99))
    got = await tier.get_many(keys)
    after = (await raw.info("commandstats"))["cmdstat_mget"]["calls"]
    assert after - before == 1
    assert got[5] is None
    assert [bytes(g or b"") for g in got[:5] + got[6:]] == [data for _, data in items]
    assert await tier.contains(keys) == 5


async def test_put_many_error_replies_are_counted_and_the_connection_stays_in_step(
    tier: RedisTier, raw: aioredis.Redis
) -> None:
    # Every SET refused by the server (out of memory, noeviction): each error reply is read, none raised.
    limits = await raw.config_get("maxmemory*")
    memory, policy = limits["maxmemory"], limits["maxmemory-policy"]
    assert memory is not None and policy is not None
    await raw.config_set("maxmemory-policy", "noeviction")
    await raw.config_set("maxmemory", 1)
    try:
        assert await tier.put_many([(key(i), payload(i)) for i in range(3)]) == 0
    finally:
        await raw.config_set("maxmemory", memory)
        await raw.config_set("maxmemory-policy", policy)
    stats = tier.stats()
    assert stats.errors == 3 and stats.write_drops == 3 and tier.up
    # The next batch on the same pooled connection gets its own replies, not leftovers.
    items = [(key(i), memoryview(payload(i, 70_000))) for i in range(4)]
    assert await tier.put_many(items) == 4
    got = await tier.get_many([key(i) for i in range(4)])
    assert [bytes(g or b"") for g in got] == [bytes(data) for _, data in items]


async def test_ttl_expires_chunks(redis_server: RedisServer, raw: aioredis.Redis) -> None:
    short = RedisTier(redis_server.url, prefix="ttl:", ttl_s=0.3)
    forever = RedisTier(redis_server.url, prefix="ttl-none:", ttl_s=None)
    for t in (short, forever):
        await t.start()
        await t.put(key(1), payload(1))
    assert 0 < await raw.pttl(f"ttl:{key(1).hex()}") <= 300
    assert await raw.pttl(f"ttl-none:{key(1).hex()}") == -1

    async def expired() -> bool:
        return await short.get(key(1)) is None

    await eventually(expired, timeout_s=5)
    assert await forever.get(key(1)) is not None
    for t in (short, forever):
        await t.clear()
        await t.close()


async def test_prefixes_isolate_tiers(redis_server: RedisServer, raw: aioredis.Redis) -> None:
    a = RedisTier(redis_server.url, prefix="iso:a:")
    b = RedisTier(redis_server.url, prefix="iso:a*")  # a glob character in a prefix is matched literally
    await a.start()
    await b.start()
    await raw.set("iso:other", b"not ours")
    await a.put(key(1), payload(1))
    assert await b.get(key(1)) is None and await b.contains([key(1)]) == 0
    await b.put(key(1), payload(2))
    await b.clear()
    assert bytes(await a.get(key(1)) or b"") == payload(1)
    await a.clear()
    assert await a.get(key(1)) is None
    assert await raw.get("iso:other") == b"not ours"
    await raw.delete("iso:other")
    await a.close()
    await b.close()


async def test_flipped_bytes_in_redis_are_a_miss_deleted_and_counted(
    tier: RedisTier, raw: aioredis.Redis
) -> None:
    for i, offset in enumerate([HEADER_BYTES + 1234, 10, 30, 60]):  # payload, length, key, checksum
        await tier.put(key(i), payload(i))
        name = f"{tier.prefix}{key(i).hex()}"
        value = await raw.getrange(name, offset, offset)
        assert isinstance(value, bytes)
        await raw.setrange(name, offset, bytes([value[0] ^ 0x40]))
    await tier.put(key(9), payload(9))
    # A sound value among corrupt ones keeps its place.
    got = await tier.get_many([key(0), key(1), key(9), key(2), key(3)])
    assert got[:2] == [None, None] and got[3:] == [None, None] and got[2] == payload(9)
    assert tier.stats().corrupt == 4 and tier.stats().misses == 4 and tier.stats().hits == 1
    assert await raw.exists(*[f"{tier.prefix}{key(i).hex()}" for i in range(4)]) == 0


async def test_unreachable_at_start_is_down_not_an_error() -> None:
    tier = RedisTier(f"redis://127.0.0.1:{free_port()}/0", retry_initial_s=0.05, retry_max_s=0.1)
    await tier.start()
    assert not tier.up
    assert await tier.get(key(1)) is None and await tier.contains([key(1)]) == 0
    assert not await tier.put(key(1), b"x")
    stats = tier.stats()
    assert stats.misses == 1 and stats.write_drops == 1 and stats.errors >= 1 and not stats.up
    await tier.close()


async def test_redis_stopped_mid_run_store_keeps_serving_then_recovers(
    redis_server: RedisServer, raw: aioredis.Redis, tmp_path: Path
) -> None:
    memory = MemoryTier(2 * 4096)
    disk = DiskTier(tmp_path, 1 << 20)
    remote = RedisTier(redis_server.url, prefix="restart:", ttl_s=60, retry_initial_s=0.02, retry_max_s=0.2)
    store = TieredStore([memory, disk, remote], write_queue_size=64)
    await store.start()
    keys = [key(i) for i in range(6)]
    for i, k in enumerate(keys):
        # One at a time: a queued write holds its memory pages until written, and memory has two.
        store.put([k], [payload(i, 4096)])
        await store.flush()
    assert await remote.contains(keys) == 6 and memory.contains_sync(keys[4:]) == 2

    redis_server.stop()
    try:
        # A chunk that only Redis could have: asking for it finds the server gone.
        assert (await store.lookup([*keys, key(100)]))[0] == 6
        assert not remote.up and remote.stats().errors >= 1
        got = await store.get(keys)  # served by memory and disk
        assert [bytes(g) for g in got] == [payload(i, 4096) for i in range(6)]
        del got
        more = [key(i) for i in range(6, 10)]
        for i, k in enumerate(more, start=6):
            store.put([k], [payload(i, 4096)])
            await store.flush()
        assert await disk.contains(more) == 4 and memory.contains_sync(more[2:]) == 2
        assert remote.stats().write_drops == 4  # dropped and counted while down, never raised
        assert (await store.lookup(more))[0] == 4
    finally:
        await asyncio.to_thread(redis_server.start)

    async def back_up() -> bool:
        return remote.up

    await eventually(back_up)
    assert await remote.get(key(0)) is None  # a fresh server holds nothing
    store.put([key(20)], [payload(20)])
    await store.flush()
    assert await raw.exists(f"restart:{key(20).hex()}") == 1
    assert bytes(await remote.get(key(20)) or b"") == payload(20)
    await remote.clear()
    await store.stop()


async def test_chunks_that_vanish_from_redis_are_reported_removed_when_found_missing(
    redis_server: RedisServer, raw: aioredis.Redis
) -> None:
    tier = RedisTier(redis_server.url, prefix="gone:", ttl_s=60)
    await tier.start()
    heard = TierRecorder()
    tier.listener = heard
    assert await tier.put_many([(key(i), payload(i)) for i in range(4)]) == 4
    assert heard.stored_keys == [key(i) for i in range(4)]
    # Redis drops keys on its own (TTL, maxmemory, another client): nothing tells the tier...
    await raw.delete(f"gone:{key(1).hex()}", f"gone:{key(2).hex()}")
    assert heard.removed_keys == []
    # ...until a lookup or a get finds them missing; keys it never reported stored are not reported.
    assert await tier.contains([key(0), key(1), key(9)]) == 1
    assert heard.removed_keys == [key(1)]
    got = await tier.get_many([key(2), key(3), key(8)])
    assert got[0] is None and got[1] is not None and got[2] is None
    assert heard.removed_keys == [key(1), key(2)]
    assert await tier.contains([key(1), key(2)]) == 0 and heard.removed_keys == [key(1), key(2)]  # once
    await tier.clear()
    await tier.close()


async def connections_received(raw: aioredis.Redis) -> int:
    return int((await raw.info("stats"))["total_connections_received"])


async def test_exists_of_many_keys_is_one_pipeline_on_one_connection(
    tier: RedisTier, raw: aioredis.Redis
) -> None:
    store = TieredStore([MemoryTier(1 << 20), tier])
    await store.start()
    keys = [key(i) for i in range(3000)]
    await tier.put_many([(keys[i], payload(i, 100)) for i in (5, 2999)])
    before = await connections_received(raw)
    present = await store.exists(keys)
    assert [i for i, hit in enumerate(present) if hit] == [5, 2999]
    assert await connections_received(raw) - before <= 1 and tier.up
    await store.stop()


async def test_calls_on_the_wire_at_once_are_bounded(redis_server: RedisServer, raw: aioredis.Redis) -> None:
    # As many idle connections kept as may be in use: the count opened is the count in use at once.
    tier = RedisTier(redis_server.url, prefix="bounded:", read_connections=3, max_connections=3)
    await tier.start()
    await tier.put_many([(key(i), payload(i, 100)) for i in range(4)])
    before = await connections_received(raw)
    runs = await asyncio.gather(*(tier.contains([key(i % 5) for i in range(5)]) for _ in range(60)))
    assert runs == [4] * 60
    assert await connections_received(raw) - before <= 3 and tier.up
    await tier.clear()
    await tier.close()
    with pytest.raises(ValueError, match="read_connections"):
        RedisTier(redis_server.url, read_connections=4, max_connections=2)


async def test_a_value_that_cannot_be_a_record_is_no_hit_for_lookups_either(
    tier: RedisTier, raw: aioredis.Redis
) -> None:
    heard = TierRecorder()
    tier.listener = heard
    await tier.put_many([(key(i), payload(i, 100)) for i in range(3)])
    # Under the names of chunks 1 and 2: a list (MGET reads it as nil) and a string too short for a record.
    await raw.delete(f"{tier.prefix}{key(1).hex()}", f"{tier.prefix}{key(2).hex()}")
    await raw.rpush(f"{tier.prefix}{key(1).hex()}", b"not a record")
    await raw.set(f"{tier.prefix}{key(2).hex()}", b"short")
    assert await tier.contains([key(0), key(1)]) == 1
    assert await tier.contains_each([key(0), key(1), key(2)]) == [True, False, False]
    assert tier.stats().corrupt == 2 and heard.removed_keys == [key(1), key(2)]
    assert await raw.exists(f"{tier.prefix}{key(1).hex()}", f"{tier.prefix}{key(2).hex()}") == 0
    assert [g is not None for g in await tier.get_many([key(0), key(1)])] == [True, False]


async def test_a_stalled_redis_costs_a_lookup_its_redis_answer_not_the_clients_deadline(
    redis_server: RedisServer,
) -> None:
    remote = RedisTier(redis_server.url, prefix="stall:", retry_initial_s=0.05, retry_max_s=0.2)
    store = TieredStore([MemoryTier(1 << 20), remote])
    await store.start()
    server = CacheServer(store, "tcp://127.0.0.1:0")
    await server.start()
    held, other = key(1), key(2)
    assert redis_server.proc is not None
    try:
        async with AsyncCacheClient(server.endpoint or "") as client:  # timeout_s: the default, 1 s
            assert await client.put([held], [payload(1)])
            os.kill(redis_server.proc.pid, signal.SIGSTOP)
            try:
                # Memory holds the first chunk; Redis cannot answer about the second within the
                # client's deadline: the answer is memory's prefix, and the server stays usable.
                assert await client.lookup([held, other]) == 1
                chunks = await client.get([held])
                assert chunks is not None and [bytes(c) for c in chunks] == [payload(1)]
                assert not remote.up and client.stats.failures == {}
            finally:
                os.kill(redis_server.proc.pid, signal.SIGCONT)
    finally:
        await server.stop()
        await store.stop()


# -- the tier's own RESP connections


async def open_resp(redis_server: RedisServer) -> RespConnection:
    """A RESP connection to the test server, reading into pooled buffers as the tier's do."""
    address = RespAddress.from_url(redis_server.url)
    assert address is not None
    return await RespConnection.open(address, BufferPool())


async def test_resp_connection_replies_errors_pipelines_and_large_values(
    redis_server: RedisServer, raw: aioredis.Redis
) -> None:
    conn = await open_resp(redis_server)
    big = os.urandom(3 << 20)  # larger than the arena: read straight into its own buffer
    assert await conn.call(b"PING") == b"PONG"
    assert await conn.call(b"SET", b"resp:big", big) == b"OK"
    assert await conn.call(b"SET", b"resp:small", b"x") == b"OK"
    assert await conn.call(b"INCR", b"resp:n") == 1
    got = await conn.call(b"MGET", b"resp:small", b"resp:missing", b"resp:big")
    assert got == [bytearray(b"x"), None, bytearray(big)]
    assert await conn.call(b"MGET", b"resp:missing") == [None]
    with pytest.raises(ResponseError, match="wrong number of arguments"):
        await conn.call(b"GET")
    # A pipeline: an error reply takes its command's place, the others are read in order.
    commands = [pack_command(b"SET", b"resp:a", b"1"), pack_command(b"INCR", b"resp:a", b"2")]
    commands.append(pack_command(b"GET", b"resp:a"))
    ok, error, value = await conn.send(commands, 3)
    assert ok == b"OK" and isinstance(error, ResponseError) and value == bytearray(b"1")
    assert conn.usable and await conn.call(b"PING") == b"PONG"
    conn.close()
    with pytest.raises(RedisConnectionError):
        await conn.call(b"PING")
    await raw.delete("resp:big", "resp:small", "resp:n", "resp:a")


async def test_resp_values_sliced_from_the_arena_stay_intact_while_later_replies_arrive(
    redis_server: RedisServer, raw: aioredis.Redis
) -> None:
    """Values up to ARENA_VALUE_MAX are views of the arena: bytes handed out are never overwritten, across
    MGETs, arena switches (a value that does not fit the rest; a command that starts with the arena over
    half used) and larger values with buffers of their own."""
    conn = await open_resp(redis_server)
    sizes = [0, 1, 5000, 65_536, *[200_000] * 10, ARENA_VALUE_MAX, ARENA_VALUE_MAX + 1, 3 << 20, 70_000, 2]
    values = {f"arena:{i}".encode(): os.urandom(size) for i, size in enumerate(sizes)}
    for name, value in values.items():
        assert await conn.call(b"SET", name, value) == b"OK"
    names = list(values)
    held: list[tuple[bytes, memoryview | bytes]] = []
    for round_ in range(12):  # ~70 MiB through the connection: many arenas, some reused from the pool
        picked = names[round_ % 3 :] + names[: round_ % 3]
        got = await conn.call(b"MGET", *picked)
        assert isinstance(got, list)
        held += zip(picked, got, strict=True)
        if round_ == 5:
            del held[: len(held) // 2]  # let some arenas go back to the pool
    assert all(bytes(value) == values[name] for name, value in held)
    small = [value for name, value in held if len(values[name]) <= ARENA_VALUE_MAX]
    assert small and all(isinstance(value, memoryview) for value in small)
    large = [value for name, value in held if len(values[name]) > ARENA_VALUE_MAX]
    assert large and all(isinstance(value, bytearray) for value in large)
    conn.close()
    await raw.delete(*names)


async def test_reads_stay_within_a_bounded_set_of_arenas_over_a_long_run(tier: RedisTier) -> None:
    """Each get_many's values are views of pooled arenas; once the caller lets go of them the arenas are
    reused, so memory stays flat however much is read (here ~110 MiB in 1,800 MGETs, four in flight)."""
    keys = [key(i) for i in range(64)]
    assert await tier.put_many([(k, payload(i, 65_536)) for i, k in enumerate(keys)]) == 64
    held: list[object] = []

    async def reader(offset: int, calls: int) -> None:
        for i in range(calls):
            lo = (offset + i * 16) % 48
            got = await tier.get_many(keys[lo : lo + 16])
            assert all(g is not None for g in got)
            if i % 97 == 0:
                held[:] = got  # a caller keeping the last values for a while pins their arenas only

    tracemalloc.start()
    try:
        await asyncio.gather(*(reader(j * 5, 50) for j in range(4)))  # warm-up: pool and connections
        before = tracemalloc.get_traced_memory()[0]
        await asyncio.gather(*(reader(j * 5, 400) for j in range(4)))
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 8 << 20, f"traced memory grew by {grown / 2**20:.1f} MiB over 1,600 MGETs"
    pool = tier._buffers
    assert pool.idle_bytes <= 32 << 20


async def test_resp_pipeline_framed_as_it_goes_out_and_a_framing_error_closes_the_connection(
    redis_server: RedisServer, raw: aioredis.Redis
) -> None:
    conn = await open_resp(redis_server)
    values = [os.urandom(100_000) for _ in range(8)]  # 800 KB: written in several parts
    framed: list[int] = []

    def commands() -> Iterator[list[bytes]]:
        for i, value in enumerate(values):
            framed.append(i)
            yield pack_command(b"SET", b"stream:%d" % i, value)

    assert conn._transport is not None
    transport: asyncio.Transport = conn._transport
    writes: list[int] = []

    class CountingTransport:
        def writelines(self, frames: list[bytes]) -> None:
            writes.append(sum(map(len, frames)))
            transport.writelines(frames)

        def __getattr__(self, name: str) -> object:
            return getattr(transport, name)

    conn._transport = CountingTransport()  # type: ignore[assignment]  # counts, forwards the rest
    assert await conn.send(commands(), len(values), 256 * 1024) == [b"OK"] * len(values)
    assert framed == list(range(8))
    assert len(writes) == 3 and min(writes[:2]) >= 256 * 1024  # 3 commands, 3 more, the last 2
    assert (
        await conn.send([pack_command(b"SET", b"stream:%d" % i, v) for i, v in enumerate(values)], 8)
        == [b"OK"] * 8
    )
    assert len(writes) == 4  # without write_every: one write
    conn._transport = transport
    got = await conn.call(b"MGET", *[b"stream:%d" % i for i in range(8)])
    assert isinstance(got, list) and [bytes(v) for v in got] == values

    def broken() -> Iterator[list[bytes]]:
        yield pack_command(b"SET", b"stream:0", b"changed")
        raise ValueError("cannot frame this one")

    with pytest.raises(ValueError, match="cannot frame"):
        await conn.send(broken(), 2, 1)
    assert not conn.usable  # a reply already asked for must not reach the next command
    with pytest.raises(RedisConnectionError):
        await conn.call(b"PING")
    await raw.delete(*[b"stream:%d" % i for i in range(8)])


async def test_resp_connection_selects_the_url_database_and_a_cancelled_call_closes_it(
    redis_server: RedisServer, raw: aioredis.Redis
) -> None:
    await raw.execute_command("SELECT", 0)
    db3 = aioredis.Redis.from_url(f"{redis_server.url[:-2]}/3")
    await db3.set("resp:where", b"db3")
    address = RespAddress.from_url(f"{redis_server.url[:-2]}/3")
    assert address is not None and address.db == 3
    conn = await RespConnection.open(address)
    assert await conn.call(b"GET", b"resp:where") == bytearray(b"db3")
    # BLPOP blocks server side: cancel the call; its late reply must never reach another command.
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.1):
            await conn.call(b"BLPOP", b"resp:nothing", b"5")
    assert not conn.usable
    await db3.delete("resp:where")
    await db3.aclose()
    assert RespAddress.from_url("rediss://127.0.0.1:1/0") is None  # TLS stays with redis-py


def test_resp_connection_on_uvloop(redis_server: RedisServer) -> None:
    """The cache server runs on uvloop, whose transports are not asyncio.Transport subclasses."""

    async def main() -> None:
        tier = RedisTier(redis_server.url, prefix="uvloop:")
        await tier.start()
        items = [(key(i), payload(i, 200_000)) for i in range(3)]
        assert await tier.put_many(items) == 3
        got = await tier.get_many([key(i) for i in range(4)])
        assert [None if g is None else bytes(g) for g in got] == [payload(i, 200_000) for i in range(3)] + [
            None
        ]
        await tier.clear()
        await tier.close()

    uvloop.run(main())


def test_buffer_pool_reuses_only_unreferenced_buffers() -> None:
    pool = BufferPool(max_idle_bytes=300)
    a = pool.take(100)
    a[0] = 1
    view = memoryview(a)[10:]  # a reader still holds a view of a
    del a
    b = pool.take(100)
    assert b[0] == 0  # a fresh buffer: a is still referenced
    b[0] = 2
    del b
    c = pool.take(100)
    assert c[0] == 2  # b, unreferenced, is reused (not zeroed: the caller overwrites it)
    del view
    assert pool.take(100)[0] == 1  # a, once its view is gone
    assert len(pool.take(1000)) == 1000  # larger than the pool keeps: lent, never kept idle
    assert pool.idle_bytes <= 300
