"""The KV-event subscriber over real ZMQ: sequence tracking, replay, resets, malformed input, reconnects."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
import zmq
import zmq.asyncio

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
    EventSource,
    KVEventSubscriber,
    SequenceTracker,
    SeqVerdict,
    resolve_sources,
)
from support.ports import free_port

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

    async def wait_for(self, predicate: object) -> None:
        assert callable(predicate)
        async with asyncio.timeout(TIMEOUT):
            while not predicate():  # noqa: ASYNC110 - the conditions span the sink and the observer
                await asyncio.sleep(0.01)


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
        await sink.wait_for(lambda: len(sink.applied) == 5)
        assert sink.applied == [0, 1, 2, 3, 4]
        assert sink.resets == [] and observer.gaps == []


async def test_gap_is_filled_by_replay(ctx: zmq.asyncio.Context) -> None:
    pub = ScriptedPublisher(ctx)
    async with subscribed(ctx, pub) as (_, sink, observer):
        await pub.send(0)
        await sink.wait_for(lambda: sink.applied == [0])
        for seq in (1, 2):
            pub.buffer[seq] = encode_batch(_batch(seq))  # buffered by the engine, lost on the way
        await pub.send(3)
        await pub.send(4)
        await sink.wait_for(lambda: len(sink.applied) == 5)
        assert sink.applied == [0, 1, 2, 3, 4]
        assert observer.gaps == [2] and observer.replays == ["ok"] and sink.resets == []


async def test_gap_beyond_the_replay_buffer_resets_the_engine(ctx: zmq.asyncio.Context) -> None:
    pub = ScriptedPublisher(ctx)
    async with subscribed(ctx, pub) as (_, sink, observer):
        await pub.send(0)
        await sink.wait_for(lambda: sink.applied == [0])
        pub.buffer.clear()  # the engine's buffer moved past the missing batches
        await pub.send(5)
        await pub.send(6)
        await sink.wait_for(lambda: sink.applied[-1:] == [6])
        assert sink.applied == [0, 5, 6]
        assert sink.resets == ["gap"] and observer.replays == ["incomplete"]


async def test_gap_without_replay_endpoint_resets_the_engine(ctx: zmq.asyncio.Context) -> None:
    pub = ScriptedPublisher(ctx, replay=False)
    async with subscribed(ctx, pub) as (_, sink, observer):
        await pub.send(0)
        await pub.send(3)
        await sink.wait_for(lambda: sink.applied == [0, 3])
        assert sink.resets == ["gap"] and observer.gaps == [2] and observer.replays == []


async def test_seq_going_back_means_restart(ctx: zmq.asyncio.Context) -> None:
    pub = ScriptedPublisher(ctx)
    async with subscribed(ctx, pub) as (_, sink, _obs):
        for seq in range(3):
            await pub.send(seq)
        await sink.wait_for(lambda: len(sink.applied) == 3)
        pub.buffer.clear()
        await pub.send(0, _batch(100))
        await pub.send(1, _batch(101))
        await sink.wait_for(lambda: sink.applied[-1:] == [101])
        assert sink.applied == [0, 1, 2, 100, 101]
        assert sink.resets == ["restart"]


async def test_late_subscriber_replays_from_the_start(ctx: zmq.asyncio.Context) -> None:
    pub = ScriptedPublisher(ctx)
    for seq in range(4):  # published before anyone listened
        pub.buffer[seq] = encode_batch(_batch(seq))
    async with subscribed(ctx, pub) as (_, sink, observer):
        await pub.send(4)
        await sink.wait_for(lambda: len(sink.applied) == 5)
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
        await sink.wait_for(lambda: sink.applied == [0, 1])
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
        await sink.wait_for(lambda: sink.cleared == 1)


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
                await sink.wait_for(lambda n=restart_no: observer.connected.count(True) > n)
                # The subscription travels after the connection; publish until the first batch arrives.
                # Every batch stays in the replay buffer, so those sent too early are replayed.
                async with asyncio.timeout(TIMEOUT):
                    while not sink.applied or sink.applied[-1] < first:
                        engine.publish(_batch(first + engine.next_seq).events)
                        engine.flush()
                        await asyncio.sleep(0.05)
            await sink.wait_for(lambda n=restart_no: observer.connected.count(False) > n)
        # The second engine life started from seq 0 again: the subscriber reset before applying it.
        assert "restart" in sink.resets or "disconnected" in sink.resets
        second_life = sink.applied[sink.applied.index(100) :]
        assert second_life == sorted(second_life) and second_life[0] == 100
    finally:
        await sub.stop()
