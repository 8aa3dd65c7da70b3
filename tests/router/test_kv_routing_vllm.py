"""KV-aware routing against two real vLLM engines publishing KV events, and the router's prompt
tokenization checked token for token against real vLLM."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvstack.engines.prompt_tokens import ChatPrompt, PromptTokenizer, TextPrompt
from kvstack.engines.state import Endpoint
from kvstack.engines.tokenizer import load_tokenizer
from kvstack.http.client import UpstreamPool
from kvstack.router.server import RouterOptions, RunningRouter, start_router
from support.engines import EngineProcess, require_vllm, start_vllm
from support.waiting import eventually

pytestmark = pytest.mark.vllm

MODEL = "tiny"  # start_vllm's served name
BLOCK = 128  # vLLM's CPU block size
LONG = " ".join(f"chapter {i} of the long shared document says {i * 7 % 13}" for i in range(60))


@pytest.fixture(scope="module")
def second_vllm(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """A second real vLLM, configured like the session's ``vllm_engine``."""
    require_vllm()
    engine = start_vllm(tiny_model_dir, tmp_path_factory.mktemp("vllm-b"))
    yield engine
    engine.stop()


async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    async with http.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json(), r.headers.get("x-kvstack-engine", "")


async def _reset(http: aiohttp.ClientSession, engine: str) -> None:
    """Empty an engine's prefix cache, and run one step so the AllBlocksCleared event goes out."""
    for _ in range(50):
        async with http.post(f"{engine}/reset_prefix_cache") as r:
            if r.status == 200:
                break
        await asyncio.sleep(0.1)  # refused while requests still hold blocks
    await _post(http, f"{engine}/v1/completions", {"model": MODEL, "prompt": "step", "max_tokens": 1})


@pytest.fixture
async def kv_router(
    vllm_engine: EngineProcess, second_vllm: EngineProcess, tiny_model_dir: Path
) -> AsyncIterator[tuple[RunningRouter, aiohttp.ClientSession]]:
    http = aiohttp.ClientSession()
    for engine in (vllm_engine, second_vllm):
        await _reset(http, engine.url)
    router = await start_router(
        RouterOptions(
            port=0,
            engines=[Endpoint(vllm_engine.url), Endpoint(second_vllm.url)],
            tokenizers={"*": str(tiny_model_dir)},
        )
    )
    try:
        registry = router.app.registry
        await eventually(
            lambda: all(e.state.knowledge == "kv-events" for e in registry), timeout_s=30, interval_s=0.05
        )
        await eventually(
            lambda: all(e.state.endpoint.models and not e.state.metrics_stale for e in registry),
            timeout_s=30,
            interval_s=0.05,
        )
        feeds = router.feeds
        assert feeds is not None

        def connected() -> bool:
            subscribers = [feeds.subscriber(e.state.url) for e in registry]
            return all(s is not None and s.connected for s in subscribers)

        await eventually(connected, timeout_s=30, interval_s=0.05)
        yield router, http
    finally:
        await router.stop()
        await http.close()


async def test_repeats_go_to_the_engine_holding_the_prefix_until_it_is_reset(
    kv_router: tuple[RunningRouter, aiohttp.ClientSession],
) -> None:
    router, http = kv_router
    locator = router.locator
    assert locator is not None
    completions = f"{router.url}/v1/completions"
    chat = f"{router.url}/v1/chat/completions"
    prompt = {"model": MODEL, "prompt": LONG, "max_tokens": 2}
    messages = {"model": MODEL, "messages": [{"role": "user", "content": LONG}], "max_tokens": 2}

    answer, holder = await _post(http, completions, prompt)
    assert answer["usage"]["prompt_tokens"] >= 4 * BLOCK
    await eventually(lambda: holder in locator.index.locations(), timeout_s=30, interval_s=0.05)
    for _ in range(3):
        answer, engine = await _post(http, completions, prompt)
        assert engine == holder
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 3 * BLOCK  # the engine agrees

    # The chat form of the same text renders differently; once one engine holds it, repeats follow it.
    # (Counted before the request: its BlockStored events may reach the index before the answer does.)
    before = locator.index.stats().entries
    _, chat_holder = await _post(http, chat, messages)
    await eventually(lambda: locator.index.stats().entries > before, timeout_s=30, interval_s=0.05)
    for _ in range(3):
        answer, engine = await _post(http, chat, messages)
        assert engine == chat_holder
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 3 * BLOCK

    # Reset the holder's cache: its AllBlocksCleared removes it from the index and the pull is gone.
    await _reset(http, holder)
    await eventually(lambda: holder not in locator.index.locations(), timeout_s=30, interval_s=0.05)
    assert router.prompts is not None
    tokens = await router.prompts.token_ids(MODEL, TextPrompt(LONG))
    assert tokens is not None
    view = locator.lookup(tokens, router.app.registry.states()).view
    assert holder not in view.precise
    async with http.get(f"{router.url}/engines") as r:
        engines = (await r.json())["engines"]
    assert {e["routing_knowledge"] for e in engines} == {"kv-events"}
    assert all(e["kv_events"]["block_size"] == BLOCK for e in engines if e["kv_events"]["batches"])


# -- tokenization, token for token against real vLLM ------------------------------------------------------

CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "Hello there"}]},
    {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is KV cache?"},
            {"role": "assistant", "content": "Saved attention keys and values."},
            {"role": "user", "content": "And prefix caching? " + LONG[:500]},
        ]
    },
    {"messages": [{"role": "user", "content": "no prompt"}], "add_generation_prompt": False},
    {
        "messages": [{"role": "user", "content": "Say"}, {"role": "assistant", "content": "Sure, "}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "parts "}, {"type": "text", "text": "b"}]}
        ]
    },
]


async def test_local_and_remote_tokenization_match_vllm(
    vllm_engine: EngineProcess, tiny_model_dir: Path
) -> None:
    client = UpstreamPool()
    async with aiohttp.ClientSession() as http:
        local = PromptTokenizer({MODEL: load_tokenizer(str(tiny_model_dir))})
        remote = PromptTokenizer(client=client, engines_for=lambda _model: [vllm_engine.url])
        for text in ("plain text", LONG, "  spaces and\nnewlines\t", "ünïcödé ✓"):
            for special in (True, False):
                answer, _ = await _post(
                    http,
                    f"{vllm_engine.url}/tokenize",
                    {"model": MODEL, "prompt": text, "add_special_tokens": special},
                )
                prompt: TextPrompt | ChatPrompt = TextPrompt(text, special)
                assert await local.token_ids(MODEL, prompt) == tuple(answer["tokens"])
                assert await remote.token_ids(MODEL, prompt) == tuple(answer["tokens"])
        for case in CHATS:
            answer, _ = await _post(http, f"{vllm_engine.url}/tokenize", {"model": MODEL, **case})
            prompt = ChatPrompt(
                case["messages"],
                add_generation_prompt=case.get("add_generation_prompt", True),
                continue_final_message=case.get("continue_final_message", False),
            )
            assert await local.token_ids(MODEL, prompt) == tuple(answer["tokens"]), case
            assert await remote.token_ids(MODEL, prompt) == tuple(answer["tokens"]), case
            # What the engine computes for a real chat request is the same prompt.
            body = {"model": MODEL, "max_tokens": 1, **case}
            if case.get("continue_final_message") or case.get("add_generation_prompt") is False:
                continue
            served, _ = await _post(http, f"{vllm_engine.url}/v1/chat/completions", body)
            assert served["usage"]["prompt_tokens"] == len(answer["tokens"])
        local.close()
    await client.close()
