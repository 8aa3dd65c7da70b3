"""1,000 concurrent streams through the router, some waiting in its admission queue: all complete, and
nothing stays in flight or queued."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from support.end_to_end import (
    EventReader,
    completion,
    get_text,
    in_flight,
    inprocess_sims,
    routing_to,
    text_events,
)
from support.metrics import sample_sum


@pytest.mark.slow
async def test_a_thousand_concurrent_streams_all_complete() -> None:
    n, tokens = 1000, 16
    async with (
        inprocess_sims(4, time_scale=50, block_size=16, num_gpu_blocks=4096) as sims,
        # Fewer slots than streams: some wait in the admission queue and must get through too.
        routing_to([s.url for s in sims], max_in_flight=600, max_queue=1000, queue_timeout=120) as router,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http,
    ):
        start = asyncio.Event()

        async def one(i: int) -> list[bytes]:
            await start.wait()
            async with http.post(
                f"{router.url}/v1/completions", json=completion(tokens, stream=True, prompt=f"stream {i}")
            ) as r:
                assert r.status == 200, await r.text()
                return await EventReader(r).to_end()

        most_queued = 0

        async def watch_queue() -> None:
            nonlocal most_queued
            while True:
                most_queued = max(most_queued, router.app.admission.queued)
                await asyncio.sleep(0.02)

        watcher = asyncio.create_task(watch_queue())
        tasks = [asyncio.create_task(one(i)) for i in range(n)]
        start.set()
        try:
            results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        finally:
            watcher.cancel()
        # All 1,000 are sent at once and each stream takes 16 engine steps: the ones beyond 600 queue.
        assert most_queued > 0

        for events in results:
            assert events[-1] == b"[DONE]"
            assert len(text_events(events)) == tokens
            assert json.loads(events[-2])["usage"]["completion_tokens"] == tokens
        assert router.app.admission.queued == 0 and router.app.admission.in_flight == 0
        assert in_flight(router) == {s.url: 0 for s in sims}
        text = await get_text(http, f"{router.url}/metrics")
        for s in sims:
            assert sample_sum(text, "kvstack_router_in_flight_requests", engine=s.url) == 0
            assert sample_sum(text, "kvstack_router_requests_total", engine=s.url, status="200") > 0
        assert sample_sum(text, "kvstack_router_requests_total", status="200") == n
        assert sample_sum(text, "kvstack_router_queued_requests") == 0
        assert sample_sum(text, "kvstack_router_admission_rejections_total") == 0
