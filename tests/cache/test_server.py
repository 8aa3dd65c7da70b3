"""The cache server in this event loop: admit/evict events (vLLM's shape, read back by the router's
ingestion), /metrics and /health, the memory budget under many puts, lower tiers behind the protocol,
ipc://, REQ clients, and authentication on raw frames."""

from __future__ import annotations

import asyncio
import os
import time
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio
from blake3 import blake3

from kvstack.cache import ChunkKey, KVLayout, TieredStore, chunk_keys
from kvstack.cache.client import AsyncCacheClient
from kvstack.cache.events import ChunkEvents, block_hash, medium_of, pack_note, unpack_note
from kvstack.cache.protocol import (
    ErrorReply,
    Lookup,
    LookupReply,
    decode_reply,
    encode,
    join_keys,
    request_mac,
)
from kvstack.cache.server import CacheServer
from kvstack.cache.tiers import DiskTier, MemoryTier
from kvstack.cache.tiers.redis import RedisTier
from kvstack.frontend.prefix import PrefixLocator
from kvstack.kvevents.codec import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    decode_seq,
)
from support.cache import DictTier, serving

CHUNK = 4  # support.cache.serving's chunk size
LAYOUT = KVLayout("test-model", num_layers=2, num_kv_heads=2, head_size=8, dtype="float16")


def payload(i: int, size: int = 8_000) -> bytes:
    return blake3(b"server" + str(i).encode()).digest(length=size)


class Events:
    """A SUB socket on the server's event stream."""

    def __init__(self, server: CacheServer, ctx: zmq.asyncio.Context) -> None:
        assert server.publisher is not None and server.publisher.endpoint is not None
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(server.publisher.endpoint)
        self.seqs: list[int] = []

    async def subscribed(self, client: AsyncCacheClient) -> None:
        """Wait out the slow-joiner window: put probe chunks until their events arrive, then drain."""
        probes: list[ChunkKey] = []
        for i in range(100):
            tokens = [90_000 + i] * CHUNK
            keys = chunk_keys(tokens, LAYOUT, CHUNK)
            probes += keys
            assert await client.put(keys, [b"probe"], token_ids=[tokens])
            if await self.sock.poll(50):
                await client.evict(probes)  # every probe: none may take room in the tiers under test
                while await self.sock.poll(100):
                    await self.sock.recv_multipart()
                return
        raise AssertionError("no events arrived")

    async def next(self, timeout_s: float = 2.0) -> tuple[bytes, EventBatch]:
        topic, seq, payload = await asyncio.wait_for(self.sock.recv_multipart(), timeout_s)
        self.seqs.append(decode_seq(seq))
        return topic, decode_batch(payload)

    async def drain(self, quiet_s: float = 0.2) -> list[Any]:
        """Every event until none arrives for ``quiet_s``."""
        found: list[Any] = []
        while await self.sock.poll(int(quiet_s * 1000)):
            found += (await self.next())[1].events
        return found


async def test_put_and_evict_publish_block_events_the_router_ingests(zctx: zmq.asyncio.Context) -> None:
    async with (
        serving(
            node="node-7", events_endpoint="tcp://127.0.0.1:0", events_replay_endpoint="tcp://127.0.0.1:0"
        ) as srv,
        AsyncCacheClient(srv.endpoint or "") as client,
    ):
        sub = Events(srv, zctx)
        await sub.subscribed(client)
        tokens = list(range(100, 120))  # 5 chunks
        keys = chunk_keys(tokens, LAYOUT, CHUNK)
        per_chunk = [tokens[i * CHUNK : (i + 1) * CHUNK] for i in range(5)]
        assert await client.put(keys[:3], [payload(i) for i in range(3)], token_ids=per_chunk[:3])
        topic, batch = await sub.next()
        assert topic == b"kvstack-cache/node-7"
        [stored] = batch.events
        assert isinstance(stored, BlockStored)
        assert stored.medium == "CPU" and stored.block_size == CHUNK and stored.parent_block_hash is None
        assert stored.block_hashes == [block_hash(k) for k in keys[:3]]
        assert stored.block_hashes[0] == int.from_bytes(keys[0][:8], "big")
        assert stored.token_ids == tokens[:12]
        # The rest of the prompt, continuing the chain: the parent is the last chunk already stored.
        assert await client.put(
            keys[3:], [payload(i) for i in (3, 4)], token_ids=per_chunk[3:], parent=keys[2]
        )
        [more] = (await sub.next())[1].events
        assert isinstance(more, BlockStored) and more.parent_block_hash == block_hash(keys[2])
        assert more.token_ids == tokens[12:]
        # Without token ids there is nothing to key the blocks by: no BlockStored.
        anonymous = chunk_keys(list(range(500, 504)), LAYOUT, CHUNK)
        assert await client.put(anonymous, [b"anon"])
        assert await client.evict([keys[4], keys[1]]) == 2
        [removed] = (await sub.next())[1].events
        assert isinstance(removed, BlockRemoved) and removed.medium == "CPU"
        assert removed.block_hashes == [block_hash(keys[4]), block_hash(keys[1])]
        assert await client.clear()
        assert isinstance((await sub.next())[1].events[0], AllBlocksCleared)
        assert sub.seqs == list(range(sub.seqs[0], sub.seqs[0] + 4))

        # The router's ingestion reads the same batches as a location's blocks, chained without orphans.
        locator = PrefixLocator()
        assert srv.publisher is not None and srv.publisher.replay_endpoint is not None
        dealer = zctx.socket(zmq.DEALER)
        dealer.connect(srv.publisher.replay_endpoint)
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = 0
        while True:
            _, _, seq, data = await asyncio.wait_for(dealer.recv_multipart(), 2)
            if decode_seq(seq) == -1:
                break
            replayed += 1
            locator.apply("cache:node-7", decode_batch(data))
        dealer.close(linger=0)
        assert replayed >= 4
        assert locator.stats.orphans == 0 and locator.stats.malformed == 0
        assert locator.stats.stored_blocks >= 5 and locator.stats.clears == 1
        sub.sock.close(linger=0)


async def test_memory_evictions_and_lower_tiers_publish_their_media(
    zctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    memory = MemoryTier(3 * 8192)  # three 8 KB chunks
    disk = DiskTier(tmp_path / "disk", 1 << 20)
    async with (
        serving([memory, disk], node="n", events_endpoint="tcp://127.0.0.1:0") as srv,
        AsyncCacheClient(srv.endpoint or "") as client,
    ):
        sub = Events(srv, zctx)
        await sub.subscribed(client)
        await srv.store.flush()
        await sub.drain()
        tokens = list(range(1, 1 + 5 * CHUNK))
        keys = chunk_keys(tokens, LAYOUT, CHUNK)
        per_chunk = [tokens[i * CHUNK : (i + 1) * CHUNK] for i in range(5)]
        for i in range(5):  # one chunk per put: the fourth and fifth evict the oldest from memory
            assert await client.put(
                [keys[i]], [payload(i, 8_000)], token_ids=[per_chunk[i]], parent=keys[i - 1] if i else None
            )
            # A chunk queued for disk holds its memory pages until written: let each write finish.
            await srv.store.flush()
        events = await sub.drain()
        cpu = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
        disk_stored = [
            h for e in events if isinstance(e, BlockStored) and e.medium == "DISK" for h in e.block_hashes
        ]
        cpu_removed = [
            h for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU" for h in e.block_hashes
        ]
        assert [e.block_hashes[0] for e in cpu] == [block_hash(k) for k in keys]
        assert sorted(disk_stored) == sorted(block_hash(k) for k in keys)
        assert cpu_removed[:2] == [block_hash(keys[0]), block_hash(keys[1])]
        # Disk holds the whole prefix (a run goes to the highest tier holding its first chunk); a get
        # promotes chunks 0 and 1 back into memory, which is announced again.
        assert await client.locate(keys) == ["disk"] * 5
        assert await client.locate(keys[2:]) == ["memory"] * 3
        chunks = await client.get(keys[:2])
        assert chunks is not None and [bytes(c) for c in chunks] == [payload(i, 8_000) for i in range(2)]
        chunks.release()
        promoted = [e for e in await sub.drain() if isinstance(e, BlockStored)]
        assert {e.medium for e in promoted} == {"CPU"} and promoted[0].parent_block_hash is None
        assert [h for e in promoted for h in e.block_hashes] == [block_hash(keys[0]), block_hash(keys[1])]
        chunks = await client.get(keys)
        assert chunks is not None and [bytes(c) for c in chunks] == [payload(i, 8_000) for i in range(5)]
        chunks.release()
        stats = await client.server_stats()
        assert stats is not None and stats["promotions"] >= 1
        sub.sock.close(linger=0)


async def test_chunks_kept_on_disk_are_announced_after_a_restart(
    zctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    tokens = list(range(1000, 1000 + 6 * CHUNK))
    keys = chunk_keys(tokens, LAYOUT, CHUNK)
    per_chunk = [tokens[i * CHUNK : (i + 1) * CHUNK] for i in range(6)]
    async with (
        serving(
            [MemoryTier(1 << 20), DiskTier(tmp_path, 1 << 20)], events_endpoint="tcp://127.0.0.1:0"
        ) as srv,
        AsyncCacheClient(srv.endpoint or "") as client,
    ):
        assert await client.put(keys[:4], [payload(i) for i in range(4)], token_ids=per_chunk[:4])
        assert await client.put(
            keys[4:], [payload(i) for i in (4, 5)], token_ids=per_chunk[4:], parent=keys[3]
        )
        await srv.store.flush()
    # Make the files' LRU order (mtime) put children before their parents: announcements must not.
    for age, k in enumerate(keys):
        path = tmp_path / k.hex()[:2] / f"{k.hex()}.kv"
        os.utime(path, ns=(time.time_ns(), 10**18 - age * 10**9))

    async with serving(
        [MemoryTier(1 << 20), DiskTier(tmp_path, 1 << 20)],
        node="n1",
        events_endpoint="tcp://127.0.0.1:0",
        events_replay_endpoint="tcp://127.0.0.1:0",
    ) as srv:
        assert srv._announcing is not None
        await srv._announcing
        assert srv.publisher is not None and srv.publisher.replay_endpoint is not None
        dealer = zctx.socket(zmq.DEALER)  # a subscriber that joins later replays from seq 0
        dealer.connect(srv.publisher.replay_endpoint)
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        batches: list[EventBatch] = []
        while True:
            _, _, seq, data = await asyncio.wait_for(dealer.recv_multipart(), 2)
            if decode_seq(seq) == -1:
                break
            batches.append(decode_batch(data))
        dealer.close(linger=0)
    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    assert {e.medium for e in stored} == {"DISK"}
    assert sorted(h for e in stored for h in e.block_hashes) == sorted(block_hash(k) for k in keys)
    locator = PrefixLocator()
    for batch in batches:
        locator.apply("cache:n1", batch)
    assert locator.stats.orphans == 0 and locator.stats.malformed == 0
    assert locator.stats.stored_blocks == 6


def test_restored_chunks_are_announced_parents_first_and_orphans_last() -> None:
    published: list[Any] = []
    events = ChunkEvents(published.extend, chunk_size=CHUNK)
    tokens = list(range(50, 50 + 4 * CHUNK))
    keys = chunk_keys(tokens, LAYOUT, CHUNK)
    notes = [
        pack_note(keys[i - 1] if i else None, array("I", tokens[i * CHUNK : (i + 1) * CHUNK]))
        for i in range(4)
    ]
    disk = DiskTier("/nonexistent", 1)
    orphan = chunk_keys(list(range(900, 900 + 2 * CHUNK)), LAYOUT, CHUNK)
    orphan_note = pack_note(orphan[0], array("I", range(900 + CHUNK, 900 + 2 * CHUNK)))

    async def run() -> None:
        # Children before parents, across batches, plus a chunk whose parent never comes.
        events.restored(disk, [(keys[3], notes[3]), (orphan[1], orphan_note), (keys[1], notes[1])], False)
        events.restored(disk, [(keys[2], notes[2]), (keys[0], notes[0]), (keys[0], b"bad note")], False)
        events.restored(disk, [], True)
        await asyncio.sleep(0)

    asyncio.run(run())
    hashes = [h for e in published for h in e.block_hashes]
    assert hashes == [block_hash(k) for k in keys] + [block_hash(orphan[1])]
    assert isinstance(published[0], BlockStored) and published[0].token_ids == tokens  # one chained event
    assert unpack_note(notes[0], CHUNK) == (None, array("I", tokens[:CHUNK]), None)
    assert unpack_note(notes[0], CHUNK + 1) is None


async def test_shared_tiers_publish_remote(zctx: zmq.asyncio.Context) -> None:
    assert medium_of(RedisTier("redis://127.0.0.1:1/0")) == "REMOTE"
    async with (
        serving([MemoryTier(1 << 20), DictTier()], events_endpoint="tcp://127.0.0.1:0") as srv,
        AsyncCacheClient(srv.endpoint or "") as client,
    ):
        sub = Events(srv, zctx)
        await sub.subscribed(client)
        await srv.store.flush()
        await sub.drain()
        tokens = list(range(7, 7 + 2 * CHUNK))
        keys = chunk_keys(tokens, LAYOUT, CHUNK)
        assert await client.put(keys, [b"x", b"y"], token_ids=[tokens[:CHUNK], tokens[CHUNK:]])
        await srv.store.flush()
        events = await sub.drain()
        remote = [e for e in events if isinstance(e, BlockStored) and e.medium == "REMOTE"]
        assert [h for e in remote for h in e.block_hashes] == [block_hash(k) for k in keys]
        assert await client.evict(keys[:1]) == 1
        removed = [e for e in await sub.drain() if isinstance(e, BlockRemoved)]
        assert {(e.medium, tuple(e.block_hashes)) for e in removed} == {
            ("CPU", (block_hash(keys[0]),)),
            ("REMOTE", (block_hash(keys[0]),)),
        }
        sub.sock.close(linger=0)


async def test_a_chunk_put_while_a_clear_runs_is_announced_after_the_clear(zctx: zmq.asyncio.Context) -> None:
    gate = asyncio.Event()

    class SlowToClear(DictTier):
        async def clear(self) -> None:
            await gate.wait()
            await super().clear()

    shared = SlowToClear()
    async with (
        serving([MemoryTier(1 << 20), shared], events_endpoint="tcp://127.0.0.1:0") as srv,
        AsyncCacheClient(srv.endpoint or "") as client,
    ):
        sub = Events(srv, zctx)
        await sub.subscribed(client)
        await srv.store.flush()
        await sub.drain()
        tokens = list(range(300, 300 + 2 * CHUNK))
        old, late = chunk_keys(tokens, LAYOUT, CHUNK)
        assert await client.put([old], [b"old"], token_ids=[tokens[:CHUNK]])
        await srv.store.flush()
        assert len(await sub.drain()) == 2  # stored in memory and in the shared tier
        clearing = asyncio.create_task(client.clear())
        await asyncio.sleep(0.1)  # memory is empty, the shared tier is still being emptied
        assert await client.put([late], [b"late"], token_ids=[tokens[CHUNK:]], parent=old)
        gate.set()
        assert await clearing
        await srv.store.flush()
        events = await sub.drain()
        kinds = [(type(e).__name__, getattr(e, "medium", None)) for e in events]
        assert kinds == [("AllBlocksCleared", None), ("BlockStored", "CPU")]
        assert events[1].block_hashes == [block_hash(late)]
        # What the router now believes is what the server holds.
        assert await client.locate([late]) == ["memory"] and late not in shared.data and not shared.data
        sub.sock.close(linger=0)


async def test_lookups_are_answered_inline_unless_a_tier_needs_io() -> None:
    """Memory-only prefixes are answered without a task; one reaching an async-only tier goes through one."""
    shared = DictTier()
    async with (
        serving([MemoryTier(1 << 20), shared]) as srv,
        AsyncCacheClient(srv.endpoint or "") as client,
    ):
        keys = chunk_keys(list(range(6 * CHUNK)), LAYOUT, CHUNK)
        assert await client.put(keys[:3], [b"a", b"b", b"c"])
        await srv.store.flush()
        assert srv.store.lookup_now(keys[:3]) == (3, ["memory"] * 3)
        assert srv.store.lookup_now(keys) is None  # the 4th key must be asked of the shared tier
        shared.data[keys[3]] = b"d"  # only the shared tier holds chunk 3
        assert await client.locate(keys) == ["memory"] * 3 + ["shared"]
        assert await client.lookup(keys[:3]) == 3
        assert await client.exists(keys[:5]) == [True, True, True, True, False]
        stats = await client.server_stats()
        assert stats is not None and stats["server"]["in_flight"] == 0


async def test_a_full_server_stops_reading_until_a_task_ends(zctx: zmq.asyncio.Context) -> None:
    gate = asyncio.Event()

    class SlowTier(DictTier):
        async def contains(self, keys: Sequence[bytes]) -> int:
            await gate.wait()
            return await super().contains(keys)

    async with serving([MemoryTier(1 << 20), SlowTier()], max_concurrency=1) as srv:
        dealer = zctx.socket(zmq.DEALER)
        dealer.connect(srv.endpoint or "")
        keys = chunk_keys(list(range(2 * CHUNK)), LAYOUT, CHUNK)
        for rid in (1, 2):  # each needs the slow tier: the first takes the only slot, the second waits
            await dealer.send_multipart([encode(Lookup(id=rid, keys=join_keys(keys))), b""])
        await asyncio.sleep(0.2)
        assert len(srv._tasks) == 1 and not await dealer.poll(50)
        gate.set()
        replies = [decode_reply((await asyncio.wait_for(dealer.recv_multipart(), 2))[0]) for _ in range(2)]
        assert sorted(r.id for r in replies) == [1, 2]
        assert all(isinstance(r, LookupReply) and r.count == 0 for r in replies)
        dealer.close(linger=0)


async def test_metrics_and_health_endpoints() -> None:
    async with (
        serving(http_port=0, node="m") as srv,
        AsyncCacheClient(srv.endpoint or "") as client,
        aiohttp.ClientSession() as http,
    ):
        keys = chunk_keys(list(range(12)), LAYOUT, CHUNK)
        assert await client.put(keys[:2], [payload(0), payload(1)])
        chunks = await client.get(keys)
        assert chunks is not None and len(chunks) == 2
        chunks.release()
        assert await client.lookup(keys) == 2
        async with http.get(f"http://127.0.0.1:{srv.http_port}/metrics") as resp:
            assert resp.status == 200
            text = await resp.text()
        async with http.get(f"http://127.0.0.1:{srv.http_port}/health") as resp:
            assert resp.status == 200 and (await resp.json())["node"] == "m"
    lines = text.splitlines()
    assert 'kvstack_cache_hits_total{tier="memory"} 2.0' in lines
    assert "kvstack_cache_misses_total 1.0" in lines
    assert 'kvstack_cache_lookup_chunks_total{result="miss"} 1.0' in lines
    assert 'kvstack_cache_entries{tier="memory"} 2.0' in lines
    assert 'kvstack_cache_capacity_bytes{tier="memory"} 1.6777216e+07' in lines
    assert any(
        line.startswith('kvstack_cache_operation_seconds_bucket{le="0.001",op="get"}') for line in lines
    )
    assert 'kvstack_cache_requests_total{op="put",result="ok"} 1.0' in lines
    assert any(
        line.startswith('kvstack_cache_payload_bytes_total{op="get",path="shm"} 16000') for line in lines
    )
    for name in ("evictions_total", "write_drops_total", "bytes", "tier_up"):
        assert f'kvstack_cache_{name}{{tier="memory"}}' in text
    assert all(line.startswith(("#", "kvstack_cache_")) for line in lines if line)


async def test_memory_stays_within_its_budget_under_many_puts() -> None:
    budget = 1 << 20
    async with serving([MemoryTier(budget)]) as srv, AsyncCacheClient(srv.endpoint or "") as client:
        for start in range(0, 400, 8):  # 400 chunks of 20 KB = 8 MB through a 1 MB budget
            keys = [ChunkKey(blake3(b"budget" + str(i).encode()).digest()) for i in range(start, start + 8)]
            assert await client.put(keys, [payload(i, 20_000) for i in range(start, start + 8)])
            stats = await client.server_stats()
            assert stats is not None
            memory = stats["tiers"]["memory"]
            assert memory["bytes"] <= budget
        assert memory["entries"] == budget // 20_480 and memory["evictions"] == 400 - memory["entries"]
        newest = [ChunkKey(blake3(b"budget" + str(i).encode()).digest()) for i in range(392, 400)]
        assert await client.lookup(newest) == 8


async def test_ipc_endpoint_and_a_req_client(tmp_path: Path, zctx: zmq.asyncio.Context) -> None:
    endpoint = f"ipc://{tmp_path}/cache.sock"
    async with serving(bind=endpoint) as srv, AsyncCacheClient(endpoint) as client:
        assert srv.endpoint == endpoint
        keys = chunk_keys(list(range(8)), LAYOUT, CHUNK)
        assert await client.put(keys, [payload(0), payload(1)])
        req = zctx.socket(zmq.REQ)
        req.connect(endpoint)
        await req.send_multipart([encode(Lookup(id=5, keys=join_keys(keys))), b""])
        reply = decode_reply((await asyncio.wait_for(req.recv_multipart(), 2))[0])
        assert isinstance(reply, LookupReply) and reply.id == 5 and reply.count == 2
        req.close(linger=0)


async def test_raw_frames_need_the_right_mac(zctx: zmq.asyncio.Context) -> None:
    secret = b"correct horse"
    async with serving(secret=secret) as srv:
        dealer = zctx.socket(zmq.DEALER)
        dealer.connect(srv.endpoint or "")
        header = encode(Lookup(id=41, keys=b""))
        for mac in (b"", b"x" * 32, request_mac(b"wrong", header), request_mac(secret, header)):
            await dealer.send_multipart([header, mac])
            reply = decode_reply((await asyncio.wait_for(dealer.recv_multipart(), 2))[0])
            assert reply.id == 41
            if mac == request_mac(secret, header):
                assert isinstance(reply, LookupReply) and reply.count == 0
            else:
                assert isinstance(reply, ErrorReply) and reply.code == "auth"
        dealer.close(linger=0)
        text = srv.metrics.render().decode()
        assert 'kvstack_cache_protocol_errors_total{code="auth"} 3.0' in text


async def test_bad_server_arguments() -> None:
    store = TieredStore([MemoryTier(1 << 20)])
    with pytest.raises(ValueError, match="secret"):
        CacheServer(store, secret=b"")
    with pytest.raises(ValueError, match="max_message_bytes"):
        CacheServer(store, max_message_bytes=10)
    async with serving() as srv:
        taken = CacheServer(store, srv.endpoint or "")
        with pytest.raises(OSError, match="cannot bind"):
            await taken.start()


def test_request_counts_render_as_prometheus_counters_and_histograms() -> None:
    from kvstack.cache.metrics import CacheMetrics

    metrics = CacheMetrics(TieredStore([MemoryTier(1 << 20)]))
    for seconds in (0.00005, 0.0002, 0.001, 7.0):  # a bucket's bound counts in it; 7 s only in +Inf
        metrics.request_done("lookup", True, seconds)
    metrics.request_done("get", False, 0.01)
    lines = metrics.render().decode().splitlines()
    expected = {
        'kvstack_cache_operation_seconds_bucket{le="5e-05",op="lookup"} 1.0',
        'kvstack_cache_operation_seconds_bucket{le="0.0001",op="lookup"} 1.0',
        'kvstack_cache_operation_seconds_bucket{le="0.00025",op="lookup"} 2.0',
        'kvstack_cache_operation_seconds_bucket{le="0.001",op="lookup"} 3.0',
        'kvstack_cache_operation_seconds_bucket{le="2.5",op="lookup"} 3.0',
        'kvstack_cache_operation_seconds_bucket{le="+Inf",op="lookup"} 4.0',
        'kvstack_cache_operation_seconds_count{op="lookup"} 4.0',
        'kvstack_cache_operation_seconds_bucket{le="0.005",op="get"} 0.0',
        'kvstack_cache_operation_seconds_bucket{le="0.01",op="get"} 1.0',
        'kvstack_cache_requests_total{op="lookup",result="ok"} 4.0',
        'kvstack_cache_requests_total{op="get",result="error"} 1.0',
    }
    assert expected <= set(lines)
    sums = [line for line in lines if line.startswith('kvstack_cache_operation_seconds_sum{op="lookup"}')]
    assert len(sums) == 1 and float(sums[0].split()[-1]) == pytest.approx(7.00125)


async def test_a_put_naming_an_overlong_model_is_refused() -> None:
    async with serving() as srv, AsyncCacheClient(srv.endpoint or "") as client:
        keys = chunk_keys(list(range(CHUNK)), LAYOUT, CHUNK)
        assert not await client.put(keys, [b"x"], token_ids=[list(range(CHUNK))], model="m" * 257)
        assert client.stats.failures == {"error:bad_request": 1}
        assert await client.put(keys, [b"x"], token_ids=[list(range(CHUNK))], model="m" * 256)
