"""How the subscriber gets back in step with an engine: replays that fill a gap (bounded by the live
batch), resets when they cannot, restarts, lost connections and blips, late ranks, duplicates, and the
replay replies of other vLLM versions."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import pytest
import zmq
import zmq.asyncio

from kvstack.kvevents.codec import REPLAY_END_SEQ_BYTES, encode_batch, encode_seq
from kvstack.kvevents.publisher import KVEventPublisher
from kvstack.kvevents.replay import replay
from kvstack.kvevents.subscriber import EventSource, KVEventSubscriber
from support.kv_events import (
    TIMEOUT,
    CountingObserver,
    RecordingSink,
    ScriptedPublisher,
    following,
    subscribed,
)
from support.kv_events import stored_batch as _batch
from support.ports import free_port
from support.waiting import eventually


def connections(observer: CountingObserver, connected: bool, *, more_than: int) -> Callable[[], bool]:
    """Whether ``observer`` heard more than ``more_than`` (dis)connections."""
    return lambda: observer.connected.count(connected) > more_than


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


async def test_late_subscriber_catches_up_with_the_buffer_before_any_live_batch(
    ctx: zmq.asyncio.Context,
) -> None:
    pub = ScriptedPublisher(ctx)
    for seq in range(4):  # published before anyone listened
        pub.buffer[seq] = encode_batch(_batch(seq))
    async with subscribed(ctx, pub) as (_, sink, observer):
        await eventually(lambda: sink.applied == [0, 1, 2, 3], timeout_s=TIMEOUT)  # no event sent yet
        assert observer.catch_ups == 1
        await pub.send(4)
        await eventually(lambda: len(sink.applied) == 5, timeout_s=TIMEOUT)
        assert sink.applied == [0, 1, 2, 3, 4]
        assert observer.replays == [] and sink.resets == []


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
        await pub.rebind()
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
        served = pub.replays_served
        await pub.rebind()
        await pub.subscribed()
        # Back within the grace period it asks the replay service at once: nothing was missed.
        await eventually(lambda: pub.replays_served > served, timeout_s=TIMEOUT)
        await pub.send(3)  # the same publisher goes on
        await eventually(lambda: sink.applied[-1:] == [3], timeout_s=TIMEOUT)
        assert sink.applied == [0, 1, 2, 3]
        assert sink.resets == [] and observer.replays == [] and observer.connected[-2:] == [False, True]


async def test_a_blip_that_lost_batches_replays_only_the_gap_at_reconnect(ctx: zmq.asyncio.Context) -> None:
    pub = ScriptedPublisher(ctx)
    async with following(ctx, pub, disconnect_grace=3.0) as (_sub, sink, observer):
        for seq in range(3):
            await pub.send(seq)
        await eventually(lambda: sink.applied == [0, 1, 2], timeout_s=TIMEOUT)
        await pub.rebind()
        for seq in (3, 4):  # published while the connection was down
            pub.buffer[seq] = encode_batch(_batch(seq))
        await eventually(lambda: sink.applied == [0, 1, 2, 3, 4], timeout_s=TIMEOUT)  # before a new batch
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
