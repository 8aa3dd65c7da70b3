"""Prompt tokens from the engines (kvstack.engines.prompt_tokens): remote tokenization rotates past an
engine that does not answer and rests it, and the router asks an engine that answers its scrapes."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web

from kvstack.engines.prompt_tokens import PromptTokenizer, TextPrompt
from kvstack.engines.state import Endpoint
from kvstack.http.client import UpstreamPool
from kvstack.router.server import RouterOptions, running_router
from support.waiting import eventually

MODEL = "m"
METRICS = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0.1\n"


@asynccontextmanager
async def engine_client() -> AsyncIterator[UpstreamPool]:
    client = UpstreamPool()
    try:
        yield client
    finally:
        await client.close()


@asynccontextmanager
async def tokenizing_engine(*, hang: bool = False) -> AsyncIterator[tuple[str, list[str]]]:
    """An engine on 127.0.0.1 answering /metrics, /v1/models and /tokenize, or (``hang``) never answering.
    Yields its URL and the paths asked."""
    asked: list[str] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        asked.append(request.path)
        if hang:
            await asyncio.Event().wait()
        if request.path == "/metrics":
            return web.Response(text=METRICS)
        if request.path == "/v1/models":
            return web.json_response({"data": [{"id": MODEL}]})
        return web.json_response({"tokens": [1, 2, 3]})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    site = web.SockSite(runner, sock)
    await site.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", asked
    finally:
        await runner.cleanup()


async def test_remote_tokenize_rotates_and_rests_an_engine_that_does_not_answer() -> None:
    observed: list[tuple[str, float]] = []
    async with (
        tokenizing_engine(hang=True) as (hung, hung_asked),
        tokenizing_engine() as (good, good_asked),
        engine_client() as client,
    ):
        prompts = PromptTokenizer(
            client=client,
            engines_for=lambda _model: [hung, good],
            remote_timeout=0.3,
            remote_cooldown=60.0,
            observe=lambda source, seconds: observed.append((source, seconds)),
        )
        answers = [await prompts.token_ids(MODEL, TextPrompt(f"prompt {i}")) for i in range(8)]
    # The hung engine cost one request its timeout; then it rested and the other engine answered.
    assert hung_asked == ["/tokenize"] and len(good_asked) == 7
    assert answers.count(None) == 1 and answers.count((1, 2, 3)) == 7
    failed = [seconds for source, seconds in observed if source == "remote_failed"]
    assert len(failed) == 1 and failed[0] >= 0.3
    assert [source for source, _ in observed].count("remote") == 7


async def test_remote_tokenize_bounds_the_answer_by_the_prompt_and_rests_no_engine_for_it() -> None:
    asked: list[int] = []

    async def tokenize(request: web.Request) -> web.Response:
        asked.append(len(await request.read()))
        # More than 8 bytes per request byte plus 1 MiB: no prompt renders to this many tokens.
        return web.json_response({"tokens": [1] * (asked[-1] * 8 + (1 << 20))})

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        async with engine_client() as client:
            prompts = PromptTokenizer(client=client, engines_for=lambda _model: [url], remote_timeout=5.0)
            assert await prompts.token_ids(MODEL, TextPrompt("a")) is None
            assert await prompts.token_ids(MODEL, TextPrompt("b")) is None
    finally:
        await runner.cleanup()
    assert len(asked) == 2  # the oversized answer was the prompt's problem: the engine was asked again


async def test_router_tokenizes_with_an_engine_that_answers_scrapes() -> None:
    async with tokenizing_engine(hang=True) as (hung, _), tokenizing_engine() as (good, good_asked):
        opts = RouterOptions(
            port=0,
            routing="default",
            kv_events=False,
            engines=[Endpoint(hung, models=frozenset({MODEL})), Endpoint(good, models=frozenset({MODEL}))],
            scrape_interval=0.05,
            scrape_timeout=0.1,
        )
        async with running_router(opts) as router:
            entry = router.app.registry.get(good)
            assert entry is not None and router.prompts is not None
            await eventually(lambda: not entry.state.metrics_stale)
            started = time.monotonic()
            for i in range(4):
                assert await router.prompts.token_ids(MODEL, TextPrompt(f"prompt {i}")) == (1, 2, 3)
            assert time.monotonic() - started < 1.0  # the hung engine, registered first, was never asked
            assert good_asked.count("/tokenize") == 4
