"""Fuzzing the cache server with frames from DEALER sockets: random bytes, truncated and bit-flipped
requests, random msgpack of the right and wrong shapes, other versions, unknown ops, huge declared sizes,
deep nesting, inconsistent puts and gets (bad arenas, offsets, sizes, key lengths), too many keys, and
frames over the size limit. Every message gets an error reply (or, for a frame over the limit, its
connection is dropped), and the server keeps serving a well-behaved client afterwards."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable

import pytest
import zmq
import zmq.asyncio

from kvstack.cache import TieredStore
from kvstack.cache.client import AsyncCacheClient
from kvstack.cache.protocol import (
    ErrorReply,
    Stats,
    decode_reply,
    encode,
    request_mac,
)
from kvstack.cache.server import CacheServer
from kvstack.cache.tiers import MemoryTier
from support.cache_fuzz import MAX_BYTES, MAX_KEYS, SEED, message


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
