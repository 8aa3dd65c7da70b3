"""Prefill/decode disaggregation on vLLM's request-level protocol, shared by the proxy and the sidecar.

A request whose prompt is prefilled elsewhere goes twice: first to a prefill engine as ``prefill_body``
(the client's body with ``kv_transfer_params: {"do_remote_decode": true}``, one token, not streamed, one
sequence), then to a decode engine as ``decode_body`` (the client's body with the ``kv_transfer_params``
the prefill answered, which name the KV blocks to pull). `Prefiller.prefill` makes the first call within
a timeout; when it fails the decode engine gets the client's body and computes the prompt itself.

Fallback reasons (``kvstack_pd_fallbacks{reason}``): ``unsupported_request`` (not /v1/completions or
/v1/chat/completions, a list of prompts, or a client that sets ``kv_transfer_params`` itself),
``no_prefill_engine`` (none known, or every circuit open), ``unreachable`` (connect failed or the
connection broke), ``timeout``, ``error_status`` (the prefill answered non-200), ``no_params`` (a 200
without ``kv_transfer_params``, or not JSON). In Envoy mode the prefill engine travels to the sidecar as
``x-prefiller-host-port`` (`PREFILLER_HEADER`, `host_port`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec

from kvstack.frontend.metrics import RouterMetrics
from kvstack.http.client import BodyTooLarge, Reply, UpstreamError, UpstreamPool

PREFILLER_HEADER = "x-prefiller-host-port"
PD_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
PREFILL_ANSWER_MAX = 4 << 20  # a one-token answer (with logprobs, echo): well under this
# Fields the prefill request drops: the stream's options, and what asks for more than one token or sequence.
_PREFILL_DROPS = ("stream_options", "min_tokens", "n", "best_of")

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


def host_port(url: str) -> str:
    """An engine URL's ``host:port`` (``[v6]:port``): how Envoy and ``x-prefiller-host-port`` name engines."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def json_object(raw: bytes) -> dict[str, Any] | None:
    """A request body as a JSON object, or None when it is not one."""
    try:
        parsed = _decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return None
    return parsed if isinstance(parsed, dict) else None


def unsupported(path: str, body: dict[str, Any]) -> bool:
    """Whether a request cannot be disaggregated (it is then served whole by the decode engine)."""
    if path not in PD_PATHS or "kv_transfer_params" in body:
        return True
    prompt = body.get("prompt")
    # One answer's kv_transfer_params describe one prompt's blocks: a batch of prompts is served whole.
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))


def prefill_body(path: str, body: dict[str, Any]) -> bytes:
    """The prefill engine's request: compute the prompt, keep its KV for a decode engine, answer one token."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPS}
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    out["stream"] = False
    out["max_tokens"] = 1
    if path == "/v1/chat/completions":
        out["max_completion_tokens"] = 1
    return _encode(out)


def decode_body(body: dict[str, Any], params: dict[str, Any]) -> bytes:
    """The decode engine's request: the client's, with the prefill's ``kv_transfer_params``."""
    return _encode({**body, "kv_transfer_params": params})


def transfer_params(answer: bytes) -> tuple[dict[str, Any] | None, int | None]:
    """(``kv_transfer_params``, ``usage.prompt_tokens``) of a prefill answer; None for what it lacks."""
    parsed = json_object(answer)
    if parsed is None:
        return None, None
    params = parsed.get("kv_transfer_params")
    usage = parsed.get("usage")
    tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return (
        params if isinstance(params, dict) and params else None,
        tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None,
    )


@dataclass(frozen=True, slots=True)
class Prefill:
    """One prefill's outcome: the params for the decode engine, or why there are none."""

    params: dict[str, Any] | None
    failure: str | None  # a fallback reason (module docstring) when ``params`` is None
    engine_ok: bool | None  # for the prefill engine's circuit breaker: None says nothing about it

    def body_for_decode(self, body: dict[str, Any], raw: bytes) -> bytes:
        """What the decode engine gets: the client's body with the params, or as the client sent it."""
        return raw if self.params is None else decode_body(body, self.params)


class Prefiller:
    """Sends prefill requests through ``upstream`` and counts them (``kvstack_pd_*``)."""

    def __init__(
        self,
        upstream: UpstreamPool,
        metrics: RouterMetrics,
        *,
        timeout: float = 30.0,
        connect_timeout: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.upstream = upstream
        self.metrics = metrics
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._clock = clock

    def fallback(self, reason: str) -> None:
        """Count a request served whole although scheduling chose to disaggregate it."""
        self.metrics.pd_fallback(reason)

    async def prefill(
        self,
        url: str,
        path: str,
        body: dict[str, Any],
        headers: Sequence[tuple[str, str]],
        *,
        within: float | None = None,
    ) -> Prefill:
        """Prefill ``body``'s prompt on engine ``url`` within ``within`` s (default: the timeout).

        ``headers`` are the ones the decode request carries (``x-request-id`` included). A failure is
        counted as a fallback; cancelling closes the connection, which makes the engine abort.
        """
        started = self._clock()
        limit = self.timeout if within is None else min(within, self.timeout)
        sent = [(k, v) for k, v in headers if k.lower() != "content-type"]
        try:
            reply = await self.upstream.post_json(
                url,
                path,
                prefill_body(path, body),
                within=limit,
                max_bytes=PREFILL_ANSWER_MAX,
                headers=sent,
                connect_timeout=min(self.connect_timeout, limit),
            )
        except BodyTooLarge:
            result = Prefill(None, "no_params", None)
        except TimeoutError:
            # The engine's failure only at the configured limit, not at a client's shorter deadline.
            result = Prefill(None, "timeout", False if limit >= self.timeout else None)
        except UpstreamError:
            result = Prefill(None, "unreachable", False)
        else:
            result = self._judge(url, reply, started)
        self.metrics.pd_prefill_sent(url, result.failure or "ok")
        if result.failure is not None:
            self.fallback(result.failure)
        return result

    def _judge(self, url: str, reply: Reply, started: float) -> Prefill:
        if reply.status != 200:
            return Prefill(None, "error_status", False if reply.status >= 500 else None)
        params, prompt_tokens = transfer_params(reply.body)
        if params is None:
            return Prefill(None, "no_params", None)
        self.metrics.pd_prefilled(url, self._clock() - started, prompt_tokens)
        return Prefill(params, None, True)
