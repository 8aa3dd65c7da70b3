"""The router's proxy in front of simulated engines: the real OpenAI clients through it, models, health and
spreading, bad input and the router's own errors (request ids kept or replaced, nested JSON, 500s, 413),
and which headers go on to the engine. Engines and router run in the test's event loop.
Failures and retries: test_proxy_retries.py; streams and clients: test_proxy_streams.py; admission and the
admin API: test_admin.py."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest
from multidict import CIMultiDict, CIMultiDictProxy

import openai
from kvstack.engines.state import Endpoint, EngineState
from kvstack.frontend.routing import Decision, RouteRequest
from kvstack.router.app import RouterConfig
from kvstack.router.proxy import forward_headers
from kvstack.sim.cluster import RunningEngine
from support.metrics import counter_totals
from support.routers import (
    FAST,
    MODEL,
    Stack,
    router_for,
    wait_models,
)

# -- the OpenAI client through the router --------------------------------------------------------------------


async def test_async_openai_client_streaming_and_not(stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0)
    r = await client.completions.create(
        model=MODEL, prompt="hello", max_tokens=8, extra_body={"ignore_eos": True}
    )
    assert r.usage is not None and r.usage.completion_tokens == 8
    chunks = [
        c
        async for c in await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    ]  # fmt: skip
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content is not None) >= 6
    await client.close()


async def test_sync_openai_client(stack: Stack) -> None:
    def run() -> tuple[int, int]:
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            extra_body={"ignore_eos": True},
        )
        stream = client.completions.create(
            model=MODEL, prompt="x", max_tokens=5, stream=True, extra_body={"ignore_eos": True}
        )
        n = sum(1 for _ in stream)
        assert r.usage is not None
        return r.usage.completion_tokens, n

    assert await asyncio.to_thread(run) == (4, 5)


async def test_models_union_health_ready_engines(stack: Stack) -> None:
    async with stack.http.get(f"{stack.url}/v1/models") as r:
        assert [m["id"] for m in (await r.json())["data"]] == [MODEL]
    async with stack.http.get(f"{stack.url}/health") as r:
        assert r.status == 200
    async with stack.http.get(f"{stack.url}/ready") as r:
        body = await r.json()
        assert r.status == 200 and len(body["models"][MODEL]["routable_engines"]) == 2
    async with stack.http.get(f"{stack.url}/engines") as r:
        engines = (await r.json())["engines"]
        assert {e["url"] for e in engines} == {e.url for e in stack.engines}
        assert all(e["circuit"] == "closed" and e["routable"] for e in engines)


async def test_requests_spread_and_request_id_round_trips(stack: Stack) -> None:
    body = {"model": MODEL, "prompt": "spread me", "max_tokens": 2}

    async def one(i: int) -> str:
        headers = {"x-request-id": f"rid-{i}"}
        async with stack.http.post(f"{stack.url}/v1/completions", json=body, headers=headers) as r:
            assert r.status == 200
            assert r.headers["x-request-id"] == f"rid-{i}"
            await r.read()
        return r.headers["x-request-id"]

    await asyncio.gather(*(one(i) for i in range(40)))
    counts = [await stack.engine_metric(i, "vllm:request_success_total") for i in range(2)]
    assert sum(counts) == 40 and min(counts) >= 10, counts


# -- bad input and the router's own errors -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "headers", "status"),
    [
        (b'{"model": "sim-model", "prompt": ', {}, 400),
        (b"[1, 2]", {}, 400),
        (b'{"model": "nope", "prompt": "x"}', {}, 404),
        (b'{"model": 5, "prompt": "x"}', {}, 400),
        (b'{"model": "sim-model", "prompt": "x", "stream": "yes"}', {}, 400),
        (b'{"model": "sim-model", "prompt": "\xff\xfe"}', {}, 400),
        (b'{"model": "sim-model", "prompt": "x"}', {"Content-Type": "text/plain"}, 400),
        (b'{"model": "sim-model", "prompt": "x"}', {"x-kvstack-timeout-total": "soon"}, 400),
        # Validation the engine does comes back through the router unchanged.
        (b'{"model": "sim-model", "prompt": "x", "max_tokens": -1}', {}, 400),
    ],
)
async def test_bad_input_gets_openai_error_json(
    stack: Stack, raw: bytes, headers: dict[str, str], status: int
) -> None:
    h = {"Content-Type": "application/json", **headers}
    async with stack.http.post(f"{stack.url}/v1/completions", data=raw, headers=h) as r:
        body = await r.json(content_type=None)
        assert r.status == status, body
        assert set(body["error"]) == {"message", "type", "param", "code"}
    # Refused requests are counted too; the router's own refusals under engine "none", model "other".
    async with stack.http.get(f"{stack.url}/metrics") as r:
        text = await r.text()
    counted = counter_totals(text, "kvstack_router_requests", "engine", "model", "status")
    engine_side = b"max_tokens" in raw
    assert sum(counted.values()) == 1, counted
    ((engine, model, counted_status),) = counted
    assert counted_status == str(status)
    assert (engine != "none") == engine_side
    assert model == (MODEL if engine_side else "other")  # a refused body's model is never a label


class BrokenPicker:
    """A picker with a bug."""

    async def pick(self, route: RouteRequest, states: list[EngineState]) -> Decision:
        raise RuntimeError("scheduler bug")

    def decide(self, route: RouteRequest, states: list[EngineState]) -> Decision | None:
        raise RuntimeError("scheduler bug")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_a_router_bug_answers_500_and_is_counted_as_500(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    # (plain requests are picked without a coroutine, streams with one: both meet the bug)
    monkeypatch.setattr(stack.router.app, "picker", BrokenPicker())
    body = {"model": MODEL, "prompt": "x", "stream": stream}
    async with stack.http.post(f"{stack.url}/v1/completions", json=body) as r:
        assert r.status == 500
        assert (await r.json())["error"]["type"] == "InternalServerError"
    assert "scheduler bug" in caplog.text
    async with stack.http.get(f"{stack.url}/metrics") as r:
        text = await r.text()
    assert f'kvstack_router_requests_total{{engine="none",model="{MODEL}",status="500"}} 1.0' in text


async def test_huge_body_gets_413(stack: Stack) -> None:
    raw = b'{"model": "sim-model", "prompt": "' + b"a" * (33 * 1024 * 1024) + b'"}'
    async with stack.http.post(
        f"{stack.url}/v1/completions", data=raw, headers={"Content-Type": "application/json"}
    ) as r:
        assert r.status == 413
        assert (await r.json())["error"]["code"] == 413


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


# -- headers forwarded to the engine -------------------------------------------------------------------------


def test_headers_named_in_connection_are_not_forwarded() -> None:
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
    assert forward_headers(incoming, "rid-1") == [
        ("X-End-To-End", "2"),
        ("Content-Type", "application/json"),
        ("x-request-id", "rid-1"),
    ]
