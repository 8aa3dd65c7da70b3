"""``kvstack sidecar``: the P/D sidecar in front of ONE decode engine, for Envoy mode.

Every request is forwarded to the engine by the proxy's machinery (`Proxy`: streaming, timeouts, a client
that leaves aborts the engine's request). A request carrying ``x-prefiller-host-port`` (set by the picker
when scheduling disaggregates it) is first prefilled on that engine (`kvstack.frontend.pd`), then sent to
the local engine with the returned ``kv_transfer_params``; a failed prefill falls back to the local engine
computing the prompt, counted by reason. The header is never forwarded. An engine failing before its first
token (the proxy holds a stream until then) is a 502 before any byte, which Envoy retries elsewhere.

Only prefill engines in the allowlist may be named (SSRF): those given with ``--prefill-engine``, and the
engines whose role is prefill in the discovery source (an engines file, Kubernetes pods), kept current.
Any other value is refused with 403 in OpenAI error JSON.

``/metrics`` is the engine's page followed by the sidecar's own ``kvstack_`` series (P/D, upstream errors),
so that the sidecar's URL stands for its engine everywhere: the picker lists the decode engine at the
sidecar's URL, scrapes its metrics, learns its models and KV-event sources through it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from multidict import CIMultiDict, CIMultiDictProxy

from kvstack.engines.discovery import Discovery, DiscoveryUpdate, UpdateKind
from kvstack.engines.state import Endpoint, EngineRole
from kvstack.frontend import pd
from kvstack.frontend.circuit import CircuitConfig
from kvstack.frontend.metrics import RouterMetrics
from kvstack.frontend.registry import EngineRegistry
from kvstack.http.client import UpstreamError, UpstreamPool
from kvstack.http.listen import listening_socket
from kvstack.http.server import Connection, HttpServer, Request, Response
from kvstack.openai.errors import OpenAIError
from kvstack.router.app import request_id_of
from kvstack.router.proxy import Outcome, Proxy, RetryPolicy, Timeouts, forward_headers

METRICS_TIMEOUT_S = 10.0
METRICS_MAX_BYTES = 16 << 20
# The front end in front keeps the circuit breakers; the sidecar always tries its one engine.
NEVER_OPEN = CircuitConfig(failure_threshold=sys.maxsize)


class PrefillAllowlist:
    """The prefill engines a sidecar may send prompts to, by ``host:port`` (lower case)."""

    def __init__(self, metrics: RouterMetrics | None = None) -> None:
        self._by_address: dict[str, str] = {}  # host:port -> engine URL
        self._metrics = metrics

    def url_for(self, address: str) -> str | None:
        """The URL of the allowed prefill engine at ``address``, or None."""
        return self._by_address.get(address.strip().lower())

    def add(self, url: str) -> None:
        self._by_address[pd.host_port(url).lower()] = url
        if self._metrics is not None:
            self._metrics.engine_added(url)

    def remove(self, url: str) -> None:
        address = pd.host_port(url).lower()
        if self._by_address.get(address) == url:
            del self._by_address[address]
            if self._metrics is not None:
                self._metrics.forget_engine(url)

    def apply(self, update: DiscoveryUpdate) -> None:
        """A discovery update: prefill engines join, others (and removed ones) leave."""
        endpoint = update.endpoint
        if update.kind is not UpdateKind.REMOVED and endpoint.role is EngineRole.PREFILL:
            self.add(endpoint.url)
        else:
            self.remove(endpoint.url)

    def urls(self) -> list[str]:
        return sorted(self._by_address.values())


class SidecarApp:
    def __init__(
        self,
        engine: str,
        proxy: Proxy,
        prefiller: pd.Prefiller,
        allowlist: PrefillAllowlist,
        *,
        timeouts: Timeouts,
    ) -> None:
        self.engine = engine
        self.proxy = proxy
        self.prefiller = prefiller
        self.allowlist = allowlist
        self.metrics = proxy.metrics
        self.timeouts = timeouts

    async def handle(self, request: Request, conn: Connection) -> Response | None:
        if request.path == "/metrics" and request.method in ("GET", "HEAD"):
            return await self.metrics_page()
        request_id = request_id_of(request)
        try:
            await self._forward(request, conn, request_id)
        except OpenAIError as err:
            if conn.response_started:
                raise
            headers = [("Content-Type", "application/json"), ("x-request-id", request_id)]
            return Response(err.status, err.to_json(), headers)
        return None

    async def _forward(self, request: Request, conn: Connection, request_id: str) -> None:
        timeouts = self.timeouts.overridden(request.headers)
        headers = request.headers
        body, stream = request.body, False
        named = headers.get(pd.PREFILLER_HEADER)
        if named is not None:
            prefill_url = self.allowlist.url_for(named)
            if prefill_url is None:
                message = f"{pd.PREFILLER_HEADER} {named!r} is not a prefill engine of this pool"
                raise OpenAIError(403, message, "PermissionDeniedError", pd.PREFILLER_HEADER)
            kept = CIMultiDict(headers)
            kept.popall(pd.PREFILLER_HEADER)
            headers = CIMultiDictProxy(kept)
            body, stream = await self._prefilled(request, prefill_url, headers, request_id, timeouts)
        target = request.path + (f"?{request.query_string}" if request.query_string else "")
        await self.proxy.forward(
            conn,
            headers,
            path=target,
            body=body,
            candidates=[self.engine],
            stream=stream,
            request_id=request_id,
            timeouts=timeouts,
            outcome=Outcome(),
            method="GET" if request.method == "HEAD" else request.method,
        )

    async def _prefilled(
        self,
        request: Request,
        prefill_url: str,
        headers: CIMultiDictProxy[str],
        request_id: str,
        timeouts: Timeouts,
    ) -> tuple[bytes, bool]:
        """(the body for the local engine, whether it streams) after prefilling on ``prefill_url``."""
        body = pd.json_object(request.body) if request.method == "POST" else None
        if body is None or pd.unsupported(request.path, body):
            self.prefiller.fallback("unsupported_request")
            return request.body, False
        result = await self.prefiller.prefill(
            prefill_url,
            request.path,
            body,
            forward_headers(headers, request_id),
            within=timeouts.total,
        )
        return result.body_for_decode(body, request.body), body.get("stream") is True

    async def metrics_page(self) -> Response:
        """The engine's /metrics, then the sidecar's own series."""
        try:
            reply = await self.proxy.upstream.get(
                self.engine, "/metrics", within=METRICS_TIMEOUT_S, max_bytes=METRICS_MAX_BYTES
            )
        except UpstreamError as exc:
            err = OpenAIError(502, f"engine {self.engine} /metrics failed: {exc}", "BadGatewayError")
            return Response(502, err.to_json(), [("Content-Type", "application/json")])
        if reply.status != 200:
            message = f"engine {self.engine} answered /metrics with HTTP {reply.status}"
            err = OpenAIError(502, message, "BadGatewayError")
            return Response(502, err.to_json(), [("Content-Type", "application/json")])
        page = reply.body if reply.body.endswith(b"\n") or not reply.body else reply.body + b"\n"
        content_type = reply.header("content-type") or "text/plain; version=0.0.4; charset=utf-8"
        return Response(200, page + self.metrics.render(), [("Content-Type", content_type)])


@dataclass
class SidecarOptions:
    engine: str  # the local decode engine's base URL
    host: str = "127.0.0.1"
    port: int = 8000
    prefill_engines: list[Endpoint] = field(default_factory=list)  # allowed whatever their role
    discovery: Discovery | None = None  # its engines whose role is prefill are allowed too
    timeouts: Timeouts = field(default_factory=Timeouts)
    pd_prefill_timeout: float = 30.0
    max_body_bytes: int = 32 * 1024 * 1024


@dataclass
class RunningSidecar:
    url: str
    app: SidecarApp
    server: HttpServer
    upstream: UpstreamPool
    discovery: Discovery | None

    @property
    def allowlist(self) -> PrefillAllowlist:
        return self.app.allowlist

    async def stop(self) -> None:
        try:
            if self.discovery is not None:
                await self.discovery.stop()
            await self.server.close()
        finally:
            await self.upstream.close()


async def start_sidecar(opts: SidecarOptions) -> RunningSidecar:
    upstream = UpstreamPool()
    metrics = RouterMetrics()
    registry = EngineRegistry(NEVER_OPEN)
    registry.upsert(Endpoint(opts.engine, role=EngineRole.DECODE))
    metrics.engine_added(opts.engine)
    proxy = Proxy(upstream, registry, metrics, timeouts=opts.timeouts, retry=RetryPolicy(max_attempts=1))
    prefiller = pd.Prefiller(
        upstream, metrics, timeout=opts.pd_prefill_timeout, connect_timeout=opts.timeouts.connect
    )
    allowlist = PrefillAllowlist(metrics)
    for endpoint in opts.prefill_engines:
        allowlist.add(endpoint.url)
    app = SidecarApp(opts.engine, proxy, prefiller, allowlist, timeouts=opts.timeouts)
    server = HttpServer(app.handle, max_body=opts.max_body_bytes)
    try:
        sock = listening_socket(opts.host, opts.port)
        await server.start(sock)
    except BaseException:
        await server.close()
        await upstream.close()
        raise
    if opts.discovery is not None:
        opts.discovery.start(allowlist.apply)
    port = sock.getsockname()[1]
    return RunningSidecar(f"http://{opts.host}:{port}", app, server, upstream, opts.discovery)


@contextlib.asynccontextmanager
async def running_sidecar(opts: SidecarOptions) -> AsyncIterator[RunningSidecar]:
    sidecar = await start_sidecar(opts)
    try:
        yield sidecar
    finally:
        await sidecar.stop()
