"""Routers in the test's event loop in front of in-process simulated engines (``Stack``, ``start_sims``),
and a raw-HTTP fake engine for answers a simulator never gives (``fake_engine``)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvstack.engines.state import Endpoint
from kvstack.engines.tokenizer import load_tokenizer
from kvstack.router.proxy import Timeouts
from kvstack.router.server import RouterOptions, RunningRouter, start_router
from kvstack.sim.cluster import RunningEngine, SimOptions, start_engine
from kvstack.sim.engine import EngineConfig
from kvstack.sim.faults import FaultConfig
from kvstack.sim.textgen import OutputSampler
from support.metrics import sample_sum
from support.waiting import eventually

MODEL = "sim-model"  # what the simulated engines serve
FAST = Timeouts(connect=1.0, first_byte=10.0, idle=5.0, total=60.0)


@dataclass
class Stack:
    """Simulated engines behind a router, and a client session."""

    engines: list[RunningEngine]
    router: RunningRouter
    http: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return self.router.url

    async def engine_metric(self, i: int, name: str) -> float:
        async with self.http.get(f"{self.engines[i].url}/metrics") as r:
            text = await r.text()
        return sample_sum(text, name)


async def start_sims(
    n: int,
    *,
    time_scale: float = 20.0,
    faults: FaultConfig | None = None,
    kv_events: bool = False,
    **config: Any,
) -> list[RunningEngine]:
    """``n`` sims serving MODEL on free ports; ``kv_events``: each publishes them (and replays); ``config``:
    more `EngineConfig` fields (a latency model, a token budget per step, ...)."""
    tok = load_tokenizer(None)
    sampler = OutputSampler(tok)
    out = []
    for _ in range(n):
        cfg = EngineConfig(
            model_name=MODEL, time_scale=time_scale, block_size=16, num_gpu_blocks=4096, **config
        )
        opts = SimOptions(
            engine=cfg, served_model_names=[MODEL], model_root=MODEL, port=0, kv_events=kv_events,
            replay=kv_events, faults=faults or FaultConfig(),
        )  # fmt: skip
        out.append(await start_engine(opts, tok, sampler, 0))
    return out


async def wait_models(router: RunningRouter, count: int) -> None:
    """Until ``count`` engines have known models and fresh metrics (an engine never scraped counts as
    saturated, so a test starting earlier would see traffic avoid it)."""

    def ready() -> bool:
        known = [e for e in router.app.registry if e.state.endpoint.models and not e.state.metrics_stale]
        return len(known) >= count

    await eventually(ready, what=f"{count} engines' models and metrics known", timeout_s=10, interval_s=0.05)


async def set_faults(stack: Stack, i: int, **faults: object) -> None:
    """Engine ``i``'s fault injection (its /admin/faults)."""
    async with stack.http.post(f"{stack.engines[i].url}/admin/faults", json=faults) as r:
        assert r.status == 200


# A fake engine's answer to one POST: write to the client, return False to drop the connection after it.
Answer = Callable[[asyncio.StreamWriter], Awaitable[bool]]


@asynccontextmanager
async def fake_engine(answer: Answer) -> AsyncIterator[str]:
    """An engine that answers every POST with ``answer`` and every GET with 404 (no metrics, no models)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"content-length: *(\d+)", head, re.I)
                await reader.readexactly(int(length.group(1)) if length else 0)
                if head.startswith(b"GET"):
                    writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                elif not await answer(writer):
                    writer.transport.abort()
                    return
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()


async def router_for(*endpoints: Endpoint, **options: Any) -> RunningRouter:
    """A round-robin router to ``endpoints``; ``options`` go to `RouterOptions`."""
    opts = RouterOptions(port=0, engines=list(endpoints), routing="round-robin", **options)
    return await start_router(opts)


async def circuits(http: aiohttp.ClientSession, router: RunningRouter) -> dict[str, str]:
    async with http.get(f"{router.url}/engines") as r:
        return {e["url"]: e["circuit"] for e in (await r.json())["engines"]}


async def in_flight(http: aiohttp.ClientSession, router: RunningRouter) -> int:
    async with http.get(f"{router.url}/engines") as r:
        return sum(e["in_flight"] for e in (await r.json())["engines"])
