"""The router in front of simulated engines: the real OpenAI client through it, retries, circuit breaker,
aborts, admission control, bad input, admin endpoints. Engines and router run in the test's event loop.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

import openai
from kvstack.engines.state import Endpoint
from kvstack.engines.tokenizer import load_tokenizer
from kvstack.router.app import RouterConfig
from kvstack.router.circuit import CircuitConfig
from kvstack.router.proxy import RetryPolicy, Timeouts
from kvstack.router.server import RouterOptions, RunningRouter, start_router
from kvstack.sim.cluster import RunningEngine, SimOptions, start_engine, stop_engine
from kvstack.sim.engine import EngineConfig
from kvstack.sim.faults import FaultConfig
from kvstack.sim.textgen import OutputSampler
from support.metrics import counter_totals

MODEL = "sim-model"


@dataclass
class Stack:
    engines: list[RunningEngine]
    router: RunningRouter
    http: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return self.router.url

    async def engine_metric(self, i: int, name: str) -> float:
        async with self.http.get(f"{self.engines[i].url}/metrics") as r:
            text = await r.text()
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


async def start_sims(
    n: int, *, time_scale: float = 20.0, faults: FaultConfig | None = None
) -> list[RunningEngine]:
    tok = load_tokenizer(None)
    sampler = OutputSampler(tok)
    out = []
    for _ in range(n):
        cfg = EngineConfig(model_name=MODEL, time_scale=time_scale, block_size=16, num_gpu_blocks=4096)
        opts = SimOptions(
            engine=cfg, served_model_names=[MODEL], model_root=MODEL, port=0, kv_events=False,
            faults=faults or FaultConfig(),
        )  # fmt: skip
        out.append(await start_engine(opts, tok, sampler, 0))
    return out


async def wait_models(router: RunningRouter, count: int) -> None:
    """Until ``count`` engines have known models and fresh metrics (an engine never scraped counts as
    saturated, so a test starting earlier would see traffic avoid it)."""
    for _ in range(200):
        ready = [e for e in router.app.registry if e.state.endpoint.models and not e.state.metrics_stale]
        if len(ready) >= count:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("engines' models or metrics never became known")


@pytest.fixture
async def stack(request: pytest.FixtureRequest) -> AsyncIterator[Stack]:
    """Two sims behind the router; ``@pytest.mark.routing("round-robin")`` picks another preset."""
    marker = request.node.get_closest_marker("routing")
    engines = await start_sims(2)
    opts = RouterOptions(
        port=0,
        engines=[Endpoint(e.url) for e in engines],
        routing=marker.args[0] if marker else "default",
        app=RouterConfig(timeouts=Timeouts(connect=1.0, first_byte=10.0, idle=5.0, total=60.0)),
        retry=RetryPolicy(max_attempts=3, backoff_base=0.01),
        circuit=CircuitConfig(failure_threshold=3, open_seconds=60.0),
    )
    router = await start_router(opts)
    await wait_models(router, 2)
    http = aiohttp.ClientSession()
    try:
        yield Stack(engines, router, http)
    finally:
        await http.close()
        await router.stop()
        for e in engines:
            await stop_engine(e)


# -- the OpenAI client through the router -------------------------------------------------------------
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


# -- bad input -------------------------------------------------------------------------------------
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


async def test_a_router_bug_answers_500_and_is_counted_as_500(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def broken(*_: object) -> None:
        raise RuntimeError("scheduler bug")

    monkeypatch.setattr(stack.router.app.picker, "pick", broken)
    async with stack.http.post(f"{stack.url}/v1/completions", json={"model": MODEL, "prompt": "x"}) as r:
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


# -- faults --------------------------------------------------------------------------------------------
async def set_faults(stack: Stack, i: int, **faults: object) -> None:
    async with stack.http.post(f"{stack.engines[i].url}/admin/faults", json=faults) as r:
        assert r.status == 200


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


async def test_429_passes_through_when_every_engine_refuses(stack: Stack) -> None:
    for i in range(2):
        await set_faults(stack, i, error_rate=1.0, error_codes=[429])
    async with stack.http.post(f"{stack.url}/v1/completions", json={"model": MODEL, "prompt": "x"}) as r:
        assert r.status == 429
        assert (await r.json())["error"]["code"] == 429


async def test_engine_stopped_requests_go_elsewhere(stack: Stack) -> None:
    await stop_engine(stack.engines[0])
    body = {"model": MODEL, "prompt": "still served", "max_tokens": 2}
    for _ in range(6):
        async with stack.http.post(f"{stack.url}/v1/completions", json=body) as r:
            assert r.status == 200


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


async def test_first_byte_timeout_retries_then_504(stack: Stack) -> None:
    for i in range(2):
        await set_faults(stack, i, hang_rate=1.0)
    h = {"x-kvstack-timeout-first-byte": "0.3"}
    async with stack.http.post(
        f"{stack.url}/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=h
    ) as r:
        assert r.status == 504
        assert (await r.json())["error"]["type"] == "GatewayTimeoutError"


# -- admission and admin -----------------------------------------------------------------------------
async def test_admission_queue_full_gives_429_with_retry_after() -> None:
    engines = await start_sims(1, time_scale=2.0)
    opts = RouterOptions(port=0, engines=[Endpoint(engines[0].url)], max_in_flight=2, max_queue=2)
    router = await start_router(opts)
    await wait_models(router, 1)
    try:
        async with aiohttp.ClientSession() as http:

            async def one() -> tuple[int, str | None]:
                body = {"model": MODEL, "prompt": "x", "max_tokens": 20, "ignore_eos": True}
                async with http.post(f"{router.url}/v1/completions", json=body) as r:
                    await r.read()
                    return r.status, r.headers.get("Retry-After")

            results = await asyncio.gather(*(one() for _ in range(8)))
        ok = [r for r in results if r[0] == 200]
        limited = [r for r in results if r[0] == 429]
        assert len(ok) == 4 and len(limited) == 4
        assert all(ra is not None and int(ra) >= 1 for _, ra in limited)
    finally:
        await router.stop()
        await stop_engine(engines[0])


async def test_admin_endpoints_need_the_key_and_drain_works() -> None:
    engines = await start_sims(2)
    opts = RouterOptions(
        port=0,
        engines=[Endpoint(engines[0].url)],
        app=RouterConfig(admin_key="s3cret", api_keys=frozenset({"k1"})),
    )
    router = await start_router(opts)
    try:
        async with aiohttp.ClientSession() as http:
            add = {"url": engines[1].url}
            async with http.post(f"{router.url}/admin/engines", json=add) as r:
                assert r.status == 401
            admin = {"Authorization": "Bearer s3cret"}
            async with http.post(f"{router.url}/admin/engines", json=add, headers=admin) as r:
                assert r.status == 200
            await wait_models(router, 2)
            async with http.post(
                f"{router.url}/admin/engines/drain", json={"url": engines[0].url}, headers=admin
            ) as r:
                assert r.status == 200 and (await r.json())["draining"] is True
            client_auth = {"Authorization": "Bearer k1"}
            body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
            async with http.post(f"{router.url}/v1/completions", json=body) as r:
                assert r.status == 401
            for _ in range(5):
                async with http.post(f"{router.url}/v1/completions", json=body, headers=client_auth) as r:
                    assert r.status == 200
            async with http.get(f"{engines[1].url}/metrics") as r:
                text = await r.text()
            assert (
                'vllm:request_success_total{engine="0",finished_reason="length",model_name="sim-model"} 5.0'
                in text
            )
            async with http.delete(
                f"{router.url}/admin/engines", params={"url": engines[1].url}, headers=admin
            ) as r:
                assert r.status == 200
            async with http.get(f"{router.url}/ready") as r:
                assert r.status == 503  # the only engine left is draining
    finally:
        await router.stop()
        for e in engines:
            await stop_engine(e)
