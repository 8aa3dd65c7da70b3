"""The chaos benchmark's load: users streaming chat through a router with the official ``openai`` client.

Each user sends one streamed chat request after another, pausing ``think_s`` on average between them
(``max_retries=0``: the client never retries, so what a router does not absorb shows). Prompts are unique
per request (no prefix stickiness: a rejoined engine gets work as soon as its router sends it some). Every
request ends as exactly one of ``OUTCOMES``:

- ``ok``: a ``finish_reason`` arrived and the stream ended cleanly;
- ``failed_before_token``: an error (HTTP status, SSE error event, reset) before any content token;
- ``broken_mid_stream``: an error after some content;
- ``truncated``: the stream ended without a ``finish_reason`` and without an error;
- ``hung``: no end within the per-request deadline (the client gives up).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import openai

OUTCOMES = ("ok", "failed_before_token", "broken_mid_stream", "truncated", "hung")
WORDS = [
    "amber",
    "basil",
    "cedar",
    "delta",
    "ember",
    "fjord",
    "grove",
    "harbor",
    "iris",
    "juniper",
    "kelp",
    "lumen",
    "maple",
    "nectar",
    "onyx",
]
ENGINE_HEADER = "x-kvstack-engine"  # kvstack's served-engine header (the peers send none)


@dataclass
class Request:
    user: int
    started: float  # monotonic
    outcome: str
    chunks: int  # content chunks received
    ttft_s: float | None
    e2e_s: float
    engine: str | None
    error: str | None = None


@dataclass
class Load:
    """Users streaming chat at ``url`` until ``stop()``; what each request ended as."""

    url: str
    model: str
    users: int = 6
    max_tokens: int = 24
    deadline_s: float = 30.0
    think_s: float = 0.5  # mean pause between a user's requests (uniform in [0.5, 1.5] x think_s)
    seed: int = 0
    requests: list[Request] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _client: openai.AsyncOpenAI | None = None

    def start(self) -> None:
        client = openai.AsyncOpenAI(
            base_url=f"{self.url}/v1",
            api_key="chaos",
            max_retries=0,
            timeout=openai.Timeout(self.deadline_s + 5.0, connect=5.0),  # the deadline below ends first
        )
        self._client = client
        self._tasks = [asyncio.create_task(self._user(client, u)) for u in range(self.users)]

    async def stop(self) -> None:
        """Let every request in flight end (each within its deadline), then stop the users."""
        self._stop.set()
        await asyncio.gather(*self._tasks)
        if self._client is not None:
            await self._client.close()

    def since(self, t0: float) -> list[Request]:
        return [r for r in self.requests if r.started >= t0]

    async def _user(self, client: openai.AsyncOpenAI, user: int) -> None:
        rng = random.Random(self.seed * 1000 + user)
        while not self._stop.is_set():
            words = " ".join(rng.choice(WORDS) for _ in range(40))
            self.requests.append(await self._one(client, user, f"user {user}, {rng.random()}: {words}"))
            await asyncio.sleep(self.think_s * rng.uniform(0.5, 1.5))

    async def _one(self, client: openai.AsyncOpenAI, user: int, prompt: str) -> Request:
        t0 = time.monotonic()
        chunks, finished, ttft, engine = 0, False, None, None
        outcome, error = "ok", None
        try:
            async with asyncio.timeout(self.deadline_s):
                async with client.chat.completions.with_streaming_response.create(
                    model=self.model,
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=self.max_tokens,
                    stream=True,
                    extra_body={"ignore_eos": True},
                ) as response:
                    engine = response.headers.get(ENGINE_HEADER)
                    async for chunk in await response.parse():
                        for choice in chunk.choices:
                            if choice.delta.content:
                                chunks += 1
                                ttft = ttft if ttft is not None else time.monotonic() - t0
                            finished = finished or choice.finish_reason is not None
            if not finished:
                outcome = "truncated"
        except (TimeoutError, openai.APITimeoutError):
            outcome, error = "hung", f"no end within {self.deadline_s:g}s"
        except Exception as exc:  # whatever the SDK or its HTTP library raises is what the user sees
            outcome = "broken_mid_stream" if chunks else "failed_before_token"
            error = f"{type(exc).__name__}: {str(exc)[:160]}"
        return Request(user, t0, outcome, chunks, ttft, time.monotonic() - t0, engine, error)


def tally(requests: list[Request]) -> dict[str, Any]:
    """Counts per outcome, ratios of the total, TTFT p50/p99 of the ok requests, the first errors seen."""
    counts = Counter(r.outcome for r in requests)
    total = len(requests)
    ttfts = sorted(r.ttft_s for r in requests if r.outcome == "ok" and r.ttft_s is not None)

    def pct(q: float) -> float | None:
        return round(ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))], 3) if ttfts else None

    errors = Counter(r.error for r in requests if r.error)
    return {
        "requests": total,
        **{o: counts.get(o, 0) for o in OUTCOMES},
        "ok_ratio": round(counts.get("ok", 0) / total, 4) if total else None,
        "ttft_p50_s": pct(0.5),
        "ttft_p99_s": pct(0.99),
        "errors": [{"error": e, "count": n} for e, n in errors.most_common(5)],
    }
