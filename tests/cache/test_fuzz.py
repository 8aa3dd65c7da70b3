"""Fuzzing the cache server with frames from DEALER sockets: random bytes, truncated and bit-flipped
requests, random msgpack of the right and wrong shapes, other versions, unknown ops, huge declared sizes,
deep nesting, inconsistent puts and gets (bad arenas, offsets, sizes, key lengths), too many keys, and
frames over the size limit. Every message gets an error reply (or, for a frame over the limit, its
connection is dropped), and the server keeps serving a well-behaved client afterwards."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvstack.cache import TieredStore
from kvstack.cache.client import AsyncCacheClient
from kvstack.cache.protocol import (
    OPS,
    Clear,
    ErrorReply,
    Evict,
    Exists,
    Get,
    Hello,
    Lookup,
    Put,
    Stats,
    decode_reply,
    encode,
    request_mac,
)
from kvstack.cache.server import CacheServer
from kvstack.cache.tiers import MemoryTier

MAX_BYTES = 64 << 10
MAX_KEYS = 64
SEED = 20_260_517
FIELDS = (
    "op", "v", "id", "keys", "sizes", "offsets", "arena", "parent", "token_ids",
    "region_offset", "region_size", "client", "arena_nonce",
)  # fmt: skip
HUGE_HEADERS = (
    b"\xc6\xff\xff\xff\xff",  # bin32 of 4 GiB
    b"\xdb\xff\xff\xff\xf0abc",  # str32
    b"\xdd\xff\xff\xff\xff\x01",  # array32 of 4 G items
    b"\xdf\xff\xff\xff\xff\xa2op",  # map32 of 4 G pairs
    b"\xc9\x7f\xff\xff\xff\x01",  # ext32
    b"\x81\xa4keys\xc6\x7f\xff\xff\xff",  # a map whose keys field declares 2 GiB
)


def _key(rng: random.Random) -> bytes:
    return rng.randbytes(32)


def valid_request(rng: random.Random) -> Any:
    rid = rng.randrange(1, 2**40)
    keys = b"".join(_key(rng) for _ in range(rng.randrange(0, 5)))
    n = len(keys) // 32
    return rng.choice(
        [
            Hello(id=rid, client="fuzz"),
            Lookup(id=rid, keys=keys),
            Exists(id=rid, keys=keys),
            Get(id=rid, keys=keys),
            Put(id=rid, keys=keys, sizes=[0] * n),
            Evict(id=rid, keys=keys),
            Stats(id=rid),
            Clear(id=rid),
        ]
    )


def random_object(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(10 if depth < 4 else 7)
    if kind == 0:
        return rng.choice([0, 1, -1, 2**63 - 1, -(2**63), 2**64 - 1, rng.randrange(-1000, 1000)])
    if kind == 1:
        return rng.choice([0.5, float("nan"), float("inf"), -1e300])
    if kind == 2:
        return rng.choice([*OPS, "", "put ", "PUT", "error", "x" * 300])
    if kind == 3:
        return rng.randbytes(rng.choice([0, 1, 31, 32, 33, 64, 100]))
    if kind == 4:
        return rng.choice([None, True, False])
    if kind == 5:
        return rng.choice(
            ["../../etc/passwd", "kvstack-arena-nope", "kvstack-arena-" + "a" * 200, "/dev/shm/x"]
        )
    if kind == 6:
        return [rng.randrange(-5, 2**33) for _ in range(rng.randrange(0, 6))]
    if kind in (7, 8):
        return {
            rng.choice(FIELDS) if rng.random() < 0.9 else str(rng.random()): random_object(rng, depth + 1)
            for _ in range(rng.randrange(0, 8))
        }
    return [random_object(rng, depth + 1) for _ in range(rng.randrange(0, 4))]


def shaped_request(rng: random.Random) -> dict[str, Any]:
    """A map that looks like a request (right op and version) with random, inconsistent fields."""
    fields: dict[str, Any] = {"op": rng.choice(OPS), "v": 1, "id": rng.randrange(2**32)}
    for name in rng.sample(FIELDS[3:], rng.randrange(0, 6)):
        fields[name] = random_object(rng, 2)
    if rng.random() < 0.5:
        n = rng.randrange(0, MAX_KEYS + 3)
        fields["keys"] = rng.randbytes(32 * n + rng.choice([0, 0, 0, 1, 31]))
        fields["sizes"] = [rng.choice([0, 1, 100, -1, 2**40]) for _ in range(n + rng.choice([0, 0, 1, -1]))]
        fields["offsets"] = rng.choice([[], [-1] * n, [rng.randrange(-2, 2**20) for _ in range(n)]])
    return fields


def message(rng: random.Random) -> list[bytes]:
    """One fuzz message: the frames after the DEALER's identity."""
    kind = rng.randrange(12)
    if kind == 0:  # random frames
        return [rng.randbytes(rng.choice([0, 1, 5, 40, 300, 3000])) for _ in range(rng.randrange(1, 6))]
    header = encode(valid_request(rng))
    if kind == 1:  # truncated request
        return [header[: rng.randrange(0, len(header))], b""]
    if kind == 2:  # flipped bytes
        data = bytearray(header)
        for _ in range(rng.randrange(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return [bytes(data), b"", *([rng.randbytes(10)] if rng.random() < 0.2 else [])]
    if kind == 3:  # random msgpack
        return [msgspec.msgpack.encode(random_object(rng)), b""]
    if kind == 4:  # the right shape, inconsistent contents, random payload frames
        frames = [rng.randbytes(rng.choice([0, 1, 100])) for _ in range(rng.randrange(0, 4))]
        return [msgspec.msgpack.encode(shaped_request(rng)), rng.choice([b"", rng.randbytes(32)]), *frames]
    if kind == 5:  # another version
        fields = msgspec.msgpack.decode(header)
        fields["v"] = rng.choice([0, 2, 99, -1, "1", None])
        return [msgspec.msgpack.encode(fields), b""]
    if kind == 6:  # unknown op
        fields = msgspec.msgpack.decode(header)
        fields["op"] = rng.choice(["drop_table", "", "Lookup", 7, None])
        return [msgspec.msgpack.encode(fields), b""]
    if kind == 7:  # huge declared sizes, deep nesting
        return [rng.choice([*HUGE_HEADERS, b"\x91" * 50_000 + b"\xc0", b"\x81\xa1a" * 20_000]), b""]
    if kind == 8:  # wrong frame counts: no mac, or payload frames an op does not take
        return rng.choice([[header], [header, b"", b"payload"], [b"", header]])
    if kind == 9:  # too large altogether (each frame under the limit)
        return [header, b"", *(rng.randbytes(MAX_BYTES // 2) for _ in range(3))]
    if kind == 10:  # too many keys
        return [encode(Lookup(id=3, keys=rng.randbytes(32 * (MAX_KEYS + 1)))), b""]
    # Shared-memory requests naming arenas that are not there or not arenas.
    name = rng.choice(["../../etc/passwd", "kvstack-arena-missing", "kvstack-arena-x/../../y", "", "shm"])
    if rng.random() < 0.5:
        request: Any = Get(
            id=9, keys=_key(rng), arena=name, region_offset=rng.randrange(-10, 2**40), region_size=8
        )
    else:
        request = Put(id=9, keys=_key(rng), sizes=[8], offsets=[rng.randrange(-3, 2**20)], arena=name)
    return [encode(request), b""]


@pytest.fixture
async def fuzz_server() -> AsyncIterator[CacheServer]:
    store = TieredStore([MemoryTier(8 << 20)])
    await store.start()
    server = CacheServer(
        store,
        "tcp://127.0.0.1:0",
        max_message_bytes=MAX_BYTES,
        max_keys=MAX_KEYS,
        events_endpoint="tcp://127.0.0.1:0",
        events_replay_endpoint="tcp://127.0.0.1:0",
    )
    await server.start()
    yield server
    await server.stop()
    await store.stop()


async def _exchange(sock: zmq.asyncio.Socket, frames: list[bytes], timeout_s: float) -> list[bytes] | None:
    await sock.send_multipart(frames)
    if not await sock.poll(int(timeout_s * 1000)):
        return None
    reply = await sock.recv_multipart()
    while reply and reply[0] == b"":  # the echo of a delimiter-like empty first frame
        reply = reply[1:]
    return reply


async def _fuzz(
    server: CacheServer, count: int, workers: int, make: Callable[[random.Random], list[bytes]]
) -> tuple[int, int]:
    ctx = zmq.asyncio.Context()
    errors = successes = 0

    async def worker(n: int) -> None:
        nonlocal errors, successes
        rng = random.Random(SEED + n)
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.endpoint or "")
        for i in range(count // workers):
            frames = make(rng)
            reply = await _exchange(sock, frames, 5.0)
            assert reply is not None, (
                f"no reply to message {i} of worker {n} (seed {SEED + n}): {frames!r:.300}"
            )
            decoded = decode_reply(reply[0])
            if isinstance(decoded, ErrorReply):
                errors += 1
                assert decoded.code and decoded.message
            else:
                successes += 1  # a mutation that still made a valid request
        sock.close()

    await asyncio.gather(*(worker(n) for n in range(workers)))
    ctx.destroy(linger=0)
    return errors, successes


async def _still_serves(server: CacheServer) -> None:
    assert server._loops and not any(task.done() for task in server._loops)
    async with AsyncCacheClient(server.endpoint or "") as client:
        keys = [bytes([i]) * 32 for i in range(3)]
        assert await client.put(keys, [b"a" * 1000, b"b" * 1000, b"c"])
        chunks = await client.get(keys)
        assert chunks is not None and [bytes(c) for c in chunks] == [b"a" * 1000, b"b" * 1000, b"c"]
        chunks.release()
        assert client.stats.failures == {}


async def test_thousands_of_random_messages_get_error_replies_and_the_server_keeps_serving(
    fuzz_server: CacheServer,
) -> None:
    errors, successes = await _fuzz(fuzz_server, 3000, 4, message)
    assert errors + successes == 3000 and errors > 2700
    counted = sum(
        sample.value
        for metric in fuzz_server.metrics.protocol_errors.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
    )
    assert counted == errors
    codes = {
        sample.labels["code"]
        for metric in fuzz_server.metrics.protocol_errors.collect()
        for sample in metric.samples
    }
    assert {"malformed", "version", "unknown_op", "too_large", "bad_request", "arena"} <= codes
    assert "internal" not in codes  # no handler raised
    await _still_serves(fuzz_server)


async def test_a_frame_over_the_limit_drops_only_that_connection(fuzz_server: CacheServer) -> None:
    ctx = zmq.asyncio.Context()
    big = ctx.socket(zmq.DEALER)
    big.setsockopt(zmq.LINGER, 0)
    big.connect(fuzz_server.endpoint or "")
    for _ in range(2):
        assert await _exchange(big, [encode(Stats(id=1)), b"", b"x" * (MAX_BYTES + 1)], 0.3) is None
    big.close()
    ctx.destroy(linger=0)
    await _still_serves(fuzz_server)


async def test_secret_server_answers_garbage_with_errors() -> None:
    store = TieredStore([MemoryTier(1 << 20)])
    await store.start()
    server = CacheServer(
        store, "tcp://127.0.0.1:0", secret=b"k", max_message_bytes=MAX_BYTES, max_keys=MAX_KEYS
    )
    await server.start()
    try:

        def signed_or_not(rng: random.Random) -> list[bytes]:
            frames = message(rng)
            if rng.random() < 0.5 and len(frames) >= 2 and frames[0]:
                frames[1] = request_mac(b"k", frames[0])
            return frames

        errors, successes = await _fuzz(server, 400, 2, signed_or_not)
        assert errors + successes == 400 and errors > 350
    finally:
        await server.stop()
        await store.stop()


async def test_event_replay_survives_garbage(fuzz_server: CacheServer) -> None:
    publisher = fuzz_server.publisher
    assert publisher is not None and publisher.replay_endpoint is not None
    ctx = zmq.asyncio.Context()
    rng = random.Random(SEED)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(publisher.replay_endpoint)
    for _ in range(200):
        await sock.send_multipart([rng.randbytes(rng.randrange(0, 20)) for _ in range(rng.randrange(1, 4))])
    while await sock.poll(100):
        await sock.recv_multipart()  # replies to the garbage that happened to be [b"", seq]
    await sock.send_multipart([b"", (0).to_bytes(8, "big")])
    frames = await asyncio.wait_for(sock.recv_multipart(), 2)
    while frames[2] != b"\xff" * 8:  # until the end marker, seq -1
        frames = await asyncio.wait_for(sock.recv_multipart(), 2)
    sock.close()
    ctx.destroy(linger=0)
