"""A front end's answer to an engine going down and coming back (the scraper's `EngineWatcher`).

Down (a refused connect: nothing listens at its address): the engine's prefix entries, from KV events and
from routing history, are dropped at once, since whatever answers there next is a new process with an
empty cache. Back (its next good scrape): its circuit, if open, turns half-open so the next request probes
it now rather than when an open time grown during the outage runs out; ``kvstack_engine_rejoins`` counts it.
Why these signals: docs/design/kv-aware-routing.md, "Engine restarts".
"""

from __future__ import annotations

from kvstack.engines.state import EngineState
from kvstack.frontend.metrics import RouterMetrics
from kvstack.frontend.prefix import PrefixLocator
from kvstack.frontend.registry import EngineRegistry


class EngineRejoin:
    def __init__(self, registry: EngineRegistry, locator: PrefixLocator, metrics: RouterMetrics) -> None:
        self.registry = registry
        self.locator = locator
        self.metrics = metrics

    def engine_down(self, state: EngineState) -> None:
        self.locator.engine_down(state.url)

    def engine_back(self, state: EngineState) -> None:
        entry = self.registry.get(state.url)
        if entry is None:
            return
        entry.breaker.probe_now()
        self.metrics.set_circuit(state.url, entry.breaker.state)
        self.metrics.engine_rejoined(state.url)
