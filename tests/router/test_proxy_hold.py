"""Retries until the first content token, through a real router and the `openai` client (no client retries):
an engine that breaks after its headers or role chunk, sends a server error event, stalls, or cuts a
non-streaming body is replaced by the next one unseen (one role chunk, the retry's headers, counted); once
content went out, or the hold's byte or time bound passed, a failure ends the stream with an error event
as before; when every engine fails first, the client gets one clean error."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest
from openai.types.chat import ChatCompletionMessageParam

import openai
from kvstack.engines.state import Endpoint
from kvstack.frontend.circuit import CircuitConfig
from kvstack.openai import errors
from kvstack.openai.sse import DONE, encode_error_event, encode_event
from kvstack.router.app import RouterConfig
from kvstack.router.hold import HoldPolicy
from kvstack.router.proxy import RetryPolicy, Timeouts
from kvstack.router.server import RouterOptions, RunningRouter, start_router
from kvstack.sim import responses as R
from kvstack.sim.cluster import RunningEngine, stop_engine
from support.metrics import counter_totals
from support.pd import FixedDecision
from support.routers import FAST, MODEL, fake_engine, in_flight, start_sims, wait_models

QUICK = Timeouts(connect=1.0, first_byte=10.0, idle=0.5, total=30.0)
ROLE = encode_event(R.chat_role_chunk("chatcmpl-x", MODEL, 1, 0))
SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello there"}]


@dataclass
class Held:
    """A router trying ``engines`` in their order for every request, and a client session."""

    router: RunningRouter
    engines: list[str]
    http: aiohttp.ClientSession

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.router.url}/v1", api_key="x", max_retries=0)

    async def page(self) -> str:
        async with self.http.get(f"{self.router.url}/metrics") as r:
            return await r.text()

    async def retries(self) -> dict[tuple[str, ...], float]:
        return counter_totals(await self.page(), "kvstack_router_retries", "reason")

    async def releases(self) -> dict[tuple[str, ...], float]:
        return counter_totals(await self.page(), "kvstack_router_hold_releases", "cause")

    async def faults(self, i: int, **faults: object) -> None:
        async with self.http.post(f"{self.engines[i]}/admin/faults", json=faults) as r:
            assert r.status == 200

    async def chat_sse(self) -> tuple[aiohttp.ClientResponse, str]:
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 5, "stream": True, "ignore_eos": True}
        async with self.http.post(f"{self.router.url}/v1/chat/completions", json=body) as r:
            return r, (await asyncio.wait_for(r.read(), 10)).decode()


async def held_router(
    urls: list[str], *, hold: HoldPolicy | None = None, timeouts: Timeouts = FAST
) -> AsyncIterator[Held]:
    router = await start_router(
        RouterOptions(
            port=0,
            engines=[Endpoint(u, models=frozenset({MODEL})) for u in urls],
            app=RouterConfig(timeouts=timeouts, hold=hold or HoldPolicy()),
            retry=RetryPolicy(max_attempts=3, backoff_base=0.01),
            circuit=CircuitConfig(failure_threshold=100, open_seconds=60.0),
        )
    )
    router.app.picker = FixedDecision(list(urls))
    http = aiohttp.ClientSession()
    try:
        yield Held(router, urls, http)
    finally:
        await http.close()
        await router.stop()


@pytest.fixture
async def sims() -> AsyncIterator[list[RunningEngine]]:
    engines = await start_sims(2)
    try:
        yield engines
    finally:
        for e in engines:
            await stop_engine(e)


@pytest.fixture
async def two(sims: list[RunningEngine]) -> AsyncIterator[Held]:
    """Two simulated engines, the first always tried first."""
    async for held in held_router([e.url for e in sims]):
        await wait_models(held.router, 2)
        yield held


def data_events(text: str) -> list[str]:
    return [e[len("data: ") :] for e in text.split("\n\n") if e.startswith("data: ")]


# -- retried unseen --------------------------------------------------------------------------------------


async def test_a_stream_broken_after_its_role_chunk_is_served_whole_by_the_next_engine(two: Held) -> None:
    await two.faults(0, drop_rate=1.0, drop_after_chunks=1)  # the role chunk, then the connection drops
    client = two.client()
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=CHAT, max_tokens=5, stream=True, extra_body={"ignore_eos": True}
    )
    assert raw.headers["x-kvstack-engine"] == two.engines[1]
    roles, text, finish = [], "", None
    async for chunk in raw.parse():
        delta = chunk.choices[0].delta
        roles += [delta.role] if delta.role else []
        text += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    await client.close()
    assert roles == ["assistant"] and text and finish == "length"
    assert await two.retries() == {("broken_before_content",): 1.0}
    assert await two.releases() == {("content",): 1.0}
    page = await two.page()
    errors_by_engine = counter_totals(page, "kvstack_router_upstream_errors", "engine", "reason")
    assert errors_by_engine == {(two.engines[0], "broken_before_content"): 1.0}
    assert await in_flight(two.http, two.router) == 0  # settled on both engines


async def test_the_client_sees_exactly_one_well_formed_stream(two: Held) -> None:
    await two.faults(0, drop_rate=1.0, drop_after_chunks=1)
    r, text = await two.chat_sse()
    assert r.status == 200 and r.headers["x-kvstack-engine"] == two.engines[1]
    events = data_events(text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["delta"].get("role") for c in chunks].count("assistant") == 1
    assert len({c["id"] for c in chunks}) == 1  # all from the engine that served
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_a_completion_stream_dropped_after_its_headers_is_retried(two: Held) -> None:
    await two.faults(0, drop_rate=1.0, drop_after_chunks=0)  # the simulator sent its 200 and headers
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True}
    async with two.http.post(f"{two.router.url}/v1/completions", json=body) as r:
        assert r.headers["x-kvstack-engine"] == two.engines[1]
        assert (await r.read()).endswith(DONE)
    assert await two.retries() == {("broken_before_content",): 1.0}


async def test_a_server_error_event_before_content_is_retried(sims: list[RunningEngine]) -> None:
    async def role_then_error(writer: asyncio.StreamWriter) -> bool:
        body = ROLE + encode_error_event(errors.internal_error("EngineCore encountered an issue")) + DONE
        writer.write(SSE_HEAD + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        return True

    async with fake_engine(role_then_error) as url:
        async for held in held_router([url, sims[0].url]):
            await wait_models(held.router, 1)
            r, text = await held.chat_sse()
            assert r.headers["x-kvstack-engine"] == sims[0].url
            assert '"error"' not in text and text.endswith("data: [DONE]\n\n")
            assert await held.retries() == {("error_before_content",): 1.0}


async def test_a_client_error_event_is_passed_on_not_retried(sims: list[RunningEngine]) -> None:
    async def role_then_400(writer: asyncio.StreamWriter) -> bool:
        body = ROLE + encode_error_event(errors.bad_request("prompt too long")) + DONE
        writer.write(SSE_HEAD + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        return True

    async with fake_engine(role_then_400) as url:
        async for held in held_router([url, sims[0].url]):
            await wait_models(held.router, 1)
            r, text = await held.chat_sse()
            assert r.headers["x-kvstack-engine"] == url
            assert "prompt too long" in text and await held.retries() == {}


async def headers_then_reset(writer: asyncio.StreamWriter) -> bool:
    writer.write(SSE_HEAD)
    await writer.drain()
    await asyncio.sleep(0.05)
    return False


async def test_a_completion_stream_reset_after_its_headers_is_retried(sims: list[RunningEngine]) -> None:
    async with fake_engine(headers_then_reset) as url:
        async for held in held_router([url, sims[0].url]):
            await wait_models(held.router, 1)
            client = held.client()
            stream = await client.completions.create(
                model=MODEL, prompt="x", max_tokens=4, stream=True, extra_body={"ignore_eos": True}
            )
            texts = [c.choices[0].text async for c in stream]
            await client.close()
            assert "".join(texts)
            assert await held.retries() == {("broken_before_content",): 1.0}


async def test_a_stream_silent_before_content_times_out_and_is_retried(sims: list[RunningEngine]) -> None:
    async def role_then_silence(writer: asyncio.StreamWriter) -> bool:
        writer.write(SSE_HEAD + b"%x\r\n%s\r\n" % (len(ROLE), ROLE))
        await writer.drain()
        await asyncio.sleep(2)
        return False

    async with fake_engine(role_then_silence) as url:
        async for held in held_router([url, sims[0].url], timeouts=QUICK):
            await wait_models(held.router, 1)
            r, text = await held.chat_sse()
            assert r.headers["x-kvstack-engine"] == sims[0].url and '"error"' not in text
            assert await held.retries() == {("timeout_before_content",): 1.0}


@pytest.mark.parametrize(
    ("stall", "reason"),
    [(0.05, "broken_before_content"), (2.0, "timeout_before_content")],
    ids=["reset", "stall"],
)
async def test_a_non_streaming_answer_cut_short_is_retried(
    sims: list[RunningEngine], stall: float, reason: str
) -> None:
    async def half_a_body(writer: asyncio.StreamWriter) -> bool:
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 400\r\n\r\n"
        writer.write(head + b'{"id":')
        await writer.drain()
        await asyncio.sleep(stall)
        return False

    async with fake_engine(half_a_body) as url:
        async for held in held_router([url, sims[0].url], timeouts=QUICK):
            await wait_models(held.router, 1)
            client = held.client()
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=CHAT, max_tokens=3, extra_body={"ignore_eos": True}
            )
            await client.close()
            assert raw.headers["x-kvstack-engine"] == sims[0].url
            assert raw.parse().choices[0].message.content
            assert await held.retries() == {(reason,): 1.0}


# -- not retried: content went out, or the hold gave up ---------------------------------------------------


async def test_a_stream_broken_after_content_still_ends_with_an_error(two: Held) -> None:
    for i in range(2):
        await two.faults(i, drop_rate=1.0, drop_after_chunks=2)  # the role chunk, one content chunk
    client = two.client()
    texts = []
    with pytest.raises(openai.APIError, match="failed mid-stream"):
        stream = await client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=20, stream=True, extra_body={"ignore_eos": True}
        )
        async for chunk in stream:
            texts.append(chunk.choices[0].delta.content or "")
    await client.close()
    assert "".join(texts)  # never a silent truncation: the content, then the error
    assert await two.retries() == {}


async def test_when_every_engine_fails_before_content_the_client_gets_one_clean_error(two: Held) -> None:
    for i in range(2):
        await two.faults(i, drop_rate=1.0, drop_after_chunks=1)
    client = two.client()
    with pytest.raises(openai.APIStatusError, match="failed before its first token") as caught:
        await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, stream=True)
    await client.close()
    assert caught.value.status_code == 502
    assert await two.retries() == {("broken_before_content",): 1.0}
    assert await in_flight(two.http, two.router) == 0


async def test_without_holding_a_stream_broken_after_its_role_chunk_ends_with_an_error(
    sims: list[RunningEngine],
) -> None:
    async for held in held_router([e.url for e in sims], hold=HoldPolicy(enabled=False)):
        await wait_models(held.router, 2)
        await held.faults(0, drop_rate=1.0, drop_after_chunks=1)
        r, text = await held.chat_sse()
        assert r.headers["x-kvstack-engine"] == sims[0].url
        assert "failed mid-stream" in text and await held.retries() == {}
        assert await held.releases() == {}


async def roles_then_reset(writer: asyncio.StreamWriter) -> bool:
    body = ROLE * 3
    writer.write(SSE_HEAD + b"%x\r\n%s\r\n" % (len(body), body))
    await writer.drain()
    await asyncio.sleep(0.3)
    return False


@pytest.mark.parametrize(
    ("hold", "cause"),
    [(HoldPolicy(max_bytes=len(ROLE) * 2), "bytes"), (HoldPolicy(seconds=0.1), "time")],
    ids=["bytes", "seconds"],
)
async def test_past_a_hold_bound_the_stream_is_released_and_not_retried(
    sims: list[RunningEngine], hold: HoldPolicy, cause: str
) -> None:
    async with fake_engine(roles_then_reset) as url:
        async for held in held_router([url, sims[0].url], hold=hold):
            await wait_models(held.router, 1)
            r, text = await held.chat_sse()
            assert r.status == 200 and r.headers["x-kvstack-engine"] == url
            assert text.startswith(ROLE.decode()) and "failed mid-stream" in text
            assert await held.releases() == {(cause,): 1.0}
            assert await held.retries() == {}
