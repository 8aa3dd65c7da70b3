"""Build and run what both front ends share: side-call connections to engines, the fleet (registry with
circuit breakers, model discovery), scheduling (one `SchedulerPicker`), prefix knowledge (index, history,
KV-event and cache-event feeds), prompt tokenization, the metrics scraper (with `EngineRejoin` watching
engines go down and come back), discovery and admission.

The proxy (`kvstack.router.server`) and the Envoy picker (`kvstack.epp`) each build one `FrontEnd` from
their options, add their own serving part, then ``start()`` it; ``stop()`` undoes everything it started.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstack.engines.discovery import Discovery, DiscoveryUpdate, UpdateKind
from kvstack.engines.prompt_tokens import PromptTokenizer
from kvstack.engines.scraper import MetricsScraper
from kvstack.engines.state import Endpoint, EngineState
from kvstack.engines.tokenizer import load_tokenizer
from kvstack.frontend.admission import AdmissionController
from kvstack.frontend.circuit import CircuitConfig
from kvstack.frontend.fleet import EngineListener, Fleet
from kvstack.frontend.kv_feeds import CacheEvents, KVEventFeeds
from kvstack.frontend.metrics import RouterMetrics
from kvstack.frontend.prefix import PrefixLocator, PrefixSource
from kvstack.frontend.registry import EngineRegistry, InFlightTable
from kvstack.frontend.rejoin import EngineRejoin
from kvstack.frontend.routing import SchedulerPicker
from kvstack.http.client import UpstreamPool
from kvstack.index.history import HistoryIndex
from kvstack.index.prefix_index import PrefixIndex
from kvstack.scheduling import Scheduler, build_scheduler
from kvstack.scheduling.presets import load_routing

log = logging.getLogger(__name__)


@dataclass
class FrontEndOptions:
    engines: list[Endpoint] = field(default_factory=list)
    discovery: Discovery | None = None
    # A preset name or a YAML file; "auto": auto_routing's second while some engine publishes KV events,
    # else its first.
    routing: str = "auto"
    auto_routing: tuple[str, str] = ("default", "kv-aware")
    circuit: CircuitConfig = field(default_factory=CircuitConfig)
    max_in_flight: int = 0
    max_queue: int = 1024
    queue_timeout: float = 10.0
    expected_models: frozenset[str] = frozenset()
    scrape_interval: float = 1.0
    scrape_timeout: float = 0.5
    # Prompt tokenization for prefix routing: tokenizer directories by model ("*" = any model), and
    # whether to ask an engine's /tokenize for models without one.
    tokenizers: dict[str, str] = field(default_factory=dict)
    remote_tokenize: bool = True
    kv_events: bool = True  # subscribe to engines' KV events (configured or from /kv_event_sources)
    index_max_entries: int = 4_000_000  # (engine, block) entries in the prefix index
    history_max_blocks: int = 50_000  # per engine, for approximate prefix routing
    history_ttl: float = 600.0
    # Replaces the index-and-history locator as the source of prefix views (experiments: an oracle).
    prefix_source: PrefixSource | None = None
    # KV cache servers whose chunk events credit engines on their node (kvstack.frontend.prefix).
    cache_events: list[CacheEvents] = field(default_factory=list)


@dataclass
class FrontEnd:
    fleet: Fleet
    picker: SchedulerPicker
    locator: PrefixLocator
    prompts: PromptTokenizer
    admission: AdmissionController
    side_calls: UpstreamPool
    scraper: MetricsScraper
    feeds: KVEventFeeds | None
    options: FrontEndOptions

    @property
    def registry(self) -> EngineRegistry:
        return self.fleet.registry

    @property
    def metrics(self) -> RouterMetrics:
        return self.fleet.metrics

    def start(self) -> None:
        """Add the configured engines and caches, start discovery and the scraper (on the running loop)."""
        if self.feeds is not None:
            for cache in self.options.cache_events:
                self.feeds.cache_added(cache)
        for endpoint in self.options.engines:
            self.fleet.add_engine(endpoint)
        if self.options.discovery is not None:
            fleet = self.fleet

            def on_update(update: DiscoveryUpdate) -> None:
                if update.kind is UpdateKind.REMOVED:
                    fleet.remove_engine(update.endpoint.url)
                else:
                    fleet.add_engine(update.endpoint)

            self.options.discovery.start(on_update)
        self.scraper.start()

    async def stop(self) -> None:
        try:
            if self.options.discovery is not None:
                await self.options.discovery.stop()
            if self.feeds is not None:
                await self.feeds.stop()
            self.prompts.close()
            await self.scraper.stop()
            await self.fleet.close()
        finally:  # connections are released even when a step above failed or was cancelled
            await self.side_calls.close()

    def refresh_gauges(self) -> None:
        """Gauges read from other objects, before metrics are rendered."""
        self.fleet.refresh_gauges()
        self.metrics.queue_depth.set(self.admission.queued)
        self.metrics.prefix_index_entries.set(len(self.locator.index))
        self.metrics.prefix_index_evictions.set(self.locator.index.evicted_entries)


def build_front_end(
    opts: FrontEndOptions,
    metrics: RouterMetrics,
    *,
    shared_in_flight: InFlightTable | None = None,
    on_circuit_open: Callable[[str, float], None] | None = None,
    admission_limits: tuple[int, int] | None = None,
) -> FrontEnd:
    """Everything shared, built but not started. ``admission_limits``: (max in flight, max queued) of this
    process when they differ from the options' (a share of them, in a worker group)."""
    # The front end's own calls to engines use their own connections, so that thousands of proxied
    # streams cannot starve them (or their scrapes queue behind requests); each call has its own timeout.
    side_calls = UpstreamPool(idle_timeout=max(30.0, 3 * opts.scrape_interval))
    registry = EngineRegistry(
        opts.circuit, shared_in_flight=shared_in_flight, on_circuit_open=on_circuit_open
    )
    kv_scheduler: Scheduler | None = None
    if opts.routing == "auto":
        without_events, with_events = opts.auto_routing
        scheduler = build_scheduler(load_routing(without_events))
        kv_scheduler = build_scheduler(load_routing(with_events))
    else:
        scheduler = build_scheduler(load_routing(opts.routing))
    locator = PrefixLocator(
        PrefixIndex(opts.index_max_entries), HistoryIndex(opts.history_max_blocks, opts.history_ttl)
    )
    locator.on_dropped = metrics.prefix_dropped
    prompts = _prompt_tokenizer(opts, side_calls, registry, metrics)
    picker = SchedulerPicker(
        scheduler, kv_scheduler=kv_scheduler, prompts=prompts, locator=opts.prefix_source or locator
    )
    feeds = (
        KVEventFeeds(locator, side_calls, lambda url: _state(registry, url), observer=metrics)
        if opts.kv_events and picker.needs_prefix
        else None
    )
    # Until an engine's events are found, prefix routing knows it only from its own history.
    # (In "auto" routing, the fallback preset uses no prefix knowledge at all.)
    registry.default_knowledge = "approximate" if scheduler.needs_prefix else "none"
    # Without event feeds (which forget a removed engine's entries), the locator forgets its history.
    listener: EngineListener = _ForgetOnRemoval(locator) if feeds is None else feeds
    fleet = Fleet(
        registry,
        metrics,
        side_calls,
        expected_models=opts.expected_models,
        extra_state=lambda state: _prefix_state(state, feeds, locator),
        listeners=[listener],
    )
    max_in_flight, max_queue = admission_limits or (opts.max_in_flight, opts.max_queue)
    admission = AdmissionController(max_in_flight, max_queue, opts.queue_timeout)
    scraper = MetricsScraper(
        side_calls,
        registry.states,
        interval=opts.scrape_interval,
        timeout=opts.scrape_timeout,
        observer=metrics,
        watcher=EngineRejoin(registry, locator, metrics),
    )
    return FrontEnd(fleet, picker, locator, prompts, admission, side_calls, scraper, feeds, opts)


class _ForgetOnRemoval:
    """An engine listener dropping a removed engine's history: a new engine at its URL starts anew."""

    def __init__(self, locator: PrefixLocator) -> None:
        self._locator = locator

    def engine_added(self, endpoint: Endpoint) -> None:
        pass

    def engine_removed(self, url: str) -> None:
        self._locator.forget(url)


def _state(registry: EngineRegistry, url: str) -> EngineState | None:
    entry = registry.get(url)
    return None if entry is None else entry.state


def _prompt_tokenizer(
    opts: FrontEndOptions, client: UpstreamPool, registry: EngineRegistry, metrics: RouterMetrics
) -> PromptTokenizer:
    tokenizers = {model: load_tokenizer(path) for model, path in opts.tokenizers.items() if model != "*"}
    default = opts.tokenizers.get("*")

    def engines_for(model: str) -> list[str]:
        # Any routable engine serving the model renders it exactly as the one that will serve it. Those with
        # fresh metrics answered a scrape lately; a hung engine's scrapes time out, so it drops out here.
        serving = [
            s
            for s in registry.states()
            if s.routable and (not s.endpoint.models or model in s.endpoint.models)
        ]
        return [s.url for s in serving if not s.metrics_stale] or [s.url for s in serving]

    return PromptTokenizer(
        tokenizers,
        default=None if default is None else load_tokenizer(default),
        client=client if opts.remote_tokenize else None,
        engines_for=engines_for if opts.remote_tokenize else None,
        observe=metrics.tokenized,
    )


def _prefix_state(
    state: EngineState, feeds: KVEventFeeds | None, locator: PrefixLocator
) -> dict[str, object]:
    """The /engines detail of an engine's prefix knowledge."""
    sub = None if feeds is None else feeds.subscriber(state.url)
    return {
        "prefix_entries": locator.index.location_entries(state.url),
        "kv_events": None
        if sub is None or not sub.sources  # no events known (yet)
        else {
            "sources": [s.endpoint for s in sub.sources],
            "connected": sub.connected,
            "batches": sub.batches,
            "block_size": locator.block_size(state.url),
        },
    }
