"""Prefill/decode disaggregation between two real vLLM engines through the cache tier, done by hand with the
openai client as kvstack's router will do it.

Three engines on the same weights (``support.connector``): a prefill engine and a decode engine, both with
`KVStackConnector` on the module's cache server, and a colocated engine without a connector whose answers
are the reference. The prefill request carries ``kv_transfer_params: {"do_remote_decode": true}`` and
``max_tokens: 1``; the prefill engine's answer names what it left in the tier; the decode request is the
client's body with those params. The decode engine loads the prompt's full chunks (vLLM counts them in
``vllm:external_prefix_cache_hits_total`` and ``vllm:prompt_tokens_by_source_total{source=
"external_kv_transfer"}``), computes the rest, and answers as the colocated engine does.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import openai
from kvstack.cache.keys import ChunkKey, chunk_keys
from kvstack.connector import PAGED_LAYOUT, AttentionShape, block_layout_name, kv_layout, loadable_end
from kvstack.engines.state import Endpoint, EngineRole
from kvstack.router.server import RouterOptions, running_router
from support.cache import CacheServerProcess
from support.connector import MODEL_ID, Answer, assert_close, start_connector_engine
from support.engines import EngineProcess
from support.metrics import sample_sum
from support.waiting import eventually

pytestmark = pytest.mark.vllm

CHUNK = 256  # the cache_server fixture's chunk size (connector/conftest.py)
BLOCK = 128
LAYOUT = kv_layout(
    MODEL_ID,
    AttentionShape(2, 2, 64, "bfloat16", BLOCK),
    block_layout=block_layout_name(PAGED_LAYOUT, platform="cpu", backend="CPU_ATTN", block_size=BLOCK),
    tp_rank=0,
    tp_size=1,
)
WAIT_S = 5.0  # the decode engine's prefill_wait_s
MAX_TOKENS = 8


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 4000 + 3 for i in range(n)]


# Lengths around the chunk grid: 2 chunks + 88, exactly 2 chunks, 1 chunk + 44, 3 chunks + 232, under 1.
PROMPTS = {n: prompt(100 + i, n) for i, n in enumerate((600, 512, 300, 1000, 200))}
CONCURRENT = [prompt(110 + i, 400 + 150 * i) for i in range(4)]
FIRST, SHORT = prompt(90, 600), prompt(91, 200)
UNSAVED = prompt(120, 600)  # never prefilled: a plain request to the decode engine
EVICTED = prompt(121, 600)  # prefilled, then its chunks evicted before the decode request
EARLY = prompt(122, 600)  # its chunks are held back until its decode request waits for them
MISKEYED = prompt(123, 600)  # a decode request whose params name another prompt's chunk
ROUTED = prompt(124, 700)  # through kvstack's router on the pd preset
EVERY = [*PROMPTS.values(), *CONCURRENT, UNSAVED, EVICTED, EARLY, MISKEYED, ROUTED]


def keys(tokens: list[int]) -> list[ChunkKey]:
    return chunk_keys(tokens, LAYOUT, CHUNK)


def loaded(tokens: list[int]) -> int:
    """What the decode engine loads of a prompt whose full chunks are all in the tier."""
    return loadable_end(len(tokens), len(tokens) // CHUNK * CHUNK, BLOCK)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def generate(
    engine: EngineProcess,
    tokens: list[int],
    *,
    max_tokens: int = MAX_TOKENS,
    kv_transfer_params: dict[str, Any] | None = None,
    cache_salt: str | None = None,
) -> tuple[Answer, Any]:
    """``generate_at`` an engine."""
    return generate_at(
        engine.url,
        engine.model,
        tokens,
        max_tokens=max_tokens,
        kv_transfer_params=kv_transfer_params,
        cache_salt=cache_salt,
    )


def generate_at(
    url: str,
    model: str,
    tokens: list[int],
    *,
    max_tokens: int = MAX_TOKENS,
    kv_transfer_params: dict[str, Any] | None = None,
    cache_salt: str | None = None,
) -> tuple[Answer, Any]:
    """A greedy completion through the openai client: the answer, and the response (its
    ``kv_transfer_params`` is an extra field). With a ``cache_salt`` the connector leaves the prompt alone."""
    extra: dict[str, Any] = {"return_tokens_as_token_ids": True}
    if kv_transfer_params is not None:
        extra["kv_transfer_params"] = kv_transfer_params
    if cache_salt is not None:
        extra["cache_salt"] = cache_salt
    reply = client(url).completions.create(
        model=model,
        prompt=tokens,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=5,
        stream=False,
        extra_body=extra,
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and reply.usage is not None
    answer = Answer(list(logprobs.tokens or []), list(logprobs.top_logprobs or []), reply.usage.prompt_tokens)
    return answer, reply


def prefill(engine: EngineProcess, tokens: list[int]) -> dict[str, Any]:
    """The router's prefill request; the ``kv_transfer_params`` the prefill engine answers."""
    _, reply = generate(engine, tokens, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = (reply.model_extra or {}).get("kv_transfer_params")
    assert isinstance(params, dict), reply
    return params


def metric(engine: EngineProcess, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"{engine.url}/metrics", timeout=10) as r:
        return sample_sum(r.read().decode(), name, **labels)


def loads(engine: EngineProcess) -> dict[str, float]:
    """The decode engine's counters of prompt tokens by where they came from."""
    return {
        "hits": metric(engine, "vllm:external_prefix_cache_hits_total"),
        "external": metric(engine, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"),
        "computed": metric(engine, "vllm:prompt_tokens_by_source_total", source="local_compute"),
    }


def grown(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def stored(server: CacheServerProcess, tokens: list[int]) -> int:
    client = server.client()
    try:
        return client.lookup(keys(tokens))
    finally:
        client.close()


def wait_stored(server: CacheServerProcess, tokens: list[int]) -> None:
    deadline = time.monotonic() + 20
    while stored(server, tokens) < len(keys(tokens)):
        assert time.monotonic() < deadline, "the prefill engine's chunks never reached the tier"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def engines(
    model_dir: Path, cache_server: CacheServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, EngineProcess]]:
    """The colocated, prefill and decode engines, started at once (the prefill engine on the server's ZMQ
    endpoint, the decode engine on its unix socket)."""
    workdir = tmp_path_factory.mktemp
    starts = {
        "colocated": lambda: start_connector_engine(model_dir, workdir("colocated"), None, chunk_size=CHUNK),
        "prefill": lambda: start_connector_engine(
            model_dir, workdir("prefill"), cache_server.endpoint, chunk_size=CHUNK
        ),
        "decode": lambda: start_connector_engine(
            model_dir, workdir("decode"), cache_server.unix_endpoint, chunk_size=CHUNK, prefill_wait_s=WAIT_S
        ),
    }
    with ThreadPoolExecutor(len(starts)) as pool:
        futures = {name: pool.submit(start) for name, start in starts.items()}
    started = {name: f.result() for name, f in futures.items() if f.exception() is None}
    failed = [e for f in futures.values() if (e := f.exception()) is not None]
    try:
        if failed:
            raise failed[0]
        for engine in started.values():
            # An engine's first forward passes take seconds (one-time set-up); the waits tested are shorter.
            generate(engine, prompt(1, 600), cache_salt="warm-up")
        yield started
    finally:
        for engine in started.values():
            engine.stop()


@pytest.fixture(scope="module")
def colocated(engines: dict[str, EngineProcess]) -> dict[tuple[int, ...], Answer]:
    """Every prompt's answer from the colocated engine (one request, prefill and decode in one engine),
    which is then stopped."""
    engine = engines["colocated"]
    answers = {tuple(tokens): generate(engine, tokens)[0] for tokens in EVERY}
    engine.stop()
    return answers


def test_the_prefill_engine_answers_what_it_left_in_the_tier(
    engines: dict[str, EngineProcess], cache_server: CacheServerProcess
) -> None:
    params = prefill(engines["prefill"], FIRST)
    # vLLM adds the prefill side's own prefix-cache hits (none: a cold prompt) for the decode side's usage.
    assert params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "kvstack_tokens": 512,
        "kvstack_key": str(keys(FIRST)[1]),
        "remote_prefill_cached_tokens": 0,
    }
    wait_stored(cache_server, FIRST)  # saves are asynchronous: the chunks follow the answer
    # Shorter than a chunk: nothing in the tier, nothing for the decode engine to wait for.
    params = prefill(engines["prefill"], SHORT)
    assert (params["do_remote_prefill"], params["kvstack_tokens"], params["kvstack_key"]) == (True, 0, None)


def test_the_decode_engine_loads_the_prompt_and_answers_as_a_colocated_engine(
    engines: dict[str, EngineProcess], colocated: dict[tuple[int, ...], Answer]
) -> None:
    prefiller, decoder = engines["prefill"], engines["decode"]
    for n, tokens in PROMPTS.items():
        params = prefill(prefiller, tokens)
        assert params["kvstack_tokens"] == n // CHUNK * CHUNK
        before = loads(decoder)
        started = time.monotonic()
        answer, reply = generate(decoder, tokens, kv_transfer_params=params)
        took = time.monotonic() - started
        moved = grown(loads(decoder), before)
        assert moved == {
            "hits": loaded(tokens),
            "external": loaded(tokens),
            "computed": n - loaded(tokens),
        }, n
        assert_close(answer, colocated[tuple(tokens)])
        assert took < WAIT_S, f"{n} tokens: {took:.2f} s"  # no wait ran out
        # vLLM reports the prefill engine's cache hits as the decode request's.
        assert reply.usage.prompt_tokens_details.cached_tokens == params["remote_prefill_cached_tokens"]
        assert (reply.model_extra or {}).get("kv_transfer_params") is None


def test_concurrent_handoffs_each_load_their_own_prompt(
    engines: dict[str, EngineProcess], colocated: dict[tuple[int, ...], Answer]
) -> None:
    prefiller, decoder = engines["prefill"], engines["decode"]
    with ThreadPoolExecutor(len(CONCURRENT)) as pool:
        handoffs = list(pool.map(lambda tokens: prefill(prefiller, tokens), CONCURRENT))
        before = loads(decoder)
        answers = list(
            pool.map(
                lambda job: generate(decoder, job[0], kv_transfer_params=job[1])[0],
                zip(CONCURRENT, handoffs, strict=True),
            )
        )
    assert grown(loads(decoder), before)["hits"] == sum(loaded(tokens) for tokens in CONCURRENT)
    for tokens, answer in zip(CONCURRENT, answers, strict=True):
        assert_close(answer, colocated[tuple(tokens)])


def test_a_decode_request_ahead_of_the_chunks_waits_for_them(
    engines: dict[str, EngineProcess],
    colocated: dict[tuple[int, ...], Answer],
    cache_server: CacheServerProcess,
) -> None:
    """Saves are asynchronous: a decode request may arrive before the prefill engine's chunks. The test
    holds them back (takes them off the server) until the decode engine holds the request, which vLLM counts
    as waiting for KV; once they are back, it loads them.

    (Not the prefill itself sent late: on two shared cores, the waiting decode engine's busy loop slows
    the prefill engine's forward passes many times over.)"""
    prefiller, decoder = engines["prefill"], engines["decode"]
    params = prefill(prefiller, EARLY)
    wait_stored(cache_server, EARLY)
    waiting = {"stage": "waiting_to_start"}
    client = cache_server.client()
    try:
        chunks = client.get(keys(EARLY))
        assert chunks is not None
        with chunks as held:
            payloads = [bytes(p) for p in held]
        assert client.evict(keys(EARLY)) == 2
        before = loads(decoder)
        with ThreadPoolExecutor(1) as pool:
            decoding = pool.submit(generate, decoder, EARLY, kv_transfer_params=params)
            deadline = time.monotonic() + WAIT_S / 2
            while metric(decoder, "vllm:num_requests_kv_fetch_by_stage", **waiting) != 1:
                assert time.monotonic() < deadline and not decoding.done()
                time.sleep(0.02)
            assert client.put(keys(EARLY), payloads)
            answer, _ = decoding.result(timeout=60)
    finally:
        client.close()
    assert grown(loads(decoder), before)["hits"] == 512
    assert metric(decoder, "vllm:num_requests_kv_fetch_by_stage", **waiting) == 0
    assert_close(answer, colocated[tuple(EARLY)])


def test_without_the_chunks_in_the_tier_the_decode_engine_computes_the_prompt(
    engines: dict[str, EngineProcess],
    colocated: dict[tuple[int, ...], Answer],
    cache_server: CacheServerProcess,
) -> None:
    prefiller, decoder = engines["prefill"], engines["decode"]
    # A plain request for a prompt no engine has seen: computed at once.
    before = loads(decoder)
    answer, _ = generate(decoder, UNSAVED)
    assert grown(loads(decoder), before) == {"hits": 0, "external": 0, "computed": len(UNSAVED)}
    assert_close(answer, colocated[tuple(UNSAVED)])

    # Handed off, then evicted: the decode engine waits prefill_wait_s for them, then computes.
    params = prefill(prefiller, EVICTED)
    wait_stored(cache_server, EVICTED)
    client = cache_server.client()
    try:
        assert client.evict(keys(EVICTED)) == 2
    finally:
        client.close()
    before = loads(decoder)
    started = time.monotonic()
    answer, _ = generate(decoder, EVICTED, kv_transfer_params=params)
    assert WAIT_S <= time.monotonic() - started < WAIT_S + 20
    assert grown(loads(decoder), before) == {"hits": 0, "external": 0, "computed": len(EVICTED)}
    assert_close(answer, colocated[tuple(EVICTED)])
    log = decoder.log_path.read_text(errors="replace")
    assert "0 of the 512 prompt tokens its prefill engine handed off are in the tier after 5.0 s" in log

    # Params naming chunks this engine does not compute (another prompt's): no wait, computed at once.
    wrong = {"do_remote_prefill": True, "kvstack_tokens": 512, "kvstack_key": str(keys(UNSAVED)[1])}
    started = time.monotonic()
    answer, _ = generate(decoder, MISKEYED, kv_transfer_params=wrong)
    assert time.monotonic() - started < WAIT_S
    assert_close(answer, colocated[tuple(MISKEYED)])
    assert "saved the prompt under other chunk keys" in decoder.log_path.read_text(errors="replace")


async def test_the_router_on_the_pd_preset_does_the_handoff(
    engines: dict[str, EngineProcess], colocated: dict[tuple[int, ...], Answer]
) -> None:
    """kvstack's router, roles from the engine specs, routing "pd": a long prompt is prefilled on the prefill
    engine, the decode engine loads it from the tier and answers as the colocated engine does."""
    prefiller, decoder = engines["prefill"], engines["decode"]
    endpoints = [
        Endpoint(prefiller.url, role=EngineRole.PREFILL),
        Endpoint(decoder.url, role=EngineRole.DECODE),
    ]
    async with running_router(RouterOptions(port=0, engines=endpoints, routing="pd")) as router:
        await eventually(
            lambda: all(e.state.endpoint.models and not e.state.metrics_stale for e in router.app.registry),
            what="both engines known",
            timeout_s=30,
        )
        before = await asyncio.to_thread(loads, decoder)
        answer, _ = await asyncio.to_thread(generate_at, router.url, decoder.model, ROUTED)
        moved = grown(await asyncio.to_thread(loads, decoder), before)
        assert moved == {
            "hits": loaded(ROUTED),
            "external": loaded(ROUTED),
            "computed": len(ROUTED) - loaded(ROUTED),
        }
        assert_close(answer, colocated[tuple(ROUTED)])
        text = router.app.metrics.render().decode()
        assert sample_sum(text, "kvstack_pd_prefills_total", outcome="ok") == 1
        assert sample_sum(text, "kvstack_pd_fallbacks_total") == 0
