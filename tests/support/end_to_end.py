"""What the router end-to-end tests share: a router in this event loop in front of engines once it knows
them (``routing_to``), ``kvstack sim`` subprocesses (stopped by process group) and in-process simulators,
completion bodies, an SSE reader, and the router's views of its engines. Waits are polls with a deadline."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import aiohttp

from kvstack.engines.state import Endpoint
from kvstack.engines.tokenizer import load_tokenizer
from kvstack.frontend.registry import EngineEntry
from kvstack.openai.sse import SSEParser
from kvstack.router.proxy import RetryPolicy
from kvstack.router.server import RouterOptions, RunningRouter, start_router
from kvstack.sim.cluster import RunningEngine, SimOptions, start_engine, stop_engine
from kvstack.sim.engine import EngineConfig
from kvstack.sim.textgen import OutputSampler
from support.engines import EngineProcess, start_sim
from support.waiting import eventually

MODEL = "tiny"  # served name of the vLLM fixture and of start_sim
SCRAPE_S = 0.2


async def get_text(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url) as r:
        assert r.status == 200, url
        return await r.text()


async def get_json(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as r:
        return await r.json()


async def engine_view(http: aiohttp.ClientSession, router: RunningRouter, url: str) -> dict[str, Any]:
    """The router's /engines entry of one engine."""
    engines = (await get_json(http, f"{router.url}/engines"))["engines"]
    return next(e for e in engines if e["url"] == url)


class EventReader:
    """Reads the SSE data payloads of one response."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self.resp = resp
        self.parser = SSEParser()
        self.events: list[bytes] = []

    async def at_least(self, n: int) -> list[bytes]:
        while len(self.events) < n:
            chunk = await self.resp.content.readany()
            assert chunk, f"stream ended after {len(self.events)} events"
            self.events += self.parser.feed(chunk)
        return self.events

    async def to_end(self) -> list[bytes]:
        async for chunk in self.resp.content.iter_any():
            self.events += self.parser.feed(chunk)
        assert not self.parser.has_partial, "stream ended inside an event"
        self.resp.release()
        return self.events


async def post_status(http: aiohttp.ClientSession, router: RunningRouter, body: dict[str, Any]) -> int:
    async with http.post(f"{router.url}/v1/completions", json=body) as r:
        await r.read()
        return r.status


def text_events(events: list[bytes]) -> list[dict[str, Any]]:
    """The chunks of a completions stream that carry a choice (not [DONE], usage-only or error)."""
    out = []
    for raw in events:
        if raw == b"[DONE]":
            continue
        obj = json.loads(raw)
        if obj.get("choices"):
            out.append(obj)
    return out


def completion(
    max_tokens: int, *, stream: bool = False, prompt: str = "hello", **extra: Any
) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


@asynccontextmanager
async def routing_to(urls: list[str], **options: Any) -> AsyncIterator[RunningRouter]:
    """A router in this event loop in front of ``urls``, once it knows every engine's models."""
    options.setdefault("scrape_interval", SCRAPE_S)
    options.setdefault("retry", RetryPolicy(max_attempts=3, backoff_base=0.01))
    router = await start_router(RouterOptions(port=0, engines=[Endpoint(u) for u in urls], **options))
    try:
        await eventually(
            lambda: _known(router, len(urls)),
            what="engines' models and metrics known",
            timeout_s=10,
            interval_s=0.05,
        )
        yield router
    finally:
        await router.stop()


async def _known(router: RunningRouter, count: int) -> bool:
    # An engine never scraped counts as saturated: waiting keeps the first decisions of a test plain.
    known = [e for e in router.app.registry if e.state.endpoint.models and not e.state.metrics_stale]
    return len(known) >= count


def entry(router: RunningRouter, url: str) -> EngineEntry:
    """The router's registry entry of one engine (its state and circuit breaker)."""
    found = router.app.registry.get(url)
    assert found is not None, f"the router does not know {url}"
    return found


def in_flight(router: RunningRouter) -> dict[str, int]:
    return {e.state.url: e.state.in_flight for e in router.app.registry}


async def start_sim_processes(workdir: Path, n: int, *args: str) -> list[EngineProcess]:
    """``n`` ``kvstack sim`` subprocesses (start_sim), started side by side."""
    extra = ["--no-kv-events", *args]
    return list(
        await asyncio.gather(
            *(
                asyncio.to_thread(start_sim, workdir / f"sim{i}", replay=False, extra_args=extra)
                for i in range(n)
            )
        )
    )


@contextmanager
def stopping(engines: list[EngineProcess]) -> Iterator[list[EngineProcess]]:
    try:
        yield engines
    finally:
        for engine in engines:
            engine.stop()


@asynccontextmanager
async def inprocess_sims(n: int, *, time_scale: float, **config: Any) -> AsyncIterator[list[RunningEngine]]:
    """``n`` simulated engines in this event loop (built-in tokenizer, no KV events)."""
    tokenizer = load_tokenizer(None)
    sampler = OutputSampler(tokenizer)
    engines: list[RunningEngine] = []
    try:
        for i in range(n):
            cfg = EngineConfig(model_name=MODEL, time_scale=time_scale, **config)
            opts = SimOptions(
                engine=cfg, served_model_names=[MODEL], model_root=MODEL, port=0, kv_events=False
            )
            engines.append(await start_engine(opts, tokenizer, sampler, i))
        yield engines
    finally:
        for engine in engines:
            if engine.runner.server is not None:  # not stopped by the test already
                await stop_engine(engine)


def patch_metrics(engine: RunningEngine, transform: Callable[[bytes], bytes]) -> None:
    """Make a simulator's /metrics answer ``transform(real dump)`` from now on."""
    metrics = engine.engine.metrics
    real = type(metrics).render
    metrics.render = lambda: transform(real(metrics))  # type: ignore[method-assign]  # this engine only


def with_queue(waiting: int) -> Callable[[bytes], bytes]:
    pattern = re.compile(rb"^(vllm:num_requests_waiting\{[^}]*\}) \S+$", re.M)
    return lambda text: pattern.sub(rb"\g<1> " + str(float(waiting)).encode(), text)
