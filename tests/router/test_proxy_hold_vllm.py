"""Real vLLM killed under streaming load: its streams that had no content yet (queued behind a full KV cache:
vLLM had sent the 200 and headers) are finished by the other engine, unseen by the `openai` client; those
that had streamed content end with an error, never silently."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

import openai
from kvstack.router.server import RunningRouter
from support.end_to_end import in_flight, routing_to
from support.engines import EngineProcess, require_vllm, start_vllm
from support.metrics import counter_totals, sample_sum
from support.pd import FixedDecision
from support.processes import kill_group
from support.waiting import eventually

pytestmark = pytest.mark.vllm

MODEL = "tiny"  # start_vllm's served name
STREAMS = 8  # about 1,700 tokens each of 64 x 128 KV slots: four run, the others wait with headers sent
MAX_TOKENS = 400


@dataclass
class Seen:
    engine: str = ""
    content: bool = False
    finish: str | None = None
    error: Exception | None = None


@pytest.fixture(scope="module")
def victim(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """A real vLLM to be killed, configured like the session's ``vllm_engine``."""
    require_vllm()
    engine = start_vllm(tiny_model_dir, tmp_path_factory.mktemp("vllm-victim"))
    yield engine
    engine.stop()


async def stream(router: RunningRouter, seen: Seen) -> None:
    client = openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
    prompt = f"{uuid.uuid4().hex} " + "the quick brown fox jumps over the lazy dog " * 85
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=MAX_TOKENS,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        seen.engine = raw.headers["x-kvstack-engine"]
        async for chunk in raw.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                seen.content = True
            if chunk.choices and chunk.choices[0].finish_reason:
                seen.finish = chunk.choices[0].finish_reason
    except openai.APIError as exc:
        seen.error = exc
    finally:
        await client.close()


async def waiting(http: aiohttp.ClientSession, url: str, last: dict[str, float]) -> bool:
    async with http.get(f"{url}/metrics") as r:
        text = await r.text()
    for state in ("waiting", "running"):
        last[state] = sample_sum(text, f"vllm:num_requests_{state}")
    return last["waiting"] >= 1 and last["running"] >= 1


async def test_streams_without_content_on_a_killed_vllm_finish_on_the_other(
    victim: EngineProcess, vllm_engine: EngineProcess
) -> None:
    async with routing_to([victim.url, vllm_engine.url]) as router, aiohttp.ClientSession() as http:
        router.app.picker = FixedDecision([victim.url, vllm_engine.url])  # every stream to the victim first
        seen = [Seen() for _ in range(STREAMS)]
        tasks = [asyncio.create_task(stream(router, s)) for s in seen]
        last: dict[str, float] = {}
        try:
            await eventually(lambda: waiting(http, victim.url, last), what="streams queued", timeout_s=60)
        except AssertionError as exc:  # (what the router and the victim saw, for a failure's reader)
            raise AssertionError(
                f"{exc}; victim's last requests {last}, router {in_flight(router)}, {seen}"
            ) from None
        kill_group(victim.proc)
        await asyncio.wait_for(asyncio.gather(*tasks), 90)
        async with http.get(f"{router.url}/metrics") as r:
            retries = counter_totals(await r.text(), "kvstack_router_retries", "reason")

    for s in seen:  # a stream without content never fails; one with content fails loudly or finishes
        assert s.finish == "length" or (s.content and s.error is not None), s
    moved = [s for s in seen if s.engine == vllm_engine.url and s.finish == "length"]
    assert moved and retries.get(("broken_before_content",), 0) >= len(moved), (seen, retries)
