"""A real vLLM engine SIGKILLed under load and started again on its address, behind the router with another
one: it serves again within two scrape intervals of answering /health, the prefix entries of its old
process are gone before it answers (a prompt it cached before must be recomputed, never credited), and the
new process's KV events are indexed. Measured times are printed."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvstack.engines.state import Endpoint
from kvstack.router.server import RouterOptions, RunningRouter, start_router
from support.engines import EngineProcess, require_vllm, start_vllm
from support.metrics import sample_sum
from support.trickle import Trickle, healthy_at
from support.waiting import eventually

# Three vLLM starts (two engines, one restart): 40 s to several minutes each on a busy 2-core machine (a
# restart competes with the loaded steady engine for the core vLLM binds its threads to).
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(900),
    # A vLLM server restarted right after a SIGKILL hung in startup once in a fresh `make test` (its log ends
    # after the config lines; 480 s without /health), which would fail CI for a reason outside kvstack.
    # Real-vLLM rejoin is measured by benchmarks/chaos.py; this test runs on demand until that is understood.
    pytest.mark.skipif(
        os.environ.get("KVSTACK_VLLM_RESTART_TESTS") != "1",
        reason="restarts a SIGKILLed vLLM, which can hang in startup: set KVSTACK_VLLM_RESTART_TESTS=1",
    ),
]

MODEL = "tiny"  # start_vllm's served name
BLOCK = 128  # vLLM's CPU block size
LONG = " ".join(f"chapter {i} of the document kept before the kill says {i * 7 % 13}" for i in range(60))
INTERVAL = 1.0  # the default scrape interval


@pytest.fixture
def victim_starting(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Future[EngineProcess]]:
    """A vLLM engine of this test's own, to be killed; it starts in a thread while the session's engine
    (the next fixture) starts too."""
    require_vllm()
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(start_vllm, tiny_model_dir, tmp_path / "victim")
        try:
            yield starting
        finally:
            starting.result().stop()


def sent_to(router: RunningRouter, url: str, since: float) -> float | None:
    entry = router.app.registry.get(url)
    times = [] if entry is None else [t for t in entry.state.recent_requests if t >= since]
    return min(times) if times else None


async def complete(http: aiohttp.ClientSession, url: str, prompt: str) -> tuple[int, str]:
    """(cached prompt tokens, engine header) of a 1-token completion."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    async with http.post(f"{url}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        reply: dict[str, Any] = await r.json()
        details = reply["usage"].get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0), r.headers.get("x-kvstack-engine", "")


async def test_restarted_vllm_serves_again_and_recomputes_what_it_cached_before(
    victim_starting: Future[EngineProcess], vllm_engine: EngineProcess, tiny_model_dir: Path
) -> None:
    victim = await asyncio.to_thread(victim_starting.result)
    async with aiohttp.ClientSession() as http:
        router = await start_router(
            RouterOptions(
                port=0,
                engines=[Endpoint(vllm_engine.url), Endpoint(victim.url)],
                tokenizers={"*": str(tiny_model_dir)},
                routing="kv-aware",
                scrape_interval=INTERVAL,
            )
        )
        index = router.front.locator.index
        registry = router.app.registry
        try:
            await eventually(
                lambda: all(
                    e.state.knowledge == "kv-events" and e.state.endpoint.models and not e.state.metrics_stale
                    for e in registry
                ),
                what="both engines' models, metrics and KV events known",
                timeout_s=30,
            )
            await complete(http, victim.url, LONG)  # cached on the victim only
            await eventually(lambda: index.location_entries(victim.url) >= 2, what="its blocks indexed")
            assert (await complete(http, router.url, LONG))[1] == victim.url  # prefix credit

            def body(n: int) -> dict[str, object]:
                return {"model": MODEL, "prompt": f"request {n} of the steady trickle", "max_tokens": 2}

            feeds = router.feeds
            subscriber = None if feeds is None else feeds.subscriber(victim.url)
            assert subscriber is not None
            changes: list[tuple[float, bool]] = []  # (when, connected) of the victim's KV-event stream

            async def follow_connection() -> None:
                while True:
                    if not changes or changes[-1][1] != subscriber.connected:
                        changes.append((time.monotonic(), subscriber.connected))
                    await asyncio.sleep(0.01)

            watching = asyncio.create_task(follow_connection())
            async with Trickle(http, router.url, body, every_s=0.5, concurrency=1) as load:
                await asyncio.sleep(2.0)
                await asyncio.to_thread(victim.kill)
                killed = time.monotonic()
                victim.start_again()
                healthy = await healthy_at(http, victim.url, timeout_s=480)
                stale = index.location_entries(victim.url)
                first = await eventually(
                    lambda: sent_to(router, victim.url, healthy), what="a request to it", timeout_s=30
                )
                await eventually(lambda: load.to(victim.url, healthy), what="an answer from it", timeout_s=30)
                await eventually(lambda: subscriber.connected, what="its KV events reconnected", timeout_s=30)
            watching.cancel()
            events_back = next(t for t, connected in changes if connected and t > killed)
            rejoin = first - healthy
            print(
                f"\nrejoin (vLLM, scrape interval {INTERVAL:g} s): healthy {healthy - killed:.1f} s after "
                f"the kill, first request {rejoin:.3f} s after healthy, KV events connected "
                f"{events_back - healthy:+.3f} s from healthy; prefix entries at healthy {stale}; "
                f"trickle statuses {load.statuses()}"
            )
            assert stale == 0, "the old process's prefix entries outlived it"
            assert rejoin < 2 * INTERVAL + 3.0, f"rejoin took {rejoin:.2f} s"
            # What it cached before the kill is gone: the new process recomputes it...
            cached, _ = await complete(http, victim.url, LONG)
            assert cached == 0
            # ... and its new KV events are indexed, so repeats follow its new cache again.
            await eventually(lambda: index.location_entries(victim.url) >= 2, what="its new blocks indexed")
            cached, engine = await complete(http, router.url, LONG)
            assert engine == victim.url and cached >= BLOCK
            text = (await (await http.get(f"{router.url}/metrics")).read()).decode()
            assert sample_sum(text, "kvstack_engine_rejoins_total", engine=victim.url) >= 1
            assert sample_sum(text, "kvstack_prefix_entries_dropped_total", engine=victim.url) >= 2
        finally:
            await router.stop()
