"""Fixtures of the picker tests: simulated engines in this event loop and a picker over them."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from kvstack.sim.cluster import stop_engine
from support.pickers import PickerStack, picking_over
from support.routers import start_sims


@pytest.fixture(params=["lean", "grpcio"])
async def picker_stack(request: pytest.FixtureRequest) -> AsyncIterator[PickerStack]:
    """Two sims behind a round-robin picker, once per gRPC transport; ``@pytest.mark.epp_options(...)`` sets
    EppOptions fields."""
    marker = request.node.get_closest_marker("epp_options")
    options = {"routing": "round-robin", "transport": request.param, **(marker.kwargs if marker else {})}
    engines = await start_sims(2, time_scale=100.0)
    try:
        async with picking_over(engines, **options) as stack:
            yield stack
    finally:
        for e in engines:
            await stop_engine(e)
