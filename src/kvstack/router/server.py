"""Assemble and run the router: one aiohttp client session, the registry, scheduling, proxy, admission,
metrics and the engine-state background tasks, all built here and passed in (no globals).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from kvstack.engines.discovery import Discovery, DiscoveryUpdate, UpdateKind
from kvstack.engines.scraper import MetricsScraper
from kvstack.engines.state import Endpoint
from kvstack.router.admission import AdmissionController
from kvstack.router.app import RouterApp, RouterConfig
from kvstack.router.circuit import CircuitConfig
from kvstack.router.metrics import RouterMetrics
from kvstack.router.proxy import Proxy, RetryPolicy
from kvstack.router.registry import EngineRegistry
from kvstack.router.routing import SchedulerPicker
from kvstack.scheduling import build_scheduler
from kvstack.scheduling.presets import load_routing

log = logging.getLogger(__name__)


@dataclass
class RouterOptions:
    host: str = "127.0.0.1"
    port: int = 8080
    engines: list[Endpoint] = field(default_factory=list)
    discovery: Discovery | None = None
    routing: str = "default"  # a preset name or a YAML file
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


@dataclass
class RunningRouter:
    url: str
    app: RouterApp
    runner: web.AppRunner
    session: aiohttp.ClientSession
    scraper: MetricsScraper
    scrape_session: aiohttp.ClientSession
    discovery: Discovery | None = None

    async def stop(self) -> None:
        if self.discovery is not None:
            await self.discovery.stop()
        await self.scraper.stop()
        await self.runner.cleanup()
        await self.session.close()
        await self.scrape_session.close()


async def start_router(opts: RouterOptions) -> RunningRouter:
    connector = aiohttp.TCPConnector(limit=opts.connection_limit, limit_per_host=0, ttl_dns_cache=300)
    # No client-wide timeout: the proxy applies connect, first-byte, idle and total timeouts itself.
    session = aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False
    )
    registry = EngineRegistry(opts.circuit)
    metrics = RouterMetrics()
    scheduler = build_scheduler(load_routing(opts.routing))
    proxy = Proxy(session, registry, metrics, timeouts=opts.app.timeouts, retry=opts.retry)
    admission = AdmissionController(opts.max_in_flight, opts.max_queue, opts.queue_timeout)
    router = RouterApp(
        opts.app,
        registry,
        SchedulerPicker(scheduler),
        proxy,
        admission,
        metrics,
        session,
        expected_models=opts.expected_models,
    )
    app = router.app()
    # handler_cancellation: a client that disconnects cancels its handler, which closes the upstream request.
    runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    try:
        sock = _bind(opts.host, opts.port, reuse_port=opts.reuse_port)
        site = web.SockSite(runner, sock, backlog=4096)
        await site.start()
    except BaseException:
        await runner.cleanup()
        await session.close()
        raise
    for endpoint in opts.engines:
        router.add_engine(endpoint)
    if opts.discovery is not None:

        def on_update(update: DiscoveryUpdate) -> None:
            if update.kind is UpdateKind.REMOVED:
                router.remove_engine(update.endpoint.url)
            else:
                router.add_engine(update.endpoint)

        opts.discovery.start(on_update)
    # Scrapes use their own connections so that thousands of proxied streams cannot starve them.
    scrape_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    scraper = MetricsScraper(
        scrape_session,
        registry.states,
        interval=opts.scrape_interval,
        timeout=opts.scrape_timeout,
        observer=metrics,
    )
    scraper.start()
    port = sock.getsockname()[1]
    return RunningRouter(
        f"http://{opts.host}:{port}", router, runner, session, scraper, scrape_session, opts.discovery
    )


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


async def serve_forever(opts: RouterOptions) -> None:
    async with running_router(opts) as router:
        log.info("router listening on %s", router.url)
        print(
            f"kvstack router: {router.url}/v1 ({len(opts.engines)} engine(s), routing {opts.routing!r})",
            flush=True,
        )
        await asyncio.Event().wait()
