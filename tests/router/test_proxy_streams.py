"""Streams and clients through the router: a stream an engine cuts (between events or mid-event) ends
with an error event and [DONE], a client that leaves aborts the engine's request (counted as 499), a
client that stops reading is cut off at its deadline, and an answer without a body (204) is relayed."""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import pytest

import openai
from kvstack.engines.state import Endpoint
from kvstack.router import proxy
from kvstack.router.app import RouterConfig
from kvstack.sim.cluster import RunningEngine
from support.metrics import counter_totals
from support.routers import (
    FAST,
    MODEL,
    Stack,
    circuits,
    fake_engine,
    in_flight,
    router_for,
    set_faults,
    wait_models,
)

COMPLETION_EVENT = (
    b'data: {"id":"x","object":"text_completion","created":1,"model":"sim-model",'
    b'"choices":[{"index":0,"text":"hi","logprobs":null,"finish_reason":null}]}\n\n'
)


# -- streams an engine breaks --------------------------------------------------------------------------------


async def test_stream_cut_mid_way_ends_with_error_not_hang(stack: Stack) -> None:
    for i in range(2):
        await set_faults(stack, i, drop_rate=1.0, drop_after_chunks=3)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 50, "stream": True, "ignore_eos": True}
    async with stack.http.post(f"{stack.url}/v1/completions", json=body) as r:
        assert r.status == 200
        text = (await asyncio.wait_for(r.read(), 10)).decode()
    events = [e for e in text.split("\n\n") if e.startswith("data: ")]
    assert len(events) == 5
    assert "error" in json.loads(events[-2][len("data: ") :])
    assert events[-1] == "data: [DONE]"  # as vLLM ends a failed stream


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


# -- clients that leave or stop reading ----------------------------------------------------------------------


async def test_client_disconnect_aborts_the_engine_request(stack: Stack) -> None:
    body = {"model": MODEL, "prompt": "long", "max_tokens": 3000, "stream": True, "ignore_eos": True}
    async with stack.http.post(f"{stack.url}/v1/completions", json=body) as r:
        assert r.status == 200
        await r.content.readany()
    running = 1.0
    for _ in range(100):
        await asyncio.sleep(0.05)
        running = sum([await stack.engine_metric(i, "vllm:num_requests_running") for i in range(2)])
        if running == 0:
            break
    assert running == 0
    # Ended early, not finished: like vLLM, the engine does not count the aborted request as a success.
    assert sum([await stack.engine_metric(i, "vllm:request_success_total") for i in range(2)]) == 0
    assert sum([await stack.engine_metric(i, "vllm:generation_tokens_total") for i in range(2)]) < 3000


async def test_a_client_that_leaves_before_the_answer_counts_as_499(stack: Stack) -> None:
    for i in range(2):
        await set_faults(stack, i, hang_rate=1.0)
    with pytest.raises(TimeoutError):
        async with stack.http.post(
            f"{stack.url}/v1/completions",
            json={"model": MODEL, "prompt": "x"},
            timeout=aiohttp.ClientTimeout(total=0.5),
        ):
            pass
    counted: dict[tuple[str, ...], float] = {}
    for _ in range(100):  # the router sees the disconnect a moment after the client gives up
        async with stack.http.get(f"{stack.url}/metrics") as r:
            text = await r.text()
        counted = counter_totals(text, "kvstack_router_requests", "status")
        if counted:
            break
        await asyncio.sleep(0.05)
    assert counted == {("499",): 1.0}  # under the engine it was waiting for


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


# -- answers without a body ----------------------------------------------------------------------------------


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
