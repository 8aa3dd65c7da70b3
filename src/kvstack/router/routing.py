"""The router's side of scheduling: turn a parsed request into a ``SchedulingRequest``, run the
configured scheduler over every known engine, and map "nowhere to send it" to OpenAI errors
(404 when no engine serves the model, 503 when engines serve it but none is routable now).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstack.engines.state import EngineState
from kvstack.openai import errors
from kvstack.scheduling import NoEndpointError, NoEndpointReason, Scheduler, SchedulingRequest

if TYPE_CHECKING:
    from kvstack.router.app import RouteRequest


class SchedulerPicker:
    """Adapts ``Scheduler`` to the router: returns (profile, [target, *fallbacks]) as engine URLs."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def pick(self, route: RouteRequest, states: list[EngineState]) -> tuple[str, list[str]]:
        model = route.model
        if model is None:
            # No model named: vLLM serves its default; any engine that serves exactly one model will do.
            known = {m for s in states for m in s.endpoint.models}
            model = next(iter(known)) if len(known) == 1 else ""
        request = SchedulingRequest(
            model=model,
            request_id=route.request_id,
            prompt_token_ids=None,
            session_key=route.session_key,
            body_fields={"user": route.body["user"]} if "user" in route.body else {},
        )
        try:
            result = self.scheduler.schedule(request, states)
        except NoEndpointError as exc:
            if exc.reason in (NoEndpointReason.MODEL_NOT_SERVED, NoEndpointReason.NO_ENGINES):
                served = sorted({m for s in states for m in s.endpoint.models})
                raise errors.not_found_model(model, served) from None
            raise errors.service_unavailable(str(exc)) from None
        ordered = [result.target.url, *(e.url for e in result.fallbacks)]
        # Retries may go beyond what the profile kept (for example engines a saturation filter set aside):
        # a busy engine is a better answer than an error.
        chosen = set(ordered)
        ordered += [s.url for s in states if s.routable and s.url not in chosen and _serves(s, model)]
        return result.primary_profile, ordered


def _serves(state: EngineState, model: str) -> bool:
    return not model or not state.endpoint.models or model in state.endpoint.models
