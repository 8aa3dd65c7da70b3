"""The router's HTTP data plane: OpenAI endpoints proxied to the engine scheduling picks.

Served by `kvstack.http.server`; engines' models are learned through the side-call `UpstreamPool`.
Routes:
- POST /v1/completions, /v1/chat/completions, /v1/embeddings, /v1/responses, /tokenize, /detokenize:
  parsed just enough to route (model, stream, session key, prompt), then proxied (prefilled on a prefill
  engine first when scheduling disaggregates the request: `kvstack.router.prefill`);
- GET /v1/models: the union of the engines' models;
- GET /health (the router is alive), /ready (every configured model has a routable engine; JSON detail),
  /metrics (the router's own ``kvstack_`` metrics), /engines (JSON state of every engine);
- POST /admin/engines (add; the URL must be http(s)://host[:port][/path], port 1-65535),
  DELETE /admin/engines?url= (remove), POST /admin/engines/drain and /undrain.
Access (``Authorization: Bearer``): client API keys, when configured, are needed everywhere but /health,
/ready and /metrics. The admin routes need ``admin_key`` when it is set; without one they need a client API
key when those are configured, and are open only when neither is.
Every error is OpenAI error JSON. ``x-request-id`` goes to the engine and back on every answer: the
client's value when it is at most 256 printable ASCII characters, else a generated ``kvs-...`` id.
"""

from __future__ import annotations

import functools
import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvstack.engines.specs import EngineSpecError, build_endpoint
from kvstack.engines.state import Endpoint
from kvstack.frontend.admission import AdmissionController, AdmissionRejected
from kvstack.frontend.fleet import Fleet
from kvstack.frontend.routing import Decision, Picker, RouteRequest, decode_json, parse_route, request_id
from kvstack.http.server import Connection, HttpServer, Request, Response
from kvstack.openai import errors
from kvstack.openai.errors import OpenAIError
from kvstack.router.hold import HoldPolicy
from kvstack.router.prefill import PrefillStep
from kvstack.router.proxy import Outcome, Proxy, Sent, Timeouts
from kvstack.router.workers import WorkerGroup
from kvstack.scheduling.interfaces import SESSION_HEADERS

log = logging.getLogger(__name__)

Handler = Callable[[Request, Connection], Awaitable[Response | None]]
_encode = msgspec.json.Encoder().encode

FLUSH_HOT_SERIES = "flush-hot-series"  # worker control operation: write your request metrics now
PROXIED_PATHS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/tokenize",
    "/detokenize",
)
_PROXIED = frozenset(PROXIED_PATHS)
# How far a proxied request got before the coroutine path goes on with it (RouterApp._rest).
_NEW, _PARSED, _ADMITTED, _ROUTED = 0, 1, 2, 3
WORKER_HEADER = "x-kvstack-worker"
KV_EVENTS_ALIAS = "kv_events_endpoint"  # the admin API's old name of the kv_events field


@dataclass
class RouterConfig:
    max_body_bytes: int = 32 * 1024 * 1024
    api_keys: frozenset[str] = frozenset()
    admin_key: str | None = None
    timeouts: Timeouts = field(default_factory=Timeouts)
    hold: HoldPolicy = field(default_factory=HoldPolicy)  # a stream's start, until its first content
    session_headers: tuple[str, ...] = SESSION_HEADERS  # tried in order, before the body's fields
    # A P/D prefill request's time limit; past it the decode engine computes the prompt itself.
    pd_prefill_timeout: float = 30.0


class RouterApp:
    def __init__(
        self,
        config: RouterConfig,
        fleet: Fleet,
        picker: Picker,
        proxy: Proxy,
        admission: AdmissionController,
        *,
        prefill: PrefillStep,
        group: WorkerGroup | None = None,
        on_metrics: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.fleet = fleet
        self.registry = fleet.registry
        self.metrics = fleet.metrics
        self.picker = picker
        self.proxy = proxy
        self.admission = admission
        self.prefill = prefill
        self.group = group
        self._worker_index = "" if group is None else str(group.index)
        self.on_metrics = on_metrics  # refreshes gauges read from other objects (FrontEnd.refresh_gauges)
        if group is not None:
            for op in ("add", "remove", "drain", "undrain", "circuit-open"):
                group.on(op, self.apply_internal)
            group.on(FLUSH_HOT_SERIES, lambda op, body: self.metrics.flush_hot())
        self._proxied: Handler = self.proxied  # (one bound method, for `handle` to know it)
        self._routes: dict[str, dict[str, Handler]] = {
            path: {"POST": self._proxied} for path in PROXIED_PATHS
        }
        self._routes.update(
            {
                "/v1/models": {"GET": self.models},
                "/health": {"GET": self.health},
                "/ready": {"GET": self.ready},
                "/metrics": {"GET": self.prometheus},
                "/engines": {"GET": self.engines},
                "/admin/engines": {"POST": self.admin_add, "DELETE": self.admin_remove},
                "/admin/engines/drain": {"POST": self.admin_drain},
                "/admin/engines/undrain": {"POST": self.admin_undrain},
            }
        )

    # -- serving ----------------------------------------------------------------------------------
    def server(self) -> HttpServer:
        """The HTTP server for this app (not yet listening)."""
        default_headers = [] if self.group is None else [(WORKER_HEADER, self._worker_index)]
        return HttpServer(
            self.handle,
            max_body=self.config.max_body_bytes,
            default_headers=default_headers,
            direct=self.direct,
        )

    async def close(self) -> None:
        await self.fleet.close()

    def handle(self, request: Request, conn: Connection) -> Awaitable[Response | None]:
        """Every request: route by path and method, check keys, answer errors in OpenAI JSON.

        (A plain function: a proxied request's handler, which answers its own errors, is handed to the server
        as it is, one coroutine fewer on every proxied request; the others run in `_answering`.)"""
        methods = self._routes.get(request.path)
        if methods is None:
            return _answered(_error(OpenAIError(404, "Not Found", "Not Found")))
        handler = methods.get(request.method)
        if handler is None and request.method == "HEAD":
            handler = methods.get("GET")
        if handler is None:
            allowed = ", ".join(sorted(methods))
            err = OpenAIError(405, "Method Not Allowed", "Method Not Allowed")
            return _answered(_error(err, [("Allow", allowed)]))
        try:
            self._authorize(request)
        except OpenAIError as err:
            return _answered(_error(err, [("x-request-id", request_id_of(request))]))
        if handler is self._proxied:
            return handler(request, conn)
        return self._answering(handler, request, conn)

    async def _answering(self, handler: Handler, request: Request, conn: Connection) -> Response | None:
        """``handler``'s answer; an OpenAIError it raises as OpenAI error JSON."""
        try:
            return await handler(request, conn)
        except OpenAIError as err:
            if conn.response_started:
                raise
            return _error(err, [("x-request-id", request_id_of(request))])

    def _authorize(self, request: Request) -> None:
        path = request.path
        admin_key = self.config.admin_key
        if path.startswith("/admin/") and admin_key is not None:
            if not _bearer_matches(request, {admin_key}):
                raise OpenAIError(
                    401, "admin endpoints need Authorization: Bearer <admin key>", "AuthenticationError"
                )
        elif (
            self.config.api_keys
            and path not in ("/health", "/ready", "/metrics")
            and not _bearer_matches(request, self.config.api_keys)
        ):
            raise OpenAIError(401, "invalid or missing API key", "AuthenticationError")

    # -- engine bookkeeping --------------------------------------------------------------------------
    def add_engine(self, endpoint: Endpoint) -> None:
        self.fleet.add_engine(endpoint)

    def remove_engine(self, url: str) -> bool:
        return self.fleet.remove_engine(url)

    # -- handlers ----------------------------------------------------------------------------------
    async def health(self, request: Request, conn: Connection) -> Response:
        body: dict[str, Any] = {"status": "ok"}
        if self.group is not None:
            body["worker"] = {"index": self.group.index, "count": self.group.count}
        return _json(body)

    async def ready(self, request: Request, conn: Connection) -> Response:
        ok, body = self.fleet.readiness()
        return _json(body, status=200 if ok else 503)

    async def prometheus(self, request: Request, conn: Connection) -> Response:
        if self.on_metrics is not None:
            self.on_metrics()
        if self.group is not None:
            # Each worker counts its requests itself: have the others write theirs, then sum them all.
            await self.group.broadcast(FLUSH_HOT_SERIES, {})
        return Response(200, self.metrics.render(), [("Content-Type", "text/plain; charset=utf-8")])

    async def models(self, request: Request, conn: Connection) -> Response:
        return _json(self.fleet.models_list())

    async def engines(self, request: Request, conn: Connection) -> Response:
        body: dict[str, Any] = {"engines": self.fleet.engines_detail(), "roles": self.fleet.roles()}
        if self.group is not None:
            body["worker"] = {"index": self.group.index, "count": self.group.count}
        return _json(body)

    async def admin_add(self, request: Request, conn: Connection) -> Response:
        body = _json_object(request)
        self._apply_admin("add", body)
        return _json({"added": str(body["url"]).rstrip("/"), **await self._broadcast("add", body)})

    async def admin_remove(self, request: Request, conn: Connection) -> Response:
        body = {"url": request.query.get("url", "")}
        self._apply_admin("remove", body)
        return _json({"removed": body["url"].rstrip("/"), **await self._broadcast("remove", body)})

    async def admin_drain(self, request: Request, conn: Connection) -> Response:
        return await self._set_draining(request, "drain")

    async def admin_undrain(self, request: Request, conn: Connection) -> Response:
        return await self._set_draining(request, "undrain")

    async def _set_draining(self, request: Request, op: str) -> Response:
        body = _json_object(request)
        self._apply_admin(op, body)
        url = str(body.get("url", "")).rstrip("/")
        entry = self.registry.get(url)
        in_flight = entry.state.total_in_flight if entry else 0
        spread = await self._broadcast(op, body)
        return _json({"url": url, "draining": op == "drain", "in_flight": in_flight, **spread})

    async def _broadcast(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        """Pass an admin change on to the other worker processes; say how many processes hold it."""
        if self.group is None:
            return {}
        applied = await self.group.broadcast(op, body)
        return {"workers": self.group.count, "applied_by_workers": applied + 1}

    def apply_internal(self, op: str, body: dict[str, Any]) -> None:
        """A sibling worker's change (see kvstack.router.workers)."""
        if op == "circuit-open":
            entry = self.registry.get(str(body.get("url")))
            if entry is not None:
                entry.breaker.force_open(float(body.get("seconds", 0.0)))
                self.metrics.set_circuit(entry.state.url, entry.breaker.state)
            return
        self._apply_admin(op, body)

    def _apply_admin(self, op: str, body: dict[str, Any]) -> None:
        """Apply an admin change to this process; raises OpenAIError (400/404) for a bad one."""
        if op == "add":
            self.add_engine(_endpoint_of(body))
            return
        url = str(body.get("url", "")).rstrip("/")
        if op == "remove":
            # An admin's removal ends a drain too (a drain outlives removals by discovery, see registry).
            self.registry.set_draining(url, False)
            found = self.remove_engine(url)
        else:
            found = self.registry.set_draining(url, op == "drain")
        if not found:
            raise OpenAIError(404, f"no engine {url!r}", "NotFoundError", "url")

    async def proxied(self, request: Request, conn: Connection) -> Response | None:
        return await self._rest(_Flight(request, conn), _NEW)

    def direct(self, request: Request, conn: Connection) -> bool:
        """A proxied request's start, no coroutine (the server's ``direct``; design/router-request-path.md).

        A proxied POST is taken and parsed here. A plain one that is admitted and routed at once (no queue,
        no tokenizing) and finds an idle connection to its engine (and needs no prefill) is sent from here,
        its answer relayed from the callback when it comes whole. Anything else goes on as a coroutine from
        the step it reached (`_rest`): a stream, a queue for admission, a decision that waits for tokens,
        connecting, P/D, a retry, a body still coming, a failure. Declined (False) to `proxied`: requests
        that are not proxied POSTs, a wrong API key, and a body refused when parsed (answered there).
        """
        if request.method != "POST" or request.path not in _PROXIED:
            return False
        keys = self.config.api_keys
        if keys and not _bearer_matches(request, keys):
            return False
        flight = _Flight(request, conn)
        try:
            route = self._route(flight)
        except OpenAIError:
            return False
        if route.stream or not self.admission.try_acquire():
            conn.serve_rest(self._rest(flight, _PARSED))
            return True
        try:
            decision = self.picker.decide(route, self.registry.states())
            if decision is not None:
                flight.decision = decision
                self.metrics.decision(decision.profile, decision.target)
                sent = None if decision.prefill else self._send_now(flight)
        except OpenAIError:
            decision = None  # (the coroutine path meets it again and answers it)
        except Exception:
            self.admission.release()
            flight.outcome.status = 500  # (the server answers it)
            self._count(flight)
            raise
        if decision is None:
            conn.serve_rest(self._rest(flight, _ADMITTED))
        elif sent is None:
            conn.serve_rest(self._rest(flight, _ROUTED))
        else:
            conn.on_lost = sent.abort
        return True

    def _send_now(self, flight: _Flight) -> Sent | None:
        """A direct request's first attempt, sent at once (None: no idle connection to its engine)."""
        route = flight.route

        def answered(sent: Sent) -> None:
            self._answered(flight, sent)

        return self.proxy.send_now(
            flight.request.headers,
            path=route.path,
            body=flight.request.body,
            candidates=flight.decision.candidates,
            request_id=route.request_id,
            timeouts=flight.timeouts,
            outcome=flight.outcome,
            on_answer=answered,
        )

    def _answered(self, flight: _Flight, sent: Sent) -> None:
        """A direct request's answer (its headers) or failure came: relay it, or go on as a coroutine."""
        conn = flight.conn
        conn.on_lost = None  # (from here on a client that leaves cancels the coroutine, or nothing is left)
        try:
            if conn.closed:
                self.proxy.abandon(sent, flight.outcome)
            elif not self.proxy.answer_now(conn, sent, flight.route.request_id, flight.outcome):
                conn.serve_rest(self._rest(flight, _ROUTED, sent))
                return
        except Exception:
            sent.abort()
            if not flight.outcome.status:
                flight.outcome.status = 500
            conn.failed()
        self.admission.release()
        self._count(flight)
        conn.finish()

    async def _rest(self, flight: _Flight, reached: int, sent: Sent | None = None) -> Response | None:
        """A proxied request as a coroutine, from the step it ``reached`` (`proxied`: `_NEW`; `direct` hands
        on what it cannot finish at once): parsed, admitted, routed, then forwarded (its first attempt
        ``sent`` already, when given)."""
        try:
            if reached < _PARSED:
                self._route(flight)
            if reached < _ADMITTED and not self.admission.try_acquire():
                await self.admission.acquire()  # (a coroutine per request spared when a slot is free)
            try:
                if reached < _ROUTED:
                    # Every engine, in any state: scheduling explains why none fits, and its affinity ring
                    # stays stable.
                    decision = flight.decision = await self.picker.pick(flight.route, self.registry.states())
                    self.metrics.decision(decision.profile, decision.target)
                await self._forward(flight, sent)
            finally:
                self.admission.release()
        except Exception as exc:
            return self._failed(exc, flight)
        finally:
            self._count(flight)
        return None

    def _route(self, flight: _Flight) -> RouteRequest:
        """What the request asks for, and its timeouts (refusals, bad JSON or an unknown model, raise
        OpenAIError)."""
        request = flight.request
        route = flight.route = parse_route(
            request.path,
            request.headers,
            request.body,
            flight.request_id,
            self.registry,
            self.config.session_headers,
        )
        flight.timeouts = self.config.timeouts.overridden(request.headers)
        if route.model in self.registry.models():
            flight.model_label = route.model
        return route

    async def _forward(self, flight: _Flight, sent: Sent | None) -> None:
        request, route, decision = flight.request, flight.route, flight.decision
        body = request.body
        if decision.prefill:
            body = await self.prefill.decode_body(
                route, body, decision.prefill, request.headers, flight.timeouts
            )
        await self.proxy.forward(
            flight.conn,
            request.headers,
            path=route.path,
            body=body,
            candidates=decision.candidates,
            stream=route.stream,
            request_id=route.request_id,
            timeouts=flight.timeouts,
            outcome=flight.outcome,
            sent=sent,
        )

    def _failed(self, exc: Exception, flight: _Flight) -> Response:
        """The answer to a proxied request that failed with ``exc`` (raised again when nothing can be
        answered: the response had started, or the failure is not the client's to read)."""
        outcome = flight.outcome
        if isinstance(exc, AdmissionRejected):
            self.metrics.admission_rejections.labels(reason=exc.reason).inc()
            err = errors.rate_limited(f"router is at capacity ({exc.reason}); retry later")
            outcome.status = 429
            return _error(err, [("Retry-After", exc.retry_after_header), ("x-request-id", flight.request_id)])
        if isinstance(exc, OpenAIError):
            outcome.status = exc.status
            if flight.conn.response_started:
                raise exc
            return _error(exc, [("x-request-id", flight.request_id)])
        if not outcome.status and outcome.error != "client_disconnected":
            outcome.status = 500  # what the server answers for it (a client that left counts as 499)
        raise exc

    def _count(self, flight: _Flight) -> None:
        """A proxied request's metrics, once it ended."""
        outcome = flight.outcome
        self.metrics.request_done(flight.model_label, outcome.engine or "none", str(outcome.status or 499))
        if outcome.first_byte_at is not None:
            started = flight.started
            self.metrics.observe_latency(
                flight.model_label, outcome.first_byte_at - started, time.monotonic() - started
            )


class _Flight:
    """A proxied request on its way: what it asks for, where it goes, and its bookkeeping for metrics.
    (``route`` and ``timeouts`` are set once it is parsed, ``decision`` once it is routed.)"""

    __slots__ = (
        "conn",
        "decision",
        "model_label",
        "outcome",
        "request",
        "request_id",
        "route",
        "started",
        "timeouts",
    )
    route: RouteRequest
    timeouts: Timeouts
    decision: Decision

    def __init__(self, request: Request, conn: Connection) -> None:
        self.started = time.monotonic()
        self.request = request
        self.conn = conn
        self.request_id = request_id_of(request)
        self.outcome = Outcome()
        self.model_label = "other"  # until the body names a served model: a client cannot grow the series


async def _answered(response: Response) -> Response:
    return response


def _json(body: Any, status: int = 200, headers: Sequence[tuple[str, str]] = ()) -> Response:
    return Response(status, _encode(body), [("Content-Type", "application/json"), *headers])


def _error(err: OpenAIError, headers: Sequence[tuple[str, str]] = ()) -> Response:
    return Response(err.status, err.to_json(), [("Content-Type", "application/json"), *headers])


def _endpoint_of(body: dict[str, Any]) -> Endpoint:
    """The engine an admin "add" body describes (the fields of kvstack.engines.specs); 400 naming the bad one.

    ``kv_events_endpoint`` is the deprecated name of ``kv_events``, still accepted."""
    kv_key = "kv_events"
    if KV_EVENTS_ALIAS in body:
        if kv_key in body:
            message = f"give {kv_key} only; {KV_EVENTS_ALIAS} is its old name"
            raise errors.bad_request(message, KV_EVENTS_ALIAS)
        kv_key = KV_EVENTS_ALIAS
        _warn_kv_events_alias()
    try:
        return build_endpoint(
            "POST /admin/engines",
            body.get("url"),
            engine_type=body.get("type"),
            role=body.get("role"),
            models=body.get("models"),
            node=body.get("node"),
            kv_events=body.get(kv_key),
            labels=body.get("labels"),
        )
    except EngineSpecError as exc:
        raise errors.bad_request(str(exc), kv_key if exc.field == "kv_events" else exc.field) from None


@functools.cache
def _warn_kv_events_alias() -> None:
    """Once per process: clients that still send the old name should learn the new one."""
    log.warning("POST /admin/engines: %s is deprecated; send kv_events instead", KV_EVENTS_ALIAS)


def _bearer_matches(request: Request, keys: set[str] | frozenset[str]) -> bool:
    header = request.headers.get("Authorization", "")
    if not header.startswith("Bearer "):
        return False
    token = header[len("Bearer ") :]
    return any(hmac.compare_digest(token, k) for k in keys)


def request_id_of(request: Request) -> str:
    """The request's id for the engine and the client (`frontend.routing.request_id`)."""
    return request_id(request.headers)


def _json_object(request: Request) -> dict[str, Any]:
    body = decode_json(request.body, "body must be JSON")
    if not isinstance(body, dict):
        raise errors.bad_request("body must be a JSON object", "body")
    return body
