"""Scrape every engine's /metrics on a timer; keep ``EngineState.metrics``, ``metrics_stale`` and ``healthy``.

Each round (every ``interval``) takes the current engines from ``states()`` and scrapes each after a random
delay in ``[0, jitter]``, through the `UpstreamPool` given (give it connections proxied traffic cannot
exhaust). A scrape is bounded by ``timeout`` from connect to the last byte (connecting alone by half of it)
and by ``max_bytes``; an engine whose scrape is still running is skipped for the round.

- success: a fresh ``MetricsReading``, ``metrics_stale`` = False, ``healthy`` = True.
- failure: the last reading goes stale after ``stale_after`` (stale signals read as unknown, never idle).
  ``unhealthy_after`` consecutive "connect" failures (nothing listens, connecting times out, unusable URL)
  set ``healthy`` = False; any other failure leaves health alone (the engine is there, its load unknown).
- down and back (``EngineWatcher``, after the engine answered once): a refused connect (nothing listens at
  the address: the process is gone) or ``unhealthy_after`` connect failures make it *down*; its next good
  scrape makes it *back* (a restarted engine rejoins within one interval plus jitter of answering).
Failure reasons (``ScrapeObserver.on_scrape``): ``timeout``, ``connect``, ``http_<status>``, ``too_large``,
``parse``, ``unknown_engine_type``, ``client_error``. An expected metric the engine lacks is logged once per
engine and name, with what was found instead, and reported through ``ScrapeObserver.on_missing``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from kvstack.engines.catalog import MetricCatalog, catalog_for
from kvstack.engines.metrics_reader import CatalogReading, MetricsParseError, read_signals
from kvstack.engines.state import EngineState, MetricsReading
from kvstack.http.client import (
    BodyTooLarge,
    ConnectFailed,
    ConnectTimedOut,
    UpstreamError,
    UpstreamPool,
    UpstreamTimeout,
)

__all__ = ["EngineWatcher", "MetricsScraper", "ScrapeObserver"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 16 * 1024 * 1024  # vLLM's dump is tens of KB; this only stops a runaway body
_ACCEPT_TEXT = (("Accept", "text/plain"),)


class ScrapeObserver(Protocol):
    """Told about every scrape, so the router can export scrape errors and missing names."""

    def on_scrape(self, engine: str, ok: bool, duration: float, error_reason: str | None) -> None:
        """After each scrape attempt; ``error_reason`` is None when ``ok``."""

    def on_missing(self, engine: str, names: frozenset[str]) -> None:
        """The full set of expected names ``engine`` lacks, whenever it changes (initially empty).

        Called with the empty set when the engine leaves, so its series can be dropped."""


class EngineWatcher(Protocol):
    """Told when an engine that answered before goes down and when it answers again (module docstring)."""

    def engine_down(self, state: EngineState) -> None: ...

    def engine_back(self, state: EngineState) -> None: ...


class ScrapeFailed(Exception):
    """A scrape that failed: ``reason`` is its label (module docstring), ``reached`` says the engine
    answered (a failure of its metrics, not of its health), ``absent`` that nothing listens there."""

    def __init__(self, reason: str, detail: str, *, reached: bool, absent: bool = False) -> None:
        super().__init__(detail)
        self.reason = reason
        self.reached = reached
        self.absent = absent


@dataclass
class _Track:
    """Per-engine bookkeeping, dropped when the engine leaves."""

    failures: int = 0  # consecutive scrapes that did not reach the engine
    failing: bool = False  # the last scrape failed (any reason); for one log line per outage
    answered: bool = False  # some scrape succeeded
    down: bool = False  # seen down since its last good scrape (EngineWatcher)
    missing: frozenset[str] = frozenset()
    warned: set[tuple[str, str | None]] = field(default_factory=set)  # (name, alias read instead)


class MetricsScraper:
    """Keeps the load signals of the engines ``states()`` returns fresh; see the module docstring."""

    def __init__(
        self,
        client: UpstreamPool,
        states: Callable[[], Iterable[EngineState]],
        *,
        interval: float = 1.0,
        timeout: float = 0.5,
        jitter: float | None = None,
        stale_after: float | None = None,
        unhealthy_after: int = 5,
        max_bytes: int = DEFAULT_MAX_BYTES,
        observer: ScrapeObserver | None = None,
        watcher: EngineWatcher | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if interval <= 0 or timeout <= 0 or unhealthy_after < 1 or max_bytes < 1:
            raise ValueError("interval, timeout, unhealthy_after and max_bytes must be positive")
        self._client = client
        self._states = states
        self.interval = interval
        self.timeout = timeout
        self.jitter = 0.2 * interval if jitter is None else max(0.0, jitter)
        self.stale_after = 3 * interval if stale_after is None else stale_after
        self.unhealthy_after = unhealthy_after
        self.max_bytes = max_bytes
        self._observer = observer
        self._watcher = watcher
        self._rng = rng or random.Random()
        self._tracks: dict[str, _Track] = {}
        self._inflight: dict[str, asyncio.Task[None]] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start scraping in the background (inside a running event loop)."""
        if self._task is not None:
            raise RuntimeError("MetricsScraper already started")
        self._task = asyncio.get_running_loop().create_task(self._run(), name="metrics-scraper")

    async def stop(self) -> None:
        """Stop the timer and every scrape in flight, and wait for them."""
        tasks = [t for t in (self._task, *self._inflight.values()) if t is not None]
        self._task = None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._inflight.clear()

    async def scrape_once(self) -> None:
        """One round now, without jitter, waiting for every scrape (joins one already in flight)."""
        current = self._reconcile()
        for url, state in current.items():
            if url not in self._inflight:
                self._launch(state, delay=0.0)
        if self._inflight:
            await asyncio.wait(list(self._inflight.values()))
        self._refresh_staleness(current.values())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_round = loop.time()
        while True:
            try:
                current = self._reconcile()
                for url, state in current.items():
                    if url in self._inflight:
                        logger.debug("engine %s: previous scrape still running; skipping a round", url)
                        continue
                    self._launch(state, delay=self._rng.uniform(0.0, self.jitter))
                self._refresh_staleness(current.values())
            except Exception:
                # A bug in one round (or in states()) must not stop load signals for good.
                logger.exception("metrics scrape round failed")
            next_round += self.interval
            # After a long stall (suspended process), start afresh instead of firing rounds back to back.
            next_round = max(next_round, loop.time())
            await asyncio.sleep(next_round - loop.time())

    def _reconcile(self) -> dict[str, EngineState]:
        """The current engines by URL; forget the ones that left."""
        current = {s.url: s for s in self._states()}
        for url in [u for u in self._tracks if u not in current]:
            track = self._tracks.pop(url)
            if (task := self._inflight.pop(url, None)) is not None:
                task.cancel()
            if track.missing:
                self._notify_missing(url, frozenset())
        for url in current:
            self._tracks.setdefault(url, _Track())
        return current

    def _launch(self, state: EngineState, delay: float) -> None:
        url = state.url
        task = asyncio.get_running_loop().create_task(self._scrape(state, delay), name=f"scrape {url}")
        self._inflight[url] = task

        def done(t: asyncio.Task[None]) -> None:
            if self._inflight.get(url) is t:
                del self._inflight[url]

        task.add_done_callback(done)

    def _refresh_staleness(self, states: Iterable[EngineState]) -> None:
        now = time.monotonic()
        for state in states:
            state.metrics_stale = state.metrics is None or state.metrics.age(now) > self.stale_after

    async def _scrape(self, state: EngineState, delay: float) -> None:
        if delay > 0:
            await asyncio.sleep(delay)
        url = state.url
        started = time.monotonic()
        try:
            text = await self._fetch(url)
            catalog = self._catalog(state)
            try:
                reading = read_signals(text, catalog)
            except MetricsParseError as exc:
                raise ScrapeFailed("parse", str(exc), reached=True) from exc
        except ScrapeFailed as failed:
            self._failed(state, failed, time.monotonic() - started)
        except Exception as exc:  # an unforeseen error must cost one scrape, not the engine's signals
            logger.exception("engine %s: metrics scrape failed unexpectedly", url)
            unforeseen = ScrapeFailed("client_error", repr(exc), reached=False)
            self._failed(state, unforeseen, time.monotonic() - started)
        else:
            self._succeeded(state, catalog, reading, started)

    def _catalog(self, state: EngineState) -> MetricCatalog:
        # Without a known version the newest catalog applies; its aliases cover older names.
        try:
            return catalog_for(state.endpoint.engine_type, state.endpoint.engine_version)
        except ValueError as exc:
            raise ScrapeFailed("unknown_engine_type", str(exc), reached=True) from exc

    async def _fetch(self, url: str) -> str:
        try:
            reply = await self._client.get(
                url,
                "/metrics",
                headers=_ACCEPT_TEXT,
                within=self.timeout,
                # A host that drops packets (the connect never completes) fails as "connect", which marks
                # the engine unhealthy, not as "timeout", which only makes its load unknown.
                connect_timeout=self.timeout / 2,
                max_bytes=self.max_bytes,
            )
        except ConnectTimedOut as exc:
            raise ScrapeFailed("connect", str(exc), reached=False) from exc
        except ConnectFailed as exc:
            raise ScrapeFailed("connect", str(exc), reached=False, absent=True) from exc
        except UpstreamTimeout as exc:
            raise ScrapeFailed("timeout", str(exc), reached=False) from exc
        except BodyTooLarge as exc:
            if exc.status != 200:
                raise ScrapeFailed(
                    f"http_{exc.status}", f"/metrics answered {exc.status}", reached=False
                ) from exc
            raise ScrapeFailed("too_large", str(exc), reached=True) from exc
        except UpstreamError as exc:
            raise ScrapeFailed("client_error", str(exc), reached=False) from exc
        if reply.status != 200:
            raise ScrapeFailed(f"http_{reply.status}", f"/metrics answered {reply.status}", reached=False)
        return reply.body.decode("utf-8", errors="replace")

    def _succeeded(
        self, state: EngineState, catalog: MetricCatalog, reading: CatalogReading, started: float
    ) -> None:
        url = state.url
        now = time.monotonic()
        state.metrics = MetricsReading(reading.signals, now, reading.missing, reading.aliases_used)
        state.metrics_stale = False
        state.healthy = True
        state.in_flight_at_scrape = state.total_in_flight
        track = self._tracks.get(url)
        if track is None:  # the engine left while it was being scraped
            return
        if track.failing:
            logger.info("engine %s: metrics scrape succeeds again", url)
        track.failures, track.failing, track.answered = 0, False, True
        if track.down:
            track.down = False
            logger.info("engine %s answers again after it was down", url)
            self._watch(state, back=True)
        for gap in reading.gaps:
            # Once per name, and again only if what stands in for it changes (a legacy alias vanishes).
            key = (gap.name, gap.found_instead.name if gap.found_instead else None)
            if key not in track.warned:
                track.warned.add(key)
                logger.warning(gap.message(url, catalog.engine_type))
        if reading.missing != track.missing:
            track.missing = reading.missing
            self._notify_missing(url, reading.missing)
        self._notify_scrape(url, True, now - started, None)

    def _failed(self, state: EngineState, failed: ScrapeFailed, duration: float) -> None:
        url = state.url
        track = self._tracks.get(url)
        if track is not None:
            if not track.failing:
                # One line per outage; the observer counts every failure.
                logger.warning(
                    "engine %s: metrics scrape failed (%s: %s); its load counts as unknown after %g s",
                    url,
                    failed.reason,
                    failed,
                    self.stale_after,
                )
            track.failing = True
            if failed.reason != "connect":
                # The engine is there: a slow or failing /metrics makes its load unknown (stale), not the
                # engine unroutable. A hung engine is the proxy's business: its timeouts open the circuit.
                track.failures = 0
            else:
                track.failures += 1
                if track.failures >= self.unhealthy_after and state.healthy:
                    logger.warning(
                        "engine %s: %d metrics scrapes in a row failed; marking it unhealthy",
                        url,
                        track.failures,
                    )
                    state.healthy = False
                if (failed.absent or not state.healthy) and track.answered and not track.down:
                    track.down = True
                    self._watch(state, back=False)
        self._refresh_staleness((state,))
        self._notify_scrape(url, False, duration, failed.reason)

    def _notify_scrape(self, url: str, ok: bool, duration: float, reason: str | None) -> None:
        if self._observer is not None:
            with _observer_guard():
                self._observer.on_scrape(url, ok, duration, reason)

    def _watch(self, state: EngineState, *, back: bool) -> None:
        if self._watcher is not None:
            with _observer_guard():
                if back:
                    self._watcher.engine_back(state)
                else:
                    self._watcher.engine_down(state)

    def _notify_missing(self, url: str, names: frozenset[str]) -> None:
        if self._observer is not None:
            with _observer_guard():
                self._observer.on_missing(url, names)


@contextlib.contextmanager
def _observer_guard() -> Iterator[None]:
    # A broken metrics exporter must not stop the load signals the router schedules with.
    try:
        yield
    except Exception:
        logger.exception("scrape observer failed")
