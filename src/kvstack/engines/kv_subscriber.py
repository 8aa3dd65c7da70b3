"""Subscribing to an engine's KV events: one ZMQ SUB per event source, sequence tracking, replay, resync.

Where the events come from: a configured endpoint (``--engine URL#kv-events=tcp://host:port``, a pod
annotation), else the engine's ``GET /kv_event_sources``, whose endpoints bind a wildcard host
(``tcp://*:5557``) that `resolve_sources` replaces with the engine's own address. With data parallelism
each rank is its own source.

What is delivered to the sink, per engine (the sink keys its entries by engine URL):
- ``apply(engine, batch)`` for every batch, in sequence order, each exactly once;
- ``reset(engine, reason)`` whenever the sink's view of that engine can no longer be trusted: a sequence
  gap the engine cannot replay, a publisher restart (seq went back), a lost connection, a subscriber
  stopped. After a reset the view is rebuilt from the events that follow (and a replay when available).

Sequence rules (`SequenceTracker`, pure): PUB/SUB never reorders, so on the SUB socket seq only grows
within one publisher's life. A seq at or below the last one received means the publisher restarted. A seq
beyond the next expected one is a gap: with a replay endpoint the missing batches are fetched (vLLM's
DEALER/ROUTER protocol) and applied; if the replay does not cover the gap, the engine's entries are reset.
Batches the replay already delivered are skipped when they also arrive on SUB.

ZMQ reconnects by itself with growing intervals (``RECONNECT_IVL`` → ``RECONNECT_IVL_MAX``); a socket
monitor tells the subscriber when the connection dropped, and the next message triggers a resync (the
engine may have restarted meanwhile). Resolving sources over HTTP is retried with exponential backoff.
A malformed message is counted and skipped; nothing a peer sends can stop the subscriber.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvstack.engines.kv_events import (
    REPLAY_END_SEQ,
    EventBatch,
    KVEventDecodeError,
    decode_batch,
    decode_seq,
    encode_seq,
)

__all__ = [
    "EventSource",
    "KVEventObserver",
    "KVEventSink",
    "KVEventSubscriber",
    "SeqVerdict",
    "SequenceTracker",
    "replay",
    "resolve_sources",
]

log = logging.getLogger(__name__)

_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]")


@dataclass(frozen=True, slots=True)
class EventSource:
    """One publisher: a PUB endpoint, its optional replay (ROUTER) endpoint, topic, and DP rank."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    rank: int | None = None


def _engine_host(engine_url: str) -> str:
    host = urlsplit(engine_url).hostname or "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def replace_wildcard(endpoint: str, engine_url: str) -> str:
    """``tcp://*:5557`` → ``tcp://<engine host>:5557``; other endpoints unchanged."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme != "tcp":
        return endpoint
    host, colon, port = rest.rpartition(":")
    if not colon or host not in _WILDCARD_HOSTS:
        return endpoint
    return f"tcp://{_engine_host(engine_url)}:{port}"


def resolve_sources(engine_url: str, sources: object) -> list[EventSource]:
    """The event sources in an engine's ``/kv_event_sources`` answer (``{rank: KVEventsConfig}``).

    Ranks whose config disables events or names no endpoint are left out; wildcard hosts become the
    engine's host. Raises ValueError when the answer is not that shape.
    """
    if not isinstance(sources, Mapping):
        raise ValueError(f"/kv_event_sources of {engine_url} is not a JSON object")
    out: list[EventSource] = []
    for rank_key, cfg in sources.items():
        if not isinstance(cfg, Mapping):
            raise ValueError(f"/kv_event_sources of {engine_url}: rank {rank_key} is not an object")
        if cfg.get("enable_kv_cache_events") is False or cfg.get("publisher", "zmq") != "zmq":
            continue
        endpoint = cfg.get("endpoint")
        if not isinstance(endpoint, str) or not endpoint:
            continue
        replay_ep = cfg.get("replay_endpoint")
        try:
            rank: int | None = int(rank_key)
        except (TypeError, ValueError):
            rank = None
        # With data parallelism vLLM offsets each rank's TCP port; its config shows rank 0's.
        endpoint = replace_wildcard(_offset_port(endpoint, rank), engine_url)
        replay_endpoint = (
            replace_wildcard(_offset_port(replay_ep, rank), engine_url)
            if isinstance(replay_ep, str) and replay_ep
            else None
        )
        topic = cfg.get("topic")
        out.append(EventSource(endpoint, replay_endpoint, topic if isinstance(topic, str) else "", rank))
    return out


def _offset_port(endpoint: str, rank: int | None) -> str:
    if not rank or not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint.rpartition(":")
    try:
        return f"{host}:{int(port) + rank}"
    except ValueError:
        return endpoint


class KVEventSink(Protocol):
    """Where decoded batches go (the router's prefix index)."""

    def apply(self, engine: str, batch: EventBatch) -> None:
        """One batch, in sequence order."""
        ...

    def reset(self, engine: str, reason: str) -> None:
        """Forget everything known about ``engine``; events that follow rebuild it."""
        ...


class KVEventObserver(Protocol):
    """Counters the subscriber reports (the router's metrics)."""

    def kv_batch(self, engine: str, batch: EventBatch) -> None: ...

    def kv_gap(self, engine: str, missing: int) -> None: ...

    def kv_replay(self, engine: str, result: str) -> None: ...

    def kv_decode_error(self, engine: str) -> None: ...

    def kv_reset(self, engine: str, reason: str) -> None: ...

    def kv_connected(self, engine: str, connected: bool) -> None: ...


class _NoObserver:
    def kv_batch(self, engine: str, batch: EventBatch) -> None:
        pass

    def kv_gap(self, engine: str, missing: int) -> None:
        pass

    def kv_replay(self, engine: str, result: str) -> None:
        pass

    def kv_decode_error(self, engine: str) -> None:
        pass

    def kv_reset(self, engine: str, reason: str) -> None:
        pass

    def kv_connected(self, engine: str, connected: bool) -> None:
        pass


class SeqVerdict(enum.Enum):
    FIRST = "first"  # nothing received yet from this publisher (or since a resync)
    NEXT = "next"  # exactly the next batch
    ALREADY_APPLIED = "already_applied"  # a replay delivered it before SUB did
    GAP = "gap"  # batches between the last applied and this one are missing
    RESTART = "restart"  # seq went back: a new publisher


class SequenceTracker:
    """Per-source sequence state. Pure: the subscriber asks, acts, then records what it applied."""

    __slots__ = ("applied", "received")

    def __init__(self) -> None:
        self.received: int | None = None  # last seq seen on SUB
        self.applied: int | None = None  # last seq applied to the sink (SUB or replay)

    def classify(self, seq: int) -> SeqVerdict:
        if self.received is None or self.applied is None:
            return SeqVerdict.FIRST
        if seq <= self.received:
            return SeqVerdict.RESTART
        if seq <= self.applied:
            return SeqVerdict.ALREADY_APPLIED
        if seq == self.applied + 1:
            return SeqVerdict.NEXT
        return SeqVerdict.GAP

    def forget(self) -> None:
        self.received = self.applied = None


@dataclass(slots=True)
class ReplayResult:
    batches: list[tuple[int, EventBatch]]  # (seq, batch) in order
    decode_errors: int = 0


async def replay(
    context: zmq.asyncio.Context,
    replay_endpoint: str,
    start_seq: int,
    *,
    timeout: float = 5.0,  # noqa: ASYNC109 - one budget for the whole exchange, applied inside
    max_batches: int = 20_000,
) -> ReplayResult:
    """Ask a publisher's replay service for every buffered batch with seq >= ``start_seq``.

    Raises TimeoutError when the service does not finish within ``timeout`` seconds (for instance when
    nothing listens there: ZMQ queues the request and waits for a peer).
    """
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    out = ReplayResult([])
    try:
        sock.connect(replay_endpoint)
        async with asyncio.timeout(timeout):
            await sock.send_multipart([b"", encode_seq(start_seq)])
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 4:
                    out.decode_errors += 1
                    continue
                try:
                    seq = decode_seq(frames[2])
                except KVEventDecodeError:
                    out.decode_errors += 1
                    continue
                if seq == REPLAY_END_SEQ:
                    return out
                try:
                    out.batches.append((seq, decode_batch(frames[3])))
                except KVEventDecodeError:
                    out.decode_errors += 1
                if len(out.batches) > max_batches:
                    raise TimeoutError(f"replay from {replay_endpoint} sent more than {max_batches} batches")
    finally:
        sock.close(linger=0)


class KVEventSubscriber:
    """Subscribes to one engine's KV events and feeds its sink; ``start``/``stop`` own the task."""

    def __init__(
        self,
        engine: str,
        sink: KVEventSink,
        *,
        context: zmq.asyncio.Context,
        sources: Sequence[EventSource] = (),
        fetch_sources: Callable[[], Any] | None = None,
        observer: KVEventObserver | None = None,
        replay_timeout: float = 5.0,
        rcv_hwm: int = 100_000,
        reconnect_ivl_ms: int = 100,
        reconnect_ivl_max_ms: int = 5_000,
        resolve_backoff: tuple[float, float] = (0.5, 30.0),
    ) -> None:
        """``sources`` when configured; else ``fetch_sources`` (an async callable returning them) is
        retried with exponential backoff until it yields at least one source."""
        if not sources and fetch_sources is None:
            raise ValueError(f"engine {engine}: KV events need sources or a way to fetch them")
        self.engine = engine
        self.sink = sink
        self.context = context
        self.sources: list[EventSource] = list(sources)
        self._fetch_sources = fetch_sources
        self.observer: KVEventObserver = observer or _NoObserver()
        self.replay_timeout = replay_timeout
        self.rcv_hwm = rcv_hwm
        self.reconnect_ivl_ms = reconnect_ivl_ms
        self.reconnect_ivl_max_ms = reconnect_ivl_max_ms
        self.resolve_backoff = resolve_backoff
        self.connected = False
        self.batches = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-events {self.engine}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        if not self.sources:
            self.sources = await self._resolve()
        try:
            await asyncio.gather(*(self._follow(source) for source in self.sources))
        finally:
            self.connected = False

    async def _resolve(self) -> list[EventSource]:
        assert self._fetch_sources is not None
        delay, cap = self.resolve_backoff
        while True:
            try:
                sources: list[EventSource] = await self._fetch_sources()
            except Exception as exc:  # any failure (HTTP, JSON, shape) is retried; the reason is logged
                log.info("engine %s: KV event sources not available yet (%s); retrying", self.engine, exc)
            else:
                if sources:
                    log.info("engine %s: KV events from %s", self.engine, [s.endpoint for s in sources])
                    return sources
                log.info("engine %s: publishes no KV events (yet); asking again later", self.engine)
            await asyncio.sleep(delay * random.uniform(0.8, 1.2))
            delay = min(cap, delay * 2)

    async def _follow(self, source: EventSource) -> None:
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self.rcv_hwm)
        sub.setsockopt(zmq.RECONNECT_IVL, self.reconnect_ivl_ms)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, self.reconnect_ivl_max_ms)
        sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(source.endpoint)
        tracker = SequenceTracker()
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    self._on_monitor(await monitor.recv_multipart(), tracker)
                if sub in ready:
                    frames = await sub.recv_multipart()
                    await self._on_message(source, tracker, frames)
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    def _on_monitor(self, frames: list[bytes], tracker: SequenceTracker) -> None:
        try:
            event = parse_monitor_message(frames)["event"]
        except Exception:  # pyzmq raises plain errors on odd frames; a monitor glitch is not worth dying for
            return
        if event == zmq.EVENT_CONNECTED:
            self.connected = True
            self.observer.kv_connected(self.engine, True)
        elif event == zmq.EVENT_DISCONNECTED:
            self.connected = False
            self.observer.kv_connected(self.engine, False)
            # Whatever follows may come from a restarted engine: resync on the next message.
            tracker.forget()

    async def _on_message(self, source: EventSource, tracker: SequenceTracker, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self.observer.kv_decode_error(self.engine)
            log.warning(
                "engine %s: KV event message with %d frames (expected 3); skipped", self.engine, len(frames)
            )
            return
        try:
            seq = decode_seq(frames[1])
            batch = decode_batch(frames[2])
        except KVEventDecodeError as exc:
            self.observer.kv_decode_error(self.engine)
            log.warning("engine %s: undecodable KV event message skipped: %s", self.engine, exc)
            # The batch's changes are lost: treat it as missing so a later batch sees a gap.
            return
        verdict = tracker.classify(seq)
        if verdict is SeqVerdict.ALREADY_APPLIED:
            tracker.received = seq
            return
        if verdict is SeqVerdict.NEXT:
            self._apply(tracker, seq, batch)
            tracker.received = seq
            return
        if verdict is SeqVerdict.RESTART:
            log.info("engine %s: KV event seq went back to %d: publisher restarted", self.engine, seq)
            self._reset("restart")
            tracker.forget()
            start = 0
        elif verdict is SeqVerdict.FIRST:
            # A fresh view: drop what an earlier connection taught, then rebuild from the oldest batch
            # the engine can still replay (blocks stored before that stay unknown; never wrong).
            if seq > 0 or self.batches > 0:
                self._reset("resync")
            start = 0
        else:  # GAP
            assert tracker.applied is not None
            start = tracker.applied + 1
            self.observer.kv_gap(self.engine, seq - start)
            log.info("engine %s: KV events %d..%d missing", self.engine, start, seq - 1)
        if (
            seq > start
            and source.replay_endpoint is not None
            and await self._replay(source, tracker, start, seq)
        ):
            tracker.received = seq
            if tracker.applied is not None and tracker.applied >= seq:
                return
            self._apply(tracker, seq, batch)
            return
        if seq > start and verdict is SeqVerdict.GAP:
            # Nothing fills the gap: the engine's entries may be stale (a missed BlockRemoved); drop them.
            self._reset("gap")
        self._apply(tracker, seq, batch)
        tracker.received = seq

    async def _replay(self, source: EventSource, tracker: SequenceTracker, start: int, seq: int) -> bool:
        """Apply the missing batches from the replay service; True when they covered ``start..seq-1``."""
        assert source.replay_endpoint is not None
        try:
            result = await replay(self.context, source.replay_endpoint, start, timeout=self.replay_timeout)
        except (TimeoutError, zmq.ZMQError) as exc:
            self.observer.kv_replay(self.engine, "failed")
            log.warning(
                "engine %s: KV event replay from %s failed: %s", self.engine, source.replay_endpoint, exc
            )
            return False
        for _ in range(result.decode_errors):
            self.observer.kv_decode_error(self.engine)
        batches = result.batches
        if start > 0 and (not batches or batches[0][0] != start):
            # The buffer no longer holds the first missing batch: what it has cannot fill the gap.
            self.observer.kv_replay(self.engine, "incomplete")
            return False
        expected = batches[0][0] if batches else start
        for replayed_seq, replayed in batches:
            if replayed_seq != expected:
                break
            self._apply(tracker, replayed_seq, replayed)
            expected += 1
        covered = expected >= seq
        self.observer.kv_replay(self.engine, "ok" if covered else "incomplete")
        if not covered and start > 0:
            return False
        return covered

    def _apply(self, tracker: SequenceTracker, seq: int, batch: EventBatch) -> None:
        tracker.applied = seq
        self.batches += 1
        self.observer.kv_batch(self.engine, batch)
        try:
            self.sink.apply(self.engine, batch)
        except (
            Exception
        ) as exc:  # a batch the sink cannot take (e.g. token ids out of range) must not kill us
            self.observer.kv_decode_error(self.engine)
            log.warning(
                "engine %s: KV event batch %d rejected (%r); dropping its entries", self.engine, seq, exc
            )
            self._reset("rejected")

    def _reset(self, reason: str) -> None:
        self.observer.kv_reset(self.engine, reason)
        self.sink.reset(self.engine, reason)
