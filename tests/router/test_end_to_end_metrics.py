"""Engine metrics end to end: an engine exporting legacy metric names is detected and reported once per
name, and an engine whose metrics went stale counts as unknown, not idle."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvstack.sim.cluster import RunningEngine
from support.end_to_end import (
    completion,
    engine_view,
    entry,
    get_text,
    inprocess_sims,
    patch_metrics,
    post_status,
    routing_to,
    start_sim_processes,
    stopping,
    with_queue,
)
from support.metrics import sample_sum
from support.waiting import eventually

# -- an engine exporting legacy metric names -----------------------------------------------------------------
LEGACY_PAIRS = [
    ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
    ["vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"],
    ["vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"],
]


@pytest.mark.slow
async def test_legacy_metrics_engine_is_detected_and_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvstack.engines.scraper")
    current = await start_sim_processes(tmp_path / "current", 1)
    legacy = await start_sim_processes(tmp_path / "legacy", 1, "--legacy-metric-names")
    with stopping(current + legacy):
        (new,), (old,) = current, legacy
        async with routing_to([new.url, old.url]) as router, aiohttp.ClientSession() as http:
            # Several scrapes of the legacy engine, to show each name is warned about once, not per scrape.
            seen: set[float] = set()

            async def scraped_five_times() -> bool:
                reading = entry(router, old.url).state.metrics
                if reading is not None:
                    seen.add(reading.scraped_at)
                return len(seen) >= 5

            await eventually(
                scraped_five_times, what="five scrapes of the legacy engine", timeout_s=15, interval_s=0.05
            )
            view = (await engine_view(http, router, old.url))["metrics"]
            assert {p[0] for p in LEGACY_PAIRS} <= set(view["missing"])
            assert sorted(view["aliases_used"]) == LEGACY_PAIRS
            assert view["kv_usage"] is not None  # read through the legacy alias, not turned into "unknown"
            assert view["queue"] is not None and view["running"] is not None
            assert (await engine_view(http, router, new.url))["metrics"]["missing"] == []

            metrics = await get_text(http, f"{router.url}/metrics")
            for name in view["missing"]:
                assert sample_sum(metrics, "kvstack_engine_metric_missing", engine=old.url, metric=name) == 1
            assert sample_sum(metrics, "kvstack_engine_metric_missing", engine=new.url) == 0
            assert (
                f'kvstack_engine_metric_missing{{engine="{old.url}",metric="vllm:kv_cache_usage_perc"}} 1.0'
                in metrics
            )

            warnings = [
                r.getMessage()
                for r in caplog.records
                if r.levelno == logging.WARNING and r.name == "kvstack.engines.scraper"
            ]
            for name in view["missing"]:
                said = [w for w in warnings if old.url in w and f"exports no {name} " in w]
                assert len(said) == 1, (name, said)
            legacy_kv = next(w for w in warnings if "exports no vllm:kv_cache_usage_perc " in w)
            assert "found legacy vllm:gpu_cache_usage_perc" in legacy_kv
            assert not [w for w in warnings if new.url in w]


# -- stale metrics are never idle ----------------------------------------------------------------------------
async def test_stale_metrics_count_as_unknown_not_idle() -> None:
    async with (
        inprocess_sims(2, time_scale=50) as (idle, busy),
        routing_to([idle.url, busy.url]) as router,
        aiohttp.ClientSession() as http,
    ):
        patch_metrics(busy, with_queue(10))  # saturated by the default profile's filter (queue > 5)

        async def both_fresh() -> bool:
            views = [await engine_view(http, router, e.url) for e in (idle, busy)]
            ok = all(v["metrics"] and not v["metrics"]["stale"] for v in views)
            return ok and views[1]["metrics"]["queue"] == 10

        await eventually(both_fresh, what="fresh readings of both engines", timeout_s=15, interval_s=0.05)

        async def served(engine: RunningEngine) -> float:
            text = await get_text(http, f"{router.url}/metrics")
            return sample_sum(text, "kvstack_router_requests_total", engine=engine.url)

        for i in range(8):
            assert await post_status(http, router, completion(2, prompt=f"fresh {i}")) == 200
        assert (await served(idle), await served(busy)) == (8, 0)

        # The idle engine's /metrics stops making sense; the engine itself keeps serving.
        patch_metrics(idle, lambda _: b"<html>metrics exporter crashed</html>\n")

        async def idle_is_stale() -> dict[str, Any] | None:
            view = await engine_view(http, router, idle.url)
            return view if view["metrics"]["stale"] else None

        view = await eventually(
            idle_is_stale, what="the engine's metrics marked stale", timeout_s=15, interval_s=0.05
        )
        # Healthy and routable (its /metrics answered, just not with metrics), last reading kept but stale.
        assert view["healthy"] and view["routable"] and view["circuit"] == "closed"
        assert view["metrics"]["queue"] == 0

        # Its last reading said idle (queue 0) against the other's queue of 10; stale, it counts as unknown.
        for i in range(8):
            assert await post_status(http, router, completion(2, prompt=f"stale {i}")) == 200
        assert (await served(idle), await served(busy)) == (8, 8)
        text = await get_text(http, f"{router.url}/metrics")
        assert sample_sum(text, "kvstack_engine_scrape_errors_total", engine=idle.url, reason="parse") >= 1
