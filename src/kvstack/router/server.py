"""Assemble and run the router: two connection pools (proxied requests; side calls to engines: scrapes,
/v1/models, /tokenize, /kv_event_sources), the registry, scheduling, proxy, admission, metrics and the
engine-state background tasks, all built here and passed in (no globals).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from kvstack.engines.discovery import Discovery, DiscoveryUpdate, UpdateKind
from kvstack.engines.prompt_tokens import PromptTokenizer
from kvstack.engines.scraper import MetricsScraper
from kvstack.engines.state import Endpoint, EngineState
from kvstack.engines.tokenizer import load_tokenizer
from kvstack.http.client import UpstreamPool
from kvstack.http.server import HttpServer
from kvstack.index.history import HistoryIndex
from kvstack.index.prefix_index import PrefixIndex
from kvstack.router.admission import AdmissionController
from kvstack.router.app import RouterApp, RouterConfig
from kvstack.router.circuit import CircuitConfig
from kvstack.router.kv_feeds import CacheEvents, KVEventFeeds
from kvstack.router.metrics import RouterMetrics
from kvstack.router.prefix import PrefixLocator, PrefixSource
from kvstack.router.proxy import Proxy, RetryPolicy
from kvstack.router.registry import EngineRegistry
from kvstack.router.routing import SchedulerPicker
from kvstack.router.workers import WorkerGroup, WorkerGroupConfig
from kvstack.scheduling import Scheduler, build_scheduler
from kvstack.scheduling.presets import load_routing

log = logging.getLogger(__name__)


@dataclass
class RouterOptions:
    host: str = "127.0.0.1"
    port: int = 8080
    engines: list[Endpoint] = field(default_factory=list)
    discovery: Discovery | None = None
    # A preset name or a YAML file; "auto": kv-aware while some engine publishes KV events, else default.
    routing: str = "auto"
    app: RouterConfig = field(default_factory=RouterConfig)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    circuit: CircuitConfig = field(default_factory=CircuitConfig)
    max_in_flight: int = 0
    max_queue: int = 1024
    queue_timeout: float = 10.0
    expected_models: frozenset[str] = frozenset()
    scrape_interval: float = 1.0
    scrape_timeout: float = 0.5
    # Share the port between several router processes (SO_REUSEPORT).
    reuse_port: bool = False
    connection_limit: int = 0  # upstream connections in total; 0 = unlimited
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
    # KV cache servers whose chunk events credit engines on their node (kvstack.router.prefix).
    cache_events: list[CacheEvents] = field(default_factory=list)
    # This process is one of several router workers on the port (set by the --workers supervisor).
    group: WorkerGroupConfig | None = None


@dataclass
class RunningRouter:
    url: str
    app: RouterApp
    server: HttpServer
    side_calls: UpstreamPool
    scraper: MetricsScraper
    discovery: Discovery | None = None
    feeds: KVEventFeeds | None = None
    prompts: PromptTokenizer | None = None
    locator: PrefixLocator | None = None
    group: WorkerGroup | None = None
    upstream: UpstreamPool | None = None

    async def stop(self) -> None:
        try:
            if self.discovery is not None:
                await self.discovery.stop()
            if self.group is not None:
                await self.group.stop()
            if self.feeds is not None:
                await self.feeds.stop()
            if self.prompts is not None:
                self.prompts.close()
            await self.scraper.stop()
            await self.server.close()
            await self.app.close()
        finally:  # connections are released even when a step above failed or was cancelled
            if self.upstream is not None:
                await self.upstream.close()
            await self.side_calls.close()


async def start_router(opts: RouterOptions) -> RunningRouter:
    upstream = UpstreamPool(max_connections=opts.connection_limit)
    # The router's own calls to engines use their own connections, so that thousands of proxied streams
    # cannot starve them (or their scrapes queue behind requests); each call has its own timeout.
    side_calls = UpstreamPool(idle_timeout=max(30.0, 3 * opts.scrape_interval))
    group = None if opts.group is None else WorkerGroup(opts.group)
    registry = EngineRegistry(
        opts.circuit,
        shared_in_flight=None if group is None else group.in_flight,
        on_circuit_open=None if group is None else _circuit_broadcaster(group),
    )
    metrics = RouterMetrics(
        None if opts.group is None else (opts.group.directory, opts.group.index, opts.group.count)
    )
    kv_scheduler: Scheduler | None = None
    if opts.routing == "auto":
        scheduler = build_scheduler(load_routing("default"))
        kv_scheduler = build_scheduler(load_routing("kv-aware"))
    else:
        scheduler = build_scheduler(load_routing(opts.routing))
    locator = PrefixLocator(
        PrefixIndex(opts.index_max_entries), HistoryIndex(opts.history_max_blocks, opts.history_ttl)
    )
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
    proxy = Proxy(upstream, registry, metrics, timeouts=opts.app.timeouts, retry=opts.retry)
    max_in_flight, max_queue = opts.max_in_flight, opts.max_queue
    if opts.group is not None:  # router-wide limits, shared out between the workers
        max_in_flight, max_queue = opts.group.limit(max_in_flight), opts.group.limit(max_queue)
    admission = AdmissionController(max_in_flight, max_queue, opts.queue_timeout)
    router = RouterApp(
        opts.app,
        registry,
        picker,
        proxy,
        admission,
        metrics,
        side_calls,
        expected_models=opts.expected_models,
        extra_state=lambda state: _prefix_state(state, feeds, locator),
        # Without event feeds (which forget a removed engine's entries), the locator forgets its history.
        listeners=[_ForgetOnRemoval(locator)] if feeds is None else [feeds],
        group=group,
        on_metrics=lambda: _index_gauges(metrics, locator),
    )
    # A client that disconnects cancels its handler, which closes the upstream request.
    server = router.server()
    try:
        if group is not None:
            await group.start()
        sock = _bind(opts.host, opts.port, reuse_port=opts.reuse_port)
        await server.start(sock)
    except BaseException:
        await server.close()
        await upstream.close()
        await side_calls.close()
        if group is not None:
            await group.stop()
        raise
    if feeds is not None:
        for cache in opts.cache_events:
            feeds.cache_added(cache)
    for endpoint in opts.engines:
        router.add_engine(endpoint)
    if opts.discovery is not None:

        def on_update(update: DiscoveryUpdate) -> None:
            if update.kind is UpdateKind.REMOVED:
                router.remove_engine(update.endpoint.url)
            else:
                router.add_engine(update.endpoint)

        opts.discovery.start(on_update)
    scraper = MetricsScraper(
        side_calls,
        registry.states,
        interval=opts.scrape_interval,
        timeout=opts.scrape_timeout,
        observer=metrics,
    )
    scraper.start()
    port = sock.getsockname()[1]
    return RunningRouter(
        f"http://{opts.host}:{port}",
        router,
        server,
        side_calls,
        scraper,
        opts.discovery,
        feeds,
        prompts,
        locator,
        group,
        upstream,
    )


def _circuit_broadcaster(group: WorkerGroup) -> Callable[[str, float], None]:
    """A breaker hook that opens the same engine's breakers in the sibling workers."""
    pending: set[asyncio.Task[int]] = set()

    def opened(url: str, seconds: float) -> None:
        task = asyncio.get_running_loop().create_task(
            group.broadcast("circuit-open", {"url": url, "seconds": seconds})
        )
        pending.add(task)
        task.add_done_callback(pending.discard)

    return opened


class _ForgetOnRemoval:
    """An engine listener dropping a removed engine's history: a new engine at its URL starts anew."""

    def __init__(self, locator: PrefixLocator) -> None:
        self._locator = locator

    def engine_added(self, endpoint: Endpoint) -> None:
        pass

    def engine_removed(self, url: str) -> None:
        self._locator.forget(url)


def _index_gauges(metrics: RouterMetrics, locator: PrefixLocator) -> None:
    metrics.prefix_index_entries.set(len(locator.index))
    metrics.prefix_index_evictions.set(locator.index.evicted_entries)


def _state(registry: EngineRegistry, url: str) -> EngineState | None:
    entry = registry.get(url)
    return None if entry is None else entry.state


def _prompt_tokenizer(
    opts: RouterOptions, client: UpstreamPool, registry: EngineRegistry, metrics: RouterMetrics
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
        "kv_events": None
        if sub is None or not sub.sources  # no events known (yet)
        else {
            "sources": [s.endpoint for s in sub.sources],
            "connected": sub.connected,
            "batches": sub.batches,
            "block_size": locator.block_size(state.url),
        }
    }


def _bind(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(4096)
    sock.setblocking(False)
    return sock


@contextlib.asynccontextmanager
async def running_router(opts: RouterOptions) -> AsyncIterator[RunningRouter]:
    router = await start_router(opts)
    try:
        yield router
    finally:
        await router.stop()


def settle_garbage_collector() -> None:
    """Move everything built at start (tokenizers, templates, metric families, indexes) out of the collector's
    sight, so a full collection scans only what requests made since: a full pass over the start-up heap
    paused the event loop for tens of milliseconds at a time, which is every request's tail latency."""
    gc.collect()
    gc.freeze()


async def serve_forever(opts: RouterOptions) -> None:
    async with running_router(opts) as router:
        settle_garbage_collector()
        log.info("router listening on %s", router.url)
        print(
            f"kvstack router: {router.url}/v1 ({len(opts.engines)} engine(s), routing {opts.routing!r})",
            flush=True,
        )
        await asyncio.Event().wait()
