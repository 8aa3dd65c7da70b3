"""Failures behind the router: retries on refusals and connect errors, the circuit breaker, first-byte
timeouts (the router's own and the ones a client chose), refusals from every engine (JSON or not), and
engines with unusable URLs. Engines are simulators with injected faults, or a raw-HTTP fake engine."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from kvstack.engines.state import Endpoint
from kvstack.frontend.circuit import CircuitConfig
from kvstack.router.app import RouterConfig
from kvstack.router.proxy import RetryPolicy, Timeouts
from kvstack.sim.cluster import RunningEngine, stop_engine
from support.routers import (
    FAST,
    MODEL,
    Stack,
    circuits,
    fake_engine,
    router_for,
    set_faults,
    wait_models,
)

# -- retries and the circuit breaker -------------------------------------------------------------------------


@pytest.mark.routing("round-robin")  # so that the faulty engine is picked first half the time
async def test_retries_on_503_go_to_the_other_engine(stack: Stack) -> None:
    await set_faults(stack, 0, error_rate=1.0, error_codes=[503])
    body = {"model": MODEL, "prompt": "retry me", "max_tokens": 2}
    for _ in range(10):
        async with stack.http.post(f"{stack.url}/v1/completions", json=body) as r:
            assert r.status == 200
    assert await stack.engine_metric(1, "vllm:request_success_total") == 10
    async with stack.http.get(f"{stack.url}/metrics") as r:
        text = await r.text()
    assert 'kvstack_router_retries_total{reason="status_503"}' in text


@pytest.mark.routing("round-robin")
async def test_circuit_opens_after_consecutive_failures(stack: Stack) -> None:
    await set_faults(stack, 0, error_rate=1.0, error_codes=[500])
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    statuses = []
    for _ in range(12):
        async with stack.http.post(f"{stack.url}/v1/completions", json=body) as r:
            statuses.append(r.status)
    # 500 is not retried (it may not be idempotent to repeat), but it counts against the engine.
    assert statuses.count(500) == 3, statuses
    async with stack.http.get(f"{stack.url}/engines") as r:
        states = {e["url"]: e["circuit"] for e in (await r.json())["engines"]}
    assert states[stack.engines[0].url] == "open" and states[stack.engines[1].url] == "closed"


async def test_engine_stopped_requests_go_elsewhere(stack: Stack) -> None:
    await stop_engine(stack.engines[0])
    body = {"model": MODEL, "prompt": "still served", "max_tokens": 2}
    for _ in range(6):
        async with stack.http.post(f"{stack.url}/v1/completions", json=body) as r:
            assert r.status == 200


async def test_an_engine_with_an_unusable_url_is_skipped_and_marked_failing(
    sims: list[RunningEngine], caplog: pytest.LogCaptureFixture
) -> None:
    bad = "http://127.0.0.1:99999"
    router = await router_for(
        Endpoint(bad, models=frozenset({MODEL, "other"})),
        Endpoint(sims[0].url),
        app=RouterConfig(timeouts=FAST),
        scrape_interval=0.05,
    )
    await wait_models(router, 1)
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(4):  # round-robin: half of them try the bad engine first, then the good one
                body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
                async with http.post(f"{router.url}/v1/completions", json=body) as r:
                    assert r.status == 200
            async with http.post(f"{router.url}/v1/completions", json={"model": "other", "prompt": "x"}) as r:
                body = await r.json()
                assert r.status in (502, 503), body  # 503 once its circuit opened; never a 500
            entry = router.app.registry.get(bad)
            assert entry is not None
            for _ in range(40):
                if not entry.state.healthy:
                    break
                await asyncio.sleep(0.05)
            assert not entry.state.healthy
    finally:
        await router.stop()
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


# -- first-byte timeouts: the router's open circuits, a client's do not --------------------------------------


async def test_first_byte_timeout_retries_then_504(stack: Stack) -> None:
    for i in range(2):
        await set_faults(stack, i, hang_rate=1.0)
    h = {"x-kvstack-timeout-first-byte": "0.3"}
    async with stack.http.post(
        f"{stack.url}/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=h
    ) as r:
        assert r.status == 504
        assert (await r.json())["error"]["type"] == "GatewayTimeoutError"


async def test_client_chosen_first_byte_timeouts_leave_every_circuit_closed(
    sims: list[RunningEngine],
) -> None:
    router = await router_for(
        *(Endpoint(e.url) for e in sims),
        app=RouterConfig(timeouts=FAST),
        retry=RetryPolicy(max_attempts=3, backoff_base=0.001),
        circuit=CircuitConfig(failure_threshold=2, open_seconds=60.0),
    )
    await wait_models(router, 2)
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
            tiny = {"x-kvstack-timeout-first-byte": "0.000001"}
            for _ in range(6):
                async with http.post(f"{router.url}/v1/completions", json=body, headers=tiny) as r:
                    assert r.status == 504
            tiny_connect = {"x-kvstack-timeout-connect": "0.000001"}
            for _ in range(6):
                async with http.post(f"{router.url}/v1/completions", json=body, headers=tiny_connect) as r:
                    assert r.status in (200, 502)  # 200 if a connect beat the timer
            assert set((await circuits(http, router)).values()) == {"closed"}
            for _ in range(4):
                async with http.post(f"{router.url}/v1/completions", json=body) as r:
                    assert r.status == 200
    finally:
        await router.stop()


async def test_a_first_byte_timeout_at_the_routers_own_value_still_opens_the_circuit(
    sims: list[RunningEngine],
) -> None:
    async with aiohttp.ClientSession() as http:
        for e in sims:
            async with http.post(f"{e.url}/admin/faults", json={"hang_rate": 1.0}) as r:
                assert r.status == 200
        router = await router_for(
            *(Endpoint(e.url) for e in sims),
            app=RouterConfig(timeouts=Timeouts(connect=1.0, first_byte=0.2, idle=5.0, total=60.0)),
            retry=RetryPolicy(max_attempts=2, backoff_base=0.001),
            circuit=CircuitConfig(failure_threshold=2, open_seconds=60.0),
        )
        await wait_models(router, 2)
        try:
            for _ in range(2):
                async with http.post(
                    f"{router.url}/v1/completions", json={"model": MODEL, "prompt": "x"}
                ) as r:
                    assert r.status == 504
            assert set((await circuits(http, router)).values()) == {"open"}
        finally:
            await router.stop()


# -- every engine refuses ------------------------------------------------------------------------------------


async def test_429_passes_through_when_every_engine_refuses(stack: Stack) -> None:
    for i in range(2):
        await set_faults(stack, i, error_rate=1.0, error_codes=[429])
    async with stack.http.post(f"{stack.url}/v1/completions", json={"model": MODEL, "prompt": "x"}) as r:
        assert r.status == 429
        assert (await r.json())["error"]["code"] == 429


async def html_502(writer: asyncio.StreamWriter) -> bool:
    page = b"<html>bad gateway</html>"
    writer.write(
        b"HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/html\r\nRetry-After: 3\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(page), page)
    )
    return True


async def test_a_non_json_refusal_from_every_engine_reaches_the_client_as_openai_json() -> None:
    async with fake_engine(html_502) as url:
        router = await router_for(Endpoint(url, models=frozenset({MODEL})), app=RouterConfig(timeouts=FAST))
        try:
            async with aiohttp.ClientSession() as http:
                headers = {"x-request-id": "rid-1"}
                async with http.post(
                    f"{router.url}/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=headers
                ) as r:
                    body = await r.json()
                    assert r.status == 502 and r.headers["Content-Type"] == "application/json"
                    assert r.headers["x-request-id"] == "rid-1" and r.headers["Retry-After"] == "3"
            assert body["error"]["code"] == 502 and body["error"]["type"] == "BadGatewayError"
            assert "<html>bad gateway</html>" in body["error"]["message"]
        finally:
            await router.stop()
