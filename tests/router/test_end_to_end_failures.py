"""Engines failing under the router: ``kvstack sim`` processes killed mid-run and restarted at the same
address, and connect errors retried on an engine the saturation filter had set aside."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvstack.frontend.circuit import CircuitConfig
from kvstack.router.app import RouterConfig
from kvstack.router.proxy import Timeouts
from kvstack.sim.cluster import stop_engine
from support.end_to_end import (
    MODEL,
    EventReader,
    completion,
    engine_view,
    entry,
    get_text,
    in_flight,
    inprocess_sims,
    patch_metrics,
    post_status,
    routing_to,
    start_sim_processes,
    stopping,
    text_events,
    with_queue,
)
from support.engines import EngineProcess, wait_healthy
from support.metrics import sample_sum
from support.processes import kill_group, spawn
from support.waiting import eventually


def start_sim_at(port: int, workdir: Path, *args: str) -> EngineProcess:
    """A ``kvstack sim`` subprocess on a chosen port: a restarted engine comes back at its old address."""
    cmd = [
        sys.executable, "-m", "kvstack.cli", "sim", "--served-model-name", MODEL, "--host", "127.0.0.1",
        "--port", str(port), "--block-size", "128", "--num-gpu-blocks", "64", "--max-model-len", "2048",
        "--no-kv-events", "--log-level", "warning", *args,
    ]  # fmt: skip
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / f"sim-{port}.log"
    proc = spawn(cmd, log_path, cwd=workdir)
    url = f"http://127.0.0.1:{port}"
    engine = EngineProcess("sim", url, MODEL, "", None, proc, log_path, block_size=128)
    try:
        wait_healthy(proc, url, log_path, 60.0)
    except Exception:
        engine.stop()
        raise
    return engine


def kill(engine: EngineProcess) -> None:
    """SIGKILL the engine's process group: no goodbye on its connections."""
    kill_group(engine.proc)


# -- an engine killed mid-run --------------------------------------------------------------------------------
@pytest.mark.slow
async def test_engine_killed_mid_run(tmp_path: Path) -> None:
    # At 1.5x a 400-token stream lasts a few seconds: long enough to be cut in the middle.
    with stopping(await start_sim_processes(tmp_path, 2, "--time-scale", "1.5")) as (a, b):
        timeouts = Timeouts(connect=2.0, first_byte=20.0, idle=60.0, total=120.0)
        async with (
            routing_to([a.url, b.url], routing="round-robin", app=RouterConfig(timeouts=timeouts)) as router,
            aiohttp.ClientSession() as http,
        ):
            streams: list[tuple[str, asyncio.Task[list[bytes]]]] = []
            for _ in range(6):
                before = in_flight(router)
                resp = await http.post(f"{router.url}/v1/completions", json=completion(400, stream=True))
                assert resp.status == 200
                after = in_flight(router)
                (engine,) = [url for url in after if after[url] == before.get(url, 0) + 1]
                reader = EventReader(resp)
                await reader.at_least(1)  # the stream is under way
                streams.append((engine, asyncio.create_task(reader.to_end())))
            assert {engine for engine, _ in streams} == {a.url, b.url}

            kill(a)
            # Requests that start now: those sent to the dead engine are retried on the other one.
            fresh = [
                asyncio.create_task(post_status(http, router, completion(8, prompt=f"after {i}")))
                for i in range(10)
            ]
            # Bounded well below the idle timeout (60 s): the cut streams must end on their own.
            results = await asyncio.wait_for(asyncio.gather(*(task for _, task in streams)), 30)
            assert await asyncio.wait_for(asyncio.gather(*fresh), 30) == [200] * 10

            for (engine, _), events in zip(streams, results, strict=True):
                if engine == a.url:
                    last = json.loads(events[-2])  # then [DONE], as vLLM ends a failed stream
                    assert last["error"]["code"] == 502 and a.url in last["error"]["message"]
                    assert events[-1] == b"[DONE]" and len(text_events(events)) < 400
                else:
                    assert events[-1] == b"[DONE]"
                    assert len(text_events(events)) == 400
                    assert json.loads(events[-2])["usage"]["completion_tokens"] == 400
            metrics = await get_text(http, f"{router.url}/metrics")
            assert sample_sum(metrics, "kvstack_router_upstream_errors_total", engine=a.url) >= 1
            assert sample_sum(metrics, "kvstack_router_retries_total") >= 1  # some went to the dead one first
            assert in_flight(router) == {a.url: 0, b.url: 0}


async def test_connect_error_retries_on_an_engine_the_saturation_filter_set_aside() -> None:
    # The dead engine's last scrape looked idle, the live one's queue is over the saturation threshold: the
    # profile keeps only the dead one, and the retry must still reach the busy one (not answer 502).
    # Scrapes far apart, so the dead engine's reading stays fresh for the whole test.
    async with (
        inprocess_sims(2, time_scale=50) as (dying, busy),
        routing_to([dying.url, busy.url], scrape_interval=10.0) as router,
        aiohttp.ClientSession() as http,
    ):
        patch_metrics(busy, with_queue(10))

        async def busy_seen() -> bool:
            await router.scraper.scrape_once()  # a scrape that began before the patch may answer first
            signals = entry(router, busy.url).state.signals()
            return signals is not None and signals.queue == 10

        await eventually(
            busy_seen, what="the busy engine's queue of 10 scraped", timeout_s=15, interval_s=0.05
        )
        assert entry(router, dying.url).state.signals() is not None  # fresh, and it looked idle
        await stop_engine(dying)
        async with http.post(f"{router.url}/v1/completions", json=completion(2)) as r:
            assert r.status == 200, await r.text()
        text = await get_text(http, f"{router.url}/metrics")
        assert sample_sum(text, "kvstack_router_retries_total", reason="connect_error") == 1
        assert sample_sum(text, "kvstack_router_requests_total", engine=busy.url, status="200") == 1


# -- a restarted engine rejoins ------------------------------------------------------------------------------
@pytest.mark.slow
async def test_restarted_engine_rejoins(tmp_path: Path) -> None:
    with stopping(await start_sim_processes(tmp_path, 2, "--time-scale", "20")) as engines:
        a, b = engines
        port_a = int(a.url.rsplit(":", 1)[1])
        async with (
            routing_to(
                [a.url, b.url],
                routing="round-robin",
                scrape_interval=0.5,
                circuit=CircuitConfig(failure_threshold=3, open_seconds=1.0),
            ) as router,
            aiohttp.ClientSession() as http,
        ):
            breaker = entry(router, a.url).breaker

            async def scraped() -> bool:
                return (await engine_view(http, router, a.url))["metrics"] is not None

            await eventually(scraped, what="a first scrape of the engine", timeout_s=15, interval_s=0.05)
            kill(a)
            # Round-robin keeps offering the dead engine; each connect error counts against it and the
            # request is retried on the other engine, until its circuit opens.
            for _ in range(40):
                assert await post_status(http, router, completion(2)) == 200
                if breaker.state.value == "open":
                    break
            view = await engine_view(http, router, a.url)
            assert view["circuit"] == "open" and not view["routable"]
            metrics = await get_text(http, f"{router.url}/metrics")
            assert sample_sum(metrics, "kvstack_router_circuit_state", engine=a.url) == 2
            assert sample_sum(metrics, "kvstack_router_circuit_state", engine=b.url) == 0

            async def stale_and_down() -> bool:
                v = await engine_view(http, router, a.url)
                return v["metrics"]["stale"] and not v["healthy"]

            await eventually(
                stale_and_down,
                what="the dead engine's metrics stale and the engine unhealthy",
                timeout_s=15,
                interval_s=0.05,
            )

            restarted = await asyncio.to_thread(
                start_sim_at, port_a, tmp_path / "restarted", "--time-scale", "20"
            )
            engines.append(restarted)

            async def served_by_restarted() -> bool:
                assert await post_status(http, router, completion(2)) == 200
                text = await get_text(http, f"{restarted.url}/metrics")
                return sample_sum(text, "vllm:request_success_total") > 0

            # Once its open period (1 s) is over and a scrape reached it, the probe request closes it.
            await eventually(
                served_by_restarted,
                what="a request served by the restarted engine",
                timeout_s=20,
                interval_s=0.05,
            )

            async def rejoined() -> dict[str, Any] | None:
                v = await engine_view(http, router, a.url)
                fresh = v["metrics"] is not None and not v["metrics"]["stale"]
                return v if v["circuit"] == "closed" and v["healthy"] and fresh else None

            view = await eventually(
                rejoined, what="the restarted engine closed, healthy and fresh", timeout_s=15, interval_s=0.05
            )
            assert view["routable"]
            metrics = await get_text(http, f"{router.url}/metrics")
            assert sample_sum(metrics, "kvstack_router_circuit_state", engine=a.url) == 0
