"""The KV-event subscriber over real ZMQ: sequence tracking, replay (bounded by the live batch), resets,
malformed and oversized input, unknown event types, reconnects and lost connections, several DP ranks,
duplicates, engines removed mid-batch, and the replay and sources shapes of other vLLM versions."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvstack.backoff import Backoff
from kvstack.engines.state import Endpoint
from kvstack.http.client import UpstreamPool
from kvstack.kvevents.codec import (
    REPLAY_END_SEQ_BYTES,
    AllBlocksCleared,
    BlockStored,
    EventBatch,
    encode_batch,
    encode_seq,
)
from kvstack.kvevents.publisher import KVEventPublisher
from kvstack.kvevents.subscriber import (
    RESOLVE_BACKOFF,
    EventSource,
    KVEventSubscriber,
    SequenceTracker,
    SeqVerdict,
    replay,
    resolve_sources,
)
from kvstack.router.kv_feeds import KVEventFeeds
from kvstack.router.prefix import PrefixLocator
from support.ports import free_port
from support.waiting import eventually

TIMEOUT = 5.0


def _batch(n: int) -> EventBatch:
    stored = BlockStored(block_hashes=[n], parent_block_hash=None, token_ids=[n, n], block_size=2)
    return EventBatch(ts=float(n), events=[stored])


def _first_token(batch: EventBatch) -> int:
    event = batch.events[0]
    assert isinstance(event, BlockStored)
    return event.token_ids[0]


@dataclass
class RecordingSink:
    applied: list[int] = field(default_factory=list)  # first token of each batch's first event
    resets: list[str] = field(default_factory=list)
    cleared: int = 0

    def apply(self, engine: str, batch: EventBatch) -> None:
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self.cleared += 1
        if batch.events and isinstance(batch.events[0], BlockStored):
            self.applied.append(_first_token(batch))

    def reset(self, engine: str, reason: str) -> None:
        self.resets.append(reason)


@dataclass
class CountingObserver:
    decode_errors: int = 0
    gaps: list[int] = field(default_factory=list)
    replays: list[str] = field(default_factory=list)
    connected: list[bool] = field(default_factory=list)

    def kv_batch(self, engine: str, batch: EventBatch) -> None:
        pass

    def kv_gap(self, engine: str, missing: int) -> None:
        self.gaps.append(missing)

    def kv_replay(self, engine: str, result: str) -> None:
        self.replays.append(result)

    def kv_decode_error(self, engine: str) -> None:
        self.decode_errors += 1

    def kv_reset(self, engine: str, reason: str) -> None:
        pass

    def kv_connected(self, engine: str, connected: bool) -> None:
        self.connected.append(connected)


def connections(observer: CountingObserver, connected: bool, *, more_than: int) -> Callable[[], bool]:
    """Whether ``observer`` heard more than ``more_than`` (dis)connections."""
    return lambda: observer.connected.count(connected) > more_than


class ScriptedPublisher:
    """An XPUB (so the test knows when the subscription arrived) plus a ROUTER replay service whose buffer
    the test controls: it can skip seqs, restart at 0, or send junk."""

    def __init__(self, ctx: zmq.asyncio.Context, *, replay: bool = True) -> None:
        self.ctx = ctx
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router: zmq.asyncio.Socket | None = None
        self.replay_port: int | None = None
        if replay:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: dict[int, bytes] = {}
        self._task: asyncio.Task[None] | None = None

    @property
    def source(self) -> EventSource:
        replay = None if self.replay_port is None else f"tcp://127.0.0.1:{self.replay_port}"
        return EventSource(f"tcp://127.0.0.1:{self.port}", replay)

    async def subscribed(self) -> None:
        async with asyncio.timeout(TIMEOUT):
            message = await self.pub.recv()
        assert message[:1] == b"\x01"
        if self.router is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._serve())

    async def send(self, seq: int, batch: EventBatch | None = None, *, buffered: bool = True) -> None:
        payload = encode_batch(batch if batch is not None else _batch(seq))
        if buffered:
            self.buffer[seq] = payload
        await self.pub.send_multipart([b"", encode_seq(seq), payload])

    async def send_raw(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)

    async def _serve(self) -> None:
        assert self.router is not None
        while True:
            identity, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq in sorted(s for s in self.buffer if s >= first):
                await self.router.send_multipart([identity, b"", b"", encode_seq(seq), self.buffer[seq]])
            await self.router.send_multipart([identity, b"", b"", REPLAY_END_SEQ_BYTES, b""])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)


@contextlib.asynccontextmanager
async def subscribed(
    ctx: zmq.asyncio.Context, publisher: ScriptedPublisher
) -> AsyncIterator[tuple[KVEventSubscriber, RecordingSink, CountingObserver]]:
    sink, observer = RecordingSink(), CountingObserver()
    sub = KVEventSubscriber(
        "http://engine", sink, context=ctx, sources=[publisher.source], observer=observer, replay_timeout=2.0
    )
    sub.start()
    try:
        await publisher.subscribed()
        yield sub, sink, observer
    finally:
        await sub.stop()
        await publisher.close()


@contextlib.asynccontextmanager
async def following(
    ctx: zmq.asyncio.Context, *publishers: ScriptedPublisher, **options: Any
) -> AsyncIterator[tuple[KVEventSubscriber, RecordingSink, CountingObserver]]:
    """A subscriber to ``publishers`` (one source each) that has subscribed to all of them, reconnecting
    within 20-50 ms and giving up a replay after 1 s."""
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


async def test_gap_is_filled_by_replay(ctx: zmq.asyncio.Context) -> None:
    pub = ScriptedPublisher(ctx)
    async with subscribed(ctx, pub) as (_, sink, observer):
        await pub.send(0)
        await eventually(lambda: sink.applied == [0], timeout_s=TIMEOUT)
        for seq in (1, 2):
            pub.buffer[seq] = encode_batch(_batch(seq))  # buffered by the engine, lost on the way
        await pub.send(3)
        await pub.send(4)
        await eventually(lambda: len(sink.applied) == 5, timeout_s=TIMEOUT)
        assert sink.applied == [0, 1, 2, 3, 4]
        assert observer.gaps == [2] and observer.replays == ["ok"] and sink.resets == []


async def test_gap_beyond_the_replay_buffer_resets_the_engine(ctx: zmq.asyncio.Context) -> None:
    pub = ScriptedPublisher(ctx)
    async with subscribed(ctx, pub) as (_, sink, observer):
        await pub.send(0)
        await eventually(lambda: sink.applied == [0], timeout_s=TIMEOUT)
        pub.buffer.clear()  # the engine's buffer moved past the missing batches
        await pub.send(5)
        await pub.send(6)
        await eventually(lambda: sink.applied[-1:] == [6], timeout_s=TIMEOUT)
        assert sink.applied == [0, 5, 6]
        assert sink.resets == ["gap"] and observer.replays == ["incomplete"]


async def test_gap_without_replay_endpoint_resets_the_engine(ctx: zmq.asyncio.Context) -> None:
    pub = ScriptedPublisher(ctx, replay=False)
    async with subscribed(ctx, pub) as (_, sink, observer):
        await pub.send(0)
        await pub.send(3)
        await eventually(lambda: sink.applied == [0, 3], timeout_s=TIMEOUT)
        assert sink.resets == ["gap"] and observer.gaps == [2] and observer.replays == []


async def test_seq_going_back_means_restart(ctx: zmq.asyncio.Context) -> None:
    pub = ScriptedPublisher(ctx)
    async with subscribed(ctx, pub) as (_, sink, _obs):
        for seq in range(3):
            await pub.send(seq)
        await eventually(lambda: len(sink.applied) == 3, timeout_s=TIMEOUT)
        pub.buffer.clear()
        await pub.send(0, _batch(100))
        await pub.send(1, _batch(101))
        await eventually(lambda: sink.applied[-1:] == [101], timeout_s=TIMEOUT)
        assert sink.applied == [0, 1, 2, 100, 101]
        assert sink.resets == ["restart"]


async def test_late_subscriber_replays_from_the_start(ctx: zmq.asyncio.Context) -> None:
    pub = ScriptedPublisher(ctx)
    for seq in range(4):  # published before anyone listened
        pub.buffer[seq] = encode_batch(_batch(seq))
    async with subscribed(ctx, pub) as (_, sink, observer):
        await pub.send(4)
        await eventually(lambda: len(sink.applied) == 5, timeout_s=TIMEOUT)
        assert sink.applied == [0, 1, 2, 3, 4]
        assert observer.replays == ["ok"]


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
    from kvstack.router.prefix import PrefixLocator

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


async def test_all_blocks_cleared_reaches_the_sink(ctx: zmq.asyncio.Context) -> None:
    pub = ScriptedPublisher(ctx)
    async with subscribed(ctx, pub) as (_, sink, _obs):
        await pub.send(0)
        await pub.send(1, EventBatch(ts=1.0, events=[AllBlocksCleared()]))
        await eventually(lambda: sink.cleared == 1, timeout_s=TIMEOUT)


async def test_restarted_publisher_on_the_same_port_is_resynced(ctx: zmq.asyncio.Context) -> None:
    port, replay_port = free_port(), free_port()
    endpoint, replay_endpoint = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}"
    sink, observer = RecordingSink(), CountingObserver()
    sub = KVEventSubscriber(
        "http://engine",
        sink,
        context=ctx,
        sources=[EventSource(endpoint, replay_endpoint)],
        observer=observer,
        reconnect_ivl_ms=50,
        reconnect_ivl_max_ms=200,
    )
    sub.start()
    try:
        for first, restart_no in ((0, 0), (100, 1)):
            async with KVEventPublisher(endpoint, replay_endpoint=replay_endpoint, context=ctx) as engine:
                await eventually(connections(observer, True, more_than=restart_no), timeout_s=TIMEOUT)
                # The subscription travels after the connection; publish until the first batch arrives.
                # Every batch stays in the replay buffer, so those sent too early are replayed.
                async with asyncio.timeout(TIMEOUT):
                    while not sink.applied or sink.applied[-1] < first:
                        engine.publish(_batch(first + engine.next_seq).events)
                        await asyncio.sleep(0.05)
            await eventually(connections(observer, False, more_than=restart_no), timeout_s=TIMEOUT)
        # The second engine life started from seq 0 again: the subscriber reset before applying it.
        assert "restart" in sink.resets or "disconnected" in sink.resets
        second_life = sink.applied[sink.applied.index(100) :]
        assert second_life == sorted(second_life) and second_life[0] == 100
    finally:
        await sub.stop()


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


# -- lost connections: a grace period, then a reset or a replay of the gap -----------------------------------


async def test_a_connection_lost_past_the_grace_period_resets_the_engine(ctx: zmq.asyncio.Context) -> None:
    pub = ScriptedPublisher(ctx, replay=False)
    async with following(ctx, pub, disconnect_grace=0.2) as (_sub, sink, observer):
        await pub.send(0)
        await eventually(lambda: sink.applied == [0], timeout_s=TIMEOUT)
        pub.pub.close(linger=0)  # the publisher dies and nothing else arrives
        await eventually(lambda: sink.resets == ["disconnected"], timeout_s=TIMEOUT)
        assert observer.connected == [True, False]
        # It comes back restarted (seq 0, empty cache): a fresh start, nothing more to reset.
        await _rebind(pub)
        await pub.subscribed()
        await pub.send(0, _batch(100))
        await eventually(lambda: sink.applied[-1:] == [100], timeout_s=TIMEOUT)
        assert sink.resets == ["disconnected"]


async def test_a_blip_without_loss_keeps_the_entries(ctx: zmq.asyncio.Context) -> None:
    pub = ScriptedPublisher(ctx)
    async with following(ctx, pub, disconnect_grace=3.0) as (_sub, sink, observer):
        for seq in range(3):
            await pub.send(seq)
        await eventually(lambda: sink.applied == [0, 1, 2], timeout_s=TIMEOUT)
        await _rebind(pub)
        await pub.subscribed()
        await pub.send(3)  # the same publisher goes on: nothing was lost
        await eventually(lambda: sink.applied[-1:] == [3], timeout_s=TIMEOUT)
        assert sink.applied == [0, 1, 2, 3]
        assert sink.resets == [] and observer.replays == [] and observer.connected[-2:] == [False, True]


async def test_a_blip_that_lost_batches_replays_only_the_gap(ctx: zmq.asyncio.Context) -> None:
    pub = ScriptedPublisher(ctx)
    async with following(ctx, pub, disconnect_grace=3.0) as (_sub, sink, observer):
        for seq in range(3):
            await pub.send(seq)
        await eventually(lambda: sink.applied == [0, 1, 2], timeout_s=TIMEOUT)
        await _rebind(pub)
        for seq in (3, 4):  # published while the connection was down
            pub.buffer[seq] = encode_batch(_batch(seq))
        await pub.subscribed()
        await pub.send(5)
        await eventually(lambda: sink.applied[-1:] == [5], timeout_s=TIMEOUT)
        assert sink.applied == [0, 1, 2, 3, 4, 5]
        assert sink.resets == [] and observer.gaps == [2] and observer.replays == ["ok"]


# -- several data-parallel ranks -----------------------------------------------------------------------------


async def test_a_new_rank_does_not_reset_the_other_ranks(ctx: zmq.asyncio.Context) -> None:
    rank0, rank1 = ScriptedPublisher(ctx), ScriptedPublisher(ctx)
    async with following(ctx, rank0, rank1) as (_sub, sink, observer):
        await rank0.send(0)
        await rank0.send(1)
        await eventually(lambda: sink.applied == [0, 1], timeout_s=TIMEOUT)
        await rank1.send(0, _batch(100))
        await eventually(lambda: sink.applied[-1:] == [100], timeout_s=TIMEOUT)
        # A rank joined late replays from its oldest batch; nothing is reset either.
        rank1.buffer.update({1: encode_batch(_batch(101)), 2: encode_batch(_batch(102))})
        await rank1.send(3, _batch(103))
        await eventually(lambda: sink.applied[-1:] == [103], timeout_s=TIMEOUT)
        assert sink.applied == [0, 1, 100, 101, 102, 103]
        assert sink.resets == [] and observer.replays == ["ok"]


# -- duplicate batches ---------------------------------------------------------------------------------------


async def test_a_duplicate_batch_is_skipped_and_a_real_restart_still_resets(ctx: zmq.asyncio.Context) -> None:
    pub = ScriptedPublisher(ctx, replay=False)
    async with following(ctx, pub) as (sub, sink, _obs):
        for seq in (0, 1, 2, 2, 1, 3):
            await pub.send(seq)
        await eventually(lambda: sink.applied[-1:] == [3], timeout_s=TIMEOUT)
        assert sink.applied == [0, 1, 2, 3]
        assert sub.duplicates == 2 and sink.resets == []
        await pub.send(0, _batch(100))  # back to 0: the publisher restarted
        await eventually(lambda: sink.applied[-1:] == [100], timeout_s=TIMEOUT)
        assert sink.resets == ["restart"]


# -- a replay stops at the live batch ------------------------------------------------------------------------


async def test_a_replay_never_applies_past_the_live_batch(ctx: zmq.asyncio.Context) -> None:
    pub = ScriptedPublisher(ctx)
    async with following(ctx, pub) as (_sub, sink, observer):
        await pub.send(0)
        await eventually(lambda: sink.applied == [0], timeout_s=TIMEOUT)
        # A replay service that answers with far more than the gap (another publisher's buffer, say).
        pub.buffer.update({seq: encode_batch(_batch(1000 + seq)) for seq in range(1, 500)})
        for seq in range(2, 6):
            await pub.send(seq, buffered=False)
        await eventually(lambda: sink.applied[-1:] == [5], timeout_s=TIMEOUT)
        assert sink.applied == [0, 1001, 2, 3, 4, 5]
        assert observer.replays == ["ok"] and sink.resets == []


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


# -- other vLLM versions' replay replies ---------------------------------------------------------------------


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
