"""`kvstack router --workers 2`: what one worker learns, the other knows — admin changes, circuit trips,
in-flight counts, /metrics — checked by asking both workers (the kernel picks one per connection)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from support.engines import EngineProcess, start_sim
from support.metrics import sample_sum
from support.ports import free_port
from support.processes import spawn, stop_group
from support.waiting import eventually

pytestmark = pytest.mark.slow  # a router with two worker processes per test

MODEL = "tiny"  # start_sim's served name


@dataclass
class Workers:
    url: str
    proc: subprocess.Popen[bytes]
    sim: EngineProcess

    async def each_worker(self, path: str, method: str = "GET") -> dict[int, Any]:
        """``path`` answered by every worker: new connections until both have answered."""
        seen: dict[int, Any] = {}
        async with asyncio.timeout(20):
            while len(seen) < 2:
                async with (
                    aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http,
                    http.request(method, f"{self.url}{path}") as r,
                ):
                    text = await r.text()
                    seen.setdefault(int(r.headers["x-kvstack-worker"]), text)
        return seen


async def _ready(url: str) -> bool:
    try:
        async with aiohttp.ClientSession() as http, http.get(f"{url}/ready") as r:
            return r.status == 200
    except aiohttp.ClientError:
        return False


@pytest.fixture
async def workers(tmp_path: Path) -> AsyncIterator[Workers]:
    # Slow tokens (time scale 0.2: ~40 ms each) so streams stay in flight while the test looks.
    sim = start_sim(tmp_path / "sim", extra_args=["--time-scale", "0.2"])
    port = free_port()
    proc = spawn(
        [sys.executable, "-m", "kvstack.cli", "router", "--port", str(port), "--engine", sim.url,
         "--workers", "2", "--routing", "round-robin", "--circuit-failures", "1",
         "--circuit-open-seconds", "60", "--log-level", "warning"],
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        await eventually(lambda: _ready(url), what=f"the router at {url} ready", timeout_s=30, interval_s=0.2)
        running = Workers(url, proc, sim)
        await running.each_worker("/health")  # both workers serve (and listen to each other)
        yield running
    finally:
        stop_group(proc)
        sim.stop()


def _engines(text: str) -> dict[str, dict[str, Any]]:
    return {e["url"]: e for e in json.loads(text)["engines"]}


async def test_admin_changes_reach_every_worker(workers: Workers) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{workers.url}/admin/engines/drain", json={"url": workers.sim.url}) as r:
            answer = await r.json()
        assert answer["applied_by_workers"] == 2 and answer["workers"] == 2
        extra = "http://127.0.0.1:9"  # an engine added at runtime (never reachable; only its presence counts)
        async with http.post(f"{workers.url}/admin/engines", json={"url": extra, "models": [MODEL]}) as r:
            assert (await r.json())["applied_by_workers"] == 2
    for text in (await workers.each_worker("/engines")).values():
        engines = _engines(text)
        assert engines[workers.sim.url]["draining"] is True
        assert extra in engines
    async with aiohttp.ClientSession() as http:
        async with http.delete(f"{workers.url}/admin/engines", params={"url": extra}) as r:
            assert (await r.json())["applied_by_workers"] == 2
        async with http.post(f"{workers.url}/admin/engines/undrain", json={"url": workers.sim.url}) as r:
            assert r.status == 200
    for text in (await workers.each_worker("/engines")).values():
        engines = _engines(text)
        assert engines[workers.sim.url]["draining"] is False and extra not in engines


async def test_a_circuit_trip_in_one_worker_opens_it_in_all(workers: Workers) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: connect errors
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{workers.url}/admin/engines", json={"url": dead, "models": [MODEL]}) as r:
            assert r.status == 200
        # Requests until one lands on the dead engine first (it is retried elsewhere and succeeds).
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1}

        async def tripped_somewhere() -> bool:
            async with http.post(f"{workers.url}/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
            views = await workers.each_worker("/engines")
            return any(_engines(t)[dead]["circuit"] == "open" for t in views.values())

        await eventually(tripped_somewhere, timeout_s=15, interval_s=0.1)
    views = await workers.each_worker("/engines")
    assert {_engines(t)[dead]["circuit"] for t in views.values()} == {"open"}
    # Its series (circuit state, upstream errors) go with it, from every worker's /metrics.
    assert all(f'engine="{dead}"' in text for text in (await workers.each_worker("/metrics")).values())
    async with (
        aiohttp.ClientSession() as http,
        http.delete(f"{workers.url}/admin/engines", params={"url": dead}) as r,
    ):
        assert (await r.json())["applied_by_workers"] == 2
    assert not any(dead in text for text in (await workers.each_worker("/metrics")).values())


async def test_in_flight_counts_are_shared(workers: Workers) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
    started = asyncio.Event()
    opened = 0

    async def stream() -> None:
        nonlocal opened
        async with (
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http,
            http.post(f"{workers.url}/v1/completions", json=body) as r,
        ):
            await r.content.readline()
            opened += 1
            if opened == 6:
                started.set()
            await r.read()

    tasks = [asyncio.create_task(stream()) for _ in range(6)]
    try:
        await asyncio.wait_for(started.wait(), 20)
        views = await workers.each_worker("/engines")
        for text in views.values():
            engine = _engines(text)[workers.sim.url]
            assert engine["in_flight"] == 6  # every worker sees the router's total
        assert sum(_engines(t)[workers.sim.url]["in_flight_this_worker"] for t in views.values()) <= 6
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_metrics_cover_every_worker(workers: Workers) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    for _ in range(30):
        async with (
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http,
            http.post(f"{workers.url}/v1/completions", json=body) as r,
        ):
            assert r.status == 200

    views = await workers.each_worker("/metrics")
    answered = {sample_sum(text, "kvstack_router_requests_total", status="200") for text in views.values()}
    assert answered == {30.0}
