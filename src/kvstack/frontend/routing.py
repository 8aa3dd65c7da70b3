"""The one scheduling entry point behind both front ends (the proxy and the Envoy picker).

``parse_route`` reads what routing needs from an OpenAI request (model, stream, session key, the body for
the prompt) and refuses bad bodies with OpenAI errors (400, or 404 for a model no engine serves).
``SchedulerPicker.pick`` turns it into a ``SchedulingRequest`` (tokenizing the prompt and looking up its
cached prefix when the config's plugins need it), runs the scheduler over every known engine, and maps
"nowhere to send it" to OpenAI errors (404 when no engine serves the model, 503 when engines serve it but
none is routable now).

With ``kv_scheduler`` set (routing "auto"), requests use it whenever some engine publishes KV events and
the plain scheduler otherwise, so adding an engine with events switches a fleet to KV-aware routing.

The prefix lookup gets the request's model (a LoRA adapter's requests name the adapter) and ``cache_salt``:
an adapter's blocks are credited only to its requests, and a salted request gets no exact credit.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from kvstack.engines.prompt_tokens import PromptTokenizer, prompt_of
from kvstack.engines.state import EngineRole, EngineState
from kvstack.frontend.prefix import PrefixLookup, PrefixSource
from kvstack.frontend.registry import EngineRegistry
from kvstack.openai import errors
from kvstack.scheduling import NoEndpointError, NoEndpointReason, Scheduler, SchedulingRequest
from kvstack.scheduling.interfaces import SESSION_HEADERS, extract_session_key

_decode = msgspec.json.Decoder()
REQUEST_ID_MAX = 256  # longer client request ids are replaced: they would be forwarded to every engine


def request_id(headers: Mapping[str, str]) -> str:
    """The client's x-request-id when it is short printable ASCII, else a new one (kvs-...); ``headers``
    case-insensitive or lower-cased."""
    given = headers.get("x-request-id")
    if given and len(given) <= REQUEST_ID_MAX and given.isascii() and given.isprintable():
        return given
    # Unique, not secret: the seeded generator (reseeded after fork) spares a getrandom call per request.
    # (to_bytes().hex() gives the same 24 digits as a "024x" format, in half the time.)
    return "kvs-" + random.getrandbits(96).to_bytes(12, "big").hex()


# RouteRequest and Decision are made for every request: not frozen, whose __init__ costs a Python-level
# object.__setattr__ per field.
@dataclass(slots=True)
class RouteRequest:
    """What routing needs from a request body; scheduling never sees the raw bytes."""

    path: str
    model: str | None
    stream: bool
    session_key: str | None
    request_id: str
    body: dict[str, Any]


def decode_json(raw: bytes, what: str) -> Any:
    """``raw`` decoded; a 400 starting with ``what`` when it is not JSON."""
    try:
        return _decode.decode(raw)
    except msgspec.DecodeError as exc:
        raise errors.bad_request(f"{what}: {exc}", "body") from None
    except RecursionError:
        raise errors.bad_request(f"{what}: nested too deeply", "body") from None


def parse_route(
    path: str,
    headers: Mapping[str, str],
    raw: bytes,
    request_id: str,
    registry: EngineRegistry,
    session_headers: Sequence[str] = SESSION_HEADERS,
) -> RouteRequest:
    """The routing view of an OpenAI request; ``headers`` case-insensitive or lower-cased. Raises
    OpenAIError: 400 (not JSON, bad body, model missing while several are served), 404 (unknown
    model)."""
    content_type = headers.get("content-type")
    if content_type and content_type != "application/json":  # (the usual value needs no parsing)
        media_type = content_type.split(";")[0].strip().lower()
        if media_type and media_type != "application/json":
            raise errors.unsupported_media_type()
    body = decode_json(raw, "request body is not valid JSON")
    if not isinstance(body, dict):
        raise errors.bad_request("request body must be a JSON object", "body")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise errors.bad_request("model must be a string", "model")
    known = registry.models()
    if model is None and len(known) > 1:
        raise errors.bad_request(f"model is required: this router serves {sorted(known)}", "model")
    if model is not None and registry.all_models_known() and model not in known:
        raise errors.not_found_model(model, sorted(known))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise errors.bad_request("stream must be a boolean", "stream")
    session = extract_session_key(headers, body, session_headers)
    return RouteRequest(path, model, stream, session, request_id, body)


@dataclass(slots=True)
class Decision:
    """Where a request goes: the engine URLs that may serve it (the chosen one first, then fallbacks for
    retries) and, when its prompt is to be prefilled elsewhere first, the prefill engines (best first)."""

    profile: str  # the scheduling profile that chose ``candidates``
    candidates: list[str]
    prefill: list[str] = field(default_factory=list)

    @property
    def target(self) -> str:
        return self.candidates[0]


class Picker(Protocol):
    """The scheduling entry point as a front end uses it."""

    async def pick(self, request: RouteRequest, states: list[EngineState]) -> Decision: ...

    def decide(self, request: RouteRequest, states: list[EngineState]) -> Decision | None:
        """`pick` without waiting: None when this request's decision needs to wait (for its tokens)."""


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
        if self.kv_scheduler is not None:
            for s in states:  # (a loop, not any() over a generator: this runs for every request)
                if s.knowledge == "kv-events":
                    return self.kv_scheduler
        return self.scheduler

    async def pick(self, route: RouteRequest, states: list[EngineState]) -> Decision:
        model = _model_of(route, states)
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
        return self._decide(route, states, model, scheduler, now, token_ids, lookup)

    def decide(self, route: RouteRequest, states: list[EngineState]) -> Decision | None:
        scheduler = self.scheduler_for(states)
        if scheduler.needs_prefix and self.prompts is not None and self.locator is not None:
            return None  # (the prompt's tokens and where they are cached: pick waits for them)
        return self._decide(route, states, _model_of(route, states), scheduler, time.monotonic(), None, None)

    def _decide(
        self,
        route: RouteRequest,
        states: list[EngineState],
        model: str,
        scheduler: Scheduler,
        now: float,
        token_ids: Sequence[int] | None,
        lookup: PrefixLookup | None,
    ) -> Decision:
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
        prefill = []
        if result.prefill_profile is not None:
            prefill = [e.url for e in result.profiles[result.prefill_profile].targets]
        if lookup is not None and self.locator is not None:
            self.locator.record(result.target.url, lookup, now)
            if prefill:  # the prefill engine computes the prompt too (history for engines without events)
                self.locator.record(prefill[0], lookup, now)
        # The profile's choices, then, since retries may go beyond what it kept (for example engines a
        # saturation filter set aside), every other engine that may serve: a busy engine is a better answer
        # than an error. Prefill-only engines never serve whole requests. (Loops, not comprehensions: each
        # of those is a function object made per request.)
        targets = result.primary.targets
        ordered = [targets[0].url]
        for engine in targets[1:]:
            ordered.append(engine.url)
        chosen = set(ordered)
        for s in states:
            url = s.url
            if url not in chosen and _may_serve(s, model):
                ordered.append(url)
        return Decision(result.primary_profile, ordered, prefill)


def _model_of(route: RouteRequest, states: list[EngineState]) -> str:
    """The model a request is scheduled for. None named: vLLM serves its default, so any engine that
    serves exactly one model will do."""
    if route.model is not None:
        return route.model
    known = {m for s in states for m in s.endpoint.models}
    return next(iter(known)) if len(known) == 1 else ""


def _may_serve(state: EngineState, model: str) -> bool:
    """A routable engine that may take this whole request (a prefill-only engine never does)."""
    return state.routable and state.endpoint.role is not EngineRole.PREFILL and _serves(state, model)


def _serves(state: EngineState, model: str) -> bool:
    return not model or not state.endpoint.models or model in state.endpoint.models
