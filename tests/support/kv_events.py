"""A scripted KV-event publisher for the subscriber tests (an XPUB, and a replay ROUTER whose buffer the
test controls), subscribers to it, and the sink and observer that record what a subscriber did."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

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
from kvstack.kvevents.subscriber import EventSource, KVEventSubscriber

TIMEOUT = 5.0


def stored_batch(n: int) -> EventBatch:
    """Batch ``n``: one block, hash ``n``, tokens ``[n, n]``."""
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
    catch_ups: int = 0  # catch-ups with the publisher's buffer when a source connects
    connected: list[bool] = field(default_factory=list)

    def kv_batch(self, engine: str, batch: EventBatch) -> None:
        pass

    def kv_gap(self, engine: str, missing: int) -> None:
        self.gaps.append(missing)

    def kv_replay(self, engine: str, result: str) -> None:
        if result == "catch_up":  # a connection's catch-up with the publisher's buffer, not a resync
            self.catch_ups += 1
        else:
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
        self.replays_served = 0  # replay requests answered
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

    async def rebind(self) -> None:
        """The PUB socket goes away and comes back on the same port: a network blip (the replay service
        stays)."""
        self.pub.close(linger=0)
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        async with asyncio.timeout(TIMEOUT):
            while True:
                try:
                    self.pub.bind(f"tcp://127.0.0.1:{self.port}")
                    return
                except zmq.ZMQError:  # ZMQ's I/O thread has not closed the old listener yet
                    await asyncio.sleep(0.01)

    async def send(self, seq: int, batch: EventBatch | None = None, *, buffered: bool = True) -> None:
        payload = encode_batch(batch if batch is not None else stored_batch(seq))
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
            self.replays_served += 1

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
