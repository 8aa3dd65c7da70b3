"""The metrics scraper, over the router's side-call pool, against real simulator processes, plus tiny aiohttp
servers for what an engine cannot be made to do (a /metrics that hangs, answers 500 or returns garbage)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

from kvstack.engines.scraper import MetricsScraper
from kvstack.engines.state import Endpoint, EngineState
from kvstack.http.client import UpstreamPool
from support.engines import EngineProcess, start_sim
from support.ports import free_port
from support.waiting import eventually

LEGACY = {
    "vllm:kv_cache_usage_perc": "vllm:gpu_cache_usage_perc",
    "vllm:prefix_cache_queries": "vllm:gpu_prefix_cache_queries",
    "vllm:prefix_cache_hits": "vllm:gpu_prefix_cache_hits",
}
SCRAPER_LOG = "kvstack.engines.scraper"


@dataclass
class Scrape:
    engine: str
    ok: bool
    duration: float
    reason: str | None
    at: float


@dataclass
class Recorder:
    """A ScrapeObserver that keeps everything it is told."""

    scrapes: list[Scrape] = field(default_factory=list)
    missing: list[tuple[str, frozenset[str]]] = field(default_factory=list)

    def on_scrape(self, engine: str, ok: bool, duration: float, error_reason: str | None) -> None:
        self.scrapes.append(Scrape(engine, ok, duration, error_reason, time.monotonic()))

    def on_missing(self, engine: str, names: frozenset[str]) -> None:
        self.missing.append((engine, names))

    def of(self, engine: str, ok: bool | None = None) -> list[Scrape]:
        return [s for s in self.scrapes if s.engine == engine and (ok is None or s.ok == ok)]


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, EngineProcess]]:
    """Two long-lived simulators: current vLLM metric names and legacy ones."""
    started: dict[str, EngineProcess] = {}
    try:
        for mode, extra in (("current", []), ("legacy", ["--legacy-metric-names"])):
            started[mode] = start_sim(tmp_path_factory.mktemp(f"sim-{mode}"), replay=False, extra_args=extra)
        yield started
    finally:
        for engine in started.values():
            engine.stop()


ClientFactory = Callable[[], AbstractAsyncContextManager[UpstreamPool]]


@pytest.fixture
def scrape_client() -> ClientFactory:
    """A connection pool for the scraper, as the router gives it one."""

    @asynccontextmanager
    async def pool() -> AsyncIterator[UpstreamPool]:
        client = UpstreamPool()
        try:
            yield client
        finally:
            await client.close()

    return pool


def _state(url: str, engine_type: str = "vllm") -> EngineState:
    return EngineState(Endpoint(url, engine_type=engine_type))


@asynccontextmanager
async def metrics_server(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> AsyncIterator[str]:
    """A bare HTTP server whose /metrics is ``handler``; yields its base URL."""
    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_scrape_once_reads_real_engines(
    sims: dict[str, EngineProcess], scrape_client: ClientFactory
) -> None:
    current, legacy = _state(sims["current"].url), _state(sims["legacy"].url)
    recorder = Recorder()
    async with scrape_client() as http:
        scraper = MetricsScraper(http, lambda: [current, legacy], observer=recorder)
        await scraper.scrape_once()
    for state in (current, legacy):
        assert state.healthy and not state.metrics_stale
        signals = state.signals()
        assert signals is not None
        assert (signals.queue, signals.running) == (0.0, 0.0)
        assert signals.kv_usage is not None and 0.0 <= signals.kv_usage <= 1.0
        assert (signals.block_size, signals.num_blocks) == (128, 64)
        assert signals.prefix_cache_queries is not None and signals.prefix_cache_hits is not None
    assert current.metrics is not None and current.metrics.missing == frozenset()
    assert legacy.metrics is not None and legacy.metrics.missing == frozenset(LEGACY)
    assert dict(legacy.metrics.aliases_used) == LEGACY
    assert sorted((s.engine, s.ok, s.reason) for s in recorder.scrapes) == sorted(
        [(current.url, True, None), (legacy.url, True, None)]
    )


async def test_legacy_names_warn_once_per_engine_and_name(
    sims: dict[str, EngineProcess], caplog: pytest.LogCaptureFixture, scrape_client: ClientFactory
) -> None:
    caplog.set_level(logging.WARNING, logger=SCRAPER_LOG)
    current, legacy = _state(sims["current"].url), _state(sims["legacy"].url)
    recorder = Recorder()
    async with scrape_client() as http:
        scraper = MetricsScraper(http, lambda: [current, legacy], observer=recorder)
        for _ in range(3):
            await scraper.scrape_once()
    warnings = [r.getMessage() for r in caplog.records if r.name == SCRAPER_LOG]
    for expected, old in LEGACY.items():
        line = (
            f"engine {legacy.url} exports no {expected} (found legacy {old}, renamed in vllm 0.9.2; using it)"
        )
        assert warnings.count(line) == 1, warnings
    assert len(warnings) == len(LEGACY)  # nothing about the engine with current names
    assert recorder.missing == [(legacy.url, frozenset(LEGACY))]


async def test_engines_added_and_removed_at_runtime(
    sims: dict[str, EngineProcess], scrape_client: ClientFactory
) -> None:
    current, legacy = _state(sims["current"].url), _state(sims["legacy"].url)
    engines = [current]
    recorder = Recorder()
    async with scrape_client() as http:
        scraper = MetricsScraper(http, lambda: list(engines), interval=0.1, jitter=0.02, observer=recorder)
        scraper.start()
        try:
            await eventually(lambda: current.metrics is not None, timeout_s=2)
            engines.append(legacy)
            await eventually(lambda: legacy.metrics is not None, timeout_s=2)
            engines.remove(legacy)
            # Leaving clears its missing names for the router's gauge.
            await eventually(lambda: (legacy.url, frozenset()) in recorder.missing, timeout_s=2)
            seen = len(recorder.of(legacy.url))
            await asyncio.sleep(0.4)
            assert len(recorder.of(legacy.url)) == seen  # no longer scraped
            assert len(recorder.of(current.url, ok=True)) >= 5
        finally:
            await scraper.stop()


async def test_stopped_engine_goes_stale_then_unhealthy_never_idle(
    tmp_path: Path, scrape_client: ClientFactory
) -> None:
    engine = start_sim(tmp_path, replay=False)
    state = _state(engine.url)
    recorder = Recorder()
    try:
        async with scrape_client() as http:
            scraper = MetricsScraper(
                http,
                lambda: [state],
                interval=0.1,
                timeout=0.3,
                jitter=0.02,
                stale_after=0.35,
                unhealthy_after=6,
                observer=recorder,
            )
            scraper.start()
            try:
                await eventually(lambda: state.signals() is not None, timeout_s=3)
                signals = state.signals()
                assert signals is not None and signals.queue == 0.0  # idle, and known to be
                engine.stop()
                stopped = time.monotonic()
                await eventually(lambda: state.metrics_stale, timeout_s=3, interval_s=0.005)
                stale_at = time.monotonic()
                assert state.signals() is None  # unknown, not idle
                assert state.healthy  # not yet: only 0.35 s without a reading
                await eventually(lambda: not state.healthy, timeout_s=3, interval_s=0.005)
                unhealthy_at = time.monotonic()
                assert stopped < stale_at <= unhealthy_at
                assert state.metrics_stale and state.signals() is None
                await asyncio.sleep(0.3)
                assert state.metrics_stale and state.signals() is None and not state.healthy
            finally:
                await scraper.stop()
    finally:
        engine.stop()
    failures = recorder.of(engine.url, ok=False)
    assert len(failures) >= 6
    assert {f.reason for f in failures} == {"connect"}


async def test_hanging_engine_times_out_and_others_are_scraped_on_time(
    sims: dict[str, EngineProcess], scrape_client: ClientFactory
) -> None:
    async def hang(request: web.Request) -> web.Response:
        await asyncio.sleep(30)
        return web.Response(text="")

    recorder = Recorder()
    async with metrics_server(hang) as hang_url, scrape_client() as http:
        hanging, current = _state(hang_url), _state(sims["current"].url)
        # The good engine (a simulator process) must answer every scrape within the timeout on a busy
        # machine too: 0.1 s was missed once in a full test run.
        interval, timeout, jitter = 0.3, 0.25, 0.05
        scraper = MetricsScraper(
            http,
            lambda: [hanging, current],
            interval=interval,
            timeout=timeout,
            jitter=jitter,
            observer=recorder,
        )
        scraper.start()
        await asyncio.sleep(3.0)
        await scraper.stop()
    timeouts = recorder.of(hang_url, ok=False)
    assert len(timeouts) >= 7
    assert {t.reason for t in timeouts} == {"timeout"}
    assert all(t.duration < timeout + 0.1 for t in timeouts)
    assert hanging.metrics is None and hanging.metrics_stale and hanging.signals() is None
    good = recorder.of(current.url, ok=True)
    assert len(good) >= 8 and not recorder.of(current.url, ok=False)
    gaps = [b.at - a.at for a, b in itertools.pairwise(good)]
    assert max(gaps) < interval + jitter + 0.1, gaps  # the hanging engine delayed nobody
    assert current.signals() is not None


async def test_one_scrape_in_flight_per_engine(
    sims: dict[str, EngineProcess], scrape_client: ClientFactory
) -> None:
    """A /metrics slower than the interval (but within the timeout) is not asked again until it answers."""
    body = await asyncio.to_thread(_fetch_text, f"{sims['current'].url}/metrics")
    active, peak, calls = 0, 0, 0

    async def slow(request: web.Request) -> web.Response:
        nonlocal active, peak, calls
        calls += 1
        active += 1
        peak = max(peak, active)
        try:
            await asyncio.sleep(0.5)
            return web.Response(text=body)
        finally:
            active -= 1

    recorder = Recorder()
    async with metrics_server(slow) as url, scrape_client() as http:
        state = _state(url)
        scraper = MetricsScraper(
            http, lambda: [state], interval=0.1, timeout=2.0, jitter=0.0, observer=recorder
        )
        scraper.start()
        await asyncio.sleep(2.0)
        await scraper.stop()
    assert peak == 1
    assert 3 <= calls <= 5  # one per 0.5 s answer, not one per 0.1 s round
    assert all(s.ok for s in recorder.scrapes)
    assert state.metrics is not None and state.metrics.signals.block_size == 128


def _fetch_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return str(r.read().decode())


async def test_error_answers_and_recovery(
    caplog: pytest.LogCaptureFixture, scrape_client: ClientFactory
) -> None:
    caplog.set_level(logging.INFO, logger=SCRAPER_LOG)
    mode = {"status": 500}

    async def flaky(request: web.Request) -> web.Response:
        if mode["status"] != 200:
            return web.Response(status=mode["status"], text="engine error")
        return web.Response(text="vllm:num_requests_waiting 2\nvllm:num_requests_running 1\n")

    recorder = Recorder()
    async with metrics_server(flaky) as url, scrape_client() as http:
        state = _state(url)
        scraper = MetricsScraper(http, lambda: [state], unhealthy_after=3, observer=recorder)
        for _ in range(3):
            await scraper.scrape_once()
        # The engine answers, only not with metrics: its load is unknown, it is not unreachable.
        assert state.healthy and state.metrics_stale and state.signals() is None
        mode["status"] = 200
        await scraper.scrape_once()
        assert state.healthy and not state.metrics_stale
        signals = state.signals()
        assert signals is not None and (signals.queue, signals.running) == (2.0, 1.0)
        assert signals.kv_usage is None  # not exported: unknown
    assert [s.reason for s in recorder.scrapes] == ["http_500"] * 3 + [None]
    messages = [r.getMessage() for r in caplog.records if r.name == SCRAPER_LOG]
    assert sum("metrics scrape failed (http_500" in m for m in messages) == 1  # one line per outage
    assert sum("marking it unhealthy" in m for m in messages) == 0
    assert sum("succeeds again" in m for m in messages) == 1
    assert (
        f"engine {url} exports no vllm:kv_cache_usage_perc and no known alias; KV usage unknown" in messages
    )


async def test_garbage_body_is_a_parse_error_and_the_engine_stays_healthy(
    scrape_client: ClientFactory,
) -> None:
    async def html(request: web.Request) -> web.Response:
        return web.Response(text="<html><body>login required</body></html>")

    recorder = Recorder()
    async with metrics_server(html) as url, scrape_client() as http:
        state = _state(url)
        scraper = MetricsScraper(http, lambda: [state], unhealthy_after=1, observer=recorder)
        await scraper.scrape_once()
    assert [s.reason for s in recorder.scrapes] == ["parse"]
    assert state.healthy and state.metrics is None and state.metrics_stale and state.signals() is None


async def test_oversized_body_is_refused(
    sims: dict[str, EngineProcess], scrape_client: ClientFactory
) -> None:
    state = _state(sims["current"].url)
    recorder = Recorder()
    async with scrape_client() as http:
        scraper = MetricsScraper(http, lambda: [state], max_bytes=1000, observer=recorder)
        await scraper.scrape_once()
    assert [s.reason for s in recorder.scrapes] == ["too_large"]
    assert state.healthy and state.metrics is None


async def test_an_oversized_error_answer_counts_as_its_status(scrape_client: ClientFactory) -> None:
    async def failing(request: web.Request) -> web.Response:
        return web.Response(status=503, text="x" * 5000)

    recorder = Recorder()
    async with metrics_server(failing) as url, scrape_client() as http:
        state = _state(url)
        scraper = MetricsScraper(http, lambda: [state], max_bytes=1000, unhealthy_after=1, observer=recorder)
        await scraper.scrape_once()
    assert [s.reason for s in recorder.scrapes] == ["http_503"]
    assert state.healthy and state.metrics is None


async def test_unknown_engine_type_is_a_scrape_error(
    sims: dict[str, EngineProcess], scrape_client: ClientFactory
) -> None:
    state = _state(sims["current"].url, engine_type="tgi")
    recorder = Recorder()
    async with scrape_client() as http:
        scraper = MetricsScraper(http, lambda: [state], unhealthy_after=1, observer=recorder)
        await scraper.scrape_once()
    assert [s.reason for s in recorder.scrapes] == ["unknown_engine_type"]
    assert state.healthy and state.metrics is None and state.metrics_stale


async def test_stop_cancels_scrapes_in_flight(scrape_client: ClientFactory) -> None:
    async def hang(request: web.Request) -> web.Response:
        await asyncio.sleep(30)
        return web.Response(text="")

    async with metrics_server(hang) as url, scrape_client() as http:
        scraper = MetricsScraper(http, lambda: [_state(url)], interval=0.1, timeout=20.0, jitter=0.0)
        scraper.start()
        await asyncio.sleep(0.3)
        started = time.monotonic()
        await scraper.stop()
        assert time.monotonic() - started < 1.0
        await scraper.stop()  # idempotent


@dataclass
class Watcher:
    """An EngineWatcher that keeps what it is told."""

    events: list[tuple[str, str]] = field(default_factory=list)

    def engine_down(self, state: EngineState) -> None:
        self.events.append(("down", state.url))

    def engine_back(self, state: EngineState) -> None:
        self.events.append(("back", state.url))


async def test_an_engine_refusing_connections_is_down_and_back_on_its_next_answer(
    scrape_client: ClientFactory,
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_waiting 0\n")

    async def serve() -> web.AppRunner:
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    watcher = Watcher()
    async with scrape_client() as http:
        state = _state(url)
        scraper = MetricsScraper(http, lambda: [state], unhealthy_after=3, watcher=watcher)
        await scraper.scrape_once()  # nothing listens yet: an engine never seen up is not "down"
        runner = await serve()
        await scraper.scrape_once()
        assert watcher.events == [] and state.healthy
        await runner.cleanup()  # the process goes away: the first refused connect says so
        await scraper.scrape_once()
        assert watcher.events == [("down", url)] and state.healthy  # not yet unhealthy (3 failures)
        await scraper.scrape_once()
        assert watcher.events == [("down", url)]
        runner = await serve()  # restarted on the same address
        try:
            await scraper.scrape_once()
            assert watcher.events == [("down", url), ("back", url)]
            await scraper.scrape_once()
            assert len(watcher.events) == 2
        finally:
            await runner.cleanup()


async def test_an_engine_answering_errors_or_slowly_is_not_down(scrape_client: ClientFactory) -> None:
    mode = {"status": 200}

    async def slow_or_failing(request: web.Request) -> web.Response:
        if mode["status"] == 0:
            await asyncio.sleep(5)
        return web.Response(status=mode["status"] or 200, text="vllm:num_requests_waiting 0\n")

    watcher = Watcher()
    async with metrics_server(slow_or_failing) as url, scrape_client() as http:
        state = _state(url)
        scraper = MetricsScraper(http, lambda: [state], timeout=0.2, watcher=watcher)
        await scraper.scrape_once()
        for mode["status"] in (500, 503, 0, 0, 200):
            await scraper.scrape_once()
    assert watcher.events == []
