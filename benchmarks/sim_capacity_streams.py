"""One streaming completion, and one level of K concurrent streams per engine, against the modelled ITL.

``run_level`` releases every stream of a level at once and reports completed/failed streams, TTFT, the
inter-chunk gap (ITL) p50/p99 against ``modelled_itl`` at that batch size, tokens/s, the CPU of the
simulator and of this client, the machine's busy share, and the largest ``vllm:num_requests_running`` each
engine's own ``/metrics`` showed. A level *holds* when every stream completes and ITL p50 <= ``HOLD_RATIO``
x modelled.
"""

# kvstack ships no py.typed marker, so mypy run on this file alone would refuse its (typed) modules.
# mypy: disable-error-code="import-untyped"
from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
from machine_info import machine_cpu_ticks
from prometheus_client.parser import text_string_to_metric_families
from sim_capacity_process import (
    DECODE_BASE,
    DECODE_PER_SEQ,
    MAX_NUM_BATCHED_TOKENS,
    PREFILL_PER_TOKEN,
    STEP_OVERHEAD,
    SimProcess,
)

from kvstack.openai.sse import DONE_PAYLOAD, SSEParser

PROMPT_TOKENS = 64
MAX_TOKENS = 128
HOLD_RATIO = 1.25


METRICS_POLL_S = 1.0


# -- pure pieces --------------------------------------------------------------------------------------
def modelled_itl(batch: int) -> float:
    """Seconds between tokens of one sequence in a pure-decode batch of ``batch`` sequences."""
    return STEP_OVERHEAD + DECODE_BASE + DECODE_PER_SEQ * batch


def modelled_duration(batch: int) -> float:
    """Seconds the latency model needs to prefill and decode ``batch`` requests started together."""
    prefill_tokens = batch * PROMPT_TOKENS
    prefill_steps = -(-prefill_tokens // MAX_NUM_BATCHED_TOKENS)
    prefill = prefill_steps * STEP_OVERHEAD + prefill_tokens * PREFILL_PER_TOKEN
    return prefill + MAX_TOKENS * modelled_itl(batch)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0-100), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def prompt_ids(level: str, stream_index: int) -> list[int]:
    """A 64-token prompt (byte ids 3-258) unique to this level and stream.

    Unique across levels too: the simulator keeps earlier levels' prompts in its prefix cache, and a hit
    would shorten prefill and TTFT.
    """
    rng = random.Random(f"{level}/{stream_index}")
    return [rng.randrange(3, 259) for _ in range(PROMPT_TOKENS)]


def metric_value(text: str, name: str) -> float | None:
    """The first sample of ``name`` in a Prometheus text page (gauges carry no suffix)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    return None


# -- wire types (only the fields the benchmark reads; msgspec skips the rest) ---------------------------
class _Choice(msgspec.Struct):
    index: int = 0
    text: str = ""
    finish_reason: str | None = None


class _Usage(msgspec.Struct):
    completion_tokens: int = 0


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: dict[str, Any] | None = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


# -- one stream --------------------------------------------------------------------------------------
@dataclass
class StreamResult:
    ok: bool = False
    error: str | None = None
    chunks: int = 0
    completion_tokens: int = 0
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    end: float = 0.0

    @property
    def tpot(self) -> float | None:
        """Mean seconds per token after the first: immune to several chunks arriving in one read."""
        if self.chunks < 2 or not self.gaps:
            return None
        return sum(self.gaps) / len(self.gaps)


async def run_stream(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt: list[int],
    gate: asyncio.Event,
    client_timeout: aiohttp.ClientTimeout,
) -> StreamResult:
    """One streaming completion; chunk times are taken when their bytes are read."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res = StreamResult()
    await gate.wait()
    t0 = time.perf_counter()
    last: float | None = None
    done = False
    try:
        async with session.post(f"{url}/v1/completions", json=body, timeout=client_timeout) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            parser = SSEParser()
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                for payload in parser.feed(data):
                    if payload == DONE_PAYLOAD:
                        done = True
                        continue
                    chunk = _decode_chunk(payload)
                    if chunk.error is not None:
                        res.error = f"in-stream error: {chunk.error}"
                    if chunk.usage is not None:
                        res.completion_tokens = chunk.usage.completion_tokens
                    if not chunk.choices:
                        continue  # the usage chunk is not a token
                    res.chunks += 1
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.gaps.append(now - last)
                    last = now
    except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    res.end = time.perf_counter()
    if res.error is None and not done:
        res.error = "stream ended without [DONE]"
    if res.error is None and res.chunks != MAX_TOKENS:
        res.error = f"{res.chunks} token chunks, expected {MAX_TOKENS}"
    res.ok = res.error is None
    return res


# -- one level ---------------------------------------------------------------------------------------
@dataclass
class LevelResult:
    scenario: str
    engines: int
    streams: int
    batch_per_engine: int
    completed: int
    failed: int
    errors: list[str]
    wall_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    tpot_mean_ms: float | None
    modelled_itl_ms: float
    itl_p50_ratio: float | None
    tpot_ratio: float | None
    tokens_per_s: float
    sim_cpu_pct: float
    client_cpu_pct: float
    # Busy share of all cores during the level (100 = every core busy), other processes included.
    machine_busy_pct: float
    max_running_per_engine: list[int]
    holds: bool


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 2)


async def _poll_running(
    session: aiohttp.ClientSession, urls: list[str], seen: list[int], stop: asyncio.Event
) -> None:
    """Largest ``vllm:num_requests_running`` each engine's own /metrics showed while the level ran."""
    timeout = aiohttp.ClientTimeout(total=5)

    async def one(i: int, url: str) -> None:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.get(f"{url}/metrics", timeout=timeout) as r:
                value = metric_value(await r.text(), "vllm:num_requests_running")
                if value is not None:
                    seen[i] = max(seen[i], int(value))

    while not stop.is_set():
        await asyncio.gather(*(one(i, u) for i, u in enumerate(urls)))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), METRICS_POLL_S)


async def _wait_idle(session: aiohttp.ClientSession, urls: list[str], budget_s: float) -> None:
    """Wait until no engine has running or waiting requests (aborted streams of a failed level drain)."""
    deadline = time.monotonic() + budget_s
    timeout = aiohttp.ClientTimeout(total=5)
    while time.monotonic() < deadline:
        busy = 0.0
        for url in urls:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(f"{url}/metrics", timeout=timeout) as r:
                    text = await r.text()
                    busy += metric_value(text, "vllm:num_requests_running") or 0.0
                    busy += metric_value(text, "vllm:num_requests_waiting") or 0.0
        if busy == 0:
            return
        await asyncio.sleep(0.5)


async def run_level(
    session: aiohttp.ClientSession,
    sim: SimProcess,
    model: str,
    scenario: str,
    per_engine: int,
    time_left: float,
) -> LevelResult:
    """``per_engine`` streams on every engine of ``sim``, all released at once."""
    urls = [e.url for e in sim.engines]
    total = per_engine * len(urls)
    # Generous, yet bounded by what is left of the run's deadline.
    limit = min(max(20.0, 3.0 * modelled_duration(per_engine) + 5.0), time_left)
    timeout = aiohttp.ClientTimeout(total=limit, sock_connect=10, sock_read=min(30.0, limit))
    gate = asyncio.Event()
    tasks = [
        asyncio.create_task(
            run_stream(
                session, urls[i % len(urls)], model, prompt_ids(f"{scenario}/{total}", i), gate, timeout
            ),
            name=f"stream-{i}",
        )
        for i in range(total)
    ]
    seen = [0] * len(urls)
    stop_poll = asyncio.Event()
    await asyncio.sleep(0)  # let every stream reach the gate
    sim_cpu0, client_cpu0, t0 = sim.cpu_seconds(), time.process_time(), time.perf_counter()
    busy0, all0 = machine_cpu_ticks()
    gate.set()
    poller = asyncio.create_task(_poll_running(session, urls, seen, stop_poll))
    results = await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    sim_cpu, client_cpu = sim.cpu_seconds() - sim_cpu0, time.process_time() - client_cpu0
    busy1, all1 = machine_cpu_ticks()
    stop_poll.set()
    await poller

    ok = [r for r in results if r.ok]
    gaps = [g for r in ok for g in r.gaps]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [t for r in ok if (t := r.tpot) is not None]
    tokens = sum(r.chunks for r in results)
    errors = sorted({r.error for r in results if r.error})
    modelled = modelled_itl(per_engine)
    p50 = percentile(gaps, 50)
    tpot = statistics.fmean(tpots) if tpots else None
    ratio = None if p50 is None else p50 / modelled
    holds = len(ok) == total and ratio is not None and ratio <= HOLD_RATIO
    await _wait_idle(session, urls, budget_s=min(15.0, max(0.0, time_left - limit)))
    return LevelResult(
        scenario=scenario,
        engines=len(urls),
        streams=total,
        batch_per_engine=per_engine,
        completed=len(ok),
        failed=total - len(ok),
        errors=errors[:5],
        wall_s=round(wall, 2),
        ttft_p50_ms=_ms(percentile(ttfts, 50)),
        ttft_p99_ms=_ms(percentile(ttfts, 99)),
        itl_p50_ms=_ms(p50),
        itl_p99_ms=_ms(percentile(gaps, 99)),
        tpot_mean_ms=_ms(tpot),
        modelled_itl_ms=round(modelled * 1000, 2),
        itl_p50_ratio=None if ratio is None else round(ratio, 3),
        tpot_ratio=None if tpot is None else round(tpot / modelled, 3),
        tokens_per_s=round(tokens / wall, 1) if wall > 0 else 0.0,
        sim_cpu_pct=round(100 * sim_cpu / wall, 1) if wall > 0 else 0.0,
        client_cpu_pct=round(100 * client_cpu / wall, 1) if wall > 0 else 0.0,
        machine_busy_pct=round(100 * (busy1 - busy0) / (all1 - all0), 1) if all1 > all0 else 0.0,
        max_running_per_engine=seen,
        holds=holds,
    )
