"""Prompts' partial last chunks on the cache server: the bounded tail index, lookups that offer the tails
held right after their prefix (and never an evicted one), the protocol's new optional fields both ways,
and no KV events for tails."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvstack.cache import KVLayout, chunk_keys
from kvstack.cache.cli import main as cache_cli
from kvstack.cache.client import AsyncCacheClient
from kvstack.cache.events import block_hash
from kvstack.cache.protocol import (
    PROTOCOL_VERSION,
    Lookup,
    LookupReply,
    StoredTail,
    decode_reply,
    decode_request,
    encode,
    join_keys,
)
from kvstack.cache.tails import ROOT_PARENT, TailIndex
from kvstack.cache.tiers import MemoryTier
from kvstack.kvevents.codec import BlockStored, decode_batch
from support.cache import DictTier, serving

CHUNK = 4  # support.cache.serving's chunk size
LAYOUT = KVLayout("test-model", num_layers=2, num_kv_heads=2, head_size=8, dtype="float16")


def keys_and_tail(tokens: list[int]) -> tuple[list[bytes], bytes]:
    *full, tail = chunk_keys(tokens, LAYOUT, CHUNK, include_partial=True)
    assert len(tokens) % CHUNK
    return list(full), tail


# -- the index


def test_the_index_stays_within_its_limit_dropping_the_least_recent_parent() -> None:
    index = TailIndex(limit=5)
    for i in range(100):
        index.add(bytes([i]) * 32, 1 + i % 3, bytes([i, 1]) * 16)
        assert len(index) <= 5
    assert len(index) == 5
    assert index.after(bytes([0]) * 32) == []  # dropped long ago
    assert index.after(bytes([99]) * 32) == [(1 + 99 % 3, bytes([99, 1]) * 16)]


def test_the_index_offers_longest_first_and_forgets() -> None:
    index = TailIndex(limit=10)
    parent = b"p" * 32
    index.add(parent, 2, b"a" * 32)
    index.add(parent, 3, b"b" * 32)
    index.add(parent, 2, b"c" * 32)  # the same length again: replaced, not counted twice
    index.add(None, 1, b"r" * 32)
    assert len(index) == 3
    assert index.after(parent) == [(3, b"b" * 32), (2, b"c" * 32)]
    assert index.after(None) == index.after(ROOT_PARENT) == [(1, b"r" * 32)]
    index.forget(parent, b"b" * 32)
    index.forget(parent, b"c" * 32)
    assert index.after(parent) == [] and len(index) == 1
    # one parent with more tails than the limit keeps its newest
    small = TailIndex(limit=2)
    for length in (1, 2, 3):
        small.add(parent, length, bytes([length]) * 32)
    assert len(small) == 2 and small.after(parent) == [(3, bytes([3]) * 32), (2, bytes([2]) * 32)]


# -- the protocol


def test_lookup_round_trips_with_and_without_the_tail_fields() -> None:
    plain = Lookup(id=3, keys=b"k" * 32)
    assert b"tails" not in encode(plain)  # an old server sees exactly what it always saw
    asked = decode_request(encode(Lookup(id=4, keys=b"k" * 32, tails=True, parent=b"p" * 32)))
    assert isinstance(asked, Lookup) and asked.tails and asked.parent == b"p" * 32
    assert decode_request(encode(plain)) == plain
    reply = LookupReply(id=4, count=1, tiers=["memory"], tails=[StoredTail(3, b"t" * 32, "disk")])
    assert decode_reply(encode(reply)) == reply
    assert decode_reply(encode(LookupReply(id=5, count=0, tiers=[]))) == LookupReply(id=5, count=0, tiers=[])

    # An old client's reply type (no tails field) reads a new server's reply: the field is ignored.
    class OldLookupReply(msgspec.Struct, tag_field="op", tag="lookup", kw_only=True):
        v: int = PROTOCOL_VERSION
        id: int = 0
        count: int
        tiers: list[str]

    old = msgspec.msgpack.decode(encode(reply), type=OldLookupReply)
    assert old.count == 1 and old.tiers == ["memory"]


# -- the server


async def test_a_lookup_offers_the_tails_held_after_its_prefix() -> None:
    async with serving() as srv, AsyncCacheClient(srv.endpoint or "") as client:
        round1 = list(range(100, 110))  # 2 full chunks and a 2-token tail
        full, tail = keys_and_tail(round1)
        assert await client.put(
            [*full, tail], [b"c0", b"c1", b"t"], token_ids=[round1[:4], round1[4:8], round1[8:]]
        )
        round2 = [*round1, 7, 7, 7, 7, 7]  # chunk 2 now holds the old tail and more: not stored
        keys2 = chunk_keys(round2, LAYOUT, CHUNK)
        assert await client.find(keys2) == (["memory"] * 2, [StoredTail(2, tail, "memory")])
        assert await client.locate(keys2) == ["memory"] * 2  # not asked: no tails
        # from the local hit on: the prefix is empty, the parent says where the tail would hang
        assert await client.find(keys2[2:], parent=keys2[1]) == ([], [StoredTail(2, tail, "memory")])
        assert await client.find(keys2[2:]) == ([], [])  # no tail at the prompt's start
        # a prompt shorter than a chunk: a tail after the start
        short = [5, 6, 7]
        (root_tail,) = chunk_keys(short, LAYOUT, CHUNK, include_partial=True)
        assert await client.put([root_tail], [b"s"], token_ids=[short])
        assert await client.find(chunk_keys([5, 6, 7, 8, 9], LAYOUT, CHUNK)) == (
            [],
            [StoredTail(3, root_tail, "memory")],
        )
        # an evicted tail is never offered, and leaves the index
        assert len(srv.service.tails) == 2
        assert await client.evict([tail]) == 1
        assert await client.find(keys2) == (["memory"] * 2, [])
        assert len(srv.service.tails) == 1
        assert await client.clear() and len(srv.service.tails) == 0


async def test_tails_on_a_tier_that_needs_io_are_offered_too() -> None:
    shared = DictTier()
    async with (
        serving([MemoryTier(1 << 20), shared]) as srv,
        AsyncCacheClient(srv.endpoint or "") as client,
    ):
        tokens = list(range(200, 206))
        full, tail = keys_and_tail(tokens)
        assert await client.put([*full, tail], [b"c0", b"t"], token_ids=[tokens[:4], tokens[4:]])
        await srv.store.flush()
        srv.store.memory.clear_sync()  # only the shared tier holds them now
        assert await client.find(chunk_keys([*tokens, 1, 1], LAYOUT, CHUNK)) == (
            ["shared"],
            [StoredTail(2, tail, "shared")],
        )


async def test_the_tail_index_is_bounded_by_the_server_option(capsys: pytest.CaptureFixture[str]) -> None:
    async with serving(tail_limit=3) as srv, AsyncCacheClient(srv.endpoint or "") as client:
        for i in range(10):
            tokens = [1000 + i, 1, 2, 3, 4, 5]  # a tail after another parent each time
            full, tail = keys_and_tail(tokens)
            assert await client.put([*full, tail], [b"c", b"t"], token_ids=[tokens[:4], tokens[4:]])
        assert len(srv.service.tails) == 3
        stats = await client.server_stats()
        assert stats is not None and stats["server"]["tails"] == 3
        # the oldest tails' parents were dropped: their tails are no longer offered (nor stale)
        assert await client.find(chunk_keys([1000, 1, 2, 3, 9, 9], LAYOUT, CHUNK)) == (["memory"], [])
        assert (await client.find(chunk_keys([1009, 1, 2, 3, 9, 9], LAYOUT, CHUNK)))[1] != []
    assert cache_cli(["cache-server", "--tail-index", "0"]) == 2
    assert "--tail-index must be positive" in capsys.readouterr().err


async def test_tails_are_not_announced_as_kv_events(zctx: zmq.asyncio.Context) -> None:
    async with (
        serving(events_endpoint="tcp://127.0.0.1:0") as srv,
        AsyncCacheClient(srv.endpoint or "") as client,
    ):
        assert srv.publisher is not None and srv.publisher.endpoint is not None
        sub = zctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(srv.publisher.endpoint)
        tokens = list(range(300, 306))
        full, tail = keys_and_tail(tokens)
        events: list[object] = []
        for _ in range(100):  # until subscribed: each put of the same chunks announces them again
            assert await client.put([*full, tail], [b"c0", b"t"], token_ids=[tokens[:4], tokens[4:]])
            if await sub.poll(50):
                break
        while await sub.poll(200):
            events += decode_batch((await sub.recv_multipart())[-1]).events
        sub.close(linger=0)
        stored = [e for e in events if isinstance(e, BlockStored)]
        assert stored, "no events arrived"
        hashes = {h for e in stored for h in e.block_hashes}
        assert block_hash(full[0]) in hashes and block_hash(tail) not in hashes
        assert all(len(e.token_ids) % CHUNK == 0 for e in stored)


async def test_an_old_client_lookup_gets_no_tails(zctx: zmq.asyncio.Context) -> None:
    async with serving() as srv, AsyncCacheClient(srv.endpoint or "") as client:
        tokens = list(range(400, 406))
        full, tail = keys_and_tail(tokens)
        assert await client.put([*full, tail], [b"c0", b"t"], token_ids=[tokens[:4], tokens[4:]])
        dealer = zctx.socket(zmq.DEALER)
        dealer.connect(srv.endpoint or "")
        # an old client's header: no tails field at all
        header = msgspec.msgpack.encode({"op": "lookup", "v": 1, "id": 9, "keys": join_keys(full)})
        await dealer.send_multipart([header, b""])
        raw = (await asyncio.wait_for(dealer.recv_multipart(), 2))[0]
        dealer.close(linger=0)
        assert b"tails" not in raw
        reply = decode_reply(raw)
        assert isinstance(reply, LookupReply) and reply.count == 1 and reply.tails == []
