"""aiohttp responses in the OpenAI shape, shared by every kvstack server (simulator, router)."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from kvstack.openai.errors import OpenAIError

_encoder = msgspec.json.Encoder()


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """A compact JSON response, encoded like vLLM's (no spaces)."""
    return web.Response(
        body=_encoder.encode(body), status=status, content_type="application/json", headers=headers
    )


def error_response(err: OpenAIError, headers: dict[str, str] | None = None) -> web.Response:
    """The error's JSON body with its status."""
    return json_response(err.body(), status=err.status, headers=headers)
