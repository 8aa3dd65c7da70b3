"""KV-event subscriber fixes from an audit: removal races, lost and blipped connections, DP ranks,
duplicates, over-long replays, size limits, unknown event types, other vLLM replay and sources shapes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio
from test_kv_subscriber import CountingObserver, RecordingSink, ScriptedPublisher, _batch

from kvstack.engines.state import Endpoint
from kvstack.kvevents.codec import (
    REPLAY_END_SEQ_BYTES,
    BlockStored,
    EventBatch,
    encode_batch,
    encode_seq,
)
from kvstack.kvevents.subscriber import EventSource, KVEventSubscriber, replay, resolve_sources
from kvstack.router.kv_feeds import KVEventFeeds
from kvstack.router.prefix import PrefixLocator

TIMEOUT = 3.0


@contextlib.asynccontextmanager
async def following(
    ctx: zmq.asyncio.Context, *publishers: ScriptedPublisher, **options: Any
) -> AsyncIterator[tuple[KVEventSubscriber, RecordingSink, CountingObserver]]:
    """A subscriber to ``publishers`` (one source each) that has subscribed to all of them."""
    sink, observer = RecordingSink(), CountingObserver()
    sub = KVEventSubscriber(
        "http://engine",
        sink,
        context=ctx,
        sources=[p.source for p in publishers],
        observer=observer,
        replay_timeout=1.0,
        reconnect_ivl_ms=20,
        reconnect_ivl_max_ms=50,
        **options,
    )
    sub.start()
    try:
        for publisher in publishers:
            await publisher.subscribed()
        yield sub, sink, observer
    finally:
        await sub.stop()
        for publisher in publishers:
            await publisher.close()


async def _rebind(pub: ScriptedPublisher) -> None:
    """The publisher's PUB socket goes away and comes back on the same port: a network blip."""
    pub.pub.close(linger=0)
    pub.pub = pub.ctx.socket(zmq.XPUB)
    pub.pub.setsockopt(zmq.LINGER, 0)
    async with asyncio.timeout(TIMEOUT):
        while True:
            try:
                pub.pub.bind(f"tcp://127.0.0.1:{pub.port}")
                return
            except zmq.ZMQError:  # ZMQ's I/O thread has not closed the old listener yet
                await asyncio.sleep(0.01)


async def _until(predicate: object) -> None:
    assert callable(predicate)
    async with asyncio.timeout(TIMEOUT):
        while not predicate():  # noqa: ASYNC110 - the conditions span sinks, observers and the index
            await asyncio.sleep(0.01)


# -- F1: removal is immediate --------------------------------------------------------------------------


async def test_no_event_reaches_the_index_after_engine_removed_and_a_readded_engine_starts_clean(
    ctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    pub = ScriptedPublisher(ctx, replay=False)
    locator = PrefixLocator()
    endpoint = Endpoint("http://e", kv_events_endpoint=pub.source.endpoint)
    async with aiohttp.ClientSession() as session:
        feeds = KVEventFeeds(locator, session, lambda url: None)
        try:
            feeds.engine_added(endpoint)
            sub = feeds.subscriber("http://e")
            assert sub is not None
            on_message = sub._on_message

            async def removed_in_flight(source: EventSource, tracker: Any, frames: list[bytes]) -> None:
                # Discovery removes the engine after this message was received, before it is applied.
                if sub.batches == 1:
                    feeds.engine_removed("http://e")
                await on_message(source, tracker, frames)

            monkeypatch.setattr(sub, "_on_message", removed_in_flight)
            await pub.subscribed()
            await pub.send(0)
            await _until(lambda: sub.batches == 1)
            await pub.send(1)
            await _until(lambda: "http://e" not in feeds._subscribers)
            await asyncio.sleep(0.1)
            assert locator.index.stats().entries == 0
            assert locator.block_size("http://e") is None

            # The engine restarts (empty cache) and is found again under the same URL.
            feeds.engine_added(endpoint)
            again = feeds.subscriber("http://e")
            assert again is not None
            fresh = BlockStored(block_hashes=[7], parent_block_hash=None, token_ids=[500, 501], block_size=2)
            async with asyncio.timeout(TIMEOUT):
                while again.batches == 0:  # the new subscription travels after the connection
                    await pub.send(0, EventBatch(ts=0.0, events=[fresh]))
                    await asyncio.sleep(0.02)
            assert locator.index.stats().entries == 1  # only the block the restarted engine holds
        finally:
            await feeds.stop()
            await pub.close()


async def test_a_closed_subscriber_applies_nothing_more(ctx: zmq.asyncio.Context) -> None:
    pub = ScriptedPublisher(ctx, replay=False)
    async with following(ctx, pub) as (sub, sink, _obs):
        await pub.send(0)
        await sink.wait_for(lambda: sink.applied == [0])
        sub.close()
        await pub.send(1)
        await asyncio.sleep(0.1)
        assert sink.applied == [0]


# -- F5 / F6: lost connections -------------------------------------------------------------------------


async def test_a_connection_lost_past_the_grace_period_resets_the_engine(ctx: zmq.asyncio.Context) -> None:
    pub = ScriptedPublisher(ctx, replay=False)
    async with following(ctx, pub, disconnect_grace=0.2) as (_sub, sink, observer):
        await pub.send(0)
        await sink.wait_for(lambda: sink.applied == [0])
        pub.pub.close(linger=0)  # the publisher dies and nothing else arrives
        await _until(lambda: sink.resets == ["disconnected"])
        assert observer.connected == [True, False]
        # It comes back restarted (seq 0, empty cache): a fresh start, nothing more to reset.
        await _rebind(pub)
        await pub.subscribed()
        await pub.send(0, _batch(100))
        await sink.wait_for(lambda: sink.applied[-1:] == [100])
        assert sink.resets == ["disconnected"]


async def test_a_blip_without_loss_keeps_the_entries(ctx: zmq.asyncio.Context) -> None:
    pub = ScriptedPublisher(ctx)
    async with following(ctx, pub, disconnect_grace=3.0) as (_sub, sink, observer):
        for seq in range(3):
            await pub.send(seq)
        await sink.wait_for(lambda: sink.applied == [0, 1, 2])
        await _rebind(pub)
        await pub.subscribed()
        await pub.send(3)  # the same publisher goes on: nothing was lost
        await sink.wait_for(lambda: sink.applied[-1:] == [3])
        assert sink.applied == [0, 1, 2, 3]
        assert sink.resets == [] and observer.replays == [] and observer.connected[-2:] == [False, True]


async def test_a_blip_that_lost_batches_replays_only_the_gap(ctx: zmq.asyncio.Context) -> None:
    pub = ScriptedPublisher(ctx)
    async with following(ctx, pub, disconnect_grace=3.0) as (_sub, sink, observer):
        for seq in range(3):
            await pub.send(seq)
        await sink.wait_for(lambda: sink.applied == [0, 1, 2])
        await _rebind(pub)
        for seq in (3, 4):  # published while the connection was down
            pub.buffer[seq] = encode_batch(_batch(seq))
        await pub.subscribed()
        await pub.send(5)
        await sink.wait_for(lambda: sink.applied[-1:] == [5])
        assert sink.applied == [0, 1, 2, 3, 4, 5]
        assert sink.resets == [] and observer.gaps == [2] and observer.replays == ["ok"]


# -- F7: several DP ranks ------------------------------------------------------------------------------


async def test_a_new_rank_does_not_reset_the_other_ranks(ctx: zmq.asyncio.Context) -> None:
    rank0, rank1 = ScriptedPublisher(ctx), ScriptedPublisher(ctx)
    async with following(ctx, rank0, rank1) as (_sub, sink, observer):
        await rank0.send(0)
        await rank0.send(1)
        await sink.wait_for(lambda: sink.applied == [0, 1])
        await rank1.send(0, _batch(100))
        await sink.wait_for(lambda: sink.applied[-1:] == [100])
        # A rank joined late replays from its oldest batch; nothing is reset either.
        rank1.buffer.update({1: encode_batch(_batch(101)), 2: encode_batch(_batch(102))})
        await rank1.send(3, _batch(103))
        await sink.wait_for(lambda: sink.applied[-1:] == [103])
        assert sink.applied == [0, 1, 100, 101, 102, 103]
        assert sink.resets == [] and observer.replays == ["ok"]


# -- F8: duplicates ------------------------------------------------------------------------------------


async def test_a_duplicate_batch_is_skipped_and_a_real_restart_still_resets(ctx: zmq.asyncio.Context) -> None:
    pub = ScriptedPublisher(ctx, replay=False)
    async with following(ctx, pub) as (sub, sink, _obs):
        for seq in (0, 1, 2, 2, 1, 3):
            await pub.send(seq)
        await sink.wait_for(lambda: sink.applied[-1:] == [3])
        assert sink.applied == [0, 1, 2, 3]
        assert sub.duplicates == 2 and sink.resets == []
        await pub.send(0, _batch(100))  # back to 0: the publisher restarted
        await sink.wait_for(lambda: sink.applied[-1:] == [100])
        assert sink.resets == ["restart"]


# -- F9: replay bounded by the live batch ---------------------------------------------------------------


async def test_a_replay_never_applies_past_the_live_batch(ctx: zmq.asyncio.Context) -> None:
    pub = ScriptedPublisher(ctx)
    async with following(ctx, pub) as (_sub, sink, observer):
        await pub.send(0)
        await sink.wait_for(lambda: sink.applied == [0])
        # A replay service that answers with far more than the gap (another publisher's buffer, say).
        pub.buffer.update({seq: encode_batch(_batch(1000 + seq)) for seq in range(1, 500)})
        for seq in range(2, 6):
            await pub.send(seq, buffered=False)
        await sink.wait_for(lambda: sink.applied[-1:] == [5])
        assert sink.applied == [0, 1001, 2, 3, 4, 5]
        assert observer.replays == ["ok"] and sink.resets == []


# -- F10: size limits ----------------------------------------------------------------------------------


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
        await sink.wait_for(lambda: sink.applied[-1:] == [2])
        assert sink.applied == [0, 2]
        assert observer.decode_errors == 1 and sink.resets == ["gap"]


async def test_an_oversized_message_is_dropped_by_zmq(ctx: zmq.asyncio.Context) -> None:
    pub = ScriptedPublisher(ctx, replay=False)
    options = {"max_message_bytes": 4096, "disconnect_grace": 0.2}
    async with following(ctx, pub, **options) as (_sub, sink, observer):
        await pub.send(0)
        await sink.wait_for(lambda: sink.applied == [0])
        await pub.send(1, _blocks(2000, first=1))  # ~20 KB: ZMQ drops it and the connection, for good
        await _until(lambda: observer.connected[-1:] == [False])
        seq = 2
        async with asyncio.timeout(TIMEOUT):
            while sink.applied[-1] < 2:  # after the grace period the subscriber connects afresh
                await pub.send(seq)
                seq += 1
                await asyncio.sleep(0.02)
        assert 1 not in sink.applied and sink.resets == ["disconnected"]


# -- F12: unknown event types --------------------------------------------------------------------------


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
        await sink.wait_for(lambda: sink.applied[-1:] == [3])
        assert sub.unknown_events == 120
    unknown = [r for r in caplog.records if "unknown type" in r.getMessage()]
    assert len(unknown) == 2


# -- F13: other vLLM versions --------------------------------------------------------------------------


@pytest.mark.parametrize("with_topic", [True, False])
async def test_replay_accepts_replies_with_and_without_the_topic_frame(
    ctx: zmq.asyncio.Context, with_topic: bool
) -> None:
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    topic = [b"kv"] if with_topic else []

    async def serve() -> None:
        identity, _, _start = await router.recv_multipart()
        for seq in (1, 2):
            await router.send_multipart([identity, b"", *topic, encode_seq(seq), encode_batch(_batch(seq))])
        await router.send_multipart([identity, b"", *topic, REPLAY_END_SEQ_BYTES, b""])

    server = asyncio.create_task(serve())
    try:
        result = await replay(ctx, f"tcp://127.0.0.1:{port}", 1, timeout=1.0)
        assert [seq for seq, _ in result.batches] == [1, 2] and result.decode_errors == 0
    finally:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server
        router.close(linger=0)


def test_resolve_sources_accepts_the_list_shape() -> None:
    answer = [
        {"data_parallel_rank": 1, "endpoint": "tcp://0.0.0.0:41002", "replay_endpoint": None, "topic": "kv"},
        {
            "data_parallel_rank": 0,
            "endpoint": "tcp://0.0.0.0:41001",
            "replay_endpoint": "tcp://0.0.0.0:41003",
            "topic": "kv",
        },
    ]
    expected = [
        EventSource("tcp://10.0.0.5:41002", None, "kv", 1),  # already resolved per rank: no port offset
        EventSource("tcp://10.0.0.5:41001", "tcp://10.0.0.5:41003", "kv", 0),
    ]
    assert resolve_sources("http://10.0.0.5:8000", answer) == expected
    assert resolve_sources("http://10.0.0.5:8000", {"sources": answer}) == expected
    assert resolve_sources("http://10.0.0.5:8000", []) == []
    with pytest.raises(ValueError, match="entry 0 is not an object"):
        resolve_sources("http://10.0.0.5:8000", ["tcp://*:1"])
