"""Plain requests on the router's direct path (no coroutine; `RouterApp.direct`): taken once a connection
to the engine is idle, relayed whole from callbacks, and handed to the coroutine path for everything else:
a refusal to retry, an answer that is a stream or chunked, a first-byte timeout, an idle connection the
engine had closed (sent again, not retried), a client that leaves (the engine's request closed, counted
499). Simulated engines, or a raw-HTTP fake engine."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from kvstack.engines.state import Endpoint
from kvstack.router.app import RouterConfig
from kvstack.router.proxy import Proxy, Timeouts
from support.metrics import counter_totals, sample_sum
from support.routers import FAST, MODEL, Stack, fake_engine, in_flight, router_for, set_faults, wait_models
from support.waiting import eventually

pytestmark = pytest.mark.asyncio

BODY = {"model": MODEL, "prompt": "direct", "max_tokens": 2}


class Spy:
    """What the direct path did from now on: answers relayed from a callback, first attempts handed on."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self._relayed, self._handed_on = proxy.answered_now, proxy.handed_on

    @property
    def relayed(self) -> int:
        return self.proxy.answered_now - self._relayed

    @property
    def handed_on(self) -> int:
        return self.proxy.handed_on - self._handed_on


async def requests_counted(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The router's requests by status, every engine and model together."""
    async with http.get(f"{url}/metrics") as r:
        text = await r.text()
    statuses = {s for (s,) in counter_totals(text, "kvstack_router_requests", "status")}
    return {s: sample_sum(text, "kvstack_router_requests_total", status=s) for s in statuses}


async def _post(http: aiohttp.ClientSession, url: str, **kwargs: Any) -> tuple[int, bytes, Any]:
    async with http.post(f"{url}/v1/completions", json=kwargs.pop("json", BODY), **kwargs) as r:
        return r.status, await r.read(), r.headers


@pytest.mark.routing("round-robin")
async def test_plain_requests_on_idle_connections_are_relayed_from_callbacks(stack: Stack) -> None:
    for _ in range(2):  # a connection to each engine, then idle
        assert (await _post(stack.http, stack.url))[0] == 200
    spy = Spy(stack.router.app.proxy)
    for i in range(10):
        status, body, headers = await _post(stack.http, stack.url, headers={"x-request-id": f"d-{i}"})
        assert status == 200 and json.loads(body)["choices"] and headers["x-request-id"] == f"d-{i}"
    assert spy.relayed == 10 and spy.handed_on == 0
    assert await requests_counted(stack.http, stack.url) == {"200": 12.0}
    assert await in_flight(stack.http, stack.router) == 0


@pytest.mark.routing("round-robin")
async def test_a_refusal_on_the_direct_path_is_retried_on_the_other_engine(stack: Stack) -> None:
    spy = Spy(stack.router.app.proxy)
    for _ in range(2):
        assert (await _post(stack.http, stack.url))[0] == 200
    await set_faults(stack, 0, error_rate=1.0, error_codes=[503])
    for _ in range(6):
        assert (await _post(stack.http, stack.url))[0] == 200
    assert spy.handed_on >= 3  # every request sent first to engine 0 went on in the coroutine path
    async with stack.http.get(f"{stack.url}/metrics") as r:
        text = await r.text()
    assert counter_totals(text, "kvstack_router_retries", "reason") == {("status_503",): spy.handed_on}


async def test_a_client_that_leaves_a_direct_request_closes_the_engines_and_counts_499(stack: Stack) -> None:
    spy = Spy(stack.router.app.proxy)
    for _ in range(4):
        assert (await _post(stack.http, stack.url))[0] == 200
    for i in range(2):
        await set_faults(stack, i, hang_rate=1.0)
    with pytest.raises(TimeoutError):
        await _post(stack.http, stack.url, timeout=aiohttp.ClientTimeout(total=0.5))

    async def counted() -> bool:
        return "499" in await requests_counted(stack.http, stack.url)

    await eventually(counted, what="the request counted")
    assert await requests_counted(stack.http, stack.url) == {"200": 4.0, "499": 1.0}
    assert await in_flight(stack.http, stack.router) == 0 and spy.handed_on == 0
    # The engine's end of it is closed (how vLLM learns to abort): the router holds no connection in use.
    upstream = stack.router.app.proxy.upstream
    assert upstream.open_connections == upstream.idle_connections


@asynccontextmanager
async def scripted_engine(answers: list[bytes | None]) -> AsyncIterator[tuple[str, list[int]]]:
    """An engine answering its n-th POST with ``answers[n]`` (the last one from then on); None: close the
    connection without an answer. Yields its URL and, per POST, the number of its connection (from 1)."""
    seen: list[int] = []
    writers: list[asyncio.StreamWriter] = []

    async def answer(writer: asyncio.StreamWriter) -> bool:
        if not any(w is writer for w in writers):
            writers.append(writer)
        seen.append(next(i for i, w in enumerate(writers, 1) if w is writer))
        reply = answers[min(len(seen), len(answers)) - 1]
        if reply is None:
            return False
        writer.write(reply)
        return True

    async with fake_engine(answer) as url:
        yield url, seen


OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok":true}'


async def test_an_idle_connection_the_engine_closed_is_replaced_not_retried() -> None:
    # POST 2 arrives on the kept-alive connection and the engine drops it unanswered (as one that timed the
    # connection out as the request came): sent again on a new connection, same engine, no retry counted.
    async with scripted_engine([OK, None, OK]) as (url, seen):
        router = await router_for(Endpoint(url, models=frozenset({MODEL})), app=RouterConfig(timeouts=FAST))
        spy = Spy(router.app.proxy)
        try:
            async with aiohttp.ClientSession() as http:
                for _ in range(3):
                    status, body, _ = await _post(http, router.url)
                    assert status == 200 and body == b'{"ok":true}'
                async with http.get(f"{router.url}/metrics") as r:
                    text = await r.text()
            assert seen == [1, 1, 2, 2]  # the dropped one again on connection 2, and the next one there too
            assert spy.handed_on == 1 and spy.relayed == 1
            assert counter_totals(text, "kvstack_router_retries", "reason") == {}
            assert router.app.registry.get(url).breaker.state.value == "closed"  # type: ignore[union-attr]
        finally:
            await router.stop()


def _chunked(content_type: bytes, *pieces: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nTransfer-Encoding: chunked\r\n\r\n" % content_type
    return head + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


SSE = _chunked(b"text/event-stream", b'data: {"a":1}\n\n', b"data: ", b"[DONE]\n\n")
CHUNKED_JSON = _chunked(b"application/json", b'{"ok"', b":true}")


@pytest.mark.parametrize(
    ("answer", "body"),
    [(SSE, b'data: {"a":1}\n\ndata: [DONE]\n\n'), (CHUNKED_JSON, b'{"ok":true}')],
    ids=["event-stream", "chunked-json"],
)
async def test_an_answer_without_a_length_is_relayed_by_the_coroutine_path(
    answer: bytes, body: bytes
) -> None:
    async with scripted_engine([OK, answer]) as (url, seen):
        router = await router_for(Endpoint(url, models=frozenset({MODEL})), app=RouterConfig(timeouts=FAST))
        spy = Spy(router.app.proxy)
        try:
            async with aiohttp.ClientSession() as http:
                assert (await _post(http, router.url))[0] == 200
                for _ in range(2):
                    status, got, headers = await _post(http, router.url)
                    assert status == 200 and got == body
                    assert (
                        headers["Content-Type"]
                        == answer.split(b"Content-Type: ")[1].split(b"\r\n")[0].decode()
                    )
            assert seen == [1, 1, 1] and spy.handed_on == 2
        finally:
            await router.stop()


async def test_a_first_byte_timeout_on_the_direct_path_is_a_504() -> None:
    async def hang(writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(30)
        return False

    answered = False

    async def once_then_hang(writer: asyncio.StreamWriter) -> bool:
        nonlocal answered
        if answered:
            return await hang(writer)
        answered = True
        writer.write(OK)
        return True

    async with fake_engine(once_then_hang) as url:
        timeouts = Timeouts(connect=1.0, first_byte=0.3, idle=5.0, total=60.0)
        router = await router_for(
            Endpoint(url, models=frozenset({MODEL})), app=RouterConfig(timeouts=timeouts)
        )
        try:
            await wait_models(router, 0)
            async with aiohttp.ClientSession() as http:
                assert (await _post(http, router.url))[0] == 200
                status, body, _ = await _post(http, router.url)
            assert status == 504 and json.loads(body)["error"]["type"] == "GatewayTimeoutError"
            assert await in_flight_of(router) == 0
        finally:
            await router.stop()


async def in_flight_of(router: Any) -> int:
    return sum(e.state.in_flight for e in router.app.registry)
