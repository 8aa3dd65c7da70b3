"""Following a publisher's KV events: one ZMQ SUB per event source, sequence tracking, replay, resync.

Sources: configured, else the engine's ``GET /kv_event_sources`` (`resolve_sources`; each data-parallel rank
a source), asked again with ``resolve_backoff`` until it names one. The sink hears, per engine,
``apply(engine, batch)`` for every batch in seq order, each once, and ``reset(engine, reason)`` when its view
can no longer be trusted: a gap replay cannot fill (``gap``), a new publisher (``restart``), a connection
down past ``disconnect_grace`` (``disconnected``), a batch the sink rejected; nothing once ``close``/``stop``
returns. Sequence rules: `SequenceTracker`. A source with a replay service (vLLM's DEALER/ROUTER protocol)
that connects with nothing of it known catches up with all its publisher buffers; one back within the grace
period asks at once for what follows the last applied seq: nothing means a new publisher (reset, then catch
up), a run is what was missed. Without one, a first batch resets nothing. ZMQ reconnects by itself, at least
once a second; past the grace period the task that reads the socket replaces it (libzmq aborts on a socket
reconnected in place with a message half read).
Malformed messages, ones over ``max_message_bytes`` or ``max_blocks_per_batch`` blocks are counted and
skipped, unknown event types counted: nothing a peer sends stops the subscriber.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol
from urllib.parse import urlsplit

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvstack.backoff import Backoff
from kvstack.kvevents.codec import AllBlocksCleared, EventBatch, KVEventDecodeError, decode_batch, decode_seq
from kvstack.kvevents.replay import contiguous_run, last_run_start, replay

__all__ = [
    "RESOLVE_BACKOFF",
    "EventSource",
    "KVEventObserver",
    "KVEventSink",
    "KVEventSubscriber",
    "SeqVerdict",
    "SequenceTracker",
    "resolve_sources",
]

log = logging.getLogger(__name__)

_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]")
# Asking an engine for its event sources again: 0.5 s doubling to 30 s, +-20% so routers do not ask in step.
RESOLVE_BACKOFF: Final = Backoff(0.5, 30.0, jitter=(0.8, 1.2))


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
    """The event sources in an engine's ``/kv_event_sources`` answer.

    Two shapes: vLLM 0.32's ``{rank: KVEventsConfig}``, where each rank's TCP port is rank 0's plus the
    rank, and later vLLM's list of resolved endpoints ``[{"data_parallel_rank", "endpoint",
    "replay_endpoint", "topic"}]`` (also wrapped as ``{"sources": [...]}``), used as given. Entries that
    disable events or name no endpoint are left out; wildcard hosts become the engine's host. Raises
    ValueError when the answer is neither shape.
    """
    if isinstance(sources, Mapping) and set(sources) == {"sources"}:
        sources = sources["sources"]
    if isinstance(sources, list):
        entries: list[tuple[object, object]] = []
        for index, cfg in enumerate(sources):
            if not isinstance(cfg, Mapping):
                raise ValueError(f"/kv_event_sources of {engine_url}: entry {index} is not an object")
            entries.append((cfg.get("data_parallel_rank"), cfg))
        per_rank_ports = False
    elif isinstance(sources, Mapping):
        entries = list(sources.items())
        per_rank_ports = True
    else:
        raise ValueError(f"/kv_event_sources of {engine_url} is neither a JSON object nor a list")
    out: list[EventSource] = []
    for rank_key, cfg in entries:
        if not isinstance(cfg, Mapping):
            raise ValueError(f"/kv_event_sources of {engine_url}: rank {rank_key} is not an object")
        if cfg.get("enable_kv_cache_events") is False or cfg.get("publisher", "zmq") != "zmq":
            continue
        endpoint = cfg.get("endpoint")
        if not isinstance(endpoint, str) or not endpoint:
            continue
        replay_ep = cfg.get("replay_endpoint")
        rank = _rank(rank_key)
        # vLLM 0.32 offsets each DP rank's TCP port but its config shows rank 0's; the list shape is resolved.
        offset = rank if per_rank_ports else None
        endpoint = replace_wildcard(_offset_port(endpoint, offset), engine_url)
        replay_endpoint = (
            replace_wildcard(_offset_port(replay_ep, offset), engine_url)
            if isinstance(replay_ep, str) and replay_ep
            else None
        )
        topic = cfg.get("topic")
        out.append(EventSource(endpoint, replay_endpoint, topic if isinstance(topic, str) else "", rank))
    return out


def _rank(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


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
    FIRST = "first"  # nothing received yet from this publisher (or since a reset)
    NEXT = "next"  # exactly the next batch
    ALREADY_APPLIED = "already_applied"  # a replay delivered it before SUB did
    DUPLICATE = "duplicate"  # the last batch again, or one just before it: skip
    GAP = "gap"  # batches between the last applied and this one are missing
    RESTART = "restart"  # seq went back: a new publisher


class SequenceTracker:
    """Per-source sequence state. Pure: the subscriber asks, acts, then records what it applied.

    The next seq is applied; one beyond it is a gap, filled by replay up to the live batch. A seq up to
    ``duplicate_window - 1`` below the last received one (not 0, not after a dropped connection) is a
    duplicate; one further back, back to 0, or back at all after a drop is a restart.
    """

    __slots__ = ("applied", "duplicate_window", "interrupted", "received")

    def __init__(self, duplicate_window: int = 16) -> None:
        self.received: int | None = None  # last seq seen on SUB
        self.applied: int | None = None  # last seq applied to the sink (SUB or replay)
        self.interrupted = False  # the connection dropped since the last message
        self.duplicate_window = duplicate_window

    def classify(self, seq: int) -> SeqVerdict:
        received, applied = self.received, self.applied
        if applied is None:
            return SeqVerdict.FIRST
        if received is not None and seq <= received:
            # Within one connection PUB/SUB cannot go back: a repeat comes from a proxy or a replay race.
            if seq > 0 and not self.interrupted and received - seq < self.duplicate_window:
                return SeqVerdict.DUPLICATE
            return SeqVerdict.RESTART
        if seq <= applied:
            return SeqVerdict.ALREADY_APPLIED
        if seq == applied + 1:
            return SeqVerdict.NEXT
        return SeqVerdict.GAP

    def disconnected(self) -> None:
        """The connection dropped: until the next message, a seq going back means a restart."""
        self.interrupted = True

    def forget(self) -> None:
        self.received = self.applied = None
        self.interrupted = False


def _block_count(batch: EventBatch) -> int:
    return sum(len(event.block_hashes) for event in batch.events if not isinstance(event, AllBlocksCleared))


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
        reconnect_ivl_max_ms: int = 1_000,
        resolve_backoff: Backoff = RESOLVE_BACKOFF,
        disconnect_grace: float = 3.0,
        duplicate_window: int = 16,
        max_message_bytes: int = 4 << 20,
        max_blocks_per_batch: int = 65_536,
    ) -> None:
        """``sources`` when configured; else ``fetch_sources`` (an async callable returning them) is
        retried with exponential backoff until it yields at least one source. The limits are described
        in the module docstring."""
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
        self.disconnect_grace = disconnect_grace
        self.duplicate_window = duplicate_window
        self.max_message_bytes = max_message_bytes
        self.max_blocks_per_batch = max_blocks_per_batch
        self.connected = False
        self.batches = 0
        self.duplicates = 0  # batches skipped as repeats of ones already applied
        self.unknown_events = 0  # events of a type kvstack does not know, skipped
        self._unknown_types: set[str] = set()
        self._closed = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None and not self._closed:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-events {self.engine}")

    def close(self) -> None:
        """Stop now: from here on the sink hears nothing from this subscriber (``stop`` also waits)."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()

    async def stop(self) -> None:
        self.close()
        task, self._task = self._task, None
        if task is not None:
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
        delays = self.resolve_backoff.sequence()
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
            await asyncio.sleep(delays.next())

    def _open_link(self, source: EventSource) -> _SubscriberLink:
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self.rcv_hwm)
        sub.setsockopt(zmq.RECONNECT_IVL, self.reconnect_ivl_ms)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, self.reconnect_ivl_max_ms)
        sub.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
        # A name of its own: pyzmq's default is made of the socket's FD, which a replaced socket may reuse
        # before ZMQ has released the old monitor's.
        monitor = sub.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED, f"inproc://kv-events-monitor-{next(_MONITOR_IDS)}"
        )
        sub.connect(source.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        return _SubscriberLink(sub, monitor, poller)

    async def _follow(self, source: EventSource) -> None:
        tracker = SequenceTracker(self.duplicate_window)
        loop = asyncio.get_running_loop()
        link = self._open_link(source)
        lost_at: float | None = None  # loop time the grace period ends while the connection is down
        try:
            while True:
                wait_ms = None if lost_at is None else max(0, math.ceil((lost_at - loop.time()) * 1000))
                ready = dict(await link.poller.poll(wait_ms))
                afresh = False  # the view was reset: unread messages of this link are stale
                # All pending monitor events first: a batch is judged after the drop that preceded it.
                while link.monitor in ready and _readable(link.monitor) and not afresh:
                    event = _monitor_event(await link.monitor.recv_multipart())
                    if event == zmq.EVENT_CONNECTED:
                        back_within_grace, lost_at = lost_at is not None, None
                        self.connected = True
                        self.observer.kv_connected(self.engine, True)
                        if source.replay_endpoint is not None and tracker.applied is None:
                            await self._catch_up(source, tracker)
                        elif source.replay_endpoint is not None and back_within_grace:
                            afresh = not await self._reconnected(source, tracker)
                    elif event == zmq.EVENT_DISCONNECTED:
                        self.connected = False
                        self.observer.kv_connected(self.engine, False)
                        tracker.disconnected()
                        lost_at = loop.time() + self.disconnect_grace
                if lost_at is not None and loop.time() >= lost_at:
                    self._connection_lost(source, tracker)
                    afresh = True
                if afresh:
                    # A fresh socket, here between two messages, never a disconnect of this one: libzmq
                    # aborts when a socket's pipe goes while a message it began to read (a poll prefetches
                    # one) is unread. It also recovers from a protocol error (a message over MAXMSGSIZE),
                    # after which ZMQ does not reconnect by itself; its first connection catches up.
                    link.close()
                    link = self._open_link(source)
                    lost_at = None
                elif link.sub in ready:
                    frames = await link.sub.recv_multipart()
                    await self._on_message(source, tracker, frames)
        finally:
            link.close()

    def _connection_lost(self, source: EventSource, tracker: SequenceTracker) -> None:
        """The connection stayed down past the grace period: the engine may be gone or restarting empty."""
        log.info(
            "engine %s: KV events from %s lost for over %.1fs; dropping its entries",
            self.engine,
            source.endpoint,
            self.disconnect_grace,
        )
        tracker.forget()
        self._reset("disconnected")

    async def _on_message(self, source: EventSource, tracker: SequenceTracker, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self.observer.kv_decode_error(self.engine)
            log.warning(
                "engine %s: KV event message with %d frames (expected 3); skipped", self.engine, len(frames)
            )
            return
        try:
            seq = decode_seq(frames[1])
            batch = decode_batch(frames[2], on_unknown=self._unknown_event)
        except KVEventDecodeError as exc:
            # The batch's changes are lost: treat it as missing so a later batch sees a gap.
            self.observer.kv_decode_error(self.engine)
            log.warning("engine %s: undecodable KV event message skipped: %s", self.engine, exc)
            return
        # Every block hash takes at least one byte: only a payload that long can hold too many blocks.
        if len(frames[2]) > self.max_blocks_per_batch and _block_count(batch) > self.max_blocks_per_batch:
            self.observer.kv_decode_error(self.engine)
            log.warning(
                "engine %s: KV event batch %d has more than %d blocks; skipped",
                self.engine,
                seq,
                self.max_blocks_per_batch,
            )
            return
        verdict = tracker.classify(seq)
        if verdict is SeqVerdict.NEXT:
            self._apply(tracker, seq, batch)
            tracker.received = seq
            tracker.interrupted = False
            return
        await self._resync(source, tracker, verdict, seq, batch)

    async def _resync(
        self, source: EventSource, tracker: SequenceTracker, verdict: SeqVerdict, seq: int, batch: EventBatch
    ) -> None:
        """Every verdict but NEXT: skip, reset, or fill what is missing before applying ``batch``."""
        tracker.interrupted = False
        if verdict is SeqVerdict.ALREADY_APPLIED:
            tracker.received = seq
            return
        if verdict is SeqVerdict.DUPLICATE:
            self.duplicates += 1
            log.debug("engine %s: KV event batch %d received again; skipped", self.engine, seq)
            return
        if verdict is SeqVerdict.RESTART:
            log.info("engine %s: KV event seq went back to %d: publisher restarted", self.engine, seq)
            self._reset("restart")
            tracker.forget()
            start = 0
        elif verdict is SeqVerdict.FIRST:
            # Nothing from this source is in the sink yet: rebuild from the oldest batch it can replay
            # (blocks stored before that stay unknown; never wrong). Other sources' entries stay.
            start = 0
        else:  # GAP
            assert tracker.applied is not None
            start = tracker.applied + 1
            self.observer.kv_gap(self.engine, seq - start)
            log.info("engine %s: KV events %d..%d missing", self.engine, start, seq - 1)
        filled = seq == start or (
            source.replay_endpoint is not None and await self._replay(source, tracker, start, seq, verdict)
        )
        if not filled and verdict is SeqVerdict.GAP:
            # Nothing fills the gap: the engine's entries may be stale (a missed BlockRemoved); drop them.
            self._reset("gap")
        self._apply(tracker, seq, batch)
        tracker.received = seq

    async def _replay(
        self, source: EventSource, tracker: SequenceTracker, start: int, seq: int, verdict: SeqVerdict
    ) -> bool:
        """Apply the replayed batches that lead up to ``seq``; True when they did.

        Only a contiguous run ending at ``seq - 1`` is applied, all or nothing. For a gap it must also
        begin at ``start``; for a fresh source it begins wherever the publisher's buffer does.
        """
        batches = await self._ask_replay(source, start, end_seq=seq)
        if batches is None:
            return False
        run = contiguous_run(batches, seq)
        leads_up = bool(run) and run[-1][0] == seq - 1
        from_start = bool(run) and run[0][0] == start
        self.observer.kv_replay(self.engine, "ok" if leads_up and from_start else "incomplete")
        if not leads_up or (verdict is SeqVerdict.GAP and not from_start):
            return False
        return self._apply_run(tracker, run)

    async def _catch_up(self, source: EventSource, tracker: SequenceTracker) -> None:
        """Apply everything the publisher buffers (a contiguous run), before any live batch."""
        batches = await self._ask_replay(source, 0, what="catch-up", level=logging.INFO)
        if batches is None:
            return
        run = contiguous_run(batches[-last_run_start(batches) :], end=2**63)
        if run:
            self._apply_run(tracker, run, result="catch_up")

    async def _reconnected(self, source: EventSource, tracker: SequenceTracker) -> bool:
        """Back within the grace period: asks the replay service at once, not at the next batch, for what
        follows the last applied seq. Nothing (its buffer ends before it, or is empty): a new publisher.
        A run from that seq or the next: the batches missed, applied. False when the view was reset."""
        assert tracker.applied is not None
        applied = tracker.applied
        batches = await self._ask_replay(source, applied, what="reconnect check", level=logging.INFO)
        if batches is None:  # the next batch decides, as without a replay service
            return True
        if not batches:
            log.info(
                "engine %s: KV event publisher %s restarted while disconnected", self.engine, source.endpoint
            )
            self._reset("restart")
            tracker.forget()
            return False
        if batches[0][0] > applied + 1:
            self.observer.kv_gap(self.engine, batches[0][0] - applied - 1)
            self.observer.kv_replay(self.engine, "incomplete")
            log.info(
                "engine %s: KV events %d..%d missed while disconnected",
                self.engine,
                applied + 1,
                batches[0][0] - 1,
            )
            self._reset("gap")
            tracker.forget()
            return False
        missed = [item for item in contiguous_run(batches, end=2**63) if item[0] > applied]
        if missed:
            self.observer.kv_gap(self.engine, len(missed))
            self._apply_run(tracker, missed, result="ok")
        return True

    async def _ask_replay(
        self,
        source: EventSource,
        start: int,
        *,
        end_seq: int | None = None,
        what: str = "replay",
        level: int = logging.WARNING,
    ) -> list[tuple[int, EventBatch]] | None:
        """The batches the publisher buffers from ``start`` (below ``end_seq``); None when asking failed."""
        assert source.replay_endpoint is not None
        try:
            result = await replay(
                self.context,
                source.replay_endpoint,
                start,
                end_seq=end_seq,
                timeout=self.replay_timeout,
                max_message_bytes=self.max_message_bytes,
                on_unknown=self._unknown_event,
            )
        except (TimeoutError, zmq.ZMQError) as exc:
            self.observer.kv_replay(self.engine, "failed")
            log.log(
                level,
                "engine %s: KV event %s from %s failed: %s",
                self.engine,
                what,
                source.replay_endpoint,
                exc,
            )
            return None
        for _ in range(result.decode_errors):
            self.observer.kv_decode_error(self.engine)
        return result.batches

    def _apply_run(
        self, tracker: SequenceTracker, run: list[tuple[int, EventBatch]], *, result: str | None = None
    ) -> bool:
        """Apply ``run`` unless a batch of it is over the block limit; ``result`` is reported first."""
        if any(_block_count(batch) > self.max_blocks_per_batch for _, batch in run):
            self.observer.kv_decode_error(self.engine)
            return False
        if result is not None:
            self.observer.kv_replay(self.engine, result)
        for seq, batch in run:
            self._apply(tracker, seq, batch)
        return True

    def _apply(self, tracker: SequenceTracker, seq: int, batch: EventBatch) -> None:
        if self._closed:  # an engine_removed ran while this message was in flight
            return
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
        if self._closed:
            return
        self.observer.kv_reset(self.engine, reason)
        self.sink.reset(self.engine, reason)

    def _unknown_event(self, type_name: str) -> None:
        self.unknown_events += 1
        if type_name in self._unknown_types or len(self._unknown_types) >= _MAX_UNKNOWN_TYPES_LOGGED:
            return
        self._unknown_types.add(type_name)
        log.warning(
            "engine %s: skipping KV events of unknown type %r (newer vLLM than kvstack knows?); "
            "further ones are counted, not logged",
            self.engine,
            type_name,
        )


_MAX_UNKNOWN_TYPES_LOGGED = 64  # a peer inventing type names must not grow the set without bound


_MONITOR_IDS = itertools.count()


@dataclass(slots=True)
class _SubscriberLink:
    """A SUB socket to one source with its connection monitor, replaced whole and never disconnected in
    place; only the task that reads it touches it."""

    sub: zmq.asyncio.Socket
    monitor: zmq.asyncio.Socket
    poller: zmq.asyncio.Poller

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.sub.disable_monitor()
        self.monitor.close(linger=0)
        self.sub.close(linger=0)


def _readable(sock: zmq.asyncio.Socket) -> bool:
    events = sock.get(zmq.EVENTS)
    return isinstance(events, int) and bool(events & zmq.POLLIN)


def _monitor_event(frames: list[bytes]) -> int | None:
    try:
        event: int = parse_monitor_message(frames)["event"]
    except Exception:  # pyzmq raises plain errors on odd frames; a monitor glitch is not worth dying for
        return None
    return event
