"""The picker's HTTP port: GET /health (alive), /ready (every expected model has a routable engine; JSON
detail), /metrics (the ``kvstack_`` metrics, as the router exports them), /engines (JSON state of every
engine, with the open ext_proc streams). Errors are OpenAI error JSON.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from kvstack.epp.picker import EndpointPicker
from kvstack.frontend.assembly import FrontEnd
from kvstack.http.server import Connection, HttpServer, Request, Response
from kvstack.openai.errors import OpenAIError

_encode = msgspec.json.Encoder().encode
Handler = Callable[[], Awaitable[Response]]


class PickerHttpApp:
    def __init__(self, front: FrontEnd, picker: EndpointPicker) -> None:
        self.front = front
        self.picker = picker
        self._routes: dict[str, Handler] = {
            "/health": self.health,
            "/ready": self.ready,
            "/metrics": self.prometheus,
            "/engines": self.engines,
        }

    def server(self) -> HttpServer:
        return HttpServer(self.handle, max_body=1 << 16)

    async def handle(self, request: Request, conn: Connection) -> Response:
        handler = self._routes.get(request.path)
        if handler is None:
            return _error(OpenAIError(404, "Not Found", "Not Found"))
        if request.method not in ("GET", "HEAD"):
            return _error(OpenAIError(405, "Method Not Allowed", "Method Not Allowed"), [("Allow", "GET")])
        return await handler()

    async def health(self) -> Response:
        return _json({"status": "ok"})

    async def ready(self) -> Response:
        ok, body = self.front.fleet.readiness()
        return _json(body, 200 if ok else 503)

    async def prometheus(self) -> Response:
        self.front.refresh_gauges()
        return Response(200, self.front.metrics.render(), [("Content-Type", "text/plain; charset=utf-8")])

    async def engines(self) -> Response:
        details = self.front.fleet.engines_detail()
        for item in details:
            item["address"] = self.picker.address(item["url"])
        return _json({"engines": details, "roles": self.front.fleet.roles(), "streams": self.picker.streams})


def _json(body: Any, status: int = 200) -> Response:
    return Response(status, _encode(body), [("Content-Type", "application/json")])


def _error(err: OpenAIError, headers: list[tuple[str, str]] | None = None) -> Response:
    return Response(err.status, err.to_json(), [("Content-Type", "application/json"), *(headers or [])])
