"""One KV-event subscriber per engine and per cache server, started and stopped as they come and go.

An engine's events come from its configured endpoint (``Endpoint.kv_events_endpoint``), else from what its
``/kv_event_sources`` names (a side call through the router's `UpstreamPool`, within ``sources_timeout``;
asked again with ``resolve_backoff`` until it names a source); once sources are known the engine's routing
knowledge is "kv-events". Removing an engine closes its subscriber at once and drops its index entries, so an
engine added again under the same URL starts clean. A cache server's stream (`CacheEvents`) is indexed as the
location ``cache+<endpoint>`` on its node.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import zmq.asyncio

from kvstack.backoff import Backoff
from kvstack.engines.state import Endpoint, EngineState
from kvstack.frontend.prefix import PrefixLocator
from kvstack.http.client import UpstreamError, UpstreamPool
from kvstack.kvevents.subscriber import (
    RESOLVE_BACKOFF,
    EventSource,
    KVEventObserver,
    KVEventSubscriber,
    resolve_sources,
)

log = logging.getLogger(__name__)

__all__ = ["CacheEvents", "KVEventFeeds"]

SOURCES_MAX_BYTES = 1 << 20  # one small object per data-parallel rank


@dataclass(frozen=True, slots=True)
class CacheEvents:
    """A KV cache server's event stream (``kvstack cache-server --events``) and the node it runs on."""

    endpoint: str
    node: str | None = None
    replay_endpoint: str | None = None

    @property
    def location(self) -> str:
        return f"cache+{self.endpoint}"

    @classmethod
    def parse(cls, spec: str) -> CacheEvents:
        """``tcp://host:port[#node=N,replay=tcp://host:port]``; ValueError names what is wrong."""
        endpoint, _, options = spec.partition("#")
        if not endpoint.startswith(("tcp://", "ipc://")):
            raise ValueError(f"cache events {spec!r}: the endpoint must be tcp://host:port or ipc://path")
        fields: dict[str, str] = {}
        for part in filter(None, options.split(",")):
            key, sep, value = part.partition("=")
            if not sep or key not in ("node", "replay"):
                raise ValueError(f"cache events {spec!r}: unknown option {part!r}; known: node, replay")
            fields[key] = value
        return cls(endpoint, fields.get("node"), fields.get("replay"))


class KVEventFeeds:
    def __init__(
        self,
        locator: PrefixLocator,
        client: UpstreamPool,
        state_of: Callable[[str], EngineState | None],
        *,
        observer: KVEventObserver | None = None,
        sources_timeout: float = 2.0,
        resolve_backoff: Backoff = RESOLVE_BACKOFF,
    ) -> None:
        self.locator = locator
        self.client = client
        self.state_of = state_of
        self.observer = observer
        self.sources_timeout = sources_timeout
        self.resolve_backoff = resolve_backoff
        self.context = zmq.asyncio.Context()
        self._subscribers: dict[str, tuple[str | None, KVEventSubscriber]] = {}
        self._stopping: set[asyncio.Task[None]] = set()

    def subscriber(self, url: str) -> KVEventSubscriber | None:
        entry = self._subscribers.get(url)
        return None if entry is None else entry[1]

    def engine_added(self, endpoint: Endpoint) -> None:
        """Subscribe to a new engine, or resubscribe when its configured endpoint changed."""
        url = endpoint.url
        existing = self._subscribers.get(url)
        if existing is not None:
            if existing[0] == endpoint.kv_events_endpoint:
                return
            self.engine_removed(url)
        configured = endpoint.kv_events_endpoint
        sub = KVEventSubscriber(
            url,
            self.locator,
            context=self.context,
            sources=[EventSource(configured)] if configured else (),
            fetch_sources=None if configured else lambda: self._fetch_sources(url),
            observer=self.observer,
            resolve_backoff=self.resolve_backoff,
        )
        self._subscribers[url] = (configured, sub)
        if configured:
            self._mark(url)
        sub.start()

    def cache_added(self, source: CacheEvents) -> str:
        """Subscribe to a KV cache server's chunk events; returns its index location name."""
        location = source.location
        self.locator.add_cache(location, source.node)
        sub = KVEventSubscriber(
            location,
            self.locator,
            context=self.context,
            sources=[EventSource(source.endpoint, source.replay_endpoint)],
            observer=self.observer,
            resolve_backoff=self.resolve_backoff,
        )
        self._subscribers[location] = (source.endpoint, sub)
        sub.start()
        return location

    def engine_removed(self, url: str) -> None:
        """Stop the engine's subscriber and drop its entries; no event of it reaches the index after this."""
        entry = self._subscribers.pop(url, None)
        if entry is not None:
            entry[1].close()  # at once: a message already in flight must not re-create the entries
            task = asyncio.get_running_loop().create_task(entry[1].stop())
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)
        self.locator.forget(url)

    async def _fetch_sources(self, url: str) -> list[EventSource]:
        reply = await self.client.get(
            url, "/kv_event_sources", within=self.sources_timeout, max_bytes=SOURCES_MAX_BYTES
        )
        if reply.status == 404:
            return []  # an engine without the endpoint (not vLLM, or older): no events
        if reply.status >= 400:
            raise UpstreamError(f"/kv_event_sources answered HTTP {reply.status}")
        sources = resolve_sources(url, reply.json())
        if sources:
            self._mark(url)
        return sources

    def _mark(self, url: str) -> None:
        state = self.state_of(url)
        if state is not None:
            state.knowledge = "kv-events"

    async def stop(self) -> None:
        for url in list(self._subscribers):
            self.engine_removed(url)
        await asyncio.gather(*self._stopping)
        self.context.destroy(linger=0)
