"""A steady trickle of requests through a front end, recording which engine answered each and when, for
tests of engines leaving, restarting and joining under load; ``healthy_at``: when an engine first answers
/health."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

ENGINE_HEADER = "x-kvstack-engine"


@dataclass(frozen=True, slots=True)
class Sent:
    started: float  # time.monotonic() when the request was sent
    status: int  # HTTP status, 0 when the connection failed
    engine: str  # the engine that answered (the router's header), "" when none


@dataclass
class Trickle:
    """``concurrency`` loops, each posting ``body(n)`` to ``url + path`` every ``every_s`` seconds."""

    http: aiohttp.ClientSession
    url: str
    body: Callable[[int], dict[str, Any]]
    path: str = "/v1/completions"
    every_s: float = 0.05
    concurrency: int = 2
    sent: list[Sent] = field(default_factory=list)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _numbers: itertools.count[int] = field(default_factory=itertools.count)

    async def __aenter__(self) -> Trickle:
        self._tasks = [asyncio.create_task(self._loop()) for _ in range(self.concurrency)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def to(self, engine: str, since: float = 0.0) -> list[Sent]:
        """Requests ``engine`` answered that were sent at or after ``since``."""
        return [s for s in self.sent if s.engine == engine and s.started >= since]

    def statuses(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for s in self.sent:
            out[s.status] = out.get(s.status, 0) + 1
        return out

    async def _loop(self) -> None:
        while True:
            started = time.monotonic()
            try:
                async with self.http.post(f"{self.url}{self.path}", json=self.body(next(self._numbers))) as r:
                    await r.read()
                    self.sent.append(Sent(started, r.status, r.headers.get(ENGINE_HEADER, "")))
            except aiohttp.ClientError:
                self.sent.append(Sent(started, 0, ""))
            await asyncio.sleep(max(0.0, self.every_s - (time.monotonic() - started)))


async def healthy_at(http: aiohttp.ClientSession, url: str, timeout_s: float = 60.0) -> float:
    """Poll ``url``/health every 10 ms; the monotonic time it first answers 200."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            async with http.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=1)) as r:
                if r.status == 200:
                    return time.monotonic()
        except (aiohttp.ClientError, TimeoutError):
            pass
        await asyncio.sleep(0.01)
    raise AssertionError(f"{url} not healthy after {timeout_s} s")
