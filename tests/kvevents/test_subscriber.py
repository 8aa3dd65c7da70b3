"""The KV-event subscriber: resolving the engine's event sources (and asking again with backoff), sequence
tracking, in-order batches over real ZMQ, and engines removed while a batch is in flight."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import zmq
import zmq.asyncio

from kvstack.backoff import Backoff
from kvstack.engines.state import Endpoint
from kvstack.frontend.kv_feeds import KVEventFeeds
from kvstack.frontend.prefix import PrefixLocator
from kvstack.http.client import UpstreamPool
from kvstack.kvevents.codec import AllBlocksCleared, BlockStored, EventBatch
from kvstack.kvevents.subscriber import (
    RESOLVE_BACKOFF,
    EventSource,
    KVEventSubscriber,
    SequenceTracker,
    SeqVerdict,
    resolve_sources,
)
from support.kv_events import TIMEOUT, RecordingSink, ScriptedPublisher, following, subscribed
from support.waiting import eventually

# -- pure parts -------------------------------------------------------------------------------------------


def test_resolve_sources_replaces_wildcards_and_offsets_ranks() -> None:
    answer = {
        "0": {
            "publisher": "zmq",
            "endpoint": "tcp://*:5557",
            "replay_endpoint": "tcp://*:5600",
            "topic": "kv",
        },
        "1": {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": None},
        "2": {"enable_kv_cache_events": False, "endpoint": "tcp://*:5557"},
        "3": {"publisher": "null", "endpoint": "tcp://*:5557"},
    }
    sources = resolve_sources("http://10.0.0.5:8000", answer)
    assert sources == [
        EventSource("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5600", "kv", 0),
        EventSource("tcp://10.0.0.5:5558", None, "", 1),
    ]
    ipv6 = resolve_sources("http://[fd00::1]:8000", {"0": {"endpoint": "tcp://0.0.0.0:5557"}})
    assert ipv6[0].endpoint == "tcp://[fd00::1]:5557"
    assert resolve_sources("http://h:1", {}) == []
    assert resolve_sources("http://h:1", {"0": {"endpoint": "ipc:///tmp/kv"}})[0].endpoint == "ipc:///tmp/kv"


@pytest.mark.parametrize("answer", [["tcp://*:1"], "x", 3, {"0": "tcp://*:1"}])
def test_resolve_sources_rejects_other_shapes(answer: object) -> None:
    with pytest.raises(ValueError, match="kv_event_sources"):
        resolve_sources("http://h:1", answer)


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


async def test_sources_are_asked_again_with_the_resolve_backoff(
    ctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failures and empty answers wait 0.5 s doubling to 30 s, each within +-20% (the default policy)."""
    assert Backoff(0.5, 30.0, jitter=(0.8, 1.2)) == RESOLVE_BACKOFF
    real_sleep = asyncio.sleep
    waits: list[float] = []

    async def record(delay: float) -> None:
        waits.append(delay)
        await real_sleep(0)

    answers = 0

    async def fetch() -> list[EventSource]:
        nonlocal answers
        answers += 1
        if answers == 9:
            return [EventSource("tcp://127.0.0.1:1")]
        if answers % 2:
            raise OSError("connection refused")
        return []

    monkeypatch.setattr(asyncio, "sleep", record)
    sub = KVEventSubscriber("http://engine", RecordingSink(), context=ctx, fetch_sources=fetch)
    sub.start()
    try:
        async with asyncio.timeout(TIMEOUT):
            while answers < 9:
                await real_sleep(0.01)
    finally:
        await sub.stop()
    bases = [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert len(waits) == len(bases)
    assert all(0.8 * base <= wait <= 1.2 * base for wait, base in zip(waits, bases, strict=True)), waits


def test_sequence_tracker() -> None:
    t = SequenceTracker()
    assert t.classify(7) is SeqVerdict.FIRST
    t.received = t.applied = 7
    assert t.classify(8) is SeqVerdict.NEXT
    assert t.classify(10) is SeqVerdict.GAP
    assert t.classify(7) is SeqVerdict.DUPLICATE  # the same batch again
    assert t.classify(0) is SeqVerdict.RESTART
    t.disconnected()
    assert t.classify(7) is SeqVerdict.RESTART  # after a dropped connection going back is a new publisher
    t.interrupted = False
    t.applied = 12  # a replay got ahead of SUB
    assert t.classify(9) is SeqVerdict.ALREADY_APPLIED
    assert t.classify(13) is SeqVerdict.NEXT
    t.forget()
    assert t.classify(3) is SeqVerdict.FIRST


# -- over ZMQ ---------------------------------------------------------------------------------------------


async def test_in_order_batches_are_applied_once_each(ctx: zmq.asyncio.Context) -> None:
    pub = ScriptedPublisher(ctx)
    async with subscribed(ctx, pub) as (_, sink, observer):
        for seq in range(5):
            await pub.send(seq)
        await eventually(lambda: len(sink.applied) == 5, timeout_s=TIMEOUT)
        assert sink.applied == [0, 1, 2, 3, 4]
        assert sink.resets == [] and observer.gaps == []


async def test_all_blocks_cleared_reaches_the_sink(ctx: zmq.asyncio.Context) -> None:
    pub = ScriptedPublisher(ctx)
    async with subscribed(ctx, pub) as (_, sink, _obs):
        await pub.send(0)
        await pub.send(1, EventBatch(ts=1.0, events=[AllBlocksCleared()]))
        await eventually(lambda: sink.cleared == 1, timeout_s=TIMEOUT)


# -- engines removed while a batch is in flight --------------------------------------------------------------


async def test_no_event_reaches_the_index_after_engine_removed_and_a_readded_engine_starts_clean(
    ctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    pub = ScriptedPublisher(ctx, replay=False)
    locator = PrefixLocator()
    endpoint = Endpoint("http://e", kv_events_endpoint=pub.source.endpoint)
    feeds = KVEventFeeds(locator, UpstreamPool(), lambda url: None)  # configured: no side calls
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
        await eventually(lambda: sub.batches == 1, timeout_s=TIMEOUT)
        await pub.send(1)
        await eventually(lambda: "http://e" not in feeds._subscribers, timeout_s=TIMEOUT)
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
        await eventually(lambda: sink.applied == [0], timeout_s=TIMEOUT)
        sub.close()
        await pub.send(1)
        await asyncio.sleep(0.1)
        assert sink.applied == [0]
