"""A connection to a publisher that drops and comes back: the subscriber survives the grace period ending
while a message is half read (libzmq would abort the process), and learns at reconnect, before any new
batch, that the publisher restarted or moved past what it can replay (blips whose missed batches it can
replay: test_subscriber_resync)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import zmq.asyncio

import kvstack
from kvstack.kvevents.codec import encode_batch
from kvstack.kvevents.publisher import KVEventPublisher
from kvstack.kvevents.subscriber import EventSource, KVEventSubscriber
from support.kv_events import (
    TIMEOUT,
    CountingObserver,
    RecordingSink,
    ScriptedPublisher,
    following,
    stored_batch,
)
from support.ports import free_port
from support.waiting import eventually

SRC = Path(kvstack.__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parents[1]


def test_the_grace_period_ending_while_a_backlog_is_read_does_not_abort_the_process() -> None:
    """An engine dies with 200 batches unread and the subscriber reads them slowly (5 ms each): its 50 ms
    grace period ends between a poll, which prefetched a message's first frame, and the read of the rest.
    A socket disconnected in place there makes libzmq abort the process (``!_more (src/fq.cpp:80)``)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)])}
    child = subprocess.run(
        [sys.executable, "-m", "support.kv_event_backlog", "200", "0.005", "0.05"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == 0, f"exit status {child.returncode}: {child.stderr[-3000:]}"
    assert json.loads(child.stdout)["resets"] == ["disconnected"]


# -- back within the grace period: a restart, or a gap the buffer cannot fill, known at reconnect ------------


async def publish_until_applied(engine: KVEventPublisher, sink: RecordingSink, token: int) -> None:
    """Publish batch ``token`` until the subscriber applied it: the subscription travels after the
    connection, and what is sent before it arrives is replayed from the buffer."""
    async with asyncio.timeout(TIMEOUT):
        while token not in sink.applied:
            engine.publish(stored_batch(token).events)
            await asyncio.sleep(0.05)


@pytest.mark.parametrize("published", [0, 2])
async def test_a_publisher_restarted_within_the_grace_period_resets_at_reconnect(
    ctx: zmq.asyncio.Context, published: int
) -> None:
    """Known before its first batch: the new process buffers nothing from the last applied seq on (its
    buffer is empty, or ends before it). What it buffers is caught up with."""
    endpoint, replay_endpoint = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    sink, observer = RecordingSink(), CountingObserver()
    sub = KVEventSubscriber(
        "http://engine",
        sink,
        context=ctx,
        sources=[EventSource(endpoint, replay_endpoint)],
        observer=observer,
        replay_timeout=1.0,
        reconnect_ivl_ms=20,
        reconnect_ivl_max_ms=50,
        disconnect_grace=60.0,
    )
    sub.start()
    try:
        async with KVEventPublisher(endpoint, replay_endpoint=replay_endpoint, context=ctx) as engine:
            for token in range(3):  # seqs 0..2 at least
                await publish_until_applied(engine, sink, token)
        await eventually(lambda: observer.connected[-1:] == [False], timeout_s=TIMEOUT)
        first_life, catch_ups = list(sink.applied), observer.catch_ups
        async with KVEventPublisher(endpoint, replay_endpoint=replay_endpoint, context=ctx) as engine:
            for n in range(published):  # before the subscriber is back: buffered, never sent to it
                engine.publish(stored_batch(100 + n).events)
            await eventually(lambda: sink.resets == ["restart"], timeout_s=TIMEOUT)
            restarted = [*first_life, *range(100, 100 + published)]
            await eventually(lambda: sink.applied == restarted, timeout_s=TIMEOUT)
            assert observer.catch_ups == catch_ups + (published > 0)
            await publish_until_applied(engine, sink, 200)
        assert set(sink.applied[len(restarted) :]) == {200}
        assert sink.resets == ["restart"] and observer.gaps == []
    finally:
        await sub.stop()


async def test_a_blip_longer_than_the_publishers_buffer_resets_at_reconnect(ctx: zmq.asyncio.Context) -> None:
    pub = ScriptedPublisher(ctx)
    async with following(ctx, pub, disconnect_grace=60.0) as (_sub, sink, observer):
        for seq in range(3):
            await pub.send(seq)
        await eventually(lambda: sink.applied == [0, 1, 2], timeout_s=TIMEOUT)
        catch_ups = observer.catch_ups
        await pub.rebind()
        pub.buffer = {seq: encode_batch(stored_batch(seq)) for seq in (6, 7)}  # 3..5 left the buffer
        await eventually(lambda: sink.applied == [0, 1, 2, 6, 7], timeout_s=TIMEOUT)  # caught up afresh
        assert sink.resets == ["gap"] and observer.gaps == [3] and observer.replays == ["incomplete"]
        assert observer.catch_ups == catch_ups + 1
