"""The router's HTTP data plane: OpenAI endpoints proxied to the engine scheduling picks.

Served by `kvstack.http.server`; engines' models are learned through the side-call `UpstreamPool`.
Routes:
- POST /v1/completions, /v1/chat/completions, /v1/embeddings, /v1/responses, /tokenize, /detokenize:
  parsed just enough to route (model, stream, session key, prompt), then proxied;
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

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from kvstack.backoff import Backoff, BackoffSequence
from kvstack.engines.specs import EngineSpecError, build_endpoint
from kvstack.engines.state import Endpoint, EngineState
from kvstack.http.client import UpstreamError, UpstreamPool
from kvstack.http.server import Connection, HttpServer, Request, Response
from kvstack.openai import errors
from kvstack.openai.errors import OpenAIError
from kvstack.router.admission import AdmissionController, AdmissionRejected
from kvstack.router.metrics import RouterMetrics
from kvstack.router.proxy import Outcome, Proxy, Timeouts
from kvstack.router.registry import EngineRegistry
from kvstack.router.workers import WorkerGroup
from kvstack.scheduling.interfaces import SESSION_HEADERS, extract_session_key

log = logging.getLogger(__name__)

Handler = Callable[[Request, Connection], Awaitable[Response | None]]
_decode = msgspec.json.Decoder()
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
WORKER_HEADER = "x-kvstack-worker"
KV_EVENTS_ALIAS = "kv_events_endpoint"  # the admin API's old name of the kv_events field
REQUEST_ID_MAX = 256  # longer client request ids are replaced: they would be forwarded to every engine
MODELS_MAX_BYTES = 4 << 20  # /v1/models: a few hundred bytes per model or adapter
MODELS_RETRY_MAX_S = 5.0  # an engine that never answered /v1/models is asked again at least this often


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What routing needs from a request body; scheduling never sees the raw bytes."""

    path: str
    model: str | None
    stream: bool
    session_key: str | None
    request_id: str
    body: dict[str, Any]


class EngineListener(Protocol):
    """Told when engines join or leave (the KV-event subscribers follow the fleet this way)."""

    def engine_added(self, endpoint: Endpoint) -> None: ...

    def engine_removed(self, url: str) -> None: ...


class Picker(Protocol):
    """The scheduling entry point as the router uses it: candidates in preference order."""

    async def pick(self, request: RouteRequest, states: list[EngineState]) -> tuple[str, list[str]]:
        """(profile name, engine URLs: the chosen one first, then fallbacks for retries)."""
        ...


@dataclass
class RouterConfig:
    max_body_bytes: int = 32 * 1024 * 1024
    api_keys: frozenset[str] = frozenset()
    admin_key: str | None = None
    timeouts: Timeouts = field(default_factory=Timeouts)
    models_refresh_s: float = 30.0
    models_timeout_s: float = 2.0
    session_headers: tuple[str, ...] = SESSION_HEADERS  # tried in order, before the body's fields


class RouterApp:
    def __init__(
        self,
        config: RouterConfig,
        registry: EngineRegistry,
        picker: Picker,
        proxy: Proxy,
        admission: AdmissionController,
        metrics: RouterMetrics,
        client: UpstreamPool,
        *,
        expected_models: frozenset[str] = frozenset(),
        extra_state: Callable[[EngineState], dict[str, Any]] | None = None,
        listeners: Sequence[EngineListener] = (),
        group: WorkerGroup | None = None,
        on_metrics: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.registry = registry
        self.picker = picker
        self.proxy = proxy
        self.admission = admission
        self.metrics = metrics
        self.client = client
        self.expected_models = expected_models
        self.extra_state = extra_state
        self.listeners = tuple(listeners)
        self.group = group
        self._worker_index = "" if group is None else str(group.index)
        self.on_metrics = on_metrics  # refreshes gauges read from other objects, before /metrics renders
        if group is not None:
            for op in ("add", "remove", "drain", "undrain", "circuit-open"):
                group.on(op, self.apply_internal)
            group.on(FLUSH_HOT_SERIES, lambda op, body: self.metrics.flush_hot())
        self._model_tasks: dict[str, asyncio.Task[None]] = {}
        self._routes: dict[str, dict[str, Handler]] = {path: {"POST": self.proxied} for path in PROXIED_PATHS}
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
        return HttpServer(self.handle, max_body=self.config.max_body_bytes, default_headers=default_headers)

    async def close(self) -> None:
        for task in self._model_tasks.values():
            task.cancel()
        for task in self._model_tasks.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def handle(self, request: Request, conn: Connection) -> Response | None:
        """Every request: route by path and method, check keys, answer errors in OpenAI JSON."""
        methods = self._routes.get(request.path)
        if methods is None:
            return _error(OpenAIError(404, "Not Found", "Not Found"))
        handler = methods.get(request.method)
        if handler is None and request.method == "HEAD":
            handler = methods.get("GET")
        if handler is None:
            allowed = ", ".join(sorted(methods))
            return _error(OpenAIError(405, "Method Not Allowed", "Method Not Allowed"), [("Allow", allowed)])
        try:
            self._authorize(request)
            return await handler(request, conn)
        except OpenAIError as err:
            if conn.response_started:
                raise
            return _error(err, [("x-request-id", _request_id(request))])

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
        """Add or update an engine. Models it names are kept as given (an operator may limit an engine to
        some of its models, or route an alias); models it does not name are learned from its /v1/models."""
        configured = bool(endpoint.models)
        existing = self.registry.get(endpoint.url)
        if existing is not None and not endpoint.models and existing.state.endpoint.models:
            endpoint = _replace_models(endpoint, existing.state.endpoint.models)
        entry = self.registry.upsert(endpoint)
        self.metrics.engine_added(endpoint.url)
        self.metrics.set_circuit(endpoint.url, entry.breaker.state)
        for listener in self.listeners:
            listener.engine_added(endpoint)
        task = self._model_tasks.get(endpoint.url)
        if configured:
            if task is not None:
                del self._model_tasks[endpoint.url]
                task.cancel()
        elif task is None:
            self._model_tasks[endpoint.url] = asyncio.get_running_loop().create_task(
                self._refresh_models(endpoint.url)
            )

    def remove_engine(self, url: str) -> bool:
        task = self._model_tasks.pop(url, None)
        if task is not None:
            task.cancel()
        removed = self.registry.remove(url) is not None
        if removed:
            self.metrics.forget_engine(url)
            for listener in self.listeners:
                listener.engine_removed(url)
        return removed

    async def _refresh_models(self, url: str) -> None:
        """Learn an engine's served models from its /v1/models, quickly at first, then periodically."""
        retry = _models_retry(0.2)
        while True:
            entry = self.registry.get(url)
            if entry is None:
                return
            answered = False
            try:
                reply = await self.client.get(
                    url, "/v1/models", within=self.config.models_timeout_s, max_bytes=MODELS_MAX_BYTES
                )
                if reply.status != 200:
                    raise UpstreamError(f"answered HTTP {reply.status}")
                models = frozenset(m["id"] for m in reply.json()["data"])
                if models != entry.state.endpoint.models:
                    self.registry.upsert(_replace_models(entry.state.endpoint, models))
                answered = True
            except (UpstreamError, ValueError, KeyError, TypeError, RecursionError) as exc:
                log.debug("engine %s: /v1/models failed: %r", url, exc)
            if answered or entry.state.endpoint.models:
                delay = self.config.models_refresh_s
                retry = _models_retry(delay)
            else:
                delay = retry.next()
            await asyncio.sleep(delay)

    # -- handlers ----------------------------------------------------------------------------------
    async def health(self, request: Request, conn: Connection) -> Response:
        body: dict[str, Any] = {"status": "ok"}
        if self.group is not None:
            body["worker"] = {"index": self.group.index, "count": self.group.count}
        return _json(body)

    async def ready(self, request: Request, conn: Connection) -> Response:
        states = self.registry.states()
        models = set(self.expected_models) or {m for s in states for m in s.endpoint.models}
        detail = {}
        for model in sorted(models):
            routable = [s.url for s in states if model in s.endpoint.models and s.routable]
            detail[model] = {"routable_engines": routable}
        ok = bool(models) and all(d["routable_engines"] for d in detail.values())
        body = {"ready": ok, "models": detail, "engines": len(states)}
        return _json(body, status=200 if ok else 503)

    async def prometheus(self, request: Request, conn: Connection) -> Response:
        states = self.registry.states()
        for s in states:
            self.metrics.set_circuit(s.url, s.circuit)
        self.metrics.engines.labels(state="routable").set(sum(1 for s in states if s.routable))
        self.metrics.engines.labels(state="unroutable").set(sum(1 for s in states if not s.routable))
        self.metrics.queue_depth.set(self.admission.queued)
        if self.on_metrics is not None:
            self.on_metrics()
        if self.group is not None:
            # Each worker counts its requests itself: have the others write theirs, then sum them all.
            await self.group.broadcast(FLUSH_HOT_SERIES, {})
        return Response(200, self.metrics.render(), [("Content-Type", "text/plain; charset=utf-8")])

    async def models(self, request: Request, conn: Connection) -> Response:
        now = int(time.time())
        data = [
            {"id": m, "object": "model", "created": now, "owned_by": "kvstack"}
            for m in sorted(self.registry.models())
        ]
        return _json({"object": "list", "data": data})

    async def engines(self, request: Request, conn: Connection) -> Response:
        out = []
        now = time.monotonic()
        for s in self.registry.states():
            reading = s.metrics
            item: dict[str, Any] = {
                "url": s.url,
                "type": s.endpoint.engine_type,
                "role": s.endpoint.role.value,
                "models": sorted(s.endpoint.models),
                "routable": s.routable,
                "healthy": s.healthy,
                "draining": s.draining,
                "circuit": s.circuit.value,
                "in_flight": s.total_in_flight,
                "in_flight_this_worker": s.in_flight,
                "metrics": None
                if reading is None
                else {
                    "age_seconds": round(reading.age(now), 3),
                    "stale": s.metrics_stale,
                    "queue": reading.signals.queue,
                    "running": reading.signals.running,
                    "kv_usage": reading.signals.kv_usage,
                    "missing": sorted(reading.missing),
                    "aliases_used": [list(a) for a in reading.aliases_used],
                },
                "routing_knowledge": s.knowledge,
            }
            if self.extra_state is not None:
                item.update(self.extra_state(s))
            out.append(item)
        body: dict[str, Any] = {"engines": out}
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
        started = time.monotonic()
        raw = request.body
        outcome = Outcome()
        model_label = "other"  # until the body names a served model: a client cannot grow the series
        request_id = _request_id(request)
        try:
            # Refused requests (bad JSON, unknown model, bad timeout header) are counted too, engine "none".
            route = self._parse(request, raw, request_id)
            timeouts = self.config.timeouts.overridden(request.headers)
            if route.model in self.registry.models():
                model_label = route.model
            await self.admission.acquire()
            try:
                profile, candidates = await self._candidates(route)
                self.metrics.decision(profile, candidates[0])
                await self.proxy.forward(
                    conn,
                    request.headers,
                    path=route.path,
                    body=raw,
                    candidates=candidates,
                    stream=route.stream,
                    request_id=route.request_id,
                    timeouts=timeouts,
                    outcome=outcome,
                )
            finally:
                self.admission.release()
        except AdmissionRejected as rej:
            self.metrics.admission_rejections.labels(reason=rej.reason).inc()
            err = errors.rate_limited(f"router is at capacity ({rej.reason}); retry later")
            outcome.status = 429
            return _error(err, [("Retry-After", rej.retry_after_header), ("x-request-id", request_id)])
        except OpenAIError as err:
            outcome.status = err.status
            if conn.response_started:
                raise
            return _error(err, [("x-request-id", request_id)])
        except Exception:
            if not outcome.status and outcome.error != "client_disconnected":
                outcome.status = 500  # what the server answers for it (a client that left counts as 499)
            raise
        finally:
            self.metrics.request_done(model_label, outcome.engine or "none", str(outcome.status or 499))
            if outcome.first_byte_at is not None:
                self.metrics.observe_latency(
                    model_label, outcome.first_byte_at - started, time.monotonic() - started
                )
        return None

    def _parse(self, request: Request, raw: bytes, request_id: str) -> RouteRequest:
        content_type = (request.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if content_type and content_type != "application/json":
            raise errors.unsupported_media_type()
        body = _decode_json(raw, "request body is not valid JSON")
        if not isinstance(body, dict):
            raise errors.bad_request("request body must be a JSON object", "body")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise errors.bad_request("model must be a string", "model")
        known = self.registry.models()
        if model is None and len(known) > 1:
            raise errors.bad_request(f"model is required: this router serves {sorted(known)}", "model")
        if model is not None and self.registry.all_models_known() and model not in known:
            raise errors.not_found_model(model, sorted(known))
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise errors.bad_request("stream must be a boolean", "stream")
        session = extract_session_key(request.headers, body, self.config.session_headers)
        return RouteRequest(request.path, model, stream, session, request_id, body)

    async def _candidates(self, route: RouteRequest) -> tuple[str, list[str]]:
        # Every engine, in any state: scheduling explains why none fits, and its affinity ring stays stable.
        return await self.picker.pick(route, self.registry.states())


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


def _models_retry(after: float) -> BackoffSequence:
    """Retries of an engine with no models yet: doubling from ``after`` s, up to ``MODELS_RETRY_MAX_S``."""
    return Backoff(min(2 * after, MODELS_RETRY_MAX_S), MODELS_RETRY_MAX_S).sequence()


def _replace_models(endpoint: Endpoint, models: frozenset[str]) -> Endpoint:
    return dataclasses.replace(endpoint, models=models)


def _bearer_matches(request: Request, keys: set[str] | frozenset[str]) -> bool:
    header = request.headers.get("Authorization", "")
    if not header.startswith("Bearer "):
        return False
    token = header[len("Bearer ") :]
    return any(hmac.compare_digest(token, k) for k in keys)


def _request_id(request: Request) -> str:
    """The client's x-request-id when it is short printable ASCII, else a new one."""
    given = request.headers.get("x-request-id")
    if given and len(given) <= REQUEST_ID_MAX and given.isascii() and given.isprintable():
        return given
    return f"kvs-{secrets.token_hex(12)}"


def _decode_json(raw: bytes, what: str) -> Any:
    """``raw`` decoded; a 400 starting with ``what`` when it is not JSON."""
    try:
        return _decode.decode(raw)
    except msgspec.DecodeError as exc:
        raise errors.bad_request(f"{what}: {exc}", "body") from None
    except RecursionError:
        raise errors.bad_request(f"{what}: nested too deeply", "body") from None


def _json_object(request: Request) -> dict[str, Any]:
    body = _decode_json(request.body, "body must be JSON")
    if not isinstance(body, dict):
        raise errors.bad_request("body must be a JSON object", "body")
    return body
