"""The cache server's unix-socket transport (``unix://`` endpoints): the framing, both clients through it
(every operation, shared memory and socket payloads, split requests, a secret), faults (no server, a mute
server, a server killed with kill -9 and restarted on the same path, garbage and fuzzed frames, a client
that never reads its replies, a full server) and the socket file's life (stale files reclaimed, live or
foreign ones refused, removed at stop)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import struct
from collections.abc import Sequence
from pathlib import Path

import pytest
from blake3 import blake3

from kvstack.cache.client import AsyncCacheClient, CacheClient
from kvstack.cache.keys import ChunkKey
from kvstack.cache.protocol import (
    UNIX_MAGIC,
    ErrorCode,
    ErrorReply,
    Lookup,
    LookupReply,
    ProtocolError,
    Reply,
    Stats,
    UnixFramer,
    decode_reply,
    encode,
    join_keys,
    unix_head,
)
from kvstack.cache.tiers import MemoryTier
from support.cache import RESTART_SECRET, DictTier, ThreadServer, serving, start_restartable_server
from support.cache_fuzz import MAX_BYTES, MAX_KEYS, SEED, message
from support.ports import free_port
from support.waiting import wait_until


def key(i: int, ns: bytes = b"unix") -> ChunkKey:
    return ChunkKey(blake3(ns + str(i).encode()).digest())


def payload(i: int, size: int = 20_000) -> bytes:
    return blake3(b"payload" + str(i).encode()).digest(length=size)


@pytest.fixture
def sock_path(tmp_path: Path) -> str:
    return str(tmp_path / "cache.sock")


class RawClient:
    """A unix-socket peer that writes whatever it is given and reads framed replies."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5.0)
        self.sock.connect(path)
        self.framer = UnixFramer(1 << 16, 1 << 30)

    def send(self, frames: list[bytes]) -> None:
        self.sock.sendall(unix_head(frames) + b"".join(frames))

    def recv(self) -> list[memoryview] | None:
        """The next reply, or None when the server closed the connection."""
        while (frames := self.framer.next()) is None:
            data = self.sock.recv(1 << 16)
            if not data:
                return None
            self.framer.feed(data)
        return frames

    def close(self) -> None:
        self.sock.close()


# -- framing


def test_framer_cuts_a_stream_fed_in_any_pieces_into_messages() -> None:
    messages = [[b"header", b"", b"x" * 70_000], [b"h2", b"mac"], [b""]]
    stream = b"".join(unix_head(m) + b"".join(m) for m in messages)
    for piece in (1, 7, 4096, len(stream)):
        framer = UnixFramer(8, 1 << 20)
        got = []
        for at in range(0, len(stream), piece):
            framer.feed(stream[at : at + piece])
            while (frames := framer.next()) is not None:
                got.append([bytes(f) for f in frames])
        assert got == messages and framer.buffered == 0


@pytest.mark.parametrize(
    ("head", "code"),
    [
        (b"HTTP" + struct.pack("<I", 1), ErrorCode.MALFORMED),  # not ours
        (UNIX_MAGIC + struct.pack("<I", 0), ErrorCode.TOO_LARGE),  # no frames
        (UNIX_MAGIC + struct.pack("<I", 9), ErrorCode.TOO_LARGE),  # over max_frames
        (UNIX_MAGIC + struct.pack("<II", 1, (1 << 20) + 1), ErrorCode.TOO_LARGE),  # over max_bytes
    ],
)
def test_framer_refuses_heads_that_are_not_ours_or_over_its_limits(head: bytes, code: ErrorCode) -> None:
    framer = UnixFramer(8, 1 << 20)
    framer.feed(head)
    with pytest.raises(ProtocolError) as e:
        framer.next()
    assert e.value.code == code


# -- the clients over a unix socket


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "socket"])
def test_sync_client_over_a_unix_socket(sock_path: str, shm: bool) -> None:
    keys = [key(i, b"unix-sync") for i in range(6)]
    data = [payload(i, 10_000 + i) for i in range(6)]
    with ThreadServer(node="u", unix_path=sock_path) as srv:
        assert srv.unix_endpoint == f"unix://{sock_path}"
        with CacheClient(srv.unix_endpoint, shm=shm, timeout_s=2) as client:
            assert client.lookup(keys) == 0
            assert client.put(keys[:4], data[:4]) and client.node == "u" and client.shm_active is shm
            assert client.lookup(keys) == 4 and client.locate(keys) == ["memory"] * 4
            assert client.exists([keys[5], keys[1]]) == [False, True]
            chunks = client.get(keys)
            assert chunks is not None
            with chunks:
                assert [bytes(c) for c in chunks] == data[:4]
            assert (client.stats.shm_bytes > 0) is shm and (client.stats.socket_bytes > 0) is not shm
            assert client.evict([keys[1]]) == 1 and client.lookup(keys) == 1
            stats = client.server_stats()
            assert stats is not None and stats["node"] == "u"
            assert client.clear() and client.lookup(keys) == 0
            assert client.stats.failures == {} and client.stats.connects == 1
        # The ZMQ endpoint serves the same store.
        with CacheClient(srv.endpoint or "") as zmq_client:
            assert zmq_client.put(keys[:1], data[:1])
        with CacheClient(srv.unix_endpoint) as client:
            assert client.lookup(keys) == 1


def test_large_requests_over_a_unix_socket_are_split_to_the_server_limits(sock_path: str) -> None:
    with ThreadServer(unix_path=sock_path, max_message_bytes=200_000, max_keys=3) as srv:
        keys = [key(i, b"unix-split") for i in range(10)]
        data = [payload(i, 60_000) for i in range(10)]
        with CacheClient(f"unix://{sock_path}", shm=False) as client:
            assert client.put(keys, data)
            requests = client.stats.requests
            chunks = client.get(keys)
            assert chunks is not None and [bytes(c) for c in chunks] == data
            assert client.stats.requests - requests >= 4 and client.lookup(keys) == 10
            assert client.stats.failures == {}
        assert srv.unix_endpoint is not None


def test_secret_over_a_unix_socket(sock_path: str) -> None:
    with ThreadServer(unix_path=sock_path, secret=b"s3cret"):
        endpoint = f"unix://{sock_path}"
        with CacheClient(endpoint, secret=b"s3cret") as good:
            assert good.put([key(1, b"uauth")], [b"data"]) and good.lookup([key(1, b"uauth")]) == 1
        with CacheClient(endpoint, secret=b"wrong") as wrong:
            assert wrong.lookup([key(1, b"uauth")]) == 0 and wrong.stats.failures == {"error:auth": 1}


# -- faults


def test_no_server_at_the_path_is_a_counted_miss_then_fails_fast(sock_path: str) -> None:
    client = CacheClient(f"unix://{sock_path}", timeout_s=0.5, retry_initial_s=5, retry_max_s=5)
    assert client.lookup([key(1)]) == 0 and client.get([key(1)]) is None and not client.put([key(1)], [b"x"])
    assert client.stats.failures == {"unreachable": 1, "down": 2}  # after one failure: not even sent
    client.close()


async def test_async_no_server_at_the_path_is_a_counted_miss(sock_path: str) -> None:
    async with AsyncCacheClient(
        f"unix://{sock_path}", timeout_s=0.5, retry_initial_s=5, retry_max_s=5
    ) as client:
        assert await client.lookup([key(1)]) == 0 and await client.get([key(1)]) is None
        assert client.stats.failures == {"unreachable": 1, "down": 1}


def test_constructor_refuses_a_unix_endpoint_without_a_path() -> None:
    with pytest.raises(ValueError, match="needs a path"):
        CacheClient("unix://")


async def test_a_mute_server_times_out_within_the_timeout(sock_path: str) -> None:
    """A listener that accepts and never answers: each client gives up within its timeout."""
    accepted: list[asyncio.StreamWriter] = []

    async def mute(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)

    listener = await asyncio.start_unix_server(mute, sock_path)
    try:
        client = AsyncCacheClient(
            f"unix://{sock_path}", timeout_s=0.2, retry_initial_s=0.05, retry_max_s=0.05
        )
        results = await asyncio.gather(*(client.lookup([key(i)]) for i in range(5)), client.get([key(9)]))
        assert results == [0, 0, 0, 0, 0, None]
        assert sum(client.stats.failures.values()) == 6 and "timeout" in client.stats.failures
        await client.aclose()

        def sync_lookup() -> tuple[int, dict[str, int]]:
            with CacheClient(f"unix://{sock_path}", timeout_s=0.2) as sync_client:
                return sync_client.lookup([key(1)]), dict(sync_client.stats.failures)

        assert await asyncio.to_thread(sync_lookup) == (0, {"timeout": 1})
    finally:
        listener.close()
        for writer in accepted:
            writer.close()


def test_server_killed_leaves_a_stale_socket_that_the_restarted_server_reclaims(
    sock_path: str, tmp_path: Path
) -> None:
    port, unix = free_port(), ("--unix-socket", sock_path)
    server = start_restartable_server(tmp_path, port, *unix)
    client = CacheClient(
        f"unix://{sock_path}", secret=RESTART_SECRET, timeout_s=0.5, retry_initial_s=0.05, retry_max_s=0.2
    )
    keys = [key(i, b"unix-restart") for i in range(3)]
    try:
        wait_until(lambda: client.put(keys, [payload(i) for i in range(3)]), what="a first put", timeout_s=15)
        assert client.node == "proc" and client.lookup(keys) == 3
        server.kill()
        assert os.path.exists(sock_path)  # kill -9 leaves the socket file behind
        assert client.lookup(keys) == 0 and client.get(keys) is None
        assert client.stats.failures.get("unreachable", 0) >= 1
        server = start_restartable_server(tmp_path, port, *unix)  # reclaims the stale file
        wait_until(lambda: client.put(keys[:1], [payload(0)]), what="a put after the restart", timeout_s=15)
        assert client.lookup(keys) == 1
    finally:
        client.close()
        assert server.stop(10) in (0, -signal.SIGTERM), server.log()
    assert not os.path.exists(sock_path)  # a clean stop removes it


async def test_socket_file_is_claimed_only_when_stale_and_removed_only_when_still_ours(
    sock_path: str, tmp_path: Path
) -> None:
    exists = Path(sock_path).exists
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(sock_path)
    stale.close()  # a socket file nobody listens on
    async with serving(unix_path=sock_path) as srv:
        assert srv.unix_endpoint == f"unix://{sock_path}"
        with pytest.raises(OSError, match="another server answers"):
            async with serving(unix_path=sock_path):
                pass
        assert exists()  # the refused server left the live one's file alone
    assert not exists()
    regular = tmp_path / "file"
    regular.write_text("not a socket")
    with pytest.raises(OSError, match="not a socket"):
        async with serving(unix_path=str(regular)):
            pass
    assert regular.read_text() == "not a socket"
    async with serving(unix_path=sock_path):
        os.unlink(sock_path)
        other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        other.bind(sock_path)  # another process took the path meanwhile
    assert exists()  # not removed: it is not this server's
    other.close()


async def test_garbage_gets_an_error_reply_and_only_that_connection_closes(sock_path: str) -> None:
    async with serving(unix_path=sock_path, max_message_bytes=MAX_BYTES, max_keys=MAX_KEYS) as srv:
        garbage = [
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
            UNIX_MAGIC + struct.pack("<I", MAX_KEYS + 3),
            UNIX_MAGIC + struct.pack("<II", 1, MAX_BYTES + 1),
        ]
        for data in garbage:

            def exchange(data: bytes = data) -> tuple[list[memoryview] | None, list[memoryview] | None]:
                raw = RawClient(sock_path)
                try:
                    raw.sock.sendall(data)
                    return raw.recv(), raw.recv()
                finally:
                    raw.close()

            reply, after = await asyncio.to_thread(exchange)
            assert reply is not None and after is None  # an error reply, then the connection is closed
            error = decode_reply(reply[0])
            assert isinstance(error, ErrorReply) and error.code in (ErrorCode.MALFORMED, ErrorCode.TOO_LARGE)
        async with AsyncCacheClient(srv.unix_endpoint or "") as client:
            assert await client.put([key(1)], [b"still serving"]) and await client.lookup([key(1)]) == 1


async def test_thousands_of_random_messages_over_a_unix_socket_get_error_replies(sock_path: str) -> None:
    async with serving(unix_path=sock_path, max_message_bytes=MAX_BYTES, max_keys=MAX_KEYS) as srv:

        def fuzz(n: int) -> tuple[int, int]:
            rng = random.Random(SEED + 100 + n)
            raw = RawClient(sock_path)
            errors = successes = 0
            try:
                for _ in range(600):
                    frames = message(rng)
                    if sum(map(len, frames)) > MAX_BYTES or len(frames) > MAX_KEYS + 2:
                        continue  # over the limits the stream itself is refused: see the garbage test
                    raw.send(frames)
                    reply = raw.recv()
                    assert reply is not None, f"no reply to {frames!r:.300}"
                    if isinstance(decode_reply(reply[0]), ErrorReply):
                        errors += 1
                    else:
                        successes += 1
            finally:
                raw.close()
            return errors, successes

        results = await asyncio.gather(*(asyncio.to_thread(fuzz, n) for n in range(3)))
        errors = sum(e for e, _ in results)
        total = sum(e + s for e, s in results)
        assert total > 1500 and errors > 0.85 * total
        async with AsyncCacheClient(srv.unix_endpoint or "") as client:
            assert await client.put([key(2)], [b"x" * 1000]) and await client.lookup([key(2)]) == 1
            assert client.stats.failures == {}


async def test_a_full_server_stops_reading_a_unix_connection_until_a_task_ends(sock_path: str) -> None:
    gate = asyncio.Event()

    class SlowTier(DictTier):
        async def contains(self, keys: Sequence[bytes]) -> int:
            await gate.wait()
            return await super().contains(keys)

    async with serving([MemoryTier(1 << 20), SlowTier()], unix_path=sock_path, max_concurrency=1) as srv:
        reader, writer = await asyncio.open_unix_connection(sock_path)
        keys = join_keys([key(i, b"full") for i in range(2)])
        for rid in (1, 2, 3):  # each needs the slow tier: the first takes the only slot, the others wait
            frames = [encode(Lookup(id=rid, keys=keys)), b""]
            writer.write(unix_head(frames) + b"".join(frames))
        await writer.drain()
        await asyncio.sleep(0.2)
        assert len(srv._tasks) == 1 and srv._unix_waiting
        gate.set()
        framer = UnixFramer(8, 1 << 20)
        replies: list[Reply] = []
        while len(replies) < 3:
            framer.feed(await asyncio.wait_for(reader.read(1 << 16), 2))
            while (reply := framer.next()) is not None:
                replies.append(decode_reply(reply[0]))
        assert sorted(r.id for r in replies) == [1, 2, 3]
        assert all(isinstance(r, LookupReply) and r.count == 0 for r in replies)
        assert not srv._unix_waiting
        writer.close()


async def test_a_client_that_never_reads_its_replies_is_dropped(sock_path: str) -> None:
    async with serving(unix_path=sock_path, max_message_bytes=4096) as srv:

        def flood() -> int:
            raw = RawClient(sock_path)
            raw.sock.settimeout(0.5)
            frames = [encode(Stats(id=1)), b""]
            message = unix_head(frames) + b"".join(frames)
            sent = 0
            try:
                for _ in range(200_000):  # stats replies are ~1 KiB: far more than any socket buffer
                    raw.sock.sendall(message)
                    sent += 1
            except OSError:  # reset by the server, or the server stopped reading: either way it gave up
                pass
            finally:
                raw.close()
            return sent

        sent = await asyncio.to_thread(flood)
        assert sent < 200_000
        await asyncio.sleep(0.1)
        assert not srv._unix_peers  # dropped, nothing kept for it
        async with AsyncCacheClient(srv.unix_endpoint or "") as client:
            stats = await client.server_stats()
            assert stats is not None


async def test_async_client_recovers_from_a_closed_connection_and_a_restarted_server(sock_path: str) -> None:
    client = AsyncCacheClient(f"unix://{sock_path}", timeout_s=1.0, retry_initial_s=0.01, retry_max_s=0.01)
    try:
        async with serving(unix_path=sock_path):
            assert await client.put([key(1, b"ureconnect")], [b"one"])
            link = client._link
            assert link is not None and link.transport is not None
            link.transport.close()  # closing under the client: the next send finds it closed
            assert await client.lookup([key(1, b"ureconnect")]) == 0
            assert client.stats.failures == {"unreachable": 1}
            await asyncio.sleep(0.05)
            assert await client.lookup([key(1, b"ureconnect")]) == 1  # connected anew
        # The server stopped: a miss; a new one on the same path is found again.
        assert await client.lookup([key(1, b"ureconnect")]) == 0
        async with serving(unix_path=sock_path):
            await asyncio.sleep(0.05)
            assert await client.put([key(2, b"ureconnect")], [b"two"])
            assert await client.lookup([key(2, b"ureconnect")]) == 1
        assert client.stats.connects == 3
    finally:
        await client.aclose()
