"""The proxy's prefill step for a request scheduling disaggregated (a `Decision` with prefill engines).

The prompt is prefilled on the first of the decision's prefill engines whose circuit lets a request through
(one attempt, no retry elsewhere), counted in flight on that engine meanwhile; the outcome settles its
breaker. The decode engines then get the client's body with the prefill's ``kv_transfer_params``, or the
client's body unchanged after a fallback (`kvstack.frontend.pd`), and compute the prompt themselves.
A client that leaves during the prefill cancels it: its connection closes and the engine aborts.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from kvstack.frontend import pd
from kvstack.frontend.metrics import RouterMetrics
from kvstack.frontend.registry import EngineEntry, EngineRegistry
from kvstack.frontend.routing import RouteRequest
from kvstack.router.proxy import Timeouts, forward_headers


class PrefillStep:
    def __init__(self, registry: EngineRegistry, metrics: RouterMetrics, prefiller: pd.Prefiller) -> None:
        self.registry = registry
        self.metrics = metrics
        self.prefiller = prefiller

    async def decode_body(
        self,
        route: RouteRequest,
        raw: bytes,
        prefill: list[str],
        client_headers: Mapping[str, str],
        timeouts: Timeouts,
    ) -> bytes:
        """What the decode engines get for ``route`` (whose body arrived as ``raw``)."""
        if pd.unsupported(route.path, route.body):
            self.prefiller.fallback("unsupported_request")
            return raw
        entry = self._first_allowed(prefill)
        if entry is None:
            self.prefiller.fallback("no_prefill_engine")
            return raw
        state, breaker = entry.state, entry.breaker
        gauge = self.metrics.engine_in_flight(state.url)
        state.in_flight += 1
        self.registry.publish_in_flight(entry)
        self.registry.note_sent(state, time.monotonic())
        gauge.set(state.in_flight)
        verdict: bool | None = None  # a client that left says nothing about the engine
        try:
            headers = forward_headers(client_headers, route.request_id)
            result = await self.prefiller.prefill(
                state.url, route.path, route.body, headers, within=timeouts.total
            )
            verdict = result.engine_ok
        finally:
            breaker.settle(verdict)
            self.metrics.set_circuit(state.url, breaker.state)
            state.in_flight -= 1
            self.registry.publish_in_flight(entry)
            state.in_flight_at_scrape = min(state.in_flight_at_scrape, state.total_in_flight)
            gauge.set(state.in_flight)
        return result.body_for_decode(route.body, raw)

    def _first_allowed(self, urls: list[str]) -> EngineEntry | None:
        for url in urls:
            entry = self.registry.get(url)
            if entry is not None and entry.breaker.allow():
                return entry
        return None
