"""Fixtures of the router tests: simulated engines in this event loop, with or without a router."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from kvstack.engines.state import Endpoint
from kvstack.frontend.circuit import CircuitConfig
from kvstack.router.app import RouterConfig
from kvstack.router.proxy import RetryPolicy
from kvstack.router.server import RouterOptions, start_router
from kvstack.sim.cluster import RunningEngine, stop_engine
from support.routers import FAST, Stack, start_sims, wait_models


@pytest.fixture
async def stack(request: pytest.FixtureRequest) -> AsyncIterator[Stack]:
    """Two sims behind the router; ``@pytest.mark.routing("round-robin")`` picks another preset."""
    marker = request.node.get_closest_marker("routing")
    engines = await start_sims(2)
    opts = RouterOptions(
        port=0,
        engines=[Endpoint(e.url) for e in engines],
        routing=marker.args[0] if marker else "default",
        app=RouterConfig(timeouts=FAST),
        retry=RetryPolicy(max_attempts=3, backoff_base=0.01),
        circuit=CircuitConfig(failure_threshold=3, open_seconds=60.0),
    )
    router = await start_router(opts)
    await wait_models(router, 2)
    http = aiohttp.ClientSession()
    try:
        yield Stack(engines, router, http)
    finally:
        await http.close()
        await router.stop()
        for e in engines:
            await stop_engine(e)


@pytest.fixture
async def sims() -> AsyncIterator[list[RunningEngine]]:
    """Two fast simulated engines (time scale 100), no router."""
    engines = await start_sims(2, time_scale=100.0)
    try:
        yield engines
    finally:
        for e in engines:
            await stop_engine(e)
