"""Engines rejoining under load through a real router: a simulated engine SIGKILLed and started again on
its address serves again within two scrape intervals of answering /health, with its prefix entries from
before the restart dropped and the new process's KV events applied; a Kubernetes pod replaced by one with a
new IP is swapped in the same way, the old engine's series forgotten. Measured times are printed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from kubernetes_asyncio.client import ApiClient, Configuration

from kvstack.backoff import Backoff
from kvstack.engines.discovery import KubernetesDiscovery
from kvstack.engines.state import Endpoint
from kvstack.engines.tokenizer import load_tokenizer
from kvstack.router.server import RouterOptions, RunningRouter, start_router
from kvstack.sim.cluster import RunningEngine, SimOptions, start_engine, stop_engine
from kvstack.sim.engine import EngineConfig
from kvstack.sim.textgen import OutputSampler
from support.end_to_end import MODEL, completion
from support.engines import EngineProcess, fresh_prompt, start_sim
from support.fake_k8s import FakeKubeApi, make_pod
from support.metrics import sample_sum
from support.trickle import Trickle, healthy_at
from support.waiting import eventually

BLOCK = 16
PROMPT_BLOCKS = 12


def sent_to(router: RunningRouter, url: str, since: float) -> float | None:
    """When the router first sent a request to ``url`` at or after ``since`` (its monotonic clock)."""
    entry = router.app.registry.get(url)
    times = [] if entry is None else [t for t in entry.state.recent_requests if t >= since]
    return min(times) if times else None


def ids_completion(tokens: list[int], model: str = "tiny") -> dict[str, object]:
    return {"model": model, "prompt": tokens, "max_tokens": 2, "ignore_eos": True}


@asynccontextmanager
async def two_sims(tmp_path: Path) -> AsyncIterator[list[EngineProcess]]:
    started: list[EngineProcess] = []
    try:
        for i in range(2):
            started.append(start_sim(tmp_path / f"sim{i}", block_size=BLOCK, num_gpu_blocks=1024))
        yield started
    finally:
        for engine in started:
            engine.stop()


# (scrape interval, seconds down before the restart): quickly (the proxy's failures have opened the circuit,
# the scraper has not marked it unhealthy; down at least one interval, so that a scrape sees it down), and
# long enough for the scraper to mark it unhealthy.
@pytest.mark.parametrize(("interval", "down_s"), [(1.0, 1.0), (0.25, 0.0), (1.0, 6.0)])
async def test_restarted_sim_serves_again_with_its_old_prefixes_dropped(
    tmp_path: Path, interval: float, down_s: float
) -> None:
    async with two_sims(tmp_path) as (steady, restarted), aiohttp.ClientSession() as http:
        router = await start_router(
            RouterOptions(
                port=0,
                engines=[Endpoint(e.url, models=frozenset({"tiny"})) for e in (steady, restarted)],
                routing="kv-aware",
                scrape_interval=interval,
            )
        )
        locator = router.front.locator
        try:
            feeds = router.feeds
            assert feeds is not None

            def known() -> bool:
                subs = [feeds.subscriber(e.url) for e in (steady, restarted)]
                scraped = all(not s.metrics_stale for s in router.app.registry.states())
                return scraped and all(s is not None and s.connected for s in subs)

            await eventually(known, what="both engines scraped, their KV events connected", timeout_s=20)
            # A prompt cached only on the engine that will restart (sent to it directly).
            cached = fresh_prompt(1, PROMPT_BLOCKS * BLOCK)
            async with http.post(f"{restarted.url}/v1/completions", json=ids_completion(cached)) as r:
                assert r.status == 200
            await eventually(
                lambda: locator.index.location_entries(restarted.url) >= PROMPT_BLOCKS,
                what="the cached prompt's blocks indexed",
            )

            async def routed(prompt: list[int]) -> str:
                async with http.post(f"{router.url}/v1/completions", json=ids_completion(prompt)) as r:
                    assert r.status == 200
                    return r.headers["x-kvstack-engine"]

            assert await routed(cached) == restarted.url  # prefix credit

            async with Trickle(
                http, router.url, lambda n: ids_completion(fresh_prompt(1000 + n, 64))
            ) as load:
                await asyncio.sleep(1.0)
                await asyncio.to_thread(restarted.kill)
                killed = time.monotonic()
                await asyncio.sleep(down_s)
                restarted.start_again()
                healthy = await healthy_at(http, restarted.url)
                assert locator.index.location_entries(restarted.url) == 0, "entries of a dead engine kept"
                first = await eventually(
                    lambda: sent_to(router, restarted.url, healthy),
                    what="a request to the restarted engine",
                    timeout_s=60,
                )
                served = await eventually(
                    lambda: next(iter(load.to(restarted.url, healthy)), None), what="an answer from it"
                )
                subscriber = feeds.subscriber(restarted.url)
                assert subscriber is not None
                await eventually(lambda: subscriber.connected, what="its KV events reconnected")
                events_back = time.monotonic()
                await asyncio.sleep(0.5)
            rejoin = first - healthy
            print(
                f"\nrejoin (sim, scrape interval {interval:g} s): healthy {healthy - killed:.2f} s after the "
                f"kill ({down_s:g} s down), first request {rejoin:.3f} s after healthy, first answer "
                f"{served.started - healthy:.3f} s after; KV events connected by "
                f"{events_back - healthy:.3f} s after; trickle statuses {load.statuses()}"
            )
            assert rejoin < 2 * interval + 1.5, f"rejoin took {rejoin:.2f} s (scrape interval {interval} s)"
            text = (await (await http.get(f"{router.url}/metrics")).read()).decode()
            assert sample_sum(text, "kvstack_engine_rejoins_total", engine=restarted.url) >= 1
            dropped = sample_sum(text, "kvstack_prefix_entries_dropped_total", engine=restarted.url)
            assert dropped >= PROMPT_BLOCKS

            # The event stream saw a new publisher (seq from 0, or gone past the grace period).
            async def new_publisher_seen() -> bool:
                async with http.get(f"{router.url}/metrics") as r:
                    text = (await r.read()).decode()
                return any(
                    sample_sum(text, "kvstack_kv_event_resets_total", engine=restarted.url, reason=reason)
                    for reason in ("restart", "disconnected")
                )

            await eventually(new_publisher_seen, what="the restarted engine's KV events")
            # The new process starts empty (what it cached before is recomputed), and its events are applied:
            # its blocks are indexed and repeats follow them.
            async with http.post(f"{restarted.url}/v1/completions", json=ids_completion(cached)) as r:
                usage = (await r.json())["usage"]
                assert (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0, usage
            again = cached
            await eventually(
                lambda: locator.index.location_entries(restarted.url) >= PROMPT_BLOCKS,
                what="the restarted engine's new blocks indexed",
            )
            assert await routed(again) == restarted.url
        finally:
            await router.stop()


async def sim_at(host: str, port: int) -> RunningEngine:
    """An in-process simulator publishing KV events (with replay) on ``host``:``port`` (0: any port)."""
    tokenizer = load_tokenizer(None)
    cfg = EngineConfig(model_name=MODEL, time_scale=20.0, block_size=BLOCK, num_gpu_blocks=4096)
    opts = SimOptions(
        engine=cfg, served_model_names=[MODEL], model_root=MODEL, host=host, port=port, kv_events=True
    )
    return await start_engine(opts, tokenizer, OutputSampler(tokenizer), 0)


async def test_a_pod_replaced_by_one_with_a_new_ip_is_swapped_in() -> None:
    interval = 0.5
    fake = FakeKubeApi()
    await fake.start()
    old = await sim_at("127.0.0.1", 0)
    port = int(old.url.rsplit(":", 1)[1])
    new = await sim_at("127.0.0.2", port)  # the replacement pod: another IP, the same port
    try:
        async with (
            ApiClient(configuration=Configuration(host=fake.url)) as api,
            aiohttp.ClientSession() as http,
        ):
            labels = {"app": "engine"}
            fake.add_pod(make_pod("engine-a", "127.0.0.1", labels=labels))
            fast = Backoff(initial_s=0.02, max_s=0.2)
            discovery = KubernetesDiscovery("default", "app=engine", port, api_client=api, backoff=fast)
            router = await start_router(
                RouterOptions(
                    port=0,
                    discovery=discovery,
                    expected_models=frozenset({MODEL}),
                    routing="kv-aware",
                    scrape_interval=interval,
                )
            )
            registry = router.app.registry
            try:
                await eventually(
                    lambda: any(not s.metrics_stale and s.endpoint.models for s in registry.states()),
                    what="the first pod's engine scraped and its models known",
                    timeout_s=15,
                )
                body = completion(2, prompt="swap " * 40)
                async with Trickle(
                    http, router.url, lambda n: body | {"prompt": f"{n} " + "swap " * 40}
                ) as load:
                    await eventually(lambda: load.to(old.url), what="traffic on the first pod")
                    # A long stream in flight on the old pod while it is replaced: it must finish.
                    long_body = completion(1500, stream=True, prompt="long " * 30)
                    in_flight = asyncio.create_task(read_stream(http, router.url, long_body))
                    old_entry = registry.get(old.url)
                    assert old_entry is not None
                    await eventually(lambda: old_entry.state.in_flight > 0, what="the stream on the old pod")
                    # A rolling replacement: the new pod is Ready, then the old one is deleted.
                    fake.add_pod(make_pod("engine-b", "127.0.0.2", labels=labels))
                    ready = time.monotonic()
                    added = await eventually(
                        lambda: new.url in registry and time.monotonic(), what="the new pod added"
                    )
                    first = await eventually(
                        lambda: sent_to(router, new.url, ready), what="a request to the new pod", timeout_s=15
                    )
                    fake.delete_pod("engine-a")
                    await eventually(lambda: old.url not in registry, what="the old pod's engine removed")
                    removed = time.monotonic()
                    streaming_at_removal = not in_flight.done()
                    status, finished = await in_flight
                    await eventually(lambda: load.to(new.url, first), what="answers from the new pod")
                print(
                    f"\nnew pod (scrape interval {interval:g} s): registered {added - ready:.3f} s after "
                    f"Ready, first request {first - ready:.3f} s after Ready; trickle {load.statuses()}"
                )
                assert streaming_at_removal, "the long stream ended before the old pod was removed"
                assert status == 200 and finished, "the old pod's stream in flight did not finish"
                assert not [s for s in load.sent if s.engine == old.url and s.started > removed]
                assert first - ready < 2 * interval + 1.5
                # The old engine is forgotten: no series, no entries; the new pod's KV events arrive.
                await eventually(
                    lambda: router.front.locator.index.location_entries(new.url) > 0,
                    what="the new pod's KV events indexed",
                )
                assert router.front.locator.index.location_entries(old.url) == 0
                text = (await (await http.get(f"{router.url}/metrics")).read()).decode()
                assert old.url not in text
                assert new.url in text
            finally:
                await router.stop()
    finally:
        await stop_engine(new)
        if old.runner.server is not None:
            await stop_engine(old)
        await fake.close()


async def read_stream(http: aiohttp.ClientSession, url: str, body: dict[str, object]) -> tuple[int, bool]:
    """(status, whether the stream ended with [DONE]) of a streamed completion."""
    async with http.post(f"{url}/v1/completions", json=body) as r:
        data = await r.read()
        return r.status, data.rstrip().endswith(b"data: [DONE]")
