"""P/D disaggregation through the proxy: a prompt is prefilled on a prefill engine and decoded with the KV
it names (streaming and not), every failed prefill falls back to the decode engine computing the prompt
(counted by reason), a decode engine that fails before its first byte or token is replaced, and a client
that leaves during the prefill or the decode aborts both."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

import openai
from kvstack.engines.state import Endpoint, EngineRole
from kvstack.router.app import RouterConfig
from kvstack.router.proxy import RetryPolicy
from kvstack.router.server import RouterOptions, RunningRouter, start_router
from kvstack.sim.cluster import RunningEngine, stop_engine
from kvstack.sim.scheduler import LatencyModel
from support.metrics import counter_totals, sample_sum
from support.pd import LONG_PROMPT, FixedDecision, computed_tokens, finished, transferred_tokens
from support.ports import free_port
from support.routers import FAST, MODEL, fake_engine, start_sims, wait_models
from support.waiting import eventually


@dataclass
class PDStack:
    prefill: RunningEngine
    decode: list[RunningEngine]
    router: RunningRouter
    picker: FixedDecision
    http: aiohttp.ClientSession

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.router.url}/v1", api_key="x", max_retries=0)

    async def router_page(self) -> str:
        async with self.http.get(f"{self.router.url}/metrics") as r:
            return await r.text()

    async def fallbacks(self) -> dict[tuple[str, ...], float]:
        return counter_totals(await self.router_page(), "kvstack_pd_fallbacks", "reason")


async def pd_stack(**prefill_config: Any) -> AsyncIterator[PDStack]:
    [prefill] = await start_sims(1, **prefill_config)
    decode = await start_sims(2)
    engines = [Endpoint(prefill.url, role=EngineRole.PREFILL)]
    engines += [Endpoint(e.url, role=EngineRole.DECODE) for e in decode]
    opts = RouterOptions(
        port=0,
        engines=engines,
        routing="round-robin",
        app=RouterConfig(timeouts=FAST, pd_prefill_timeout=5.0),
        retry=RetryPolicy(max_attempts=3, backoff_base=0.01),
    )
    router = await start_router(opts)
    picker = FixedDecision([e.url for e in decode], [prefill.url])
    router.app.picker = picker
    http = aiohttp.ClientSession()
    try:
        await wait_models(router, 3)
        yield PDStack(prefill, decode, router, picker, http)
    finally:
        await http.close()
        await router.stop()
        for e in [prefill, *decode]:
            await stop_engine(e)


@pytest.fixture
async def stack() -> AsyncIterator[PDStack]:
    async for s in pd_stack():
        yield s


@pytest.fixture
async def slow_prefill_stack() -> AsyncIterator[PDStack]:
    """The prefill engine takes seconds per prompt: 0.02 s per token at time scale 1, in steps of 16 tokens
    (the request stays running between them)."""
    slow = LatencyModel(prefill_per_token=0.02)
    async for s in pd_stack(time_scale=1.0, latency=slow, max_num_batched_tokens=16):
        yield s


# -- prefill, then decode --------------------------------------------------------------------------------


async def test_a_prompt_is_prefilled_then_decoded_with_the_transferred_kv(stack: PDStack) -> None:
    client = stack.client()
    answer = await client.completions.create(
        model=MODEL, prompt=LONG_PROMPT, max_tokens=5, extra_body={"ignore_eos": True}
    )
    await client.close()
    assert answer.choices[0].text
    prompt_tokens = answer.usage.prompt_tokens if answer.usage else 0
    assert prompt_tokens > 300
    decode = stack.decode[0].url
    # The decode engine pulled every prompt token but the last; the prefill engine computed them.
    assert await transferred_tokens(stack.http, decode) == prompt_tokens - 1
    assert await computed_tokens(stack.http, decode) <= 1
    assert await computed_tokens(stack.http, stack.prefill.url) == prompt_tokens
    assert await finished(stack.http, stack.prefill.url) == 1
    # The prefill's request was one token, not streamed, with do_remote_decode.
    page = await stack.router_page()
    prefill = stack.prefill.url
    assert counter_totals(page, "kvstack_pd_prefills", "engine", "outcome") == {(prefill, "ok"): 1.0}
    moved = counter_totals(page, "kvstack_pd_transferred_prompt_tokens", "engine")
    assert moved == {(prefill,): float(prompt_tokens)}
    assert sample_sum(page, "kvstack_pd_prefill_seconds_count") == 1
    assert await stack.fallbacks() == {}
    # The decode engine told the prefill engine it may free the blocks it held for it.
    await eventually(lambda: not stack.prefill.engine.scheduler._held, what="prefill blocks released")


async def test_a_streamed_chat_is_prefilled_then_streamed_from_the_decode_engine(stack: PDStack) -> None:
    client = stack.client()
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": LONG_PROMPT}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},  # all 8 tokens, whatever the sim samples
    )
    pieces, usage = [], None
    async for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    await client.close()
    assert "".join(pieces)
    assert usage is not None and usage.completion_tokens == 8  # the client's stream_options were kept
    assert await transferred_tokens(stack.http, stack.decode[0].url) == usage.prompt_tokens - 1
    assert await finished(stack.http, stack.prefill.url) == 1  # one token, then its KV held


# -- fallbacks: the decode engine computes the prompt ------------------------------------------------------


async def ask(stack: PDStack) -> None:
    client = stack.client()
    answer = await client.completions.create(
        model=MODEL, prompt=LONG_PROMPT, max_tokens=3, extra_body={"ignore_eos": True}
    )
    await client.close()
    assert answer.choices[0].finish_reason == "length"  # (without ignore_eos the sim may end it sooner)


async def assert_computed_by_decode(stack: PDStack, reason: str) -> None:
    decode = stack.decode[0].url
    assert await transferred_tokens(stack.http, decode) == 0
    assert await computed_tokens(stack.http, decode) > 300
    assert await stack.fallbacks() == {(reason,): 1.0}


async def set_prefill_faults(stack: PDStack, **faults: object) -> None:
    async with stack.http.post(f"{stack.prefill.url}/admin/faults", json=faults) as r:
        assert r.status == 200


async def test_a_prefill_engine_that_answers_500_falls_back(stack: PDStack) -> None:
    await set_prefill_faults(stack, error_rate=1.0, error_codes=[500])
    await ask(stack)
    await assert_computed_by_decode(stack, "error_status")
    page = await stack.router_page()
    prefills = counter_totals(page, "kvstack_pd_prefills", "outcome")
    assert prefills == {("error_status",): 1.0}


async def test_a_failing_prefill_engine_opens_its_circuit_and_is_no_longer_asked(stack: PDStack) -> None:
    await set_prefill_faults(stack, error_rate=1.0, error_codes=[500])
    for _ in range(6):  # the breaker opens after 5 consecutive failures
        await ask(stack)
    page = await stack.router_page()
    assert counter_totals(page, "kvstack_pd_prefills", "outcome") == {("error_status",): 5.0}
    assert await stack.fallbacks() == {("error_status",): 5.0, ("no_prefill_engine",): 1.0}
    entry = stack.router.app.registry.get(stack.prefill.url)
    assert entry is not None and entry.state.circuit.value == "open"


async def test_a_prefill_engine_that_hangs_times_out_and_falls_back(stack: PDStack) -> None:
    await set_prefill_faults(stack, hang_rate=1.0)
    stack.router.app.prefill.prefiller.timeout = 0.5
    await ask(stack)
    await assert_computed_by_decode(stack, "timeout")
    # The router closed its connection at the timeout: the hung request is gone from the prefill engine.
    await eventually(lambda: stack.prefill.engine.num_unfinished == 0, what="prefill request ended")
    entry = stack.router.app.registry.get(stack.prefill.url)
    assert entry is not None and entry.state.in_flight == 0


async def test_a_prefill_engine_that_is_down_falls_back(stack: PDStack) -> None:
    down = f"http://127.0.0.1:{free_port()}"
    stack.router.app.add_engine(Endpoint(down, role=EngineRole.PREFILL, models=frozenset({MODEL})))
    stack.picker.prefill = [down]
    await ask(stack)
    await assert_computed_by_decode(stack, "unreachable")


async def no_kv_transfer_params(writer: asyncio.StreamWriter) -> bool:
    body = json.dumps(
        {"id": "x", "object": "text_completion", "created": 1, "model": MODEL,
         "choices": [{"index": 0, "text": "a", "finish_reason": "length", "logprobs": None}],
         "usage": {"prompt_tokens": 400, "completion_tokens": 1, "total_tokens": 401}}
    ).encode()  # fmt: skip
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    writer.write(head + body)
    return True


async def test_a_prefill_answer_without_kv_transfer_params_falls_back(stack: PDStack) -> None:
    async with fake_engine(no_kv_transfer_params) as url:
        stack.router.app.add_engine(Endpoint(url, role=EngineRole.PREFILL, models=frozenset({MODEL})))
        stack.picker.prefill = [url]
        await ask(stack)
    await assert_computed_by_decode(stack, "no_params")


async def test_a_batch_of_prompts_is_served_whole(stack: PDStack) -> None:
    async with stack.http.post(
        f"{stack.router.url}/v1/completions",
        json={"model": MODEL, "prompt": [LONG_PROMPT, LONG_PROMPT], "max_tokens": 2},
    ) as r:
        assert r.status == 200
    assert await finished(stack.http, stack.prefill.url) == 0
    assert await stack.fallbacks() == {("unsupported_request",): 1.0}


# -- the decode side -------------------------------------------------------------------------------------


async def test_a_decode_engine_failing_before_its_first_byte_is_replaced(stack: PDStack) -> None:
    first, second = stack.decode
    async with stack.http.post(f"{first.url}/admin/faults", json={"error_rate": 1.0, "error_codes": [503]}):
        pass
    async with stack.http.post(
        f"{stack.router.url}/v1/completions",
        json={"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 3, "stream": True},
    ) as r:
        assert r.status == 200
        assert r.headers["x-kvstack-engine"] == second.url
        assert (await r.read()).endswith(b"data: [DONE]\n\n")
    # One prefill; the second decode engine pulled its KV.
    assert await finished(stack.http, stack.prefill.url) == 1
    assert await transferred_tokens(stack.http, second.url) > 300
    assert await computed_tokens(stack.http, second.url) <= 1


async def test_a_decode_engine_breaking_after_its_role_chunk_is_replaced(stack: PDStack) -> None:
    first, second = stack.decode
    fault = {"drop_rate": 1.0, "drop_after_chunks": 1}
    async with stack.http.post(f"{first.url}/admin/faults", json=fault):
        pass
    client = stack.client()
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": LONG_PROMPT}], max_tokens=3, stream=True
    )
    assert raw.headers["x-kvstack-engine"] == second.url
    chunks = [chunk async for chunk in raw.parse()]
    await client.close()
    assert [c.choices[0].delta.role for c in chunks if c.choices].count("assistant") == 1
    assert chunks[-1].choices[0].finish_reason is not None
    assert await finished(stack.http, stack.prefill.url) == 1  # one prefill for both decode attempts


async def test_engines_shows_the_engines_by_role(stack: PDStack) -> None:
    async with stack.http.get(f"{stack.router.url}/engines") as r:
        roles = (await r.json())["roles"]
    assert roles == {
        "prefill": [stack.prefill.url],
        "decode": sorted(e.url for e in stack.decode),
        "both": [],
    }


# -- clients that leave ------------------------------------------------------------------------------------


async def prefill_in_flight(stack: PDStack) -> int:
    async with stack.http.get(f"{stack.router.url}/engines") as r:
        engines = {e["url"]: e for e in (await r.json())["engines"]}
    return int(engines[stack.prefill.url]["in_flight"])


async def test_a_client_leaving_during_the_prefill_aborts_it_and_sends_no_decode(
    slow_prefill_stack: PDStack,
) -> None:
    stack = slow_prefill_stack
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 50, "stream": True}
    request = asyncio.ensure_future(stack.http.post(f"{stack.router.url}/v1/completions", json=body))
    # The prefill runs for seconds, counted in flight on the prefill engine.
    await eventually(lambda: stack.prefill.engine.num_running == 1, what="prefill running")
    assert await prefill_in_flight(stack) == 1
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    await eventually(lambda: stack.prefill.engine.num_unfinished == 0, what="prefill aborted")

    async def nothing_in_flight() -> bool:
        return await prefill_in_flight(stack) == 0

    await eventually(nothing_in_flight, what="prefill no longer in flight")
    assert await finished(stack.http, stack.prefill.url) == 0  # aborted, not finished
    for engine in stack.decode:
        assert engine.engine.num_unfinished == 0
        assert await finished(stack.http, engine.url) == 0
    async with stack.http.get(f"{stack.router.url}/metrics") as r:
        page = await r.text()
    assert counter_totals(page, "kvstack_router_requests", "status") == {("499",): 1.0}


async def test_a_client_leaving_during_the_decode_aborts_it(stack: PDStack) -> None:
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 3000, "stream": True, "ignore_eos": True}
    async with stack.http.post(f"{stack.router.url}/v1/completions", json=body) as r:
        assert r.status == 200
        await r.content.readany()
    decode = stack.decode[0]
    await eventually(lambda: decode.engine.num_unfinished == 0, what="decode aborted")
    assert await finished(stack.http, decode.url) == 0
    assert await transferred_tokens(stack.http, decode.url) > 300  # it was decoding a prefilled prompt
    assert stack.prefill.engine.num_unfinished == 0
