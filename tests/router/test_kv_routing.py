"""KV-cache-aware routing through the router to simulated engines: events feed the index, repeats follow
the cache, a reset stops the preference, cold traffic spreads, approximate history for engines without
events, prompt tokenization (local and remote) and the scorers' formulas."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from kvstack.engines.prompt_tokens import ChatPrompt, IdsPrompt, PromptTokenizer, TextPrompt, prompt_of
from kvstack.engines.state import Endpoint, EngineState
from kvstack.engines.tokenizer import load_tokenizer
from kvstack.router.server import RouterOptions, RunningRouter, start_router
from kvstack.scheduling import CycleState, SchedulingRequest
from kvstack.scheduling.interfaces import PrefixView
from kvstack.scheduling.scorers.approximate_prefix import ApproximatePrefixScorer
from kvstack.scheduling.scorers.no_hit_lru import NoHitLRUScorer
from kvstack.scheduling.scorers.precise_prefix import PrecisePrefixScorer
from kvstack.sim.cluster import RunningEngine, SimOptions, start_engine, stop_engine
from kvstack.sim.engine import EngineConfig
from kvstack.sim.textgen import OutputSampler
from support.ports import free_port
from support.waiting import eventually

MODEL = "sim-model"
BLOCK = 16
LONG = " ".join(f"topic{i % 37} detail{i}" for i in range(150))  # many blocks, well inside max_model_len


@dataclass
class KVStack:
    engines: list[RunningEngine]
    router: RunningRouter
    http: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return self.router.url

    async def post(self, path: str, body: dict[str, object]) -> tuple[int, str]:
        async with self.http.post(f"{self.url}{path}", json={"model": MODEL, **body}) as r:
            await r.read()
            return r.status, r.headers.get("x-kvstack-engine", "")

    async def complete(self, prompt: str) -> str:
        status, engine = await self.post("/v1/completions", {"prompt": prompt, "max_tokens": 2})
        assert status == 200
        return engine

    async def chat(self, content: str) -> str:
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": content}]
        status, engine = await self.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2})
        assert status == 200
        return engine


async def _sims(
    n: int, *, kv_events: bool, block_sizes: tuple[int, ...] = (), legacy_events: bool = False
) -> list[RunningEngine]:
    tok = load_tokenizer(None)
    sampler = OutputSampler(tok)
    out = []
    for i in range(n):
        block = block_sizes[i] if block_sizes else BLOCK
        cfg = EngineConfig(model_name=MODEL, time_scale=20.0, block_size=block, num_gpu_blocks=4096)
        opts = SimOptions(
            engine=cfg, served_model_names=[MODEL], model_root=MODEL, port=0, kv_events=kv_events,
            replay=kv_events, legacy_event_encoding=legacy_events,
        )  # fmt: skip
        out.append(await start_engine(opts, tok, sampler, 0))
    return out


@pytest.fixture
async def kv_stack(request: pytest.FixtureRequest) -> AsyncIterator[KVStack]:
    """Two sims behind the router; ``@pytest.mark.routing(preset)`` picks the preset (default "auto"),
    sims publish KV events unless the preset is "prefix"."""
    marker = request.node.get_closest_marker("routing")
    routing = marker.args[0] if marker else "auto"
    engines = await _sims(2, kv_events=routing != "prefix")
    # A generous scrape timeout: on a loaded machine a slow scrape makes metrics stale, and a stale engine
    # counts as saturated, which would move repeats off the holder for reasons this file does not test.
    router = await start_router(
        RouterOptions(port=0, engines=[Endpoint(e.url) for e in engines], routing=routing, scrape_timeout=2.0)
    )
    http = aiohttp.ClientSession()
    try:
        await eventually(
            lambda: all(e.state.endpoint.models and not e.state.metrics_stale for e in router.app.registry),
            timeout_s=30,
        )
        if routing != "prefix":
            await eventually(
                lambda: all(e.state.knowledge == "kv-events" for e in router.app.registry), timeout_s=30
            )
        yield KVStack(engines, router, http)
    finally:
        await http.close()
        await router.stop()
        for e in engines:
            await stop_engine(e)


# -- through the router -----------------------------------------------------------------------------------


async def test_repeats_follow_the_engine_that_holds_the_prefix_until_its_cache_is_reset(
    kv_stack: KVStack,
) -> None:
    first = await kv_stack.complete(LONG)
    locator = kv_stack.router.locator
    assert locator is not None
    await eventually(lambda: locator.index.stats().entries >= 20, timeout_s=30)
    assert locator.index.locations() == [first]
    # Repeats, as completions and as chat whose user message is the same long text, stay on the holder.
    assert {await kv_stack.complete(LONG) for _ in range(6)} == {first}
    holder = await kv_stack.chat(LONG)
    await eventually(lambda: locator.index.stats().entries >= 40, timeout_s=30)
    assert {await kv_stack.chat(LONG) for _ in range(6)} == {holder}

    # The holder's cache is reset: AllBlocksCleared empties its index entries, and repeats lose the pull.
    async with kv_stack.http.post(f"{first}/reset_prefix_cache") as r:
        assert (await r.json())["success"] is True
    # Engines publish events once per scheduler step: a request to the engine carries the clear out.
    body = {"model": MODEL, "prompt": "step", "max_tokens": 1}
    async with kv_stack.http.post(f"{first}/v1/completions", json=body) as r:
        assert r.status == 200
    await eventually(lambda: first not in locator.index.locations(), timeout_s=30)
    tokens = await long_tokens(kv_stack.router)
    states = kv_stack.router.app.registry.states()
    view = locator.lookup(tokens, states).view
    assert first not in view.precise
    engines = await _engines(kv_stack)
    assert all(e["routing_knowledge"] == "kv-events" for e in engines)
    assert all(e["kv_events"]["connected"] and e["kv_events"]["block_size"] in (None, BLOCK) for e in engines)


async def long_tokens(router: RunningRouter) -> tuple[int, ...]:
    """``LONG`` as the router tokenizes it."""
    assert router.prompts is not None
    tokens = await router.prompts.token_ids(MODEL, TextPrompt(LONG))
    assert tokens is not None
    return tokens


async def _engines(stack: KVStack) -> list[dict[str, Any]]:
    async with stack.http.get(f"{stack.url}/engines") as r:
        body = await r.json()
    return list(body["engines"])


async def test_cold_serial_prompts_spread_over_the_engines(kv_stack: KVStack) -> None:
    # One request at a time with unrelated prompts: queues stay equal, so only the LRU rule spreads them.
    picks = Counter([await kv_stack.complete(f"{i} unrelated prompt " * 8) for i in range(10)])
    assert sorted(picks.values()) == [5, 5]


async def test_out_of_range_token_ids_get_the_engines_error_not_a_router_crash(kv_stack: KVStack) -> None:
    for prompt in ([-1, 5, 7], [5, 2**40]):
        status, _ = await kv_stack.post("/v1/completions", {"prompt": prompt, "max_tokens": 1})
        assert status == 400


async def test_metrics_report_kv_events(kv_stack: KVStack) -> None:
    await kv_stack.complete(LONG)
    locator = kv_stack.router.locator
    assert locator is not None
    await eventually(lambda: locator.index.stats().entries > 0, timeout_s=30)
    async with kv_stack.http.get(f"{kv_stack.url}/metrics") as r:
        text = await r.text()
    assert 'kvstack_kv_events_total{engine="' in text and 'type="BlockStored"' in text
    assert "kvstack_kv_events_connected" in text
    assert 'kvstack_router_tokenize_seconds_count{source="remote"}' in text


async def test_removed_engine_leaves_the_index(kv_stack: KVStack) -> None:
    first = await kv_stack.complete(LONG)
    locator = kv_stack.router.locator
    assert locator is not None
    await eventually(lambda: first in locator.index.locations(), timeout_s=30)
    kv_stack.router.app.remove_engine(first)
    assert first not in locator.index.locations()


@pytest.mark.routing("prefix")
async def test_approximate_prefix_without_events(kv_stack: KVStack) -> None:
    engines = await _engines(kv_stack)
    assert {e["routing_knowledge"] for e in engines} == {"approximate"}
    assert all(e["kv_events"] is None for e in engines)
    first = await kv_stack.complete(LONG)
    assert {await kv_stack.complete(LONG) for _ in range(5)} == {first}
    other = await kv_stack.complete("a completely different prompt " * 20)
    assert other != first  # a miss goes to the least recently used engine


@pytest.mark.parametrize("legacy_events", [False, True], ids=["tagged-events", "legacy-array-events"])
async def test_engines_with_different_block_sizes_coexist(legacy_events: bool) -> None:
    engines = await _sims(2, kv_events=True, block_sizes=(16, 128), legacy_events=legacy_events)
    router = await start_router(
        RouterOptions(port=0, engines=[Endpoint(e.url) for e in engines], routing="kv-aware")
    )
    small, large = engines[0].url, engines[1].url
    try:
        await eventually(
            lambda: all(e.state.knowledge == "kv-events" for e in router.app.registry), timeout_s=30
        )
        locator = router.locator
        assert locator is not None
        async with aiohttp.ClientSession() as http:
            for url in (small, large):  # each engine computes the long prompt once
                body = {"model": MODEL, "prompt": LONG, "max_tokens": 1}
                async with http.post(f"{url}/v1/completions", json=body) as r:
                    assert r.status == 200
        await eventually(
            lambda: locator.block_size(small) == 16 and locator.block_size(large) == 128, timeout_s=30
        )
        tokens = await long_tokens(router)
        view = locator.lookup(tokens, router.app.registry.states()).view
        # Each engine's prefix, counted in its own block size: whole blocks of the prompt.
        assert view.precise[small][0] == len(tokens) // 16 * 16
        assert view.precise[large][0] == len(tokens) // 128 * 128
    finally:
        await router.stop()
        for e in engines:
            await stop_engine(e)


# -- prompt tokenization ----------------------------------------------------------------------------------


def test_prompt_of_reads_each_form() -> None:
    assert prompt_of("/v1/completions", {"prompt": "hi"}) == TextPrompt("hi", True)
    assert prompt_of("/v1/completions", {"prompt": "hi", "add_special_tokens": False}) == TextPrompt(
        "hi", False
    )
    assert prompt_of("/v1/completions", {"prompt": [1, 2, 3]}) == IdsPrompt((1, 2, 3))
    assert prompt_of("/v1/completions", {"prompt": ["a", "b"]}) == TextPrompt("a", True)
    assert prompt_of("/v1/completions", {"prompt": [[5, 6], [7]]}) == IdsPrompt((5, 6))
    chat = prompt_of("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert isinstance(chat, ChatPrompt) and chat.add_generation_prompt and not chat.add_special_tokens
    assert prompt_of("/v1/embeddings", {"input": "x"}) is None
    assert prompt_of("/v1/completions", {"prompt": 7}) is None
    assert prompt_of("/v1/chat/completions", {"messages": []}) is None


async def test_local_tokenizer_caches_and_offloads_long_prompts(tiny_model_dir: object) -> None:
    tok = load_tokenizer(str(tiny_model_dir))
    prompts = PromptTokenizer({MODEL: tok}, inline_chars=100)
    short = TextPrompt("hello world")
    ids = await prompts.token_ids(MODEL, short)
    assert ids == tuple(tok.encode("hello world"))
    assert await prompts.token_ids(MODEL, short) == ids and prompts.stats.cache_hits == 1
    long_chat = ChatPrompt([{"role": "user", "content": "long " * 200}])
    long_ids = await prompts.token_ids(MODEL, long_chat)
    rendered = tok.render_chat([{"role": "user", "content": "long " * 200}], add_generation_prompt=True)
    assert long_ids == tuple(tok.encode(rendered, add_special_tokens=False))
    assert prompts.stats.offloaded == 1
    # A template error is no exception: the request routes without prefix knowledge.
    bad = ChatPrompt([{"role": "user", "content": "x"}], chat_template="{{ raise_exception('no') }}")
    assert await prompts.token_ids(MODEL, bad) is None
    assert await prompts.token_ids("other-model", short) is None  # no tokenizer, no engine to ask
    prompts.close()


async def test_tokenizer_cache_is_bounded(tiny_model_dir: object) -> None:
    prompts = PromptTokenizer(
        {MODEL: load_tokenizer(str(tiny_model_dir))}, cache_entries=50, cache_tokens=400
    )
    for i in range(500):
        await prompts.token_ids(MODEL, TextPrompt(f"prompt {i} " * (i % 7 + 1)))
        assert len(prompts._cache) <= 50 and prompts._cached_tokens <= 400
    prompts.close()


# -- scorer formulas --------------------------------------------------------------------------------------


def _engine(url: str, knowledge: str = "kv-events", last_sent: float | None = None) -> EngineState:
    state = EngineState(Endpoint(url, models=frozenset({MODEL})), knowledge=knowledge)
    if last_sent is not None:
        state.recent_requests.append(last_sent)
    return state


def _request(view: PrefixView | None) -> SchedulingRequest:
    return SchedulingRequest(model=MODEL, request_id="r", prefix=view)


def test_precise_prefix_weights_tiers_and_falls_back_to_history() -> None:
    engines = [_engine("a"), _engine("b"), _engine("c", knowledge="approximate"), _engine("d")]
    view = PrefixView(
        prompt_tokens=1000,
        precise={"a": (800, 800, 800, 800), "b": (0, 400, 1000, 1000)},
        approximate={"c": 500, "d": 900},  # d publishes events, so its history is not used
    )
    scores = PrecisePrefixScorer().score(_request(view), CycleState(0.0), engines)
    assert scores["a"] == pytest.approx(0.8)
    assert scores["b"] == pytest.approx((0.8 * 400 + 0.5 * 600) / 1000)
    assert scores["c"] == pytest.approx(0.9 * 0.5)
    assert "d" not in scores
    assert PrecisePrefixScorer().score(_request(None), CycleState(0.0), engines) == {}


def test_approximate_prefix_scores_history_fraction() -> None:
    engines = [_engine("a"), _engine("b")]
    view = PrefixView(prompt_tokens=200, approximate={"a": 150})
    assert ApproximatePrefixScorer().score(_request(view), CycleState(0.0), engines) == {"a": 0.75, "b": 0.0}


def test_no_hit_lru_prefers_the_least_recently_used_for_cold_prompts_only() -> None:
    engines = [_engine("a", last_sent=5.0), _engine("b", last_sent=1.0), _engine("c", last_sent=3.0)]
    cold = PrefixView(prompt_tokens=100)
    assert NoHitLRUScorer().score(_request(cold), CycleState(0.0), engines) == {"a": 0.0, "b": 1.0, "c": 0.5}
    never = [_engine("x"), _engine("y"), _engine("z", last_sent=2.0)]
    scores = NoHitLRUScorer().score(_request(None), CycleState(0.0), never)
    assert scores["x"] == scores["y"] > scores["z"] == 0.0
    warm = PrefixView(prompt_tokens=100, precise={"a": (16, 16, 16, 16)})
    assert NoHitLRUScorer().score(_request(warm), CycleState(0.0), engines) == {}


# -- cache-server events ----------------------------------------------------------------------------------


async def test_cache_server_chunks_credit_engines_on_its_node() -> None:
    from kvstack.frontend.kv_feeds import CacheEvents
    from kvstack.kvevents.codec import BlockStored
    from kvstack.kvevents.publisher import KVEventPublisher

    engines = await _sims(2, kv_events=True)
    chunk = 64
    async with KVEventPublisher(f"tcp://127.0.0.1:{free_port()}") as cache:
        cache_events = CacheEvents(cache.endpoint, node="node-a")
        router = await start_router(
            RouterOptions(
                port=0,
                engines=[Endpoint(engines[0].url, node="node-a"), Endpoint(engines[1].url, node="node-b")],
                routing="kv-aware",
                cache_events=[cache_events],
            )
        )
        try:
            locator = router.locator
            assert locator is not None
            await eventually(
                lambda: all(
                    e.state.endpoint.models and not e.state.metrics_stale for e in router.app.registry
                ),
                timeout_s=30,
            )
            tokens = await long_tokens(router)
            assert len(tokens) > 4 * chunk
            cpu = BlockStored(
                block_hashes=[1, 2], parent_block_hash=None, token_ids=list(tokens[: 2 * chunk]),
                block_size=chunk, medium="CPU",
            )  # fmt: skip
            remote = BlockStored(
                block_hashes=[3], parent_block_hash=2, token_ids=list(tokens[2 * chunk : 3 * chunk]),
                block_size=chunk, medium="REMOTE",
            )  # fmt: skip
            states = router.app.registry.states()
            near, far = engines[0].url, engines[1].url
            # The subscription is asynchronous: publish until the chunks are indexed.
            async with asyncio.timeout(10):
                while cache_events.location not in locator.index.locations():
                    cache.publish([cpu, remote])
                    await asyncio.sleep(0.05)
            view = locator.lookup(tokens, states).view
            # Near engine: CPU chunks then the REMOTE one (cumulative per tier gpu, cpu, disk, remote).
            assert view.precise[near] == (0, 2 * chunk, 2 * chunk, 3 * chunk)
            # Far engine: the REMOTE tier alone does not start at token 0, so nothing is credited.
            assert view.precise.get(far, (0, 0, 0, 0)) == (0, 0, 0, 0)
            status, engine = await KVStack(engines, router, aiohttp.ClientSession()).post(
                "/v1/completions", {"prompt": LONG, "max_tokens": 1}
            )
            assert status == 200 and engine == near
        finally:
            await router.stop()
            for e in engines:
                await stop_engine(e)


async def test_real_cache_server_events_reach_the_router() -> None:
    from kvstack.cache import KVLayout, TieredStore, chunk_keys
    from kvstack.cache.client import AsyncCacheClient
    from kvstack.cache.server import CacheServer
    from kvstack.cache.tiers import MemoryTier
    from kvstack.frontend.kv_feeds import CacheEvents

    chunk = 64
    engines = await _sims(2, kv_events=True)
    store = TieredStore([MemoryTier(16 << 20)])
    await store.start()
    events, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    server = CacheServer(
        store,
        "tcp://127.0.0.1:0",
        chunk_size=chunk,
        node="node-a",
        events_endpoint=events,
        events_replay_endpoint=replay,
    )
    await server.start()
    near, far = engines[0].url, engines[1].url
    router = await start_router(
        RouterOptions(
            port=0,
            engines=[Endpoint(near, node="node-a"), Endpoint(far, node="node-b")],
            routing="kv-aware",
            cache_events=[CacheEvents(events, node="node-a", replay_endpoint=replay)],
        )
    )
    assert server.endpoint is not None
    client = AsyncCacheClient(server.endpoint, shm=False)
    try:
        locator = router.locator
        assert locator is not None
        await eventually(
            lambda: all(e.state.endpoint.models and not e.state.metrics_stale for e in router.app.registry),
            timeout_s=30,
        )
        tokens = await long_tokens(router)
        layout = KVLayout(model=MODEL, num_layers=2, num_kv_heads=2, head_size=16, dtype="bfloat16")
        keys = chunk_keys(tokens, layout, chunk_size=chunk)[:3]
        ids = [list(tokens[i * chunk : (i + 1) * chunk]) for i in range(3)]
        assert await client.put(keys, [bytes(1024)] * 3, token_ids=ids)
        await eventually(lambda: f"cache+{events}" in locator.index.locations(), timeout_s=30)
        view = locator.lookup(tokens, router.app.registry.states()).view
        assert view.precise[near][1] == 3 * chunk  # the cache's memory tier counts as CPU on node-a
        assert far not in view.precise
        async with aiohttp.ClientSession() as http:
            body = {"model": MODEL, "prompt": LONG, "max_tokens": 1}
            async with http.post(f"{router.url}/v1/completions", json=body) as r:
                assert r.status == 200 and r.headers["x-kvstack-engine"] == near
        # Evicting the chunks takes the credit away again (near now also holds the prompt in its own blocks).
        assert await client.evict(keys) == 3
        await eventually(lambda: f"cache+{events}" not in locator.index.locations(), timeout_s=30)
    finally:
        await client.aclose()
        await router.stop()
        await server.stop()
        await store.stop()
        for e in engines:
            await stop_engine(e)
