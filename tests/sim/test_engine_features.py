"""Simulator features a router or benchmark relies on, beyond the conformance suite.

Determinism (greedy, --seed, request seed), legacy metric names, legacy KV-event encoding, several engines
in one process, the time scale and latency model (read from the sim's own histograms, which run on its
modelled clock), P/D disaggregation, preemption, bounded state under load, many concurrent streams, and
chat template details. Subprocess sims come from support.engines; the load tests run the sim in this event
loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import sys
import time
import tracemalloc
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio

from kvstack.engines.tokenizer import load_tokenizer
from kvstack.kvevents.codec import BlockStored, decode_batch
from kvstack.sim.cluster import RunningEngine, SimOptions, start_engine, stop_engine
from kvstack.sim.engine import EngineConfig
from kvstack.sim.scheduler import LatencyModel
from kvstack.sim.textgen import OutputSampler
from support.engines import EngineProcess, fresh_prompt, start_sim, wait_healthy
from support.metrics import metrics
from support.ports import free_ports
from support.processes import spawn

BLOCK = 16
# The latency model, passed explicitly so the expected modelled times below do not depend on defaults.
LATENCY = LatencyModel(
    step_overhead=0.001, prefill_per_token=0.00005, decode_base=0.008, decode_per_seq=0.0001
)
LATENCY_ARGS = [
    "--step-overhead",
    str(LATENCY.step_overhead),
    "--prefill-per-token",
    str(LATENCY.prefill_per_token),
    "--decode-base",
    str(LATENCY.decode_base),
    "--decode-per-seq",
    str(LATENCY.decode_per_seq),
]
# Wall-clock deadline for events and state changes: a liveness bound, never a speed assertion.
DEADLINE_S = 10.0


# -- helpers -----------------------------------------------------------------------------------------
async def post(http: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    async with http.post(f"{url}{path}", json=body) as r:
        payload: dict[str, Any] = await r.json()
        assert r.status == 200, payload
        return payload


async def complete(http: aiohttp.ClientSession, url: str, **body: Any) -> dict[str, Any]:
    return await post(http, url, "/v1/completions", {"model": "tiny", **body})


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        yield session


@pytest.fixture
def sim_factory(tmp_path: Path) -> Iterator[Callable[..., EngineProcess]]:
    """Start ``kvstack sim`` subprocesses (block size 16 unless given); all stopped at teardown."""
    started: list[EngineProcess] = []

    def start(*args: str, **kwargs: Any) -> EngineProcess:
        kwargs.setdefault("block_size", BLOCK)
        kwargs.setdefault("replay", False)
        engine = start_sim(tmp_path / f"sim{len(started)}", extra_args=list(args), **kwargs)
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.stop()


class EventSub:
    """A ZMQ SUB on one engine's KV-event stream."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    async def payload(self, timeout_s: float) -> bytes | None:
        if not await self.sock.poll(int(timeout_s * 1000)):
            return None
        _topic, _seq, payload = await self.sock.recv_multipart()
        return bytes(payload)

    def close(self) -> None:
        self.sock.close(linger=0)


def stored_token_ids(payload: bytes) -> list[list[int]]:
    return [ev.token_ids for ev in decode_batch(payload).events if isinstance(ev, BlockStored)]


async def store_and_watch(
    http: aiohttp.ClientSession, url: str, sub: EventSub, tags: Iterator[int]
) -> tuple[list[int], bytes, list[bytes]]:
    """Send fresh 40-token prompts to ``url`` until one's BlockStored arrives on ``sub``.

    Returns that prompt, the payload carrying it and the payloads received before it. A new prompt is
    sent whenever nothing arrives for a while, since a SUB drops what is published before it is connected.
    """
    sent: list[list[int]] = []
    before: list[bytes] = []
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        prompt = fresh_prompt(next(tags), 40)
        sent.append(prompt)
        await complete(http, url, prompt=prompt, max_tokens=1)
        while (payload := await sub.payload(0.5)) is not None:
            for token_ids in stored_token_ids(payload):
                for p in sent:
                    if token_ids == p[: 2 * BLOCK]:
                        return p, payload, before
            before.append(payload)
    raise AssertionError(f"no BlockStored for the prompts sent to {url} within {DEADLINE_S:.0f}s")


@contextlib.asynccontextmanager
async def in_process_engine(**config: Any) -> AsyncIterator[RunningEngine]:
    """One sim engine in this event loop, on a free port, without KV events."""
    tok = load_tokenizer(None)
    cfg = EngineConfig(model_name="tiny", **config)
    opts = SimOptions(engine=cfg, served_model_names=["tiny"], model_root="tiny", port=0, kv_events=False)
    running = await start_engine(opts, tok, OutputSampler(tok, seed=cfg.seed), 0)
    try:
        yield running
    finally:
        await stop_engine(running)


# -- determinism -------------------------------------------------------------------------------------
@pytest.mark.slow
async def test_output_is_deterministic_per_prompt_seed_and_request_seed(
    sim_factory: Callable[..., EngineProcess], http: aiohttp.ClientSession
) -> None:
    fast = ("--time-scale", "10")
    a, b, c = (sim_factory("--seed", seed, *fast) for seed in ("7", "7", "8"))

    async def text(url: str, **body: Any) -> tuple[str, str, int]:
        r = await complete(http, url, prompt="The quick brown fox", max_tokens=32, **body)
        choice = r["choices"][0]
        return choice["text"], choice["finish_reason"], r["usage"]["completion_tokens"]

    greedy = {"temperature": 0, "ignore_eos": True}
    first = await text(a.url, **greedy)
    assert first[0] and first[2] == 32
    assert await text(a.url, **greedy) == first, "same greedy request, same engine"
    assert await text(b.url, **greedy) == first, "same greedy request, another process with the same --seed"
    assert (await text(c.url, **greedy))[0] != first[0], "a different --seed should change the output"
    # Where the "model" stops (EOS) is deterministic too.
    natural = await text(a.url, temperature=0)
    assert await text(b.url, temperature=0) == natural

    seeded = {"temperature": 1.0, "seed": 42, "ignore_eos": True}
    s1 = await text(a.url, **seeded)
    assert await text(a.url, **seeded) == s1
    assert await text(b.url, **seeded) == s1
    assert (await text(a.url, **{**seeded, "seed": 43}))[0] != s1[0]
    unseeded = {"temperature": 1.0, "ignore_eos": True}
    assert (await text(a.url, **unseeded))[0] != (await text(a.url, **unseeded))[0], "sampling without a seed"


# -- metric names ------------------------------------------------------------------------------------
async def test_legacy_metric_names(
    sim_factory: Callable[..., EngineProcess], http: aiohttp.ClientSession
) -> None:
    legacy, current = sim_factory("--legacy-metric-names"), sim_factory()
    prompt = fresh_prompt(1, 40)
    for engine in (legacy, current):
        await complete(http, engine.url, prompt=prompt, max_tokens=3, ignore_eos=True)

    got = await metrics(http, legacy.url)
    names = {key.split("{")[0] for key in got}
    assert {
        "vllm:gpu_cache_usage_perc",
        "vllm:gpu_prefix_cache_queries_total",
        "vllm:gpu_prefix_cache_hits_total",
        "vllm:time_per_output_token_seconds_count",
    } <= names
    for gone in ("vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries", "vllm:inter_token_latency_seconds"):
        assert not any(n.startswith(gone) for n in names), f"{gone} exported under --legacy-metric-names"
    # The legacy names carry the same accounting.
    assert got["vllm:gpu_prefix_cache_queries_total"] == len(prompt)
    assert got["vllm:time_per_output_token_seconds_count"] == 2

    names = {key.split("{")[0] for key in await metrics(http, current.url)}
    assert {"vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total"} <= names
    assert not any(n.startswith(("vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache")) for n in names)


# -- KV events ---------------------------------------------------------------------------------------
async def test_legacy_event_encoding_sends_arrays(
    sim_factory: Callable[..., EngineProcess], http: aiohttp.ClientSession
) -> None:
    engine = sim_factory("--kv-events-legacy-encoding")
    ctx = zmq.asyncio.Context()
    sub = EventSub(ctx, engine.events_endpoint)
    try:
        prompt, payload, _ = await store_and_watch(http, engine.url, sub, iter(range(100, 200)))
    finally:
        sub.close()
        ctx.term()
    ts, raw_events, _rank = msgspec.msgpack.decode(payload)
    assert isinstance(ts, float) and raw_events
    assert all(isinstance(ev, list) for ev in raw_events), raw_events
    assert raw_events[0][0] == "BlockStored"
    (event,) = decode_batch(payload).events
    assert isinstance(event, BlockStored)
    assert event.token_ids == prompt[: 2 * BLOCK] and event.block_size == BLOCK
    assert len(event.block_hashes) == 2 and event.parent_block_hash is None


@pytest.fixture
def three_engines(tmp_path: Path) -> Iterator[tuple[EngineProcess, int, int]]:
    """``kvstack sim --engines 3`` in one process; yields it with its HTTP and KV-event base ports."""
    last_error: Exception | None = None
    for attempt in range(3):  # another process may take a port between the check and the bind
        ports = free_ports(3)
        port, ev_port = ports.start, free_ports(3, avoid=ports).start
        cmd = [
            sys.executable,
            "-m",
            "kvstack.cli",
            "sim",
            "--engines",
            "3",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--kv-events-port",
            str(ev_port),
            "--served-model-name",
            "tiny",
            "--block-size",
            str(BLOCK),
            "--log-level",
            "warning",
        ]
        log_path = tmp_path / f"sim3-{attempt}.log"
        proc = spawn(cmd, log_path, cwd=tmp_path)
        engine = EngineProcess(
            "sim",
            f"http://127.0.0.1:{port}",
            "tiny",
            f"tcp://127.0.0.1:{ev_port}",
            None,
            proc,
            log_path,
            BLOCK,
        )
        try:
            for i in range(3):
                wait_healthy(proc, f"http://127.0.0.1:{port + i}", log_path, 30.0)
        except RuntimeError as exc:
            engine.stop()
            last_error = exc
            continue
        yield engine, port, ev_port
        engine.stop()
        return
    raise RuntimeError(f"could not start --engines 3 after 3 attempts: {last_error}")


async def test_engines_in_one_process_are_independent(
    three_engines: tuple[EngineProcess, int, int], http: aiohttp.ClientSession
) -> None:
    _, port, ev_port = three_engines
    urls = [f"http://127.0.0.1:{port + i}" for i in range(3)]
    for url in urls:
        async with http.get(f"{url}/health") as r:
            assert r.status == 200

    # Each engine advertises its own event port.
    sources = []
    for url in urls:
        async with http.get(f"{url}/kv_event_sources") as r:
            sources.append((await r.json())["0"]["endpoint"])
    assert sources == [f"tcp://*:{ev_port + i}" for i in range(3)]

    # Counters are per engine.
    before = [await metrics(http, url) for url in urls]
    prompt = fresh_prompt(7, 40)
    await complete(http, urls[1], prompt=prompt, max_tokens=2)
    after = [await metrics(http, url) for url in urls]
    moved = [delta(after[i], before[i], "vllm:prompt_tokens_total") for i in range(3)]
    assert moved == [0, len(prompt), 0]

    # Events of a request to engine 2 arrive on engine 2's stream only.
    ctx = zmq.asyncio.Context()
    subs = [EventSub(ctx, f"tcp://127.0.0.1:{ev_port + i}") for i in range(3)]
    tags = iter(range(1000, 2000))
    try:
        for url, sub in zip(urls, subs, strict=True):
            await store_and_watch(http, url, sub, tags)  # until each subscription is live
        prompt, payload, _ = await store_and_watch(http, urls[2], subs[2], tags)
        assert isinstance(msgspec.msgpack.decode(payload)[1][0], dict), "default encoding: tagged maps"
        for i in (0, 1):
            # A marker request to engine i: whatever engine i published before it has arrived by then.
            _, _, earlier = await store_and_watch(http, urls[i], subs[i], tags)
            leaked = [ids for p in earlier for ids in stored_token_ids(p) if ids == prompt[: 2 * BLOCK]]
            assert not leaked, f"engine 2's blocks were published on engine {i}'s stream"
    finally:
        for sub in subs:
            sub.close()
        ctx.term()


# -- modelled time -----------------------------------------------------------------------------------
async def test_time_scale_runs_the_latency_model_faster(
    sim_factory: Callable[..., EngineProcess], http: aiohttp.ClientSession
) -> None:
    engine = sim_factory("--time-scale", "10", *LATENCY_ARGS, num_gpu_blocks=1024, max_model_len=4096)
    prompt_len, out_len = 1000, 200
    start = time.monotonic()
    r = await complete(
        http, engine.url, prompt=fresh_prompt(3, prompt_len), max_tokens=out_len, ignore_eos=True
    )
    wall = time.monotonic() - start
    assert r["usage"]["completion_tokens"] == out_len
    m = await metrics(http, engine.url)

    # One step prefills the whole prompt and yields the first token; each further token is one decode step.
    prefill = LATENCY.step_time(prompt_len, 0, 1)
    decode_step = LATENCY.step_time(0, 1, 1)
    decode = (out_len - 1) * decode_step
    modelled = prefill + decode
    approx = pytest.approx
    # These exclude the queueing wait, so they are exact on the modelled clock.
    assert m["vllm:request_prefill_time_seconds_sum"] == approx(prefill, rel=1e-3)
    assert m["vllm:request_decode_time_seconds_sum"] == approx(decode, rel=1e-3)
    assert m["vllm:request_inference_time_seconds_sum"] == approx(modelled, rel=1e-3)
    assert m["vllm:inter_token_latency_seconds_count"] == out_len - 1
    assert m["vllm:inter_token_latency_seconds_sum"] == approx(decode, rel=1e-3)
    # TTFT and e2e add the (scaled wall) wait before the first step.
    queue = m["vllm:request_queue_time_seconds_sum"]
    assert m["vllm:time_to_first_token_seconds_sum"] == approx(queue + prefill, abs=1e-6)
    assert m["vllm:e2e_request_latency_seconds_sum"] == approx(queue + modelled, abs=1e-6)
    e2e = m["vllm:e2e_request_latency_seconds_sum"]
    assert e2e == approx(modelled, rel=0.3)
    # The sim sleeps modelled/10; a third of the modelled time leaves room for any HTTP overhead.
    assert wall < e2e / 3, f"wall {wall:.3f}s vs modelled {e2e:.3f}s at --time-scale 10"


# What a P/D proxy sends to the prefill engine.
REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


async def test_pd_prefill_then_remote_decode_skips_prefill(
    sim_factory: Callable[..., EngineProcess], http: aiohttp.ClientSession
) -> None:
    kwargs = {"num_gpu_blocks": 1024, "max_model_len": 4096}
    prefiller, decoder = sim_factory(*LATENCY_ARGS, **kwargs), sim_factory(*LATENCY_ARGS, **kwargs)
    n = 1000
    prompt = fresh_prompt(11, n)

    r = await complete(http, prefiller.url, prompt=prompt, max_tokens=1, kv_transfer_params=REMOTE_DECODE)
    kvp = r["kv_transfer_params"]
    assert kvp["do_remote_prefill"] is True and kvp["do_remote_decode"] is False
    assert len(kvp["remote_block_ids"]) == math.ceil(n / BLOCK)
    assert all(isinstance(b, int) and b > 0 for b in kvp["remote_block_ids"])
    assert isinstance(kvp["remote_engine_id"], str) and kvp["remote_engine_id"]
    assert kvp["remote_host"] == "127.0.0.1"
    assert isinstance(kvp["remote_port"], int) and kvp["remote_port"] > 0
    # The prefill side holds the blocks for the decode side after finishing.
    held = await metrics(http, prefiller.url)
    assert held["vllm:kv_cache_usage_perc"] == pytest.approx(math.ceil(n / BLOCK) / 1023)

    m0 = await metrics(http, decoder.url)
    r = await complete(
        http, decoder.url, prompt=prompt, max_tokens=5, ignore_eos=True, kv_transfer_params=kvp
    )
    assert r["usage"]["completion_tokens"] == 5 and r["kv_transfer_params"] is None
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
    m1 = await metrics(http, decoder.url)
    assert delta(m1, m0, "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}") == n - 1
    assert delta(m1, m0, "vllm:prompt_tokens_by_source_total{source=local_compute}") == 1
    remote_prefill = delta(m1, m0, "vllm:request_prefill_time_seconds_sum")
    remote_ttft = delta(m1, m0, "vllm:time_to_first_token_seconds_sum")

    # A cold request of the same length on the same engine computes the whole prompt.
    r = await complete(http, decoder.url, prompt=fresh_prompt(12, n), max_tokens=5, ignore_eos=True)
    m2 = await metrics(http, decoder.url)
    assert delta(m2, m1, "vllm:prompt_tokens_by_source_total{source=local_compute}") == n
    cold_prefill = delta(m2, m1, "vllm:request_prefill_time_seconds_sum")
    cold_ttft = delta(m2, m1, "vllm:time_to_first_token_seconds_sum")
    assert remote_prefill == pytest.approx(LATENCY.step_time(1, 0, 1), rel=1e-3)
    assert cold_prefill == pytest.approx(LATENCY.step_time(n, 0, 1), rel=1e-3)
    assert remote_ttft < cold_ttft


async def wait_all_blocks_free(running: RunningEngine, deadline_s: float) -> None:
    kv = running.engine.kv
    deadline = time.monotonic() + deadline_s
    while kv.num_free_blocks != kv.num_blocks - 1:
        if time.monotonic() > deadline:
            held = kv.num_blocks - 1 - kv.num_free_blocks
            raise AssertionError(f"{held} KV blocks still held {deadline_s:.1f}s later")
        await asyncio.sleep(0.02)


HOLD_S = 0.2  # the prefill side's hold timeout in these tests (30 s by default)


async def test_pd_held_blocks_are_freed_after_the_hold_timeout(http: aiohttp.ClientSession) -> None:
    async with in_process_engine(block_size=BLOCK, time_scale=10.0) as prefiller:
        prefiller.server.config.kv_hold_timeout = HOLD_S
        body = {"prompt": fresh_prompt(30, 100), "max_tokens": 1, "kv_transfer_params": REMOTE_DECODE}
        r = await complete(http, prefiller.url, **body)
        assert len(r["kv_transfer_params"]["remote_block_ids"]) == math.ceil(100 / BLOCK)
        assert prefiller.engine.kv.num_free_blocks < prefiller.engine.kv.num_blocks - 1
        await wait_all_blocks_free(prefiller, deadline_s=HOLD_S + 3.0)
        assert prefiller.server._hold_timers == {}


async def test_pd_hold_timeout_release_shows_in_kv_usage(http: aiohttp.ClientSession) -> None:
    async with in_process_engine(block_size=BLOCK, time_scale=10.0) as prefiller:
        prefiller.server.config.kv_hold_timeout = HOLD_S
        body = {"prompt": fresh_prompt(31, 100), "max_tokens": 1, "kv_transfer_params": REMOTE_DECODE}
        await complete(http, prefiller.url, **body)
        assert (await metrics(http, prefiller.url))["vllm:kv_cache_usage_perc"] > 0
        await wait_all_blocks_free(prefiller, deadline_s=HOLD_S + 3.0)
        assert (await metrics(http, prefiller.url))["vllm:kv_cache_usage_perc"] == 0


@pytest.mark.parametrize("shape", [{"stream": True}, {"n": 2}], ids=["stream", "n=2"])
async def test_pd_held_blocks_of_every_request_shape_are_freed(
    http: aiohttp.ClientSession, shape: dict[str, Any]
) -> None:
    async with in_process_engine(block_size=BLOCK, time_scale=10.0) as prefiller:
        prefiller.server.config.kv_hold_timeout = HOLD_S
        body = {
            "model": "tiny",
            "prompt": fresh_prompt(32, 100),
            "max_tokens": 1,
            "kv_transfer_params": REMOTE_DECODE,
            **shape,
        }
        async with http.post(f"{prefiller.url}/v1/completions", json=body) as r:
            assert r.status == 200
            await r.read()
        await wait_all_blocks_free(prefiller, deadline_s=HOLD_S + 1.0)


async def test_pd_decode_side_pull_frees_the_prefill_side_blocks(http: aiohttp.ClientSession) -> None:
    async with (
        in_process_engine(block_size=BLOCK, time_scale=10.0) as prefiller,
        in_process_engine(block_size=BLOCK, time_scale=10.0) as decoder,
    ):
        prompt = fresh_prompt(33, 100)
        r = await complete(http, prefiller.url, prompt=prompt, max_tokens=1, kv_transfer_params=REMOTE_DECODE)
        kvp = r["kv_transfer_params"]
        r = await complete(http, decoder.url, prompt=prompt, max_tokens=4, kv_transfer_params=kvp)
        assert r["usage"]["completion_tokens"] >= 1
        await wait_all_blocks_free(prefiller, deadline_s=1.0)


# -- scheduling under pressure -----------------------------------------------------------------------
async def test_preemption_is_counted_and_requests_still_complete(
    sim_factory: Callable[..., EngineProcess], http: aiohttp.ClientSession
) -> None:
    # 11 usable blocks of 16 tokens; each request needs 5 (16 prompt + 60 output tokens), six need 30.
    engine = sim_factory("--time-scale", "10", num_gpu_blocks=12)
    out_len = 60
    results = await asyncio.gather(
        *(
            complete(http, engine.url, prompt=fresh_prompt(20 + i, 16), max_tokens=out_len, ignore_eos=True)
            for i in range(6)
        )
    )
    for r in results:
        assert r["usage"]["completion_tokens"] == out_len
        assert r["choices"][0]["finish_reason"] == "length"
    m = await metrics(http, engine.url)
    assert m["vllm:num_preemptions_total"] > 0
    assert m["vllm:request_num_preemptions_sum"] == m["vllm:num_preemptions_total"]
    assert m["vllm:request_success_total{finished_reason=length}"] == 6
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0


@pytest.mark.slow
async def test_state_stays_bounded_over_2000_requests(http: aiohttp.ClientSession) -> None:
    num_blocks = 256  # small, so that the prefix cache is saturated during the first thousand already
    async with in_process_engine(time_scale=100.0, block_size=BLOCK, num_gpu_blocks=num_blocks) as running:
        engine, scheduler = running.engine, running.engine.scheduler
        counter = iter(range(2000))

        async def worker(count: int) -> None:
            for _ in range(count):
                i = next(counter)
                body = {"prompt": f"request {i} asks what the weather is like today", "max_tokens": 4}
                r = await complete(http, running.url, **body)
                assert r["usage"]["completion_tokens"] >= 1

        async def thousand() -> int:
            await asyncio.gather(*(worker(20) for _ in range(50)))
            gc.collect()
            return tracemalloc.get_traced_memory()[0]

        tracemalloc.start()
        try:
            first = await thousand()
            second = await thousand()
        finally:
            tracemalloc.stop()

        assert engine._streams == {}
        assert not scheduler.waiting and not scheduler.running and not scheduler._held
        assert engine.kv.num_free_blocks == num_blocks - 1
        assert running.server._hold_timers == {}
        m = await metrics(http, running.url)
        finished = sum(v for k, v in m.items() if k.startswith("vllm:request_success_total"))
        assert finished == 2000 and m["vllm:request_success_total{finished_reason=abort}"] == 0
        growth = second - first
        # Flat is ~20 KiB here; leaking only the finished SimRequest objects would add ~1 MiB per 1000.
        assert growth < 512 * 1024, f"traced memory grew by {growth / 1024:.0f} KiB over the second 1000"


async def test_200_concurrent_streams_complete(http: aiohttp.ClientSession) -> None:
    out_len = 16
    async with in_process_engine(time_scale=10.0, block_size=BLOCK) as running:

        async def stream(i: int) -> tuple[list[dict[str, Any]], bool]:
            body = {
                "model": "tiny",
                "prompt": f"stream number {i}",
                "max_tokens": out_len,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            chunks: list[dict[str, Any]] = []
            done = False
            async with http.post(f"{running.url}/v1/completions", json=body) as r:
                assert r.status == 200
                async for raw in r.content:
                    line = raw.strip()
                    if line == b"data: [DONE]":
                        done = True
                    elif line.startswith(b"data: "):
                        chunks.append(msgspec.json.decode(line[len(b"data: ") :]))
            return chunks, done

        results = await asyncio.gather(*(stream(i) for i in range(200)))
        for chunks, done in results:
            assert done
            *tokens, usage = chunks
            assert len(tokens) == out_len
            assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * (out_len - 1) + ["length"]
            assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == out_len
        assert running.engine._streams == {} and running.engine.num_unfinished == 0


# -- chat template -----------------------------------------------------------------------------------
CHATS: dict[str, list[dict[str, Any]]] = {
    "developer": [
        {"role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": "What is a cache?"},
    ],
    "content-parts": [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]},
    ],
    "developer-with-parts": [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Why"}, {"type": "text", "text": "is the sky blue?"}],
        },
    ],
}


@pytest.fixture(scope="module")
def tiny_sim(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    engine = start_sim(tmp_path_factory.mktemp("sim-chat"), model_dir=tiny_model_dir, replay=False)
    yield engine
    engine.stop()


@pytest.mark.parametrize("name", list(CHATS))
async def test_chat_prompt_tokens_match_tokenize(
    tiny_sim: EngineProcess, http: aiohttp.ClientSession, name: str
) -> None:
    messages = CHATS[name]
    r = await post(
        http, tiny_sim.url, "/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 3}
    )
    assert r["choices"][0]["message"]["role"] == "assistant"
    tok = await post(http, tiny_sim.url, "/tokenize", {"model": "tiny", "messages": messages})
    assert r["usage"]["prompt_tokens"] == tok["count"] == len(tok["tokens"])
    rendered = await post(http, tiny_sim.url, "/detokenize", {"model": "tiny", "tokens": tok["tokens"]})
    for m in messages:
        assert f"<|im_start|>{m['role']}\n" in rendered["prompt"]
    # Text parts are joined with a newline, as vLLM flattens them for a string-content template.
    flat = [
        {**m, "content": "\n".join(p["text"] for p in m["content"])} if isinstance(m["content"], list) else m
        for m in messages
    ]
    tok_flat = await post(http, tiny_sim.url, "/tokenize", {"model": "tiny", "messages": flat})
    assert tok_flat["tokens"] == tok["tokens"]
