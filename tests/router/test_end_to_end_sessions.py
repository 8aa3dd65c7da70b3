"""Session affinity through ``kvstack router`` processes with two workers: the session-header flag pins
each user to one engine in every worker; without it the header is no session key."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp

from support.end_to_end import SCRAPE_S, completion, get_json, inprocess_sims
from support.ports import free_port
from support.waiting import eventually


@asynccontextmanager
async def router_process(engines: list[str], *args: str, workers: int = 1) -> AsyncIterator[str]:
    """``kvstack router`` as a process in front of ``engines``; yields its URL once every worker has every
    engine's models and a fresh scrape. Its log goes to this test's captured stderr."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "kvstack.cli", "router", "--port", str(port), "--workers", str(workers),
        "--scrape-interval", str(SCRAPE_S), "--log-level", "warning",
        *(arg for url in engines for arg in ("--engine", url)), *args,
    ]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.DEVNULL, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    ready: set[int] = set()

    async def every_worker_ready() -> bool:
        # A new connection each time: the kernel hands it to either worker.
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
                body = await get_json(http, f"{url}/engines")
        except aiohttp.ClientError:
            return False
        views = body["engines"]
        if len(views) == len(engines) and all(
            v["routable"] and v["models"] and v["metrics"] and not v["metrics"]["stale"] for v in views
        ):
            ready.add(body.get("worker", {}).get("index", 0))
        return len(ready) == workers

    try:
        await eventually(every_worker_ready, what="every router worker knows every engine", timeout_s=30)
        yield url
    finally:
        if proc.returncode is None:
            proc.terminate()  # the supervisor of several workers stops them too
        try:
            await asyncio.wait_for(proc.wait(), 20)
        except TimeoutError:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()


USERS = [f"user-{i}" for i in range(12)]


async def engines_per_user(router: str, rounds: int = 3) -> tuple[dict[str, set[str]], set[str]]:
    """``rounds`` requests per user, each carrying ``x-user-id``: the engines that answered each user, and
    the router workers that handled them."""
    served: dict[str, set[str]] = {user: set() for user in USERS}
    workers: set[str] = set()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
        for turn in range(rounds):
            for user in USERS:
                body = completion(2, prompt=f"{user} turn {turn}")
                async with http.post(f"{router}/v1/completions", json=body, headers={"x-user-id": user}) as r:
                    assert r.status == 200, await r.text()
                    served[user].add(r.headers["x-kvstack-engine"])
                    workers.add(r.headers.get("x-kvstack-worker", "0"))
    return served, workers


async def test_session_header_flag_pins_each_user_to_one_engine() -> None:
    async with inprocess_sims(3, time_scale=50) as sims:
        engines = [s.url for s in sims]
        session = ["--routing", "session"]
        async with router_process(engines, *session, "--session-header", "x-user-id", workers=2) as router:
            served, workers = await engines_per_user(router)
            # Both workers took requests and both follow the flag (the hash ring is the same in each).
            assert workers == {"0", "1"}
            assert all(len(answered) == 1 for answered in served.values()), served
            assert len(set().union(*served.values())) > 1, (
                "the users' sessions should spread over the engines"
            )
            # Without the header, the body's user is still the key.
            async with aiohttp.ClientSession() as http:
                bob: set[str] = set()
                for turn in range(4):
                    body = completion(2, prompt=f"bob {turn}", user="bob")
                    async with http.post(f"{router}/v1/completions", json=body) as r:
                        assert r.status == 200
                        bob.add(r.headers["x-kvstack-engine"])
                assert len(bob) == 1
        async with router_process(engines, *session) as router:
            served, _ = await engines_per_user(router)
            # x-user-id is no session key by default: idle engines tie, and ties go to any of them.
            assert any(len(answered) > 1 for answered in served.values()), served
