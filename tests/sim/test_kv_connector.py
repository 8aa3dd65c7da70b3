"""The simulator's emulated KV connector over a real cache server, and ``kvstack up`` with its cache server.

Modelled times are read from the engines' histograms (exact on the modelled clock, whatever the machine's
load); wall-clock limits below are liveness bounds, never speed assertions.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstack.cache import TieredStore, chunk_keys
from kvstack.cache.client import AsyncCacheClient
from kvstack.cache.server import CacheServer
from kvstack.cache.tiers import MemoryTier
from kvstack.cli import main as kvstack_main
from kvstack.engines.tokenizer import load_tokenizer
from kvstack.sim.cluster import RunningEngine, SimOptions, start_engine, stop_engine
from kvstack.sim.engine import EngineConfig
from kvstack.sim.kv_cache import KVCache
from kvstack.sim.kv_connector import CacheTierConfig, sim_kv_layout, synthetic_payload
from kvstack.sim.scheduler import ConnectorQuery, ExternalPrefix, LatencyModel, Scheduler, SimRequest
from kvstack.sim.textgen import OutputSampler
from support.engines import fresh_prompt as prompt
from support.metrics import metrics
from support.ports import free_ports
from support.processes import group_alive, kill_group, spawn
from support.waiting import eventually

MODEL = "tiny"
BLOCK = 16
CHUNK = 256
LATENCY = LatencyModel(
    step_overhead=0.001,
    prefill_per_token=0.00005,
    decode_base=0.008,
    decode_per_seq=0.0001,
    load_per_token=5e-6,
)
DEADLINE_S = 20.0


async def complete(
    http: aiohttp.ClientSession, url: str, ids: list[int], model: str = MODEL
) -> dict[str, Any]:
    body = {"model": model, "prompt": ids, "max_tokens": 2, "ignore_eos": True}
    async with http.post(f"{url}/v1/completions", json=body) as r:
        payload: dict[str, Any] = await r.json()
        assert r.status == 200, payload
        return payload


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


# -- pure parts ----------------------------------------------------------------------------------------


def test_external_prefix_loads_past_the_local_hit_up_to_the_last_block_before_the_prompt_end() -> None:
    two = ExternalPrefix(CHUNK, 0, ("host", "disk"))
    assert two.loadable(600, 0, BLOCK) == 512
    assert two.loadable(600, 32, BLOCK) == 480  # past the local hit only
    assert two.loadable(512, 0, BLOCK) == 496  # the last token is computed: its block is not loaded
    assert two.split(32, 512) == {"host": 224, "disk": 256}
    later = ExternalPrefix(CHUNK, 1, ("host",))  # found from chunk 1: the local hit covered chunk 0
    assert later.loadable(600, 256, BLOCK) == 256
    assert later.loadable(600, 128, BLOCK) == 0  # the local hit shrank below the stored chunks
    assert ExternalPrefix(CHUNK).loadable(600, 0, BLOCK) == 0


def test_scheduler_charges_loaded_tokens_the_load_cost_and_records_connector_queries() -> None:
    s = Scheduler(KVCache(128, BLOCK), lambda r: 7, latency=LATENCY)
    req = SimRequest("r", prompt(1, 600), 1, 0.0, external_prefix=ExternalPrefix(CHUNK, 0, ("host", "host")))
    s.add(req)
    out = s.step(0.0)
    assert out.stats.admitted == [(600, 0, 512)]
    assert out.stats.connector == [ConnectorQuery(600, 512, {"host": 512})]
    assert out.stats.prefill_tokens == 88 and out.stats.loaded_tokens == 512
    assert out.stats.duration == pytest.approx(LATENCY.step_time(88, 0, 1, 512))
    assert req.num_cached_tokens == 512 and req.num_external_tokens == 512
    # A connector that found nothing still counts the query, as vLLM does.
    miss = SimRequest("m", prompt(2, 100), 1, 0.0, external_prefix=ExternalPrefix(CHUNK))
    s.add(miss)
    assert s.step(1.0).stats.connector == [ConnectorQuery(100, 0, {})]


def test_layout_comes_from_the_model_config_and_names_the_simulator(tiny_model_dir: Path) -> None:
    layout = sim_kv_layout(str(tiny_model_dir), str(tiny_model_dir), BLOCK)
    assert (layout.model, layout.num_layers, layout.num_kv_heads, layout.head_size, layout.dtype) == (
        str(tiny_model_dir), 2, 2, 64, "bfloat16",
    )  # fmt: skip
    # The block layout keeps simulated chunks apart from a real engine's (the connector names its platform).
    assert layout.block_layout == "kvstack-sim:block=16"
    assert sim_kv_layout("x", None, BLOCK).num_layers == 2  # no model directory: the built-in tiny shape
    assert synthetic_payload(b"k" * 32, 70) == b"k" * 70


def test_sim_refuses_a_chunk_size_that_is_not_whole_blocks(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["sim", "--kv-cache-server", "tcp://127.0.0.1:1", "--kv-cache-chunk-size", "100"]
    assert kvstack_main(args) == 2
    assert "not a multiple of --block-size 16" in capsys.readouterr().err


# -- two simulated engines and a real cache server ----------------------------------------------------------


@dataclass
class Tier:
    server: CacheServer
    store: TieredStore
    endpoint: str


@pytest.fixture
async def cache_tier() -> AsyncIterator[Tier]:
    store = TieredStore([MemoryTier(16 << 20)])
    await store.start()
    server = CacheServer(store, "tcp://127.0.0.1:0", chunk_size=CHUNK, node="test")
    await server.start()
    assert server.endpoint is not None
    try:
        yield Tier(server, store, server.endpoint)
    finally:
        await server.stop()
        await store.stop()


async def start_sims(n: int, server: str) -> list[RunningEngine]:
    tok = load_tokenizer(None)
    sampler = OutputSampler(tok)
    cfg = EngineConfig(
        model_name=MODEL, time_scale=10.0, block_size=BLOCK, num_gpu_blocks=1024, latency=LATENCY
    )
    tier = CacheTierConfig(server, sim_kv_layout(MODEL, None, BLOCK), chunk_size=CHUNK, timeout_s=0.3)
    opts = SimOptions(cfg, [MODEL], MODEL, port=0, kv_events=False, cache_tier=tier.validate(BLOCK))
    return [await start_engine(opts, tok, sampler, i) for i in range(n)]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def until_stored(client: AsyncCacheClient, ids: list[int], chunks: int) -> None:
    keys = chunk_keys(ids, sim_kv_layout(MODEL, None, BLOCK), CHUNK)

    async def stored() -> bool:
        return await client.lookup(keys) >= chunks

    await eventually(stored, timeout_s=DEADLINE_S, interval_s=0.05)


async def test_a_prompt_computed_on_one_engine_is_loaded_by_the_other(
    cache_tier: Tier, http: aiohttp.ClientSession
) -> None:
    a, b = await start_sims(2, cache_tier.endpoint)
    client = AsyncCacheClient(cache_tier.endpoint, shm=False)
    try:
        ids = prompt(3, 600)  # two full chunks (512 tokens) and 88 more
        a0 = await metrics(http, a.url)
        await complete(http, a.url, ids)
        a1 = await metrics(http, a.url)
        # A found nothing, computed everything and saved its two full chunks.
        assert delta(a1, a0, "vllm:external_prefix_cache_queries_total") == 600
        assert delta(a1, a0, "vllm:external_prefix_cache_hits_total") == 0
        assert delta(a1, a0, "vllm:request_prefill_time_seconds_sum") == pytest.approx(
            LATENCY.step_time(600, 0, 1), rel=1e-3
        )
        await until_stored(client, ids, 2)

        b0 = await metrics(http, b.url)
        await complete(http, b.url, ids)
        b1 = await metrics(http, b.url)
        assert delta(b1, b0, "vllm:external_prefix_cache_queries_total") == 600
        assert delta(b1, b0, "vllm:external_prefix_cache_hits_total") == 512
        assert delta(b1, b0, "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}") == 512
        assert delta(b1, b0, "vllm:prompt_tokens_by_source_total{source=local_compute}") == 88
        assert delta(b1, b0, "vllm:prompt_tokens_cached_by_source_total{source=host}") == 512
        assert delta(b1, b0, "vllm:prefix_cache_hits_total") == 0  # B's own cache was cold
        # Prefill: 88 tokens computed, 512 loaded at the load cost, so a TTFT well below A's.
        b_prefill = delta(b1, b0, "vllm:request_prefill_time_seconds_sum")
        assert b_prefill == pytest.approx(LATENCY.step_time(88, 0, 1, 512), rel=1e-3)
        assert b_prefill < delta(a1, a0, "vllm:request_prefill_time_seconds_sum") / 3
        # TTFT is that prefill after the wait (which includes the lookup's round trip, in scaled wall time).
        queued = delta(b1, b0, "vllm:request_queue_time_seconds_sum")
        ttft = delta(b1, b0, "vllm:time_to_first_token_seconds_sum")
        assert ttft == pytest.approx(queued + b_prefill, abs=1e-6)
        # B saved nothing new: both chunks were in the store.
        assert b.connector is not None and b.connector.stats.puts == 0
        assert a.connector is not None and a.connector.stats.chunks_put == 2
    finally:
        await client.aclose()
        for e in (a, b):
            await stop_engine(e)


async def test_engines_keep_answering_when_the_cache_server_is_down(
    cache_tier: Tier, http: aiohttp.ClientSession
) -> None:
    a, b = await start_sims(2, cache_tier.endpoint)
    try:
        await complete(http, a.url, prompt(4, 600))
        await cache_tier.server.stop()  # gone: every call is now a timeout, then a fast miss
        b0 = await metrics(http, b.url)
        for tag in (4, 5, 6):
            async with asyncio.timeout(DEADLINE_S):
                r = await complete(http, b.url, prompt(tag, 600))
            assert r["usage"]["completion_tokens"] == 2
        b1 = await metrics(http, b.url)
        assert delta(b1, b0, "vllm:external_prefix_cache_queries_total") == 1800
        assert delta(b1, b0, "vllm:external_prefix_cache_hits_total") == 0
        assert delta(b1, b0, "vllm:prompt_tokens_by_source_total{source=local_compute}") == 1800
        connector = b.connector
        assert connector is not None

        async def put_failed() -> bool:  # its saves fail too, and are counted
            return connector.stats.puts_failed > 0

        await eventually(put_failed, timeout_s=DEADLINE_S, interval_s=0.05)
        assert connector.client.stats.failures
    finally:
        for e in (a, b):
            await stop_engine(e)


# -- kvstack up ---------------------------------------------------------------------------------------------


@dataclass
class UpProcess:
    proc: subprocess.Popen[bytes]
    url: str
    cache_port: int
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture
def up(tmp_path: Path) -> Iterator[UpProcess]:
    ports = free_ports(3)
    port, cache_port = ports.start, free_ports(3, avoid=ports).start
    log_path = tmp_path / "up.log"
    cmd = [
        sys.executable, "-m", "kvstack.cli", "up", "--engines", "2", "--port", str(port),
        "--cache-port", str(cache_port), "--time-scale", "10", "--served-model-name", MODEL,
    ]  # fmt: skip
    proc = spawn(cmd, log_path)
    stack = UpProcess(proc, f"http://127.0.0.1:{port}", cache_port, log_path)
    try:
        yield stack
    finally:
        if group_alive(proc):  # the test failed before stopping it: stop the whole group
            kill_group(proc)


async def test_up_runs_a_cache_server_whose_chunks_reach_the_router_and_the_other_engine(
    up: UpProcess, http: aiohttp.ClientSession
) -> None:
    async def ready() -> bool:
        assert up.proc.poll() is None, up.log()
        try:
            async with http.get(f"{up.url}/ready") as r:
                return r.status == 200
        except aiohttp.ClientError:
            return False

    await eventually(ready, timeout_s=60, interval_s=0.05)
    cache = f"tcp://127.0.0.1:{up.cache_port}"
    assert f"cache:    {cache}" in up.log()

    ids = prompt(7, 600)
    body = {"model": MODEL, "prompt": ids, "max_tokens": 2, "ignore_eos": True}
    async with http.post(f"{up.url}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        served = r.headers["x-kvstack-engine"]
    # The cache server announces the saved chunks; the router counts them under the cache's location.
    location = f"cache+tcp://127.0.0.1:{up.cache_port + 1}"

    async def announced() -> bool:
        async with http.get(f"{up.url}/metrics") as r:
            text = await r.text()
        return any(
            s.name == "kvstack_kv_events_total"
            and s.labels == {"engine": location, "type": "BlockStored"}
            and s.value > 0
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        )

    await eventually(announced, timeout_s=DEADLINE_S, interval_s=0.05)
    # The engine that did not compute the prompt loads it from the cache tier.
    async with http.get(f"{up.url}/engines") as r:
        urls = [e["url"] for e in (await r.json())["engines"]]
    other = next(u for u in urls if u != served)
    before = await metrics(http, other)
    await complete(http, other, ids)
    after = await metrics(http, other)
    assert delta(after, before, "vllm:external_prefix_cache_hits_total") == 512

    # Stopping `kvstack up` (SIGTERM to it alone) stops the cache server it started, too.
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(timeout=30) == 0, up.log()

    async def all_gone() -> bool:
        return not group_alive(up.proc)

    await eventually(all_gone, timeout_s=DEADLINE_S, interval_s=0.05)
