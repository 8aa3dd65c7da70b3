"""model-filter: keep the engines that serve the requested model.

Rule: keep the engines whose model list (from /v1/models, or given by discovery) contains ``request.model``.
When no engine is known to serve it, keep instead the engines whose model list is still unknown (empty:
/v1/models has not answered yet), so an engine serves traffic as soon as it is added; one that turns out
not to serve the model answers 404, which the router forwards. When some engine is known to serve the
model, engines of unknown models are not tried.

Parameters: none. Cost: O(candidates), one set lookup each.
When to use: always. The scheduler runs it before every profile, so profiles need not list it; an empty
result there becomes NoEndpointError(MODEL_NOT_SERVED).
"""

from __future__ import annotations

from typing import ClassVar

from kvstack.engines.state import EngineState
from kvstack.scheduling.interfaces import CycleState, Filter, SchedulingRequest


class ModelFilter(Filter):
    type_name: ClassVar[str] = "model-filter"

    def filter(
        self, request: SchedulingRequest, state: CycleState, candidates: list[EngineState]
    ) -> list[EngineState]:
        # (Loops, not comprehensions: each of those is a function object made per request.)
        model = request.model
        serving = []
        for e in candidates:
            if model in e.endpoint.models:
                serving.append(e)
        if serving:
            return serving
        for e in candidates:
            if not e.endpoint.models:
                serving.append(e)
        return serving
