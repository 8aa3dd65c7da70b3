"""The router's proxy and app on the paths the router audit found wrong: timeouts a client chose, a client
that stops reading, streams an engine breaks mid-event, odd engine answers (204, HTML errors, unusable
URLs), admin access without an admin key, deeply nested JSON, and x-request-id on the router's own errors.
Engines are simulators, or a small raw-HTTP fake engine for answers a simulator never gives.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict, CIMultiDictProxy
from test_router_proxy import MODEL, start_sims, wait_models

import openai
from kvstack.engines.state import Endpoint
from kvstack.router import proxy
from kvstack.router.app import RouterConfig
from kvstack.router.circuit import CircuitConfig
from kvstack.router.proxy import RetryPolicy, Timeouts, _forward_headers
from kvstack.router.server import RouterOptions, RunningRouter, start_router
from kvstack.sim.cluster import RunningEngine, stop_engine

FAST = Timeouts(connect=1.0, first_byte=10.0, idle=5.0, total=60.0)
COMPLETION_EVENT = (
    b'data: {"id":"x","object":"text_completion","created":1,"model":"sim-model",'
    b'"choices":[{"index":0,"text":"hi","logprobs":null,"finish_reason":null}]}\n\n'
)

# A fake engine's answer to one POST: write to the client, return False to drop the connection after it.
Answer = Callable[[asyncio.StreamWriter], Awaitable[bool]]


@asynccontextmanager
async def fake_engine(answer: Answer) -> AsyncIterator[str]:
    """An engine that answers every POST with ``answer`` and every GET with 404 (no metrics, no models)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"content-length: *(\d+)", head, re.I)
                await reader.readexactly(int(length.group(1)) if length else 0)
                if head.startswith(b"GET"):
                    writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                elif not await answer(writer):
                    writer.transport.abort()
                    return
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()


async def router_for(*endpoints: Endpoint, **options: Any) -> RunningRouter:
    opts = RouterOptions(port=0, engines=list(endpoints), routing="round-robin", **options)
    return await start_router(opts)


async def circuits(http: aiohttp.ClientSession, router: RunningRouter) -> dict[str, str]:
    async with http.get(f"{router.url}/engines") as r:
        return {e["url"]: e["circuit"] for e in (await r.json())["engines"]}


async def in_flight(http: aiohttp.ClientSession, router: RunningRouter) -> int:
    async with http.get(f"{router.url}/engines") as r:
        return sum(e["in_flight"] for e in (await r.json())["engines"])


@pytest.fixture
async def sims() -> AsyncIterator[list[RunningEngine]]:
    engines = await start_sims(2, time_scale=100.0)
    try:
        yield engines
    finally:
        for e in engines:
            await stop_engine(e)


# -- F1: timeouts a client chose do not open circuits ---------------------------------------------------
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


# -- F3: a client that stops reading is cut off at its deadline ----------------------------------------
async def test_a_client_that_stops_reading_is_cut_off_at_the_deadline(sims: list[RunningEngine]) -> None:
    router = await router_for(*(Endpoint(e.url) for e in sims), app=RouterConfig(timeouts=FAST))
    await wait_models(router, 2)
    body = json.dumps(
        {"model": MODEL, "prompt": "x", "max_tokens": 4000, "n": 8, "logprobs": 5, "stream": True,
         "ignore_eos": True}
    ).encode()  # fmt: skip
    host, port = router.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        async with aiohttp.ClientSession() as http:
            sock.connect((host, int(port)))
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"x-kvstack-timeout-total: 1.5\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            await asyncio.sleep(0.5)
            assert await in_flight(http, router) == 1  # streaming, to a client that reads nothing
            for _ in range(35):
                if not await in_flight(http, router):
                    break
                await asyncio.sleep(0.1)
            assert await in_flight(http, router) == 0, "the request outlived its 1.5 s deadline"
            # Dropped at once, unsent bytes and all: a close would wait for the client to take them.
            peers = {
                c._transport.get_extra_info("peername") for c in router.server._connections if c._transport
            }
            assert sock.getsockname() not in peers
            assert set((await circuits(http, router)).values()) == {"closed"}  # the client's fault
            running = 1.0
            for _ in range(40):  # and the engine's request was aborted
                async with http.get(f"{router.url}/metrics") as r:
                    await r.read()
                running = 0.0
                for e in sims:
                    async with http.get(f"{e.url}/metrics") as r:
                        text = await r.text()
                    running += sum(
                        float(line.rsplit(" ", 1)[1])
                        for line in text.splitlines()
                        if line.startswith("vllm:num_requests_running{")
                    )
                if running == 0:
                    break
                await asyncio.sleep(0.05)
            assert running == 0
    finally:
        sock.close()
        await router.stop()


# -- F9: a stream broken mid-event ends with an error event the client can read, then [DONE] ------------
async def partial_event_then_reset(writer: asyncio.StreamWriter) -> bool:
    part = COMPLETION_EVENT + COMPLETION_EVENT[:40]
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
    writer.write(b"%x\r\n%s\r\n" % (len(part), part))
    await writer.drain()
    await asyncio.sleep(0.1)
    return False


async def test_openai_client_gets_an_api_error_when_the_engine_breaks_mid_event() -> None:
    async with fake_engine(partial_event_then_reset) as url:
        router = await router_for(Endpoint(url, models=frozenset({MODEL})), app=RouterConfig(timeouts=FAST))
        try:
            client = openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
            texts = []
            with pytest.raises(openai.APIError, match="failed mid-stream"):
                async for chunk in await client.completions.create(model=MODEL, prompt="x", stream=True):
                    texts.append(chunk.choices[0].text)
            assert texts == ["hi"]  # the whole event, never the half one
            await client.close()
        finally:
            await router.stop()


async def test_an_event_too_long_to_hold_is_ended_before_the_error_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(proxy, "SSE_HOLD_MAX", 16)  # so the 40-byte half event is relayed at once
    async with fake_engine(partial_event_then_reset) as url:
        router = await router_for(Endpoint(url, models=frozenset({MODEL})), app=RouterConfig(timeouts=FAST))
        try:
            async with aiohttp.ClientSession() as http:
                body = {"model": MODEL, "prompt": "x", "stream": True}
                async with http.post(f"{router.url}/v1/completions", json=body) as r:
                    text = await r.read()
            half = COMPLETION_EVENT[:40]
            assert text.startswith(COMPLETION_EVENT + half + b'\n\ndata: {"error": ')
            assert text.endswith(b"\n\ndata: [DONE]\n\n")
        finally:
            await router.stop()


# -- F13: answers without a body ------------------------------------------------------------------------
async def no_content(writer: asyncio.StreamWriter) -> bool:
    writer.write(b"HTTP/1.1 204 No Content\r\nx-engine-said: nothing\r\n\r\n")
    return True


async def test_a_204_is_relayed_without_a_body_and_the_connection_stays_usable() -> None:
    async with fake_engine(no_content) as url:
        router = await router_for(Endpoint(url, models=frozenset({MODEL})), app=RouterConfig(timeouts=FAST))
        host, port = router.url.removeprefix("http://").split(":")
        try:
            reader, writer = await asyncio.open_connection(host, int(port))
            body = b'{"model": "sim-model", "prompt": "x"}'
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).lower()
            assert head.startswith(b"http/1.1 204") and b"x-engine-said: nothing" in head
            assert b"transfer-encoding" not in head and b"content-length" not in head
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # the next answer must parse
            assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 200")
            writer.close()
        finally:
            await router.stop()


# -- F14: x-request-id and engine refusals ---------------------------------------------------------------
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


async def test_router_errors_carry_the_request_id_and_bad_ids_are_replaced(sims: list[RunningEngine]) -> None:
    router = await router_for(
        *(Endpoint(e.url) for e in sims), app=RouterConfig(timeouts=FAST, admin_key="a")
    )
    await wait_models(router, 2)
    try:
        async with aiohttp.ClientSession() as http:
            url = f"{router.url}/v1/completions"
            tiny = {"x-kvstack-timeout-first-byte": "0.000001", "x-request-id": "rid-504"}
            async with http.post(url, json={"model": MODEL, "prompt": "x"}, headers=tiny) as r:
                assert (r.status, r.headers.get("x-request-id")) == (504, "rid-504")
            bad_json = {"Content-Type": "application/json", "x-request-id": "rid-400"}
            async with http.post(url, data=b"{", headers=bad_json) as r:
                assert (r.status, r.headers.get("x-request-id")) == (400, "rid-400")
            no_key = {"x-request-id": "rid-401"}
            async with http.post(f"{router.url}/admin/engines", json={}, headers=no_key) as r:
                assert (r.status, r.headers.get("x-request-id")) == (401, "rid-401")
            for given in ("r" * 257, "caf\u00e9"):
                async with http.post(
                    url,
                    json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                    headers={"x-request-id": given},
                ) as r:
                    assert r.status == 200
                    assert r.headers["x-request-id"].startswith("kvs-")
            ok = "r" * 256
            async with http.post(
                url, json={"model": MODEL, "prompt": "x", "max_tokens": 1}, headers={"x-request-id": ok}
            ) as r:
                assert r.headers["x-request-id"] == ok
    finally:
        await router.stop()


# -- F2: admin access --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("api_keys", "protected"), [(frozenset({"k1"}), True), (frozenset(), False)])
async def test_admin_routes_without_an_admin_key_need_an_api_key_if_there_are_any(
    sims: list[RunningEngine], api_keys: frozenset[str], protected: bool
) -> None:
    router = await router_for(Endpoint(sims[0].url), app=RouterConfig(api_keys=api_keys))
    try:
        async with aiohttp.ClientSession() as http:
            admin = f"{router.url}/admin/engines"
            async with http.post(admin, json={"url": sims[1].url}) as r:
                assert r.status == (401 if protected else 200)
            async with http.delete(admin, params={"url": "http://127.0.0.1:1"}) as r:
                assert r.status == (401 if protected else 404)
            key = {"Authorization": "Bearer k1"}
            async with http.post(admin, json={"url": sims[1].url}, headers=key) as r:
                assert r.status == 200
            async with http.post(
                f"{admin}/drain", json={"url": sims[1].url}, headers={"Authorization": "Bearer k2"}
            ) as r:
                assert r.status == (401 if protected else 200)
    finally:
        await router.stop()


# -- F10: deeply nested JSON -------------------------------------------------------------------------------
async def test_deeply_nested_json_is_a_400_without_a_traceback(
    sims: list[RunningEngine], caplog: pytest.LogCaptureFixture
) -> None:
    router = await router_for(Endpoint(sims[0].url), app=RouterConfig(admin_key="a"))
    nested = b'{"model": "sim-model", "prompt": "x", "deep": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    try:
        async with aiohttp.ClientSession() as http:
            for path, headers in (
                ("/v1/completions", {}),
                ("/admin/engines", {"Authorization": "Bearer a"}),
                ("/admin/engines/drain", {"Authorization": "Bearer a"}),
            ):
                h = {"Content-Type": "application/json", **headers}
                async with http.post(f"{router.url}{path}", data=nested, headers=h) as r:
                    body = await r.json()
                    assert r.status == 400, (path, body)
                    assert body["error"]["type"] == "BadRequestError"
                    assert "nested too deeply" in body["error"]["message"]
    finally:
        await router.stop()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


# -- F11: unusable engine URLs ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bad",
    ["http:", "http://127.0.0.1:99999", "http://[::1", "http://127.0.0.1:0", "ftp://x", "http://a b:1", "x"],
)
async def test_admin_add_refuses_an_unusable_url(sims: list[RunningEngine], bad: str) -> None:
    router = await router_for(Endpoint(sims[0].url))
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{router.url}/admin/engines", json={"url": bad}) as r:
                body = await r.json()
                assert r.status == 400 and body["error"]["param"] == "url", body
            assert [e.state.url for e in router.app.registry] == [sims[0].url]
    finally:
        await router.stop()


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


def test_headers_the_connection_header_names_are_not_forwarded() -> None:
    incoming = CIMultiDictProxy(
        CIMultiDict(
            [
                ("Connection", "Upgrade, HTTP2-Settings, X-Hop"),
                ("Upgrade", "h2c"),
                ("HTTP2-Settings", "AAMAAABkAAQCAAAAAAIAAAAA"),
                ("X-Hop", "1"),
                ("X-End-To-End", "2"),
                ("Content-Type", "application/json"),
            ]
        )
    )
    assert _forward_headers(incoming, "rid-1") == [
        ("X-End-To-End", "2"),
        ("Content-Type", "application/json"),
        ("x-request-id", "rid-1"),
    ]


@pytest.mark.parametrize(
    ("field", "value"),
    [("type", "nonsense"), ("type", 5), ("node", 5), ("node", ""), ("kv_events_endpoint", "127.0.0.1:5557")],
)
async def test_admin_add_checks_every_field(sims: list[RunningEngine], field: str, value: Any) -> None:
    router = await router_for(Endpoint(sims[0].url))
    try:
        async with aiohttp.ClientSession() as http:
            add = {"url": sims[1].url, field: value}
            async with http.post(f"{router.url}/admin/engines", json=add) as r:
                body = await r.json()
                assert r.status == 400 and body["error"]["param"] == field, body
            # An engine type in another case is the same type (as on the command line and in YAML).
            async with http.post(
                f"{router.url}/admin/engines", json={"url": sims[1].url, "type": "VLLM"}
            ) as r:
                assert r.status == 200
            assert router.app.registry.get(sims[1].url).state.endpoint.engine_type == "vllm"
    finally:
        await router.stop()


async def test_models_given_for_an_engine_are_kept_not_replaced_by_its_own_list(
    sims: list[RunningEngine],
) -> None:
    router = await router_for(Endpoint(sims[0].url, models=frozenset({"only-this"})), Endpoint(sims[1].url))
    try:
        await wait_models(router, 2)  # the second engine's models are learned from its /v1/models
        await asyncio.sleep(0.5)  # past the first /v1/models refresh, which used to overwrite given models
        models = {e.state.url: e.state.endpoint.models for e in router.app.registry}
        assert models == {sims[0].url: {"only-this"}, sims[1].url: {MODEL}}
    finally:
        await router.stop()
