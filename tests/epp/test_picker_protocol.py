"""The endpoint picker protocol over a real gRPC channel, message by message, as Envoy speaks it."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kvstack.epp.health import EXT_PROC_SERVICE
from kvstack.epp.picker import PickerConfig
from support.ext_proc import (
    FULL_DUPLEX,
    STREAMED,
    body_message,
    destination,
    headers_message,
    immediate,
    response_body_message,
    response_headers_message,
)
from support.metrics import counter_totals
from support.pickers import PickerStack
from support.routers import MODEL
from support.waiting import eventually

BODY = {"model": MODEL, "prompt": "hello there", "max_tokens": 3}


async def test_buffered_body_is_answered_with_the_pick_and_fallbacks_in_header_and_metadata(
    picker_stack: PickerStack,
) -> None:
    stream = picker_stack.client.stream()
    first = await stream.exchange(headers_message(extra=[("x-request-id", "req-1")]))
    assert first.WhichOneof("response") == "request_headers"
    assert not first.request_headers.response.header_mutation.set_headers  # CONTINUE: the body decides
    answer = await stream.exchange(body_message(BODY))
    assert answer.WhichOneof("response") == "request_body"
    header, meta = destination(answer)
    both = {picker_stack.address(0), picker_stack.address(1)}
    assert header is not None and header == meta
    assert set(header.split(",")) == both  # the pick, then the other engine as fallback
    assert answer.request_body.response.clear_route_cache
    sent = {
        o.header.key: o.header.raw_value.decode()
        for o in answer.request_body.response.header_mutation.set_headers
    }
    assert sent["x-request-id"] == "req-1"
    await stream.close()


async def test_round_robin_alternates_and_in_flight_lasts_until_the_stream_ends(
    picker_stack: PickerStack,
) -> None:
    streams, picks = [], []
    for _ in range(4):
        stream = picker_stack.client.stream()
        await stream.exchange(headers_message())
        header, _ = destination(await stream.exchange(body_message(BODY)))
        assert header is not None
        picks.append(header.split(",")[0])
        streams.append(stream)
    assert picks[0] != picks[1] and picks[0] == picks[2] and picks[1] == picks[3]
    assert picker_stack.in_flight() == {picker_stack.address(0): 2, picker_stack.address(1): 2}
    for stream in streams:
        await stream.exchange(response_headers_message(200))
        await stream.close()
    await eventually(lambda: sum(picker_stack.in_flight().values()) == 0, what="in-flight back to 0")
    assert picker_stack.epp.picker.streams == 0


async def test_a_request_without_body_is_routed_on_its_headers(picker_stack: PickerStack) -> None:
    stream = picker_stack.client.stream()
    answer = await stream.exchange(headers_message("/v1/models", method="GET", end_of_stream=True))
    assert answer.WhichOneof("response") == "request_headers"
    header, meta = destination(answer)
    assert header is not None and header == meta
    assert answer.request_headers.response.clear_route_cache
    await stream.close()


async def test_full_duplex_body_gathered_then_headers_answer_and_the_whole_body_back(
    picker_stack: PickerStack,
) -> None:
    stream = picker_stack.client.stream()
    raw = b'{"model": "%s", "prompt": "%s", "max_tokens": 2}' % (MODEL.encode(), b"x" * 5000)
    stream.send(headers_message(body_mode=FULL_DUPLEX))
    for i in range(0, len(raw), 1000):
        stream.send(body_message(raw[i : i + 1000], end_of_stream=i + 1000 >= len(raw)))
    first = await stream.receive()
    assert first.WhichOneof("response") == "request_headers"
    header, meta = destination(first)
    assert header is not None and header == meta
    second = await stream.receive()
    streamed = second.request_body.response.body_mutation.streamed_response
    assert streamed.body == raw and streamed.end_of_stream
    await stream.close()


async def test_streamed_body_answers_every_chunk_after_the_headers(picker_stack: PickerStack) -> None:
    stream = picker_stack.client.stream()
    raw = b'{"model": "%s", "prompt": "chunked", "max_tokens": 2}' % MODEL.encode()
    stream.send(headers_message(body_mode=STREAMED))
    stream.send(body_message(raw[:10], end_of_stream=False))
    stream.send(body_message(raw[10:], end_of_stream=True))
    kinds = [(await stream.receive()).WhichOneof("response") for _ in range(3)]
    assert kinds == ["request_headers", "request_body", "request_body"]
    await stream.close()


async def test_subset_hint_limits_the_pick(picker_stack: PickerStack) -> None:
    only = picker_stack.address(1)
    for _ in range(3):
        stream = picker_stack.client.stream()
        await stream.exchange(headers_message(subset=[only]))
        header, _ = destination(await stream.exchange(body_message(BODY)))
        assert header == only
        await stream.close()


async def test_subset_with_no_known_engine_is_503_json(picker_stack: PickerStack) -> None:
    stream = picker_stack.client.stream()
    await stream.exchange(headers_message(subset=["10.9.9.9:8000"]))
    status, body, headers = immediate(await stream.exchange(body_message(BODY)))
    assert status == 503 and body["error"]["code"] == 503 and "subset" in body["error"]["message"]
    assert headers["content-type"] == "application/json"
    await stream.close()


@pytest.mark.parametrize(
    ("raw", "status", "needle"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (b'{"model": 7}', 400, "model must be a string"),
        (b'{"model": "nope", "prompt": "x"}', 404, "nope"),
        (b'{"model": "%s", "prompt": "x", "stream": "yes"}' % MODEL.encode(), 400, "stream"),
    ],
)
async def test_bad_bodies_are_answered_with_openai_errors(
    picker_stack: PickerStack, raw: bytes, status: int, needle: str
) -> None:
    stream = picker_stack.client.stream()
    await stream.exchange(headers_message())
    code, body, _ = immediate(await stream.exchange(body_message(raw)))
    assert code == status
    assert needle in body["error"]["message"] and body["error"]["code"] == status
    await stream.close()
    assert sum(picker_stack.in_flight().values()) == 0


@pytest.mark.epp_options(picker=PickerConfig(max_body_bytes=1000))
async def test_a_body_over_the_limit_is_413(picker_stack: PickerStack) -> None:
    stream = picker_stack.client.stream()
    await stream.exchange(headers_message())
    code, body, _ = immediate(await stream.exchange(body_message(b"x" * 1001)))
    assert code == 413 and "1000 bytes" in body["detail"]
    await stream.close()


@pytest.mark.epp_options(max_in_flight=1, max_queue=0)
async def test_requests_beyond_the_admission_limit_are_shed_with_429(picker_stack: PickerStack) -> None:
    held = picker_stack.client.stream()
    await held.exchange(headers_message())
    header, _ = destination(await held.exchange(body_message(BODY)))
    assert header is not None
    shed = picker_stack.client.stream()
    await shed.exchange(headers_message())
    code, body, headers = immediate(await shed.exchange(body_message(BODY)))
    assert code == 429 and body["error"]["type"] == "RateLimitError" and "retry-after" in headers
    await shed.close()
    await held.close()  # frees the slot
    again = picker_stack.client.stream()
    await again.exchange(headers_message())
    header, _ = destination(await again.exchange(body_message(BODY)))
    assert header is not None
    await again.close()


async def test_a_fallback_that_served_takes_the_in_flight_count_and_the_pick_a_failure(
    picker_stack: PickerStack,
) -> None:
    stream = picker_stack.client.stream()
    await stream.exchange(headers_message())
    header, _ = destination(await stream.exchange(body_message(BODY)))
    assert header is not None
    primary, fallback = header.split(",")
    assert picker_stack.in_flight()[primary] == 1
    await stream.exchange(response_headers_message(200, served=fallback))
    assert picker_stack.in_flight() == {primary: 0, fallback: 1}
    url = f"http://{primary}"
    entry = picker_stack.epp.front.registry.get(url)
    assert entry is not None and entry.breaker._failures == 1
    await stream.close()
    assert picker_stack.in_flight() == {primary: 0, fallback: 0}


async def test_a_stream_reset_by_envoy_releases_the_engine(picker_stack: PickerStack) -> None:
    stream = picker_stack.client.stream()
    await stream.exchange(headers_message())
    await stream.exchange(body_message(BODY))
    assert sum(picker_stack.in_flight().values()) == 1
    stream.cancel()
    await eventually(lambda: sum(picker_stack.in_flight().values()) == 0, what="in-flight released on reset")
    await eventually(lambda: picker_stack.epp.picker.streams == 0, what="stream closed")


async def test_health_services(picker_stack: PickerStack) -> None:
    client = picker_stack.client
    serving = 1
    assert await client.check("liveness") == serving
    assert await client.check("readiness") == serving
    assert await client.check(EXT_PROC_SERVICE) == serving
    with pytest.raises(Exception, match="NOT_FOUND"):
        await client.check("no-such-service")


async def test_http_port_serves_metrics_engines_and_ready(picker_stack: PickerStack) -> None:
    stream = picker_stack.client.stream()
    await stream.exchange(headers_message())
    await stream.exchange(body_message(BODY))
    await stream.exchange(response_headers_message(200))
    await stream.close()
    base = picker_stack.epp.http_url
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{base}/metrics") as r:
            text = await r.text()
        async with http.get(f"{base}/engines") as r:
            engines = await r.json()
        async with http.get(f"{base}/ready") as r:
            assert r.status == 200
        async with http.get(f"{base}/nope") as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == 404
    totals = counter_totals(text, "kvstack_router_requests", "status")
    assert totals.get(("200",)) == 1
    assert {e["address"] for e in engines["engines"]} == {picker_stack.address(0), picker_stack.address(1)}
    assert engines["streams"] == 0


async def test_unready_while_draining(picker_stack: PickerStack) -> None:
    picker_stack.epp.health.ready = False
    assert await picker_stack.client.check("readiness") == 2  # NOT_SERVING
    assert await picker_stack.client.check("liveness") == 1


async def test_usage_is_counted_when_envoy_sends_response_bodies(picker_stack: PickerStack) -> None:
    stream = picker_stack.client.stream()
    await stream.exchange(headers_message())
    await stream.exchange(body_message(BODY))
    await stream.exchange(response_headers_message(200))
    first = await stream.exchange(
        response_body_message(b'data: {"choices":[{"text":"hi"}]}\n\n', end_of_stream=False)
    )
    assert first.WhichOneof("response") == "response_body"
    last = b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2}}\n\ndata: [DONE]\n\n'
    await stream.exchange(response_body_message(last, end_of_stream=True))
    await stream.close()
    async with aiohttp.ClientSession() as http, http.get(f"{picker_stack.epp.http_url}/metrics") as r:
        text = await r.text()
    tokens = counter_totals(text, "kvstack_router_tokens", "model", "kind")
    assert tokens == {(MODEL, "prompt"): 7.0, (MODEL, "completion"): 2.0}


async def test_a_message_naming_no_phase_is_answered_400(picker_stack: PickerStack) -> None:
    stream = picker_stack.client.stream()
    code, body, _ = immediate(await stream.exchange(pb.ProcessingRequest()))
    assert code == 400 and "no phase" in body["error"]["message"]
    await stream.close()


@pytest.mark.epp_options(max_in_flight=1, max_queue=0)
async def test_a_stream_reset_while_the_picker_decides_holds_no_engine_or_slot(
    picker_stack: PickerStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Envoy gives up on a slow decision (message timeout, client gone): the decision finishing afterwards
    must not count the request in flight on its engine, nor keep its admission slot."""
    picker = picker_stack.epp.picker
    decide = picker.decide
    entered, release = asyncio.Event(), asyncio.Event()

    async def slow_decide(request: Any) -> Any:
        entered.set()
        await release.wait()
        return await decide(request)

    monkeypatch.setattr(picker, "decide", slow_decide)
    stream = picker_stack.client.stream()
    await stream.exchange(headers_message())
    stream.send(body_message(BODY))
    await asyncio.wait_for(entered.wait(), 5)
    stream.cancel()
    await eventually(lambda: picker.streams == 0, what="stream closed on reset")
    release.set()
    await asyncio.sleep(0.2)  # the decision completes after the stream is gone
    assert sum(picker_stack.in_flight().values()) == 0
    monkeypatch.setattr(picker, "decide", decide)
    again = picker_stack.client.stream()  # the only admission slot is free again
    await again.exchange(headers_message())
    header, _ = destination(await again.exchange(body_message(BODY)))
    assert header is not None
    await again.close()
