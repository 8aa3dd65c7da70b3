"""A KV-event stream: vLLM's ZMQ PUB publisher and replay service, in asyncio.

``publish(events)`` sends the events as one batch, ``[topic, seq, payload]`` with seq counting from 0 (the
simulator publishes once per scheduler step, the cache server once per event-loop turn). The last
``buffer_steps`` (10000) payloads are kept for replay: a DEALER sends ``[b"", start_seq]`` to the ROUTER at
``replay_endpoint`` and receives ``[b"", topic, seq, payload]`` for each kept batch with seq >= start_seq,
then ``[b"", b"", seq=-1, b""]``. Payloads are built by ``kvstack.kvevents.codec``; ``legacy_array``
selects the older array encoding; ``data_parallel_rank`` (None: omitted) is stamped on every batch.

Publishing never waits. A PUB drops messages for a subscriber past the high-water mark ``hwm`` without
telling the sender, as vLLM's does; that subscriber sees a seq gap and replays. ``dropped_batches`` counts
the batches ZMQ refused outright (kept for replay all the same), ``sent_events`` the events sent.
Imports nothing of kvstack outside ``kvstack.kvevents``.
"""

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Self

import zmq
import zmq.asyncio

from kvstack.kvevents.codec import REPLAY_END_SEQ_BYTES, EventBatch, KVEvent, encode_batch, encode_seq

__all__ = ["KVEventPublisher"]

logger = logging.getLogger(__name__)

# A long replay yields to the event loop this often, so the publisher's owner keeps running while it streams.
_REPLAY_YIELD_EVERY = 256


class KVEventPublisher:
    """Publishes KV-event batches on a bound PUB socket and serves replays from a bounded ring buffer."""

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int | None = None,
        legacy_array: bool = False,
        context: zmq.asyncio.Context | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if buffer_steps < 1:
            raise ValueError(f"buffer_steps must be >= 1, got {buffer_steps}")
        self._requested_endpoint = endpoint
        self._requested_replay_endpoint = replay_endpoint
        self._topic = topic.encode("utf-8")
        self._buffer_steps = buffer_steps
        self._hwm = hwm
        self._data_parallel_rank = data_parallel_rank
        self._legacy_array = legacy_array
        self._given_context = context
        self._ctx: zmq.asyncio.Context | None = None
        self._clock = clock

        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self.sent_events = 0
        self.dropped_batches = 0

        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._endpoint: str | None = None
        self._bound_replay_endpoint: str | None = None
        self._closed = False

    async def start(self) -> None:
        """Bind the PUB socket (and the replay ROUTER, if configured) and start serving replays."""
        if self._ctx is not None or self._closed:
            raise RuntimeError("KVEventPublisher.start() may be called once, before close()")
        self._ctx = self._given_context if self._given_context is not None else zmq.asyncio.Context()
        # A plain socket, not an asyncio one: publish() stays synchronous for its callers (a scheduler step,
        # a loop callback), and a PUB send never waits anyway.
        pub: zmq.Socket[bytes] = zmq.Socket(self._ctx, zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self._hwm)
        pub.setsockopt(zmq.LINGER, 0)
        self._pub = pub
        try:
            self._endpoint = _bind(pub, self._requested_endpoint, "KV event PUB")
            if self._requested_replay_endpoint is not None:
                replay = self._ctx.socket(zmq.ROUTER)
                # Room for one whole replay per client; a ROUTER silently drops what exceeds it, and the
                # end marker would be lost with it.
                replay.setsockopt(zmq.SNDHWM, self._buffer_steps + 1)
                replay.setsockopt(zmq.LINGER, 0)
                self._replay = replay
                self._bound_replay_endpoint = _bind(
                    replay, self._requested_replay_endpoint, "KV event replay"
                )
                self._replay_task = asyncio.create_task(self._serve_replay(replay), name="kv-event-replay")
        except BaseException:
            await self.close()
            raise

    @property
    def endpoint(self) -> str:
        """The bound PUB endpoint, with the port the OS chose for port 0."""
        if self._endpoint is None:
            raise RuntimeError("KVEventPublisher is not started; call await start() first")
        return self._endpoint

    @property
    def port(self) -> int | None:
        """The bound PUB TCP port; None for ipc/inproc."""
        return _tcp_port(self.endpoint)

    @property
    def replay_endpoint(self) -> str | None:
        """The bound replay ROUTER endpoint, or None without replay."""
        return self._bound_replay_endpoint

    @property
    def replay_port(self) -> int | None:
        """The bound replay TCP port; None without replay or for ipc/inproc."""
        return None if self._bound_replay_endpoint is None else _tcp_port(self._bound_replay_endpoint)

    @property
    def next_seq(self) -> int:
        """The seq the next batch will carry."""
        return self._next_seq

    def publish(self, events: Iterable[KVEvent], *, ts: float | None = None) -> int | None:
        """Send ``events`` as one batch stamped ``ts`` (default: the clock now); return its seq, or None
        when there are no events (nothing is sent)."""
        batch_events = list(events)
        if not batch_events:
            return None
        if self._pub is None or self._closed:
            raise RuntimeError(
                "KVEventPublisher is not running; call await start() first and not after close()"
            )
        batch = EventBatch(
            ts=self._clock() if ts is None else ts,
            events=batch_events,
            data_parallel_rank=self._data_parallel_rank,
        )
        payload = encode_batch(batch, legacy_array=self._legacy_array)
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart([self._topic, encode_seq(seq), payload], flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped_batches += 1
        else:
            self.sent_events += len(batch_events)
        return seq

    async def close(self) -> None:
        """Stop serving replays and close the sockets (and the context, if this publisher made it)."""
        if self._closed:
            return
        self._closed = True
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._replay_task = None
        for sock in (self._replay, self._pub):
            if sock is not None:
                sock.close(linger=0)
        if self._ctx is not None and self._given_context is None:
            self._ctx.term()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _serve_replay(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                # Same as vLLM: ignore it, since a malformed request may not even carry a usable envelope.
                logger.warning(
                    "ignoring KV event replay request of %d frames; a DEALER must send [b'', start_seq]",
                    len(frames) - 1,
                )
                continue
            identity, _, start_frame = frames
            # Unsigned and any length, as vLLM reads it, so clients that work against vLLM work here.
            start_seq = int.from_bytes(start_frame, "big")
            try:
                await self._send_replay(sock, identity, start_seq)
            except zmq.ZMQError as exc:
                logger.warning("KV event replay from seq %d failed: %s", start_seq, exc)

    async def _send_replay(self, sock: zmq.asyncio.Socket, identity: bytes, start_seq: int) -> None:
        # Snapshot first: publish() may append (and evict) while this coroutine yields.
        batches = [item for item in self._buffer if item[0] >= start_seq]
        for count, (seq, payload) in enumerate(batches, start=1):
            await sock.send_multipart([identity, b"", self._topic, encode_seq(seq), payload])
            if count % _REPLAY_YIELD_EVERY == 0:
                await asyncio.sleep(0)
        # vLLM sends the end marker with an empty topic frame, whatever the configured topic.
        await sock.send_multipart([identity, b"", b"", REPLAY_END_SEQ_BYTES, b""])


def _bind(sock: zmq.Socket, endpoint: str, what: str) -> str:
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise OSError(
            f"cannot bind {what} socket to {endpoint}: {exc} (port in use? data-parallel ranks need "
            "distinct ports; use port 0 to let the OS choose)"
        ) from exc
    bound: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return bound


def _tcp_port(endpoint: str) -> int | None:
    if not endpoint.startswith("tcp://"):
        return None
    return int(endpoint.rsplit(":", 1)[1])
