"""health-filter: keep the routable engines.

Rule: keep ``EngineState.routable`` engines: healthy (the last health check or scrape reached them), not
draining, and circuit not open. A half-open circuit is routable: the proxy's breaker lets exactly one
probe through and sends the rest elsewhere.

Parameters: none. Cost: O(candidates).
When to use: always. The scheduler runs it before every profile, after model-filter; an empty result
there becomes NoEndpointError(NO_ROUTABLE_ENGINE) listing why each engine is out.
"""

from __future__ import annotations

from typing import ClassVar

from kvstack.engines.state import CircuitState, EngineState
from kvstack.scheduling.interfaces import CycleState, Filter, SchedulingRequest


class HealthFilter(Filter):
    type_name: ClassVar[str] = "health-filter"

    def filter(
        self, request: SchedulingRequest, state: CycleState, candidates: list[EngineState]
    ) -> list[EngineState]:
        routable = []
        for e in candidates:  # (a loop, not a comprehension: that is a function object made per request)
            if e.routable:
                routable.append(e)
        return routable


def unroutable_reason(engine: EngineState) -> str:
    """Why an engine is not routable, for error messages; "routable" when it is."""
    reasons = []
    if not engine.healthy:
        reasons.append("unhealthy")
    if engine.draining:
        reasons.append("draining")
    if engine.circuit is CircuitState.OPEN:
        reasons.append("circuit open")
    return ", ".join(reasons) or "routable"
