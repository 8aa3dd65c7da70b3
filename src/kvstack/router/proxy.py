"""Forwarding one request to an engine: streaming passthrough, timeouts, retries and aborts.

- Bytes are relayed as they arrive (SSE and chunked bodies alike); nothing is buffered beyond one read.
- Timeouts: connect, first byte (request sent -> response headers), idle gap between body reads, and a
  total deadline. Each can be overridden per request by headers ``x-kvstack-timeout-{connect,first-byte,
  idle,total}`` (seconds).
- Retries go to the next candidate engine, only before any byte reached the client, for connect
  errors, first-byte timeouts and statuses 429, 502, 503, 504; exponential backoff with full jitter.
  When every attempt failed, the last engine response is passed on, or a 502/504 OpenAI error.
- The circuit breaker hears every outcome except client errors (4xx) and client disconnects.
- A client that goes away (the handler is cancelled, or a write fails) closes the upstream connection,
  which is how vLLM learns to abort the request.
- After bytes were sent, an upstream failure cannot change the status: a stream gets a final SSE error
  event and ends; a plain body ends short. Never a hang: the idle timeout bounds every wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from kvstack.openai import errors
from kvstack.openai.errors import OpenAIError
from kvstack.openai.sse import encode_error_event
from kvstack.router.http1 import Connection
from kvstack.router.metrics import RouterMetrics
from kvstack.router.registry import EngineEntry, EngineRegistry
from kvstack.router.upstream import UpstreamError, UpstreamPool, UpstreamResponse

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({429, 502, 503, 504})
# Hop-by-hop headers (RFC 9110 §7.6.1) and ones the upstream client sets itself.
_DROP_REQUEST_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "authorization",
        "expect",  # the router already read the whole body; an engine's "100 Continue" would be in the way
    }
)
# Bodies are relayed as the engine sent them (never decompressed), so Content-Encoding passes through.
_DROP_RESPONSE_HEADERS = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "date", "server"}
)
TIMEOUT_HEADER_PREFIX = "x-kvstack-timeout-"
# Response header naming the engine that answered (for clients, load tests and debugging).
ENGINE_HEADER = "x-kvstack-engine"
# Sized (non-streaming) answers up to this size are relayed in one piece, with their Content-Length.
WHOLE_BODY_MAX = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect: float = 5.0
    first_byte: float = 120.0
    idle: float = 60.0
    total: float = 1800.0

    def overridden(self, headers: Mapping[str, str]) -> Timeouts:
        """Per-request overrides from ``x-kvstack-timeout-*`` headers; bad values raise a 400."""
        changes: dict[str, float] = {}
        for name in ("connect", "first-byte", "idle", "total"):
            raw = headers.get(TIMEOUT_HEADER_PREFIX + name)
            if raw is None:
                continue
            try:
                value = float(raw)
            except ValueError:
                value = -1.0
            if not 0 < value <= 86400:
                header = TIMEOUT_HEADER_PREFIX + name
                raise errors.bad_request(f"header {header} must be seconds in (0, 86400], got {raw!r}")
            changes[name.replace("-", "_")] = value
        return replace(self, **changes) if changes else self


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_attempts: int = 3
    backoff_base: float = 0.02
    backoff_max: float = 1.0

    def backoff(self, attempt: int, rng: random.Random) -> float:
        """Full jitter: uniform in [0, min(max, base * 2^attempt)]."""
        return rng.uniform(0, min(self.backoff_max, self.backoff_base * (2**attempt)))


@dataclass(slots=True)
class Outcome:
    """What happened to a proxied request, for metrics and the approximate prefix index."""

    engine: str | None = None
    status: int = 0
    attempts: int = 0
    first_byte_at: float | None = None
    bytes_sent: int = 0
    error: str | None = None


class _Retryable(Exception):
    def __init__(self, reason: str, response: UpstreamResponse | None = None, body: bytes = b"") -> None:
        super().__init__(reason)
        self.reason = reason
        self.response = response
        self.body = body


class Proxy:
    def __init__(
        self,
        upstream: UpstreamPool,
        registry: EngineRegistry,
        metrics: RouterMetrics,
        *,
        timeouts: Timeouts | None = None,
        retry: RetryPolicy | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.upstream = upstream
        self.registry = registry
        self.metrics = metrics
        self.timeouts = timeouts or Timeouts()
        self.retry = retry or RetryPolicy()
        self._rng = rng or random.Random()
        self._clock = clock

    async def forward(
        self,
        conn: Connection,
        client_headers: Mapping[str, str],
        *,
        path: str,
        body: bytes,
        candidates: list[str],
        stream: bool,
        request_id: str,
        timeouts: Timeouts,
        outcome: Outcome,
    ) -> None:
        """Send ``body`` to the first candidate that answers; relay its response to ``conn``."""
        started = self._clock()
        deadline = started + timeouts.total
        headers = _forward_headers(client_headers, request_id)
        last_error: _Retryable | None = None
        tried = 0
        for url in candidates:
            if tried >= self.retry.max_attempts:
                break
            entry = self.registry.get(url)
            if entry is None or not entry.breaker.allow():
                continue
            if tried:
                self.metrics.retries.labels(reason=last_error.reason if last_error else "unknown").inc()
                await asyncio.sleep(self.retry.backoff(tried - 1, self._rng))
            tried += 1
            outcome.attempts = tried
            outcome.engine = url
            try:
                return await self._attempt(
                    conn, entry, path, body, headers, request_id, stream, timeouts, deadline, outcome
                )
            except _Retryable as exc:
                if last_error is not None and last_error.response is not None:
                    last_error.response.release()
                last_error = exc
                self.metrics.upstream_errors.labels(engine=url, reason=exc.reason).inc()
                log.info(
                    "engine %s failed (%s) for request %s; trying the next engine",
                    url,
                    exc.reason,
                    request_id,
                )
        if last_error is not None and last_error.response is not None:
            # Every engine refused: pass the last engine's answer on unchanged.
            resp = last_error.response
            outcome.status = resp.status
            try:
                conn.send(resp.status, _response_headers(resp, request_id, resp.url), last_error.body)
            finally:
                resp.release()
            return
        if last_error is not None:
            outcome.error = last_error.reason
            if last_error.reason.endswith("timeout"):
                raise errors.gateway_timeout(f"no engine answered in time ({last_error.reason})")
            raise OpenAIError(502, f"no engine could be reached ({last_error.reason})", "BadGatewayError")
        raise errors.service_unavailable("no routable engine: every candidate's circuit is open")

    async def _attempt(
        self,
        conn: Connection,
        entry: EngineEntry,
        path: str,
        body: bytes,
        headers: list[tuple[str, str]],
        request_id: str,
        stream: bool,
        timeouts: Timeouts,
        deadline: float,
        outcome: Outcome,
    ) -> None:
        state, breaker = entry.state, entry.breaker
        url = state.url
        state.in_flight += 1
        self.registry.publish_in_flight(entry)
        self.registry.note_sent(state, self._clock())
        in_flight_gauge = self.metrics.engine_in_flight(url)
        in_flight_gauge.set(state.in_flight)
        upstream: UpstreamResponse | None = None
        settled = False

        def settle(ok: bool | None) -> None:
            nonlocal settled
            if settled:
                return
            settled = True
            if ok is True:
                breaker.record_success()
            elif ok is False:
                breaker.record_failure()
            else:
                breaker.release_probe()
            self.metrics.set_circuit(url, breaker.state)

        try:
            first_byte = min(timeouts.first_byte, max(0.0, deadline - self._clock()))
            try:
                upstream = await self.upstream.request(
                    url, path, headers, body, connect_timeout=timeouts.connect, first_byte_timeout=first_byte
                )
            except TimeoutError:
                settle(False)
                raise _Retryable("first_byte_timeout") from None
            except UpstreamError as exc:
                # Connect errors, and a connection the engine closed or broke before its answer.
                settle(False)
                raise _Retryable(exc.reason) from None

            if upstream.status in RETRY_STATUSES:
                data = await _read_small(upstream, timeouts.idle)
                # 429 says "busy", not "broken": it does not trip the breaker.
                settle(None if upstream.status == 429 else False)
                raise _Retryable(f"status_{upstream.status}", upstream, data)
            if upstream.status >= 500:
                settle(False)
            elif upstream.status >= 400:
                settle(None)  # client errors say nothing about the engine
            outcome.status = upstream.status
            resp_headers = _response_headers(upstream, request_id, url)
            is_sse = (upstream.header("content-type") or "").startswith("text/event-stream")
            length = upstream.content_length
            loop = asyncio.get_running_loop()

            if not is_sse and length is not None and length <= WHOLE_BODY_MAX:
                # A complete, sized body (a non-streaming answer): relay it in one write with its length.
                try:
                    data = await upstream.read(min(timeouts.idle, max(0.0, deadline - self._clock())))
                except UpstreamError:
                    settle(False)
                    self.metrics.upstream_errors.labels(engine=url, reason="body").inc()
                    raise OpenAIError(
                        502, f"engine {url} failed while sending its answer", "BadGatewayError"
                    ) from None
                outcome.first_byte_at = self._clock()
                settle(upstream.status < 500)
                conn.send(upstream.status, resp_headers, data)
                return

            conn.start(upstream.status, resp_headers)
            outcome.first_byte_at = self._clock()
            # One timer for the whole relay, pushed forward before each read (idle gap, capped by the total).
            async with asyncio.timeout(None) as watchdog:
                while True:
                    watchdog.reschedule(
                        min(loop.time() + timeouts.idle, loop.time() + deadline - self._clock())
                    )
                    broke: Exception | None = None
                    try:
                        chunk = await upstream.readany()
                    except UpstreamError as exc:
                        chunk, broke = b"", exc
                    if broke is not None:
                        watchdog.reschedule(None)
                        settle(False)
                        self.metrics.upstream_errors.labels(engine=url, reason="mid_stream").inc()
                        await _upstream_broke(conn, upstream, broke, url, stream or is_sse, outcome)
                        return
                    if not chunk:
                        break
                    # Only the engine's silence counts as idle, not a slow client.
                    watchdog.reschedule(None)
                    # A failed write means the client left: ConnectionResetError goes to the handler below.
                    await conn.write(chunk)
                    outcome.bytes_sent += len(chunk)
            settle(upstream.status < 500)
            conn.end()
        except TimeoutError as exc:
            # The relay watchdog fired: idle gap or total deadline, after bytes reached the client.
            settle(False)
            self.metrics.upstream_errors.labels(engine=url, reason="idle_timeout").inc()
            assert upstream is not None
            await _upstream_broke(conn, upstream, exc, url, True, outcome)
        except ConnectionResetError:
            # The client went away mid-write: closing the upstream connection makes the engine abort.
            outcome.error = "client_disconnected"
            settle(None)
            if upstream is not None:
                upstream.close()
            raise
        except asyncio.CancelledError:
            outcome.error = "client_disconnected"
            settle(None)
            if upstream is not None:
                upstream.close()
            raise
        finally:
            state.in_flight -= 1
            self.registry.publish_in_flight(entry)
            # Requests the last scrape saw have finished: the baseline of "sent since the scrape" drops too.
            state.in_flight_at_scrape = min(state.in_flight_at_scrape, state.total_in_flight)
            in_flight_gauge.set(state.in_flight)
            if upstream is not None:
                upstream.release()


async def _upstream_broke(
    conn: Connection,
    upstream: UpstreamResponse,
    exc: BaseException,
    url: str,
    sse: bool,
    outcome: Outcome,
) -> None:
    """After bytes reached the client the status cannot change: end a stream with an SSE error event."""
    reason = "idle_timeout" if isinstance(exc, TimeoutError) else "upstream_broke"
    outcome.error = reason
    if sse:
        err = OpenAIError(502, f"engine {url} failed mid-stream ({reason})", "BadGatewayError")
        with contextlib.suppress(ConnectionError):
            await conn.write(encode_error_event(err))
    upstream.close()
    conn.end()


async def _read_small(resp: UpstreamResponse, wait_s: float, limit: int = 1 << 20) -> bytes:
    """Up to ``limit`` bytes of a refused answer's body (to pass on if every engine refuses)."""
    pieces: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(wait_s):
            while size < limit:
                piece = await resp.readany()
                if not piece:
                    break
                pieces.append(piece)
                size += len(piece)
    except (TimeoutError, UpstreamError):
        pass
    return b"".join(pieces)[:limit]


def _forward_headers(incoming: Mapping[str, str], request_id: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for key, value in incoming.items():
        lk = key.lower()
        if lk in _DROP_REQUEST_HEADERS or lk.startswith(TIMEOUT_HEADER_PREFIX) or lk == "x-request-id":
            continue
        out.append((key, value))
    out.append(("x-request-id", request_id))
    return out


def _response_headers(resp: UpstreamResponse, request_id: str, engine: str) -> list[tuple[str, str]]:
    out = [
        (key, value)
        for key, value in resp.headers
        if (lk := key.lower()) not in _DROP_RESPONSE_HEADERS and lk != "x-request-id" and lk != ENGINE_HEADER
    ]
    out.append(("x-request-id", request_id))
    out.append((ENGINE_HEADER, engine))
    return out
