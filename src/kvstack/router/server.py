"""Assemble and run the router: the shared front end (`kvstack.frontend.assembly`: side calls to engines,
fleet, scheduling, prefix knowledge, scraper, discovery, admission), plus the proxy's own connection pool,
the proxy, the P/D prefill step and the HTTP app, all built here and passed in (no globals).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from kvstack.engines.discovery import Discovery
from kvstack.engines.prompt_tokens import PromptTokenizer
from kvstack.engines.scraper import MetricsScraper
from kvstack.frontend.assembly import FrontEnd, FrontEndOptions, build_front_end
from kvstack.frontend.kv_feeds import KVEventFeeds
from kvstack.frontend.metrics import RouterMetrics
from kvstack.frontend.pd import Prefiller
from kvstack.frontend.prefix import PrefixLocator
from kvstack.http.client import UpstreamPool
from kvstack.http.listen import listening_socket
from kvstack.http.server import HttpServer
from kvstack.router.app import RouterApp, RouterConfig
from kvstack.router.prefill import PrefillStep
from kvstack.router.proxy import Proxy, RetryPolicy
from kvstack.router.workers import WorkerGroup, WorkerGroupConfig

log = logging.getLogger(__name__)


@dataclass
class RouterOptions(FrontEndOptions):
    host: str = "127.0.0.1"
    port: int = 8080
    app: RouterConfig = field(default_factory=RouterConfig)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    # Share the port between several router processes (SO_REUSEPORT).
    reuse_port: bool = False
    connection_limit: int = 0  # upstream connections in total; 0 = unlimited
    # This process is one of several router workers on the port (set by the --workers supervisor).
    group: WorkerGroupConfig | None = None


@dataclass
class RunningRouter:
    url: str
    app: RouterApp
    server: HttpServer
    front: FrontEnd
    upstream: UpstreamPool
    group: WorkerGroup | None = None

    @property
    def side_calls(self) -> UpstreamPool:
        return self.front.side_calls

    @property
    def scraper(self) -> MetricsScraper:
        return self.front.scraper

    @property
    def discovery(self) -> Discovery | None:
        return self.front.options.discovery

    @property
    def feeds(self) -> KVEventFeeds | None:
        return self.front.feeds

    @property
    def prompts(self) -> PromptTokenizer:
        return self.front.prompts

    @property
    def locator(self) -> PrefixLocator:
        return self.front.locator

    async def stop(self) -> None:
        try:
            if self.group is not None:
                await self.group.stop()
            await self.server.close()
            await self.app.close()
        finally:  # connections are released even when a step above failed or was cancelled
            try:
                await self.front.stop()
            finally:
                await self.upstream.close()


async def start_router(opts: RouterOptions) -> RunningRouter:
    upstream = UpstreamPool(max_connections=opts.connection_limit)
    group = None if opts.group is None else WorkerGroup(opts.group)
    metrics = RouterMetrics(
        None if opts.group is None else (opts.group.directory, opts.group.index, opts.group.count)
    )
    front = build_front_end(
        opts,
        metrics,
        shared_in_flight=None if group is None else group.in_flight,
        on_circuit_open=None if group is None else _circuit_broadcaster(group),
        # router-wide limits, shared out between the workers
        admission_limits=None
        if opts.group is None
        else (opts.group.limit(opts.max_in_flight), opts.group.limit(opts.max_queue)),
    )
    proxy = Proxy(
        upstream, front.registry, metrics, timeouts=opts.app.timeouts, retry=opts.retry, hold=opts.app.hold
    )
    prefiller = Prefiller(
        upstream, metrics, timeout=opts.app.pd_prefill_timeout, connect_timeout=opts.app.timeouts.connect
    )
    router = RouterApp(
        opts.app,
        front.fleet,
        front.picker,
        proxy,
        front.admission,
        prefill=PrefillStep(front.registry, metrics, prefiller),
        group=group,
        on_metrics=front.refresh_gauges,
    )
    # A client that disconnects cancels its handler, which closes the upstream request.
    server = router.server()
    try:
        if group is not None:
            await group.start()
        sock = listening_socket(opts.host, opts.port, reuse_port=opts.reuse_port)
        await server.start(sock)
    except BaseException:
        await server.close()
        await upstream.close()
        await front.side_calls.close()
        if group is not None:
            await group.stop()
        raise
    front.start()
    port = sock.getsockname()[1]
    return RunningRouter(f"http://{opts.host}:{port}", router, server, front, upstream, group)


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
        if opts.group is None or opts.group.index == 0:  # one banner per router, not per worker
            workers = "" if opts.group is None else f", {opts.group.count} workers"
            print(
                f"kvstack router: {router.url}/v1 ({len(opts.engines)} engine(s), routing {opts.routing!r}"
                f"{workers})",
                flush=True,
            )
        await asyncio.Event().wait()
