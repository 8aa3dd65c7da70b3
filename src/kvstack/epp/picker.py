"""The endpoint picker: one `PickerStream` per ext_proc stream (one HTTP request through Envoy).

Request phase, by the body mode Envoy announces (``protocol_config``; BUFFERED when absent):
- BUFFERED: the headers are answered CONTINUE; the whole body arrives in one message, and its answer carries
  the destination (header mutation plus ``envoy.lb`` metadata, route cache cleared).
- STREAMED with ``send_body_without_waiting_for_header_response``, and FULL_DUPLEX_STREAMED: chunks are
  gathered up to ``max_body_bytes``; at the last one the headers answer carries the destination, then each
  chunk is answered (full duplex: the whole body is sent back as one streamed mutation).
- STREAMED without it (Envoy routes before the body), and no body (a GET): the destination goes on the
  headers answer, decided without the body (no model, prompt or body session key).
The decision is `frontend.routing`'s, the same as the proxy's: parse (400/404 as OpenAI JSON), admission
(429 when shed), scheduling over the engines in Envoy's subset hint when it sends one (503 when none is
eligible). The header lists the pick and then up to ``fallbacks`` other engines for Envoy's retries.
When scheduling disaggregates the request, ``x-prefiller-host-port`` names the prefill engine for the
decode engine's sidecar (`kvstack.router.sidecar`); a client's own value of it is removed.

Response phase: ``:status`` and the served endpoint (``x-gateway-destination-endpoint-served``; a fallback
when Envoy retried) settle the circuit breakers and the request metrics. The time to first byte is the time
to the response headers, or to the first body chunk when Envoy sends response bodies; then the tail of the
body also gives the tokens the engine's ``usage`` reports (`kvstack.epp.usage`). The request counts as in
flight on its engine, and holds its admission slot, until the stream ends (``close``), whatever ended it;
a decision that completes after Envoy reset the stream counts nothing.
"""

from __future__ import annotations

import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from kvstack.epp import messages as m
from kvstack.epp.usage import UsageTail
from kvstack.frontend.admission import AdmissionRejected
from kvstack.frontend.assembly import FrontEnd
from kvstack.frontend.pd import PREFILLER_HEADER, host_port
from kvstack.frontend.registry import EngineEntry
from kvstack.frontend.routing import RouteRequest, parse_route, request_id
from kvstack.openai import errors
from kvstack.openai.errors import OpenAIError
from kvstack.scheduling.interfaces import SESSION_HEADERS

Answers = list[m.ProcessingResponse]
BUFFERED, STREAMED, FULL_DUPLEX = 2, 1, 4  # ProcessingMode.BodySendMode values
HEADERS_ONLY = -1  # this stream's decision is made on the request headers


@dataclass
class PickerConfig:
    max_body_bytes: int = 32 * 1024 * 1024
    fallbacks: int = 2  # engines after the pick in the destination header
    session_headers: tuple[str, ...] = SESSION_HEADERS


class EndpointPicker:
    """Decisions for Envoy, on the shared front end."""

    def __init__(self, front: FrontEnd, config: PickerConfig | None = None) -> None:
        self.front = front
        self.config = config or PickerConfig()
        self._addresses: dict[str, str] = {}  # engine URL -> ip:port
        self.streams = 0  # open ext_proc streams

    def stream(self) -> PickerStream:
        return PickerStream(self)

    def address(self, url: str) -> str:
        """An engine's ``host:port`` as Envoy's original-destination cluster takes it."""
        found = self._addresses.get(url)
        if found is None:
            found = host_port(url)
            if len(self._addresses) > 65536:
                self._addresses.clear()
            self._addresses[url] = found
        return found

    async def decide(self, request: PendingRequest) -> tuple[EngineEntry, list[str], str | None]:
        """(the chosen engine's entry, destination addresses: pick first, the address of the engine to
        prefill the prompt on when scheduling disaggregates the request). Raises OpenAIError."""
        front = self.front
        states = front.registry.states()
        if request.subset is not None:
            allowed = set(request.subset)
            states = [s for s in states if self.address(s.url) in allowed]
            if not states:
                raise errors.service_unavailable("no engine of the endpoint subset Envoy allows is known")
        route = request.route
        if route is None:
            route = RouteRequest(request.path, None, False, None, request.request_id, {})
        decision = await front.picker.pick(route, states)
        candidates = decision.candidates
        entry = _first_allowed(front, candidates)
        front.metrics.decision(decision.profile, entry.state.url)
        chosen = [entry.state.url, *(u for u in candidates if u != entry.state.url)]
        prefiller = self.address(decision.prefill[0]) if decision.prefill else None
        return entry, [self.address(u) for u in chosen[: 1 + self.config.fallbacks]], prefiller


def _first_allowed(front: FrontEnd, candidates: list[str]) -> EngineEntry:
    """The first candidate whose circuit lets a request through (a half-open circuit lets one probe)."""
    for url in candidates:
        entry = front.registry.get(url)
        if entry is not None and entry.breaker.allow():
            return entry
    raise errors.service_unavailable("no engine can take the request now (circuits open)")


@dataclass
class PendingRequest:
    path: str
    method: str
    headers: dict[str, str]
    request_id: str
    subset: list[str] | None
    route: RouteRequest | None = None
    chunks: list[bytes] = field(default_factory=list)
    size: int = 0


# The answer to a stream Envoy reset while the picker decided: never sent, nothing to count.
_GONE = m.immediate_error(errors.service_unavailable("the stream ended while the picker decided"))


class PickerStream:
    """One ext_proc stream: see the module docstring."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker
        picker.streams += 1
        self.started = time.monotonic()
        self.mode = BUFFERED
        self.pending: PendingRequest | None = None
        self.entry: EngineEntry | None = None
        self.addresses: list[str] = []
        self.model_label = "other"
        self.admitted = False
        self.status = 0  # the client's status: Envoy's response, or our immediate answer
        self.first_byte_at: float | None = None
        self.body_seen = False
        self.usage: UsageTail | None = None
        self.closed = False

    async def handle(self, request: m.ProcessingRequest) -> list[m.ProcessingResponse]:
        """The answers to one message from Envoy (none while gathering a streamed body)."""
        answers = self.step(request)
        return answers if isinstance(answers, list) else await answers

    def step(self, request: m.ProcessingRequest) -> Answers | Coroutine[Any, Any, Answers]:
        """``handle`` without a coroutine where none is needed: the answers at once, or a coroutine that
        makes the decision (scheduling may wait for a tokenizer or an admission slot)."""
        kind = request.WhichOneof("request")
        if kind == "request_headers":
            return self._request_headers(request)
        if kind == "request_body":
            return self._request_body(request)
        if kind == "response_headers":
            self._response_headers(request)
        elif kind == "response_body":
            self._response_body(request)
        elif kind is None:  # a message naming no phase: nothing to continue
            return [m.immediate_error(errors.bad_request("ProcessingRequest names no phase"))]
        return [m.proceed(kind)]

    def _request_headers(self, request: m.ProcessingRequest) -> Answers | Coroutine[Any, Any, Answers]:
        if request.HasField("protocol_config"):
            config = request.protocol_config
            mode = config.request_body_mode
            early = config.send_body_without_waiting_for_header_response
            if mode == FULL_DUPLEX or (mode == STREAMED and early):
                self.mode = mode
            elif mode == STREAMED:
                self.mode = HEADERS_ONLY
        message = request.request_headers
        headers = m.header_dict(message)
        pending = self.pending = PendingRequest(
            path=headers.get(":path", "/").split("?", 1)[0],
            method=headers.get(":method", "GET"),
            headers=headers,
            request_id=request_id(headers),
            subset=m.subset_hint(request),
        )
        if message.end_of_stream or self.mode == HEADERS_ONLY:
            return self._decide(pending, None)
        if self.mode == BUFFERED:
            return [m.proceed("request_headers")]
        return []

    def _request_body(self, request: m.ProcessingRequest) -> Answers | Coroutine[Any, Any, Answers]:
        pending = self.pending
        if pending is None:
            return [m.immediate_error(errors.bad_request("request body before its headers"))]
        if self.mode == HEADERS_ONLY:  # already routed
            return [m.proceed("request_body")]
        body = request.request_body
        pending.chunks.append(body.body)
        pending.size += len(body.body)
        if pending.size > self.picker.config.max_body_bytes:
            limit = self.picker.config.max_body_bytes
            return [self._refuse(errors.http_detail(413, f"request body is larger than {limit} bytes"))]
        if not (body.end_of_stream or body.end_of_stream_without_message):
            return [] if self.mode != BUFFERED else [m.proceed("request_body")]
        raw = b"".join(pending.chunks)
        try:
            pending.route = parse_route(
                pending.path,
                pending.headers,
                raw,
                pending.request_id,
                self.picker.front.registry,
                self.picker.config.session_headers,
            )
        except OpenAIError as err:
            return [self._refuse(err)]
        if pending.route.model in self.picker.front.registry.models():
            self.model_label = pending.route.model or "other"
        return self._decide(pending, raw)

    async def _decide(self, pending: PendingRequest, raw: bytes | None) -> Answers:
        """The decision's answers: on the buffered body, or on the headers (then the gathered chunks)."""
        if raw is None or self.mode == BUFFERED:
            return [await self._route(pending, on_body=raw is not None)]
        answer = await self._route(pending, on_body=False)
        if answer.HasField("immediate_response"):
            return [answer]
        if self.mode == FULL_DUPLEX:
            return [answer, m.streamed_body(raw)]
        return [answer, *(m.proceed("request_body") for _ in pending.chunks)]

    async def _route(self, pending: PendingRequest, *, on_body: bool) -> m.ProcessingResponse:
        picker = self.picker
        admission = picker.front.admission
        try:
            await admission.acquire()
        except AdmissionRejected as rej:
            picker.front.metrics.admission_rejections.labels(reason=rej.reason).inc()
            err = errors.rate_limited(f"picker is at capacity ({rej.reason}); retry later")
            return self._refuse(err, [("retry-after", rej.retry_after_header)])
        if self.closed:  # Envoy reset the stream while this waited for a slot: nobody to answer
            admission.release()
            return _GONE
        self.admitted = True
        try:
            entry, addresses, prefiller = await picker.decide(pending)
        except OpenAIError as err:
            return self._refuse(err)
        if self.closed:  # reset while deciding: close() released the slot; count nothing in flight
            return _GONE
        self._start(entry, addresses)
        extra = [("x-request-id", pending.request_id)]
        remove: list[str] = []
        if prefiller is not None:
            extra.append((PREFILLER_HEADER, prefiller))
        elif PREFILLER_HEADER in pending.headers:
            remove.append(PREFILLER_HEADER)  # only the picker chooses where a prompt is prefilled
        return m.route("request_body" if on_body else "request_headers", addresses, extra, remove)

    def _start(self, entry: EngineEntry, addresses: list[str]) -> None:
        registry = self.picker.front.registry
        state = entry.state
        state.in_flight += 1
        registry.publish_in_flight(entry)
        registry.note_sent(state, time.monotonic())
        self.picker.front.metrics.engine_in_flight(state.url).set(state.in_flight)
        self.entry = entry
        self.addresses = addresses

    def _refuse(self, err: OpenAIError, headers: list[tuple[str, str]] | None = None) -> m.ProcessingResponse:
        self.status = err.status
        rid = self.pending.request_id if self.pending is not None else request_id({})
        return m.immediate_error(err, [*(headers or []), ("x-request-id", rid)])

    def _response_headers(self, request: m.ProcessingRequest) -> None:
        self.first_byte_at = time.monotonic()
        headers = m.header_dict(request.response_headers)
        try:
            self.status = int(headers.get(":status", "0"))
        except ValueError:
            self.status = 0
        served = m.served_endpoint(request)
        if self.entry is None or served is None or not self.addresses or served == self.addresses[0]:
            return
        # Envoy retried: the pick failed before answering, and another engine served the request.
        self._settle(self.entry, False)
        replacement = self._entry_at(served)
        if replacement is not None:
            self._finish_in_flight(self.entry)
            self._start(replacement, self.addresses)

    def _response_body(self, request: m.ProcessingRequest) -> None:
        body = request.response_body
        if not self.body_seen:
            self.body_seen = True
            self.first_byte_at = time.monotonic()
            self.usage = UsageTail()
        if self.usage is not None:
            self.usage.feed(body.body)
            if body.end_of_stream:
                found = self.usage.usage()
                self.usage = None
                if found is not None:
                    self.picker.front.metrics.usage(
                        self.model_label, found.prompt_tokens, found.completion_tokens
                    )

    def _entry_at(self, address: str) -> EngineEntry | None:
        for entry in self.picker.front.registry:
            if self.picker.address(entry.state.url) == address:
                return entry
        return None

    def close(self) -> None:
        """The stream ended: settle the engine's outcome, in-flight count, admission slot and metrics."""
        if self.closed:
            return
        self.closed = True
        picker = self.picker
        picker.streams -= 1
        metrics = picker.front.metrics
        entry = self.entry
        if entry is not None:
            status = self.status
            # No response headers: the request ended (client gone, engine broke, Envoy gave up) unseen.
            self._settle(entry, None if status == 0 or 400 <= status < 500 or status == 429 else status < 500)
            self._finish_in_flight(entry)
        if self.admitted:
            picker.front.admission.release()
        engine = "none" if entry is None else entry.state.url
        metrics.request_done(self.model_label, engine, str(self.status or 499))
        if self.first_byte_at is not None:
            metrics.observe_latency(
                self.model_label, self.first_byte_at - self.started, time.monotonic() - self.started
            )

    def _settle(self, entry: EngineEntry, ok: bool | None) -> None:
        entry.breaker.settle(ok)
        self.picker.front.metrics.set_circuit(entry.state.url, entry.breaker.state)

    def _finish_in_flight(self, entry: EngineEntry) -> None:
        state = entry.state
        state.in_flight = max(0, state.in_flight - 1)
        self.picker.front.registry.publish_in_flight(entry)
        self.picker.front.metrics.engine_in_flight(state.url).set(state.in_flight)
