"""Bad input to the subscriber: malformed messages, batches the sink rejects, batches over the block
limit, messages over the size limit, and unknown event types."""

from __future__ import annotations

import asyncio
import logging

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvstack.kvevents.codec import BlockStored, EventBatch, encode_batch, encode_seq
from kvstack.kvevents.subscriber import KVEventSubscriber
from support.kv_events import TIMEOUT, CountingObserver, ScriptedPublisher, following, subscribed
from support.kv_events import stored_batch as _batch
from support.waiting import eventually


async def test_malformed_messages_are_counted_and_skipped(ctx: zmq.asyncio.Context) -> None:
    pub = ScriptedPublisher(ctx, replay=False)
    async with subscribed(ctx, pub) as (_, sink, observer):
        await pub.send(0)
        await pub.send_raw([b"", encode_seq(1)])  # two frames
        await pub.send_raw([b"", b"\x01\x02", encode_batch(_batch(1))])  # short seq frame
        await pub.send_raw([b"", encode_seq(1), b"\xc1garbage"])  # not msgpack
        await pub.send_raw([b"", encode_seq(1), b"\x93\xcb" + bytes(8) + b"\x91\x05\xc0"])  # event is an int
        await pub.send(1)
        await eventually(lambda: sink.applied == [0, 1], timeout_s=TIMEOUT)
        assert observer.decode_errors == 4
        assert sink.resets == []


async def test_a_batch_the_sink_rejects_resets_and_the_stream_goes_on(ctx: zmq.asyncio.Context) -> None:
    from kvstack.frontend.prefix import PrefixLocator

    pub = ScriptedPublisher(ctx, replay=False)
    locator = PrefixLocator()
    observer = CountingObserver()
    sub = KVEventSubscriber("http://engine", locator, context=ctx, sources=[pub.source], observer=observer)
    sub.start()
    try:
        await pub.subscribed()
        bad = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[-1, 5], block_size=2)
        await pub.send(0, EventBatch(ts=0.0, events=[bad]))  # a negative token id cannot be keyed
        await pub.send(1, _batch(1))
        async with asyncio.timeout(TIMEOUT):
            while locator.index.stats().entries < 1:  # noqa: ASYNC110 - polls the index the subscriber fills
                await asyncio.sleep(0.01)
        assert observer.decode_errors == 1
    finally:
        await sub.stop()
        await pub.close()


# -- size limits ---------------------------------------------------------------------------------------------


def _blocks(n: int, first: int = 0) -> EventBatch:
    tokens = [t % 50_000 for t in range(first, first + 2 * n)]
    hashes: list[int | bytes] = list(range(first, first + n))
    stored = BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=2)
    return EventBatch(ts=0.0, events=[stored])


async def test_a_batch_with_too_many_blocks_is_a_decode_error(ctx: zmq.asyncio.Context) -> None:
    pub = ScriptedPublisher(ctx, replay=False)
    async with following(ctx, pub, max_blocks_per_batch=8) as (_sub, sink, observer):
        await pub.send(0)
        await pub.send(1, _blocks(9, first=1))
        await pub.send(2, _blocks(8, first=2))
        await eventually(lambda: sink.applied[-1:] == [2], timeout_s=TIMEOUT)
        assert sink.applied == [0, 2]
        assert observer.decode_errors == 1 and sink.resets == ["gap"]


async def test_an_oversized_message_is_dropped_by_zmq(ctx: zmq.asyncio.Context) -> None:
    pub = ScriptedPublisher(ctx, replay=False)
    options = {"max_message_bytes": 4096, "disconnect_grace": 0.2}
    async with following(ctx, pub, **options) as (_sub, sink, observer):
        await pub.send(0)
        await eventually(lambda: sink.applied == [0], timeout_s=TIMEOUT)
        await pub.send(1, _blocks(2000, first=1))  # ~20 KB: ZMQ drops it and the connection, for good
        await eventually(lambda: observer.connected[-1:] == [False], timeout_s=TIMEOUT)
        seq = 2
        async with asyncio.timeout(TIMEOUT):
            while sink.applied[-1] < 2:  # after the grace period the subscriber connects afresh
                await pub.send(seq)
                seq += 1
                await asyncio.sleep(0.02)
        assert 1 not in sink.applied and sink.resets == ["disconnected"]


# -- unknown event types -------------------------------------------------------------------------------------


async def test_unknown_event_types_are_logged_once_per_type_and_counted(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    events = [{"type": "BlockEvicted"}] * 50 + [{"type": "BlockPinned"}] * 10
    payload = msgspec.msgpack.encode([0.0, events, None])
    pub = ScriptedPublisher(ctx, replay=False)
    caplog.set_level(logging.WARNING)
    async with following(ctx, pub) as (sub, sink, _obs):
        await pub.send(0)
        await pub.send_raw([b"", encode_seq(1), payload])
        await pub.send_raw([b"", encode_seq(2), payload])
        await pub.send(3)
        await eventually(lambda: sink.applied[-1:] == [3], timeout_s=TIMEOUT)
        assert sub.unknown_events == 120
    unknown = [r for r in caplog.records if "unknown type" in r.getMessage()]
    assert len(unknown) == 2
