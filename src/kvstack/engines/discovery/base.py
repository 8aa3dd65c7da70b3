"""Engine discovery's contract: a source publishes per-endpoint updates, keyed by URL.

``start(on_update)`` calls ``on_update`` with ``DiscoveryUpdate`` events (ADDED, UPDATED, REMOVED). Applying
them in order keeps a registry equal to ``endpoints()``; within one change removals come first. A different
instance at a known URL (a new pod with an old pod's IP) is REMOVED then ADDED, so no runtime state carries
over. An endpoint whose source names no models is published without them while ``fetch_models(url)`` (the
router's /v1/models client) is asked in the background, retried with ``model_backoff`` while the endpoint
exists; its answer arrives as UPDATED. Each source runs as one asyncio task plus model fetches; no threads.
"""

from __future__ import annotations

import abc
import asyncio
import enum
import logging
import random
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, replace

from kvstack.backoff import Backoff
from kvstack.engines.state import Endpoint

log = logging.getLogger(__name__)

# Re-lists and /v1/models retries; the jitter keeps many routers from retrying in lockstep after an outage.
RETRY_BACKOFF = Backoff(0.5, 30.0, jitter=(0.5, 1.0))
# A fetcher that never answers must not pin an endpoint at "no models" forever; it is retried instead.
MODEL_FETCH_TIMEOUT_S = 10.0


class UpdateKind(enum.Enum):
    ADDED = "added"
    UPDATED = "updated"
    REMOVED = "removed"


@dataclass(frozen=True, slots=True)
class DiscoveryUpdate:
    """One change to the set of endpoints; for REMOVED, ``endpoint`` is the one last published."""

    kind: UpdateKind
    endpoint: Endpoint


UpdateCallback = Callable[[DiscoveryUpdate], None]
ModelFetcher = Callable[[str], Awaitable[Collection[str]]]


class DiscoveryConfigError(ValueError):
    """Engines given to discovery that cannot be used; the message says where and what is wrong."""


class Discovery(abc.ABC):
    """A source of engine endpoints. Call ``start(on_update)`` once and ``await stop()`` once."""

    def __init__(
        self, *, fetch_models: ModelFetcher | None = None, model_backoff: Backoff = RETRY_BACKOFF
    ) -> None:
        self._fetch_models = fetch_models
        self._model_backoff = model_backoff
        self._rng = random.Random()
        self._on_update: UpdateCallback | None = None
        self._task: asyncio.Task[None] | None = None
        self._synced = asyncio.Event()
        self._declared: dict[str, Endpoint] = {}  # what the source says now, by URL
        self._instances: dict[str, str] = {}  # URL -> instance id of the declared endpoint
        self._published: dict[str, Endpoint] = {}  # what on_update has been told
        self._published_instances: dict[str, str] = {}
        self._fetched: dict[str, frozenset[str]] = {}  # URL -> /v1/models answer for the current instance
        self._fetching: dict[str, asyncio.Task[None]] = {}

    def start(self, on_update: UpdateCallback) -> None:
        """Begin reading the source in a background task; ``on_update`` is called from that task."""
        if self._task is not None:
            raise RuntimeError(f"{self.describe()} was already started")
        self._on_update = on_update
        self._task = asyncio.create_task(self._main(), name=f"discovery {self.describe()}")

    async def stop(self) -> None:
        """Cancel the source task and model fetches; no updates are sent afterwards."""
        tasks = [t for t in (self._task, *self._fetching.values()) if t is not None]
        self._on_update = None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._fetching.clear()

    def endpoints(self) -> dict[str, Endpoint]:
        """The endpoints published so far, by URL."""
        return dict(self._published)

    async def wait_synced(self) -> None:
        """Return once the source has been read once (file: first attempt; Kubernetes: first list)."""
        await self._synced.wait()

    @abc.abstractmethod
    def describe(self) -> str:
        """A short human name of the source for logs."""

    @abc.abstractmethod
    async def _run(self) -> None:
        """Read the source and call ``_publish`` on every change; runs until cancelled."""

    async def _main(self) -> None:
        try:
            await self._run()
        except asyncio.CancelledError:
            raise
        except Exception:
            # A bug in a source must be loud: a silently frozen registry keeps routing to dead engines.
            log.exception("discovery %s stopped on an unexpected error", self.describe())
            raise

    def _publish(self, declared: Mapping[str, Endpoint], instances: Mapping[str, str] | None = None) -> None:
        """Make ``declared`` (by URL; instance id per URL, default the URL) current and emit the diff."""
        self._declared = dict(declared)
        self._instances = dict(instances) if instances is not None else {url: url for url in declared}
        self._reconcile()
        self._synced.set()

    def _reconcile(self) -> None:
        for url in sorted(self._published):
            if url not in self._declared or self._instances[url] != self._published_instances[url]:
                self._fetched.pop(url, None)
                fetch = self._fetching.pop(url, None)
                if fetch is not None:
                    fetch.cancel()
                del self._published_instances[url]
                self._emit(DiscoveryUpdate(UpdateKind.REMOVED, self._published.pop(url)))
        for url in sorted(self._declared):
            endpoint = self._declared[url]
            if not endpoint.models:
                if url in self._fetched:
                    endpoint = replace(endpoint, models=self._fetched[url])
                elif self._fetch_models is not None and url not in self._fetching:
                    self._fetching[url] = asyncio.create_task(
                        self._resolve_models(url, self._instances[url]), name=f"models of {url}"
                    )
            old = self._published.get(url)
            self._published[url] = endpoint
            self._published_instances[url] = self._instances[url]
            if old is None:
                self._emit(DiscoveryUpdate(UpdateKind.ADDED, endpoint))
            elif old != endpoint:
                self._emit(DiscoveryUpdate(UpdateKind.UPDATED, endpoint))

    def _emit(self, update: DiscoveryUpdate) -> None:
        if self._on_update is None:
            return
        try:
            self._on_update(update)
        except Exception:
            # The consumer's bug must not stop discovery; the next update may still apply.
            log.exception("discovery %s: on_update failed for %s", self.describe(), update)

    async def _resolve_models(self, url: str, instance: str) -> None:
        assert self._fetch_models is not None
        attempt = 0
        while True:
            try:
                async with asyncio.timeout(MODEL_FETCH_TIMEOUT_S):
                    models = frozenset(await self._fetch_models(url))
                break
            except Exception as e:
                delay = self._model_backoff.delay(attempt, self._rng)
                # First failure is a warning; repeats of a down engine would otherwise flood the log.
                level = logging.WARNING if attempt == 0 else logging.DEBUG
                log.log(
                    level,
                    "engine %s: /v1/models failed (%r); published without models, retrying in %.1f s",
                    url,
                    e,
                    delay,
                )
                attempt += 1
                await asyncio.sleep(delay)
        if attempt:
            log.info("engine %s: /v1/models answered after %d failures: %s", url, attempt, sorted(models))
        if self._fetching.get(url) is asyncio.current_task():
            del self._fetching[url]
        if url in self._declared and self._instances[url] == instance:
            self._fetched[url] = models
            self._reconcile()


def by_url(endpoints: list[Endpoint], where: str) -> dict[str, Endpoint]:
    """``endpoints`` keyed by URL; ``DiscoveryConfigError`` when a URL is listed twice."""
    out: dict[str, Endpoint] = {}
    for endpoint in endpoints:
        if endpoint.url in out:
            raise DiscoveryConfigError(f"{where}: engine {endpoint.url} is listed twice")
        out[endpoint.url] = endpoint
    return out
