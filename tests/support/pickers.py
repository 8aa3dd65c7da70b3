"""Endpoint pickers in the test's event loop, over simulated engines."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from kvstack.engines.state import Endpoint
from kvstack.epp.server import EppOptions, RunningEpp, start_epp
from kvstack.sim.cluster import RunningEngine
from support.ext_proc import ExtProcClient
from support.waiting import eventually


@dataclass
class PickerStack:
    engines: list[RunningEngine]
    epp: RunningEpp
    client: ExtProcClient

    def address(self, i: int) -> str:
        return self.engines[i].url.removeprefix("http://")

    def in_flight(self) -> dict[str, int]:
        counts = {}
        for i, engine in enumerate(self.engines):
            entry = self.epp.front.registry.get(engine.url)
            counts[self.address(i)] = 0 if entry is None else entry.state.in_flight
        return counts


async def wait_engines(epp: RunningEpp, count: int) -> None:
    """Until ``count`` engines have known models and fresh metrics."""

    def ready() -> bool:
        known = [e for e in epp.front.registry if e.state.endpoint.models and not e.state.metrics_stale]
        return len(known) >= count

    await eventually(ready, what=f"{count} engines known to the picker", timeout_s=10, interval_s=0.05)


@contextlib.asynccontextmanager
async def picking_over(engines: list[RunningEngine], **options: Any) -> AsyncIterator[PickerStack]:
    """A picker (free ports) over ``engines``; ``options`` are EppOptions fields."""
    opts = EppOptions(grpc_port=0, http_port=0, engines=[Endpoint(e.url) for e in engines], **options)
    epp = await start_epp(opts)
    client = ExtProcClient(epp.grpc_address)
    try:
        await wait_engines(epp, len(engines))
        yield PickerStack(engines, epp, client)
    finally:
        await client.close()
        await epp.stop()
