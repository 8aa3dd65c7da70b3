"""Prefill/decode disaggregation in tests: a picker that disaggregates every request as told, and what the
simulated engines say about it (prompt tokens that arrived by KV transfer, requests they finished)."""

from __future__ import annotations

from dataclasses import dataclass, field

import aiohttp

from kvstack.engines.state import EngineState
from kvstack.frontend.routing import Decision, RouteRequest
from support.metrics import sample_sum

# Long enough that a decode engine pulling its KV is plainly not computing it (hundreds of tokens).
LONG_PROMPT = " ".join(f"word{i}" for i in range(400))


@dataclass
class FixedDecision:
    """A `Picker` answering every request with the same decode candidates and prefill engines."""

    candidates: list[str]
    prefill: list[str] = field(default_factory=list)
    profile: str = "decode"
    seen: list[RouteRequest] = field(default_factory=list)

    async def pick(self, route: RouteRequest, states: list[EngineState]) -> Decision:
        self.seen.append(route)
        return Decision(self.profile, list(self.candidates), list(self.prefill))

    def decide(self, route: RouteRequest, states: list[EngineState]) -> Decision | None:
        return None  # (every request through pick, so that ``seen`` holds each one once)


async def engine_page(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(f"{url}/metrics") as r:
        assert r.status == 200, await r.text()
        return await r.text()


async def transferred_tokens(http: aiohttp.ClientSession, url: str) -> float:
    """Prompt tokens engine ``url`` took from a prefill engine instead of computing them."""
    page = await engine_page(http, url)
    return sample_sum(page, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


async def computed_tokens(http: aiohttp.ClientSession, url: str) -> float:
    """Prompt tokens engine ``url`` computed itself."""
    page = await engine_page(http, url)
    return sample_sum(page, "vllm:prompt_tokens_by_source_total", source="local_compute")


async def finished(http: aiohttp.ClientSession, url: str) -> float:
    """Requests engine ``url`` finished (aborted ones are not counted, as in vLLM)."""
    return sample_sum(await engine_page(http, url), "vllm:request_success_total")
