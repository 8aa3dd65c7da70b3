"""Forwarding one request to an engine: streaming passthrough, timeouts, retries and aborts.

- Bytes are relayed as they arrive (SSE in whole events: an event's unfinished tail waits for its end, up
  to ``SSE_HOLD_MAX`` bytes). Timeouts: connect, first byte, idle gap between body reads and a total
  deadline (which also bounds waiting for a client to take what was sent); each can be set per request
  by headers ``x-kvstack-timeout-{connect,first-byte,idle,total}`` (seconds).
- Retries go to the next candidate, only before any byte reached the client, for connect errors, first-byte
  timeouts and statuses 429, 502, 503, 504, after ``RetryPolicy.backoff`` (full jitter). A stream's start is
  held until its first content (`kvstack.router.hold`), and a sized body until it is whole: an engine that
  breaks, times out or sends a server error event before then is retried too. When every attempt failed,
  the last engine answer is passed on (as OpenAI error JSON if it is not JSON), or a 502/504.
- The circuit breaker hears every outcome except client errors (4xx), client disconnects and timeouts the
  client caused (a shorter timeout header, a deadline missed waiting for the client).
- A plain request's first attempt may be sent and, when its answer comes whole, relayed with no coroutine
  (`send_now`, `answer_now`); anything else about it goes on in `forward` from that attempt.
- A client that goes away closes the upstream connection, which is how vLLM learns to abort. After bytes
  were sent, an upstream failure ends a stream with an SSE error event and ``data: [DONE]``, a plain body
  short. Never a hang: the idle timeout bounds every wait for the engine, the deadline every wait for the
  client.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Literal

import msgspec

from kvstack.backoff import Backoff
from kvstack.engines.state import CircuitState
from kvstack.frontend.metrics import InFlightGauge, RouterMetrics
from kvstack.frontend.registry import EngineEntry, EngineRegistry
from kvstack.http.client import (
    ConnectTimedOut,
    UpstreamBroken,
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
)
from kvstack.http.server import Connection
from kvstack.openai import errors
from kvstack.openai.errors import OpenAIError
from kvstack.openai.sse import DONE, encode_error_event
from kvstack.router.hold import HoldPolicy, scan

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
_NOT_FORWARDED = _DROP_REQUEST_HEADERS | {"x-request-id"}  # the router sends its own request id
# Bodies are relayed as the engine sent them (never decompressed), so Content-Encoding passes through.
_DROP_RESPONSE_HEADERS = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "date", "server"}
)
TIMEOUT_HEADER_PREFIX = "x-kvstack-timeout-"
# Response header naming the engine that answered (for clients, load tests and debugging).
ENGINE_HEADER = "x-kvstack-engine"
# What an engine's answer loses on its way to the client: the headers above and the ones the router sets.
_NOT_RELAYED = _DROP_RESPONSE_HEADERS | {"x-request-id", ENGINE_HEADER}
# (header, Timeouts field) of each per-request timeout override.
_TIMEOUT_HEADERS = tuple(
    (TIMEOUT_HEADER_PREFIX + name, name.replace("-", "_"))
    for name in ("connect", "first-byte", "idle", "total")
)
# Sized (non-streaming) answers up to this size are relayed in one piece, with their Content-Length.
WHOLE_BODY_MAX = 8 * 1024 * 1024
# An SSE event longer than this is relayed as it arrives instead of whole.
SSE_HOLD_MAX = 1024 * 1024
# Answers that never have a body (RFC 9110 §6.4.1): relayed without one, never chunked.
NO_BODY_STATUSES = frozenset({204, 304})
# The error type of an engine refusal the router wraps (its body was not JSON).
_REFUSAL_TYPES = {
    429: "RateLimitError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}
_decode_json = msgspec.json.Decoder().decode
# The Timeouts field bounding a wait for the engine.
Bound = Literal["connect", "first_byte", "idle", "total"]


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect: float = 5.0
    first_byte: float = 120.0
    idle: float = 60.0
    total: float = 1800.0

    def overridden(self, headers: Mapping[str, str]) -> Timeouts:
        """Per-request overrides from ``x-kvstack-timeout-*`` headers; bad values raise a 400."""
        changes: dict[str, float] = {}
        for header, field_name in _TIMEOUT_HEADERS:
            raw = headers.get(header)
            if raw is None:
                continue
            try:
                value = float(raw)
            except ValueError:
                value = -1.0
            if not 0 < value <= 86400:
                raise errors.bad_request(f"header {header} must be seconds in (0, 86400], got {raw!r}")
            changes[field_name] = value
        return replace(self, **changes) if changes else self

    def limit(self, bound: Literal["first_byte", "idle"], remaining: float) -> tuple[Bound, float]:
        """How long a wait may last and which bound sets that: ``bound``, or the total deadline when it
        comes first (``remaining`` seconds away)."""
        seconds = self.first_byte if bound == "first_byte" else self.idle
        return (bound, seconds) if seconds < remaining else ("total", max(0.0, remaining))

    def shortened(self, bound: Bound, configured: Timeouts) -> bool:
        """Whether ``bound`` is below the router's ``configured`` value (a client's header chose it)."""
        mine: float = getattr(self, bound)
        return mine < getattr(configured, bound)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_attempts: int = 3
    backoff_base: float = 0.02
    backoff_max: float = 1.0

    @property
    def backoff(self) -> Backoff:
        """Delay before retry n (from 0), full jitter: uniform in [0, min(max, base * 2^n)]."""
        return Backoff(self.backoff_base, self.backoff_max, jitter=(0.0, 1.0))


@dataclass(slots=True)
class Outcome:
    """What happened to a proxied request, for metrics and the approximate prefix index."""

    engine: str | None = None
    status: int = 0
    attempts: int = 0
    first_byte_at: float | None = None
    bytes_sent: int = 0
    error: str | None = None


class Sent:
    """A request's first attempt, sent by `Proxy.send_now` with no coroutine; its answer's headers (or
    ``error``) once ``on_answer`` is called."""

    __slots__ = ("entry", "error", "gauge", "on_answer", "response", "started")

    def __init__(self, entry: EngineEntry, started: float, on_answer: Callable[[Sent], None]) -> None:
        self.entry = entry
        self.started = started
        self.on_answer = on_answer
        self.response: UpstreamResponse | None = None
        self.error: UpstreamError | None = None
        self.gauge: InFlightGauge | None = None

    def answered(self, response: UpstreamResponse, error: UpstreamError | None) -> None:
        self.error = error
        self.on_answer(self)

    def abort(self) -> None:
        """Close the request's connection: the engine stops, ``on_answer`` hears of it."""
        if self.response is not None:
            self.response.close()


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
        hold: HoldPolicy | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.upstream = upstream
        self.registry = registry
        self.metrics = metrics
        self.timeouts = timeouts or Timeouts()
        self.retry = retry or RetryPolicy()
        self.hold = hold or HoldPolicy()
        self._backoff = self.retry.backoff
        self._rng = rng or random.Random()
        self._clock = clock
        # Direct requests (send_now) whose answer was relayed from the callback, and those whose first
        # attempt went on in the coroutine path (forward's ``sent``): what the path did, for tests.
        self.answered_now = 0
        self.handed_on = 0

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
        method: str = "POST",
        sent: Sent | None = None,
    ) -> None:
        """Send ``body`` to the first candidate that answers; relay its response to ``conn``. ``sent``: the
        first attempt, already sent to ``candidates[0]`` (`send_now`), and its answer's headers."""
        if sent is None:
            started = self._clock()
        else:
            started = sent.started
            self.handed_on += 1
        deadline = started + timeouts.total
        headers = forward_headers(client_headers, request_id)
        last_error: _Retryable | None = None
        tried = 0
        for url in candidates:
            if tried >= self.retry.max_attempts:
                break
            entry: EngineEntry | None
            if sent is not None and not tried:
                entry = sent.entry  # (sent already: its circuit let it through, see send_now)
            else:
                entry = self.registry.get(url)
                if entry is None or not entry.breaker.allow():
                    continue
            if tried:
                self.metrics.retries.labels(reason=last_error.reason if last_error else "unknown").inc()
                await asyncio.sleep(self._backoff.delay(tried - 1, self._rng))
            tried += 1
            outcome.attempts = tried
            outcome.engine = url
            first, sent = sent, None
            try:
                return await self._attempt(
                    conn,
                    entry,
                    method,
                    path,
                    body,
                    headers,
                    request_id,
                    stream,
                    timeouts,
                    deadline,
                    outcome,
                    first,
                )
            except _Retryable as exc:
                if last_error is not None and last_error.response is not None:
                    last_error.response.release()
                last_error = exc
                self.metrics.upstream_error(url, exc.reason)
                log.info(
                    "engine %s failed (%s) for request %s; trying the next engine",
                    url,
                    exc.reason,
                    request_id,
                )
        if last_error is not None and last_error.response is not None:
            # Every engine refused: pass the last engine's answer on.
            resp = last_error.response
            outcome.status = resp.status
            try:
                conn.send(resp.status, *_refusal(resp, last_error.body, request_id))
            finally:
                resp.release()
            return
        if last_error is not None:
            outcome.error = last_error.reason
            reason = last_error.reason
            if reason.endswith("_before_content"):
                message = f"every engine tried failed before its first token ({reason})"
                if reason.startswith("timeout"):
                    raise errors.gateway_timeout(message)
                raise OpenAIError(502, message, "BadGatewayError")
            if reason.endswith("timeout"):
                raise errors.gateway_timeout(f"no engine answered in time ({reason})")
            raise OpenAIError(502, f"no engine could be reached ({reason})", "BadGatewayError")
        raise errors.service_unavailable("no routable engine: every candidate's circuit is open")

    async def _attempt(
        self,
        conn: Connection,
        entry: EngineEntry,
        method: str,
        path: str,
        body: bytes,
        headers: list[tuple[str, str]],
        request_id: str,
        stream: bool,
        timeouts: Timeouts,
        deadline: float,
        outcome: Outcome,
        sent: Sent | None,
    ) -> None:
        state, breaker = entry.state, entry.breaker
        url = state.url
        if sent is None or sent.gauge is None:
            started = self._clock()
            in_flight_gauge = self._begin(entry, started)
        else:
            started, in_flight_gauge = sent.started, sent.gauge
        upstream: UpstreamResponse | None = None
        settled = False

        def settle(ok: bool | None) -> None:
            nonlocal settled
            if settled:
                return
            settled = True
            breaker.settle(ok)
            self.metrics.set_circuit(url, breaker.state)

        try:
            bound, first_byte = timeouts.limit("first_byte", deadline - started)
            try:
                if sent is not None and not _send_again(sent):
                    if sent.error is not None:
                        raise sent.error
                    assert sent.response is not None  # (send_now sent it)
                    response = sent.response
                else:
                    response = await self.upstream.request(
                        url,
                        path,
                        headers,
                        body,
                        connect_timeout=timeouts.connect,
                        first_byte_timeout=first_byte,
                        method=method,
                    )
            except TimeoutError:
                settle(self._timeout_verdict(timeouts, bound))
                raise _Retryable("first_byte_timeout") from None
            except UpstreamError as exc:
                # Connect errors, an unusable engine URL, and a connection the engine closed or broke
                # before its answer.
                settle(
                    self._timeout_verdict(timeouts, "connect") if isinstance(exc, ConnectTimedOut) else False
                )
                raise _Retryable(exc.reason) from None
            # (the except and finally clauses below release it; see _unnarrowed)
            upstream = _unnarrowed(response)

            if response.status in RETRY_STATUSES:
                data = await _read_small(response, timeouts.idle)
                # 429 says "busy", not "broken": it does not trip the breaker.
                settle(None if response.status == 429 else False)
                raise _Retryable(f"status_{response.status}", response, data)
            if response.status >= 500:
                settle(False)
            elif response.status >= 400:
                settle(None)  # client errors say nothing about the engine
            resp_headers = _response_headers(response, request_id, url)
            is_sse = response.content_type.startswith("text/event-stream")

            if _whole(response):
                # A complete, sized body (a non-streaming answer): relay it in one write with its length.
                if response.complete:  # it came with the headers (small answers do): nothing to wait for
                    data = response.received()
                else:
                    bound, within = timeouts.limit("idle", deadline - self._clock())
                    try:
                        data = await response.read(within)
                    except UpstreamError as exc:
                        timed_out = isinstance(exc, TimeoutError)
                        settle(self._timeout_verdict(timeouts, bound) if timed_out else False)
                        # Nothing reached the client yet: another engine may answer.
                        reason = "timeout_before_content" if timed_out else "broken_before_content"
                        raise _Retryable(reason) from None
                outcome.status = response.status
                outcome.first_byte_at = self._clock()
                settle(response.status < 500)
                conn.send(response.status, resp_headers, data)
                return

            events = _WholeEvents() if is_sse else None
            held = b""
            if events is not None and response.status == 200 and self.hold.enabled:
                held = await self._hold(response, events, timeouts, deadline, started, settle)
            outcome.status = response.status
            conn.start(response.status, resp_headers)
            outcome.first_byte_at = self._clock()
            stopped = await self._relay(conn, response, events, timeouts, deadline, outcome, held)
            if stopped is None:
                settle(response.status < 500)
                conn.end()
            elif stopped == "client":
                # The client took nothing until the deadline: abort the engine's request, drop the client.
                settle(None)
                outcome.error = "client_too_slow"
                log.info("request %s: the client stopped reading; cut off at its deadline", request_id)
                response.close()
                conn.abort()
            else:
                settle(False if stopped == "broke" else self._timeout_verdict(timeouts, stopped))
                if stopped == "broke":
                    reason, label = "upstream_broke", "mid_stream"
                else:
                    reason = label = f"{stopped}_timeout"
                self.metrics.upstream_error(url, label)
                sse = stream or is_sse
                await self._end_early(conn, response, reason, url, events, sse, deadline, outcome)
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
            self._end(entry, in_flight_gauge)
            if upstream is not None:
                upstream.release()

    def _begin(self, entry: EngineEntry, started: float) -> InFlightGauge:
        """An attempt on ``entry`` starts: count it in flight."""
        state = entry.state
        state.in_flight += 1
        self.registry.publish_in_flight(entry)
        self.registry.note_sent(state, started)
        gauge = self.metrics.engine_in_flight(state.url)
        gauge.set(state.in_flight)
        return gauge

    def _end(self, entry: EngineEntry, gauge: InFlightGauge) -> None:
        state = entry.state
        state.in_flight -= 1
        self.registry.publish_in_flight(entry)
        # Requests the last scrape saw have finished: the baseline of "sent since the scrape" drops too.
        state.in_flight_at_scrape = min(state.in_flight_at_scrape, state.total_in_flight)
        gauge.set(state.in_flight)

    # -- a plain request's path without a coroutine ------------------------------------------------------
    def send_now(
        self,
        client_headers: Mapping[str, str],
        *,
        path: str,
        body: bytes,
        candidates: list[str],
        request_id: str,
        timeouts: Timeouts,
        outcome: Outcome,
        on_answer: Callable[[Sent], None],
    ) -> Sent | None:
        """Send the first attempt at once, on an idle connection to ``candidates[0]``; None (nothing sent)
        when that engine has none or its circuit is not closed: `forward` then. ``on_answer(sent)`` is
        called once, when the answer's headers or a failure came: `answer_now` relays an answer that needs
        nothing more, `forward` (``sent=``) goes on with anything else, `abandon` ends it for a client that
        left."""
        entry = self.registry.get(candidates[0])
        if entry is None or entry.breaker.state is not CircuitState.CLOSED:
            return None
        started = self._clock()
        sent = Sent(entry, started, on_answer)
        _, first_byte = timeouts.limit("first_byte", timeouts.total)
        response = self.upstream.send_now(
            entry.state.url,
            path,
            forward_headers(client_headers, request_id),
            body,
            first_byte_timeout=first_byte,
            on_answer=sent.answered,
        )
        if response is None:
            return None
        sent.response = response
        sent.gauge = self._begin(entry, started)
        outcome.attempts = 1
        outcome.engine = entry.state.url
        return sent

    def answer_now(self, conn: Connection, sent: Sent, request_id: str, outcome: Outcome) -> bool:
        """Relay ``sent``'s answer if it is whole and final: it came with its headers, sized, and its
        status is not one to retry. False: nothing was done."""
        upstream = sent.response
        if sent.error is not None or upstream is None or not upstream.complete or sent.gauge is None:
            return False
        status = upstream.status
        if status in RETRY_STATUSES or not _whole(upstream):
            return False
        entry = sent.entry
        url = entry.state.url
        outcome.status = status
        outcome.first_byte_at = self._clock()
        breaker = entry.breaker
        try:
            conn.send(status, _response_headers(upstream, request_id, url), upstream.received())
        except ConnectionResetError:
            outcome.error = "client_disconnected"
            breaker.settle(None)
            upstream.close()
        else:
            # (a server error is the engine's failure; a client error says nothing about it)
            breaker.settle(False if status >= 500 else (None if status >= 400 else True))
            upstream.release()
        self.metrics.set_circuit(url, breaker.state)
        self._end(entry, sent.gauge)
        self.answered_now += 1
        return True

    def abandon(self, sent: Sent, outcome: Outcome) -> None:
        """The client left before ``sent``'s answer was relayed: stop the engine, count nothing against it."""
        outcome.error = "client_disconnected"
        sent.abort()
        entry = sent.entry
        entry.breaker.settle(None)
        self.metrics.set_circuit(entry.state.url, entry.breaker.state)
        if sent.gauge is not None:
            self._end(entry, sent.gauge)

    def _timeout_verdict(self, timeouts: Timeouts, bound: Bound) -> bool | None:
        """For the breaker: a timeout is the engine's failure only at the router's own limit."""
        return None if timeouts.shortened(bound, self.timeouts) else False

    async def _hold(
        self,
        upstream: UpstreamResponse,
        events: _WholeEvents,
        timeouts: Timeouts,
        deadline: float,
        sent_at: float,
        settle: Callable[[bool | None], None],
    ) -> bytes:
        """Read a stream's start until its first content or a bound of `HoldPolicy` (`kvstack.router.hold`);
        return the whole events read, for the client. An engine that fails first is settled, its connection
        closed, and ``_Retryable`` raised: the client has seen nothing of it."""
        policy = self.hold
        release_at = sent_at + (timeouts.first_byte if policy.seconds is None else policy.seconds)
        pieces: list[bytes] = []
        size = 0
        failure: str | None = None
        cause = "time"
        while True:
            now = self._clock()
            bound, wait = timeouts.limit("idle", deadline - now)
            left = release_at - now
            if left <= 0:
                break
            try:
                async with asyncio.timeout(min(wait, left)):
                    chunk = await upstream.readany()
            except TimeoutError:
                if left < wait:
                    break
                settle(self._timeout_verdict(timeouts, bound))
                failure = "timeout_before_content"
                break
            except UpstreamError:
                chunk, failure = b"", "broken_before_content"
            if not chunk:  # ended (or broke) before any content: as good as broken
                settle(False)
                failure = failure or "ended_before_content"
                break
            size += len(chunk)
            whole = events.whole(chunk)
            if whole:
                pieces.append(whole)
                verdict = scan(whole)
                if verdict == "error":
                    settle(False)
                    failure = "error_before_content"
                    break
                if verdict == "content":
                    cause = "content"
                    break
            if size > policy.max_bytes:
                cause = "bytes"
                break
        if failure is not None:
            upstream.close()
            raise _Retryable(failure)
        self.metrics.hold_released(cause)
        return b"".join(pieces)

    async def _relay(
        self,
        conn: Connection,
        upstream: UpstreamResponse,
        events: _WholeEvents | None,
        timeouts: Timeouts,
        deadline: float,
        outcome: Outcome,
        held: bytes = b"",
    ) -> Bound | Literal["client", "broke"] | None:
        """Copy the engine's body to the client, starting with the ``held`` bytes. None when it ended;
        "broke" when the engine's connection failed; else what timed out: a wait for the engine (idle gap or
        total), or for the client."""
        loop = asyncio.get_running_loop()
        deadline_at = loop.time() + deadline - self._clock()  # the total deadline on the loop's clock
        idle = timeouts.idle
        waiting_for: Bound | Literal["client"] = "idle"
        try:
            # One timer for the whole relay, moved before each wait: for the engine, the idle gap capped by
            # the deadline; for a client that is slow to read, the deadline alone.
            async with asyncio.timeout(None) as timer:
                if held:
                    waiting_for = "client"
                    timer.reschedule(deadline_at)
                    await conn.write(held)
                    outcome.bytes_sent += len(held)
                while True:
                    idle_at = loop.time() + idle
                    if idle_at < deadline_at:
                        waiting_for = "idle"
                        timer.reschedule(idle_at)
                    else:
                        waiting_for = "total"
                        timer.reschedule(deadline_at)
                    try:
                        chunk = await upstream.readany()
                    except UpstreamError:
                        return "broke"
                    ended = not chunk
                    if events is not None:
                        chunk = events.rest() if ended else events.whole(chunk)
                    if chunk:
                        waiting_for = "client"
                        timer.reschedule(deadline_at)
                        # A failed write means the client left: ConnectionResetError goes to the caller.
                        await conn.write(chunk)
                        outcome.bytes_sent += len(chunk)
                    if ended:
                        return None
        except TimeoutError:
            return waiting_for

    async def _end_early(
        self,
        conn: Connection,
        upstream: UpstreamResponse,
        reason: str,
        url: str,
        events: _WholeEvents | None,
        sse: bool,
        deadline: float,
        outcome: Outcome,
    ) -> None:
        """After bytes reached the client the status cannot change: end a stream with an SSE error event
        and ``[DONE]``, which the client gets until the deadline to take."""
        outcome.error = reason
        upstream.close()
        if sse:
            err = OpenAIError(502, f"engine {url} failed mid-stream ({reason})", "BadGatewayError")
            # A client holding part of an event would read the error as the rest of it: end that one.
            separator = b"\n\n" if events is not None and events.mid_event else b""
            loop = asyncio.get_running_loop()
            try:
                async with asyncio.timeout_at(loop.time() + deadline - self._clock()):
                    await conn.write(separator + encode_error_event(err) + DONE)
            except TimeoutError:
                conn.abort()  # the client stopped reading
                return
            except ConnectionError:
                return
            if conn.unsent and self._clock() >= deadline:
                conn.abort()  # past the deadline with bytes the client has not taken: it stopped reading
                return
        conn.end()


def _unnarrowed(response: UpstreamResponse) -> UpstreamResponse | None:
    """``response`` typed as maybe None, for the variable an attempt's except and finally clauses read: a
    plain assignment would narrow it, and mypyc's compiled code then takes the None it holds in those
    clauses (when the request failed before it was assigned) for an error."""
    return response


def _whole(upstream: UpstreamResponse) -> bool:
    """Whether an answer is relayed in one piece with its length: no body, or a sized one that is not a
    stream and at most ``WHOLE_BODY_MAX``."""
    if upstream.status in NO_BODY_STATUSES:
        return True
    length = upstream.content_length
    return (
        length is not None
        and length <= WHOLE_BODY_MAX
        and not upstream.content_type.startswith("text/event-stream")
    )


def _send_again(sent: Sent) -> bool:
    """A first attempt that failed before the engine sent anything, on an idle connection the engine had
    closed: the request is sent again on a new one (as `UpstreamPool.request` does for its own)."""
    error, response = sent.error, sent.response
    return isinstance(error, UpstreamBroken) and response is not None and response.unanswered


class _WholeEvents:
    """An SSE stream cut after its last complete event; the rest waits for its end. A stream the engine
    breaks off then never leaves the client half an event, which would swallow the error event sent
    after it. An event over ``SSE_HOLD_MAX`` bytes is relayed as it comes (``mid_event`` says the client
    holds part of one)."""

    __slots__ = ("held", "mid_event")

    def __init__(self) -> None:
        self.held = b""
        self.mid_event = False

    def whole(self, chunk: bytes) -> bytes:
        """What can go to the client now, of the held bytes followed by ``chunk``."""
        data = self.held + chunk if self.held else chunk
        if data.endswith(b"\n\n"):  # the usual case: engines write whole events
            self.held, self.mid_event = b"", False
            return data
        end = _events_end(data)
        if len(data) - end > SSE_HOLD_MAX:
            self.held, self.mid_event = b"", True
            return data
        if end:
            self.mid_event = False
        self.held = data[end:]
        return data[:end]

    def rest(self) -> bytes:
        """The held bytes, at the end of the stream (an engine that ended mid-event: passed on as is)."""
        held, self.held = self.held, b""
        return held


def _events_end(data: bytes) -> int:
    """Where the last complete SSE event in ``data`` ends (0: none does); an event ends with a blank line."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


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


def forward_headers(incoming: Mapping[str, str], request_id: str) -> list[tuple[str, str]]:
    """The client's headers as an engine gets them: hop-by-hop and router-only ones out, our request id in."""
    drop = _NOT_FORWARDED
    named = incoming.get("connection")
    if named:  # headers the Connection header names are hop-by-hop too (RFC 9110 §7.6.1), e.g. HTTP2-Settings
        drop = drop | {name.strip().lower() for name in named.split(",")}
    out = []
    for key, value in incoming.items():  # (a loop: a comprehension would cost a function object per call)
        lk = key.lower()
        if lk not in drop and not lk.startswith(TIMEOUT_HEADER_PREFIX):
            out.append((key, value))
    out.append(("x-request-id", request_id))
    return out


def _refusal(resp: UpstreamResponse, body: bytes, request_id: str) -> tuple[list[tuple[str, str]], bytes]:
    """The headers and body an engine's refusal reaches the client with: as the engine sent them, or, when
    the body is not JSON (an HTML page from a proxy in front of the engine), as OpenAI error JSON."""
    headers = _response_headers(resp, request_id, resp.url)
    if resp.header("content-encoding") is not None:
        return headers, body  # (compressed: passed on as sent)
    try:
        _decode_json(body)
    except (msgspec.DecodeError, RecursionError):
        excerpt = body[:200].decode("utf-8", "replace").strip()
        message = f"engine {resp.url} answered {resp.status} with a body that is not JSON: {excerpt!r}"
        err = OpenAIError(resp.status, message, _REFUSAL_TYPES.get(resp.status, "BadGatewayError"))
        keep = [(k, v) for k, v in headers if k.lower() in ("retry-after", "x-request-id", ENGINE_HEADER)]
        return [("Content-Type", "application/json"), *keep], err.to_json()
    return headers, body


def _response_headers(resp: UpstreamResponse, request_id: str, engine: str) -> list[tuple[str, str]]:
    out = []
    for key, value in resp.headers:
        if key.lower() not in _NOT_RELAYED:
            out.append((key, value))
    out += (("x-request-id", request_id), (ENGINE_HEADER, engine))
    return out
