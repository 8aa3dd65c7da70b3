"""The router's side of scheduling: turn a parsed request into a ``SchedulingRequest`` (tokenizing the
prompt and looking up its cached prefix when the config's plugins need it), run the scheduler over every
known engine, and map "nowhere to send it" to OpenAI errors (404 when no engine serves the model, 503
when engines serve it but none is routable now).

With ``kv_scheduler`` set (routing "auto"), requests use it whenever some engine publishes KV events and
the plain scheduler otherwise, so adding an engine with events switches a fleet to KV-aware routing.

The prefix lookup gets the request's model (a LoRA adapter's requests name the adapter) and ``cache_salt``:
an adapter's blocks are credited only to its requests, and a salted request gets no exact credit.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvstack.engines.prompt_tokens import PromptTokenizer, prompt_of
from kvstack.engines.state import EngineState
from kvstack.openai import errors
from kvstack.router.prefix import PrefixLookup, PrefixSource
from kvstack.scheduling import NoEndpointError, NoEndpointReason, Scheduler, SchedulingRequest

if TYPE_CHECKING:
    from kvstack.router.app import RouteRequest


class SchedulerPicker:
    """Adapts ``Scheduler`` to the router: returns (profile, [target, *fallbacks]) as engine URLs."""

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        kv_scheduler: Scheduler | None = None,
        prompts: PromptTokenizer | None = None,
        locator: PrefixSource | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.kv_scheduler = kv_scheduler
        self.prompts = prompts
        self.locator = locator

    @property
    def needs_prefix(self) -> bool:
        return self.scheduler.needs_prefix or (
            self.kv_scheduler is not None and self.kv_scheduler.needs_prefix
        )

    def scheduler_for(self, states: list[EngineState]) -> Scheduler:
        if self.kv_scheduler is not None and any(s.knowledge == "kv-events" for s in states):
            return self.kv_scheduler
        return self.scheduler

    async def pick(self, route: RouteRequest, states: list[EngineState]) -> tuple[str, list[str]]:
        model = route.model
        if model is None:
            # No model named: vLLM serves its default; any engine that serves exactly one model will do.
            known = {m for s in states for m in s.endpoint.models}
            model = next(iter(known)) if len(known) == 1 else ""
        scheduler = self.scheduler_for(states)
        lookup: PrefixLookup | None = None
        token_ids = None
        now = time.monotonic()
        if scheduler.needs_prefix and self.prompts is not None and self.locator is not None:
            token_ids = await self.prompts.token_ids(model, prompt_of(route.path, route.body))
            if token_ids is not None:
                salt = route.body.get("cache_salt")
                lookup = await self.locator.find(
                    token_ids,
                    states,
                    now,
                    model=model,
                    cache_salt=salt if isinstance(salt, str) else None,
                )
        request = SchedulingRequest(
            model=model,
            request_id=route.request_id,
            prompt_token_ids=token_ids,
            prefix=None if lookup is None else lookup.view,
            session_key=route.session_key,
            body_fields={"user": route.body["user"]} if "user" in route.body else {},
        )
        try:
            result = scheduler.schedule(request, states, now)
        except NoEndpointError as exc:
            if exc.reason in (NoEndpointReason.MODEL_NOT_SERVED, NoEndpointReason.NO_ENGINES):
                served = sorted({m for s in states for m in s.endpoint.models})
                raise errors.not_found_model(model, served) from None
            raise errors.service_unavailable(str(exc)) from None
        if lookup is not None and self.locator is not None:
            self.locator.record(result.target.url, lookup, now)
        ordered = [result.target.url, *(e.url for e in result.fallbacks)]
        # Retries may go beyond what the profile kept (for example engines a saturation filter set aside):
        # a busy engine is a better answer than an error.
        chosen = set(ordered)
        ordered += [s.url for s in states if s.routable and s.url not in chosen and _serves(s, model)]
        return result.primary_profile, ordered


def _serves(state: EngineState, model: str) -> bool:
    return not model or not state.endpoint.models or model in state.endpoint.models
