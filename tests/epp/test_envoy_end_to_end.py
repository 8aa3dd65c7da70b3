"""kvstack's picker behind real Envoy, over simulated engine processes that publish KV events: the official
openai client streaming and not, prefix-aware picks seen as engine-side prefix hits, an engine killed, the
picker killed (fail closed and fail open) and restarted (it resyncs from the engines' KV events)."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

import openai
from kvstack.epp.envoy_config import EnvoyOptions, bootstrap
from support.engines import EngineProcess, start_sim
from support.envoy import EnvoyProcess, require_envoy, start_envoy
from support.metrics import sample_sum
from support.pickers import PickerProcess, picker_engines, start_picker_process
from support.ports import free_port
from support.processes import kill_group
from support.waiting import eventually

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

MODEL = "tiny"


def _prompt(topic: int) -> str:
    """Several hundred tokens, distinct per topic from the first block on."""
    return f"topic {topic}: " + " ".join(f"item{topic}x{i} detail{i % 13}" for i in range(40))


@dataclass
class EnvoyStack:
    engines: list[EngineProcess]
    picker: PickerProcess
    envoy: EnvoyProcess
    workdir: Path
    envoy_url: str

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.envoy_url}/v1", api_key="unused", max_retries=0, timeout=30
        )

    def restart_picker(self) -> None:
        """Start the picker again on the same ports (after it was killed)."""
        grpc_port = int(self.picker.grpc_address.rsplit(":", 1)[1])
        http_port = int(self.picker.http_url.rsplit(":", 1)[1])
        self.picker = start_picker_process(
            self.workdir, [e.url for e in self.engines], grpc_port=grpc_port, http_port=http_port
        )


def _engine_metric(engine: EngineProcess, name: str) -> float:
    with urllib.request.urlopen(f"{engine.url}/metrics", timeout=5) as r:
        return sample_sum(r.read().decode(), name)


def _prefix_hits(engines: list[EngineProcess]) -> float:
    return sum(_engine_metric(e, "vllm:prefix_cache_hits_total") for e in engines)


def _served(engines: list[EngineProcess]) -> list[float]:
    return [_engine_metric(e, "vllm:request_success_total") for e in engines]


@contextmanager
def _stack(tmp_path: Path, *, fail_open: bool = False) -> Iterator[EnvoyStack]:
    require_envoy()
    engines: list[EngineProcess] = []
    picker: PickerProcess | None = None
    envoy: EnvoyProcess | None = None
    try:
        engines = [start_sim(tmp_path / f"sim{i}", block_size=16, num_gpu_blocks=2048) for i in range(2)]
        picker = start_picker_process(tmp_path, [e.url for e in engines])
        port = free_port()
        options = EnvoyOptions(
            pickers=(picker.grpc_address,),
            engines=tuple(e.url.removeprefix("http://") for e in engines),
            listen_host="127.0.0.1",
            listen_port=port,
            admin_port=free_port(),
            fail_open=fail_open,
        )
        envoy = start_envoy(bootstrap(options.validate()), tmp_path)
        stack = EnvoyStack(engines, picker, envoy, tmp_path, envoy_url=f"http://127.0.0.1:{port}")
        yield stack
        picker = stack.picker
    finally:
        if envoy is not None:
            envoy.stop()
        if picker is not None:
            picker.stop()
        for e in engines:
            e.stop()


@pytest.fixture
def envoy_stack(tmp_path: Path) -> Iterator[EnvoyStack]:
    with _stack(tmp_path) as stack:
        yield stack


async def _kv_events_known(stack: EnvoyStack) -> None:
    def known() -> bool:
        views = picker_engines(stack.picker).values()
        return all(v["routing_knowledge"] == "kv-events" and v["kv_events"] for v in views)

    await eventually(known, what="the picker subscribed to every engine's KV events", timeout_s=30)


async def _complete(client: openai.AsyncOpenAI, prompt: str) -> int:
    answer = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert answer.usage is not None
    return answer.usage.prompt_tokens


async def test_openai_client_through_envoy_streaming_and_not(envoy_stack: EnvoyStack) -> None:
    client = envoy_stack.client()
    # ignore_eos: every asked token, whatever the engine samples
    answer = await client.completions.create(
        model=MODEL, prompt="hello there", max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert answer.choices[0].text and answer.usage is not None and answer.usage.completion_tokens == 4
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    finish = None
    text = ""
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert text and finish == "length"
    with pytest.raises(openai.NotFoundError) as caught:
        await client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert "no-such-model" in str(caught.value)  # the picker's 404, as OpenAI error JSON through Envoy
    await client.close()


async def test_prefix_aware_picks_show_as_engine_prefix_hits(envoy_stack: EnvoyStack) -> None:
    await _kv_events_known(envoy_stack)
    client = envoy_stack.client()
    prompts = [_prompt(t) for t in range(6)]
    for p in prompts:
        await _complete(client, p)
    await asyncio.sleep(0.5)  # the engines' BlockStored events reach the picker
    before = _prefix_hits(envoy_stack.engines)
    cacheable = 0
    for _ in range(2):
        for p in prompts:
            tokens = await _complete(client, p)
            cacheable += (tokens - 1) // 16 * 16  # whole blocks, the last token always computed
    hits = _prefix_hits(envoy_stack.engines) - before
    # Each repeat went where its prompt's blocks are (round-robin over two engines would hit about half).
    assert hits >= 0.95 * cacheable, (hits, cacheable)
    await client.close()


async def test_a_killed_engine_gets_no_more_requests(envoy_stack: EnvoyStack) -> None:
    client = envoy_stack.client()
    for t in range(4):
        await _complete(client, _prompt(100 + t))
    dead, alive = envoy_stack.engines
    kill_group(dead.proc)
    served_before = _engine_metric(alive, "vllm:request_success_total")
    started = time.monotonic()
    for t in range(10):  # no request fails: Envoy retries the picker's fallback, the picker learns
        await _complete(client, _prompt(200 + t))
    assert _engine_metric(alive, "vllm:request_success_total") - served_before == 10
    await eventually(
        lambda: not picker_engines(envoy_stack.picker)[dead.url]["routable"],
        what="the picker marks the killed engine unroutable",
        timeout_s=15,
    )
    assert time.monotonic() - started < 60
    await client.close()


async def test_picker_killed_fails_closed_with_503_then_recovers(envoy_stack: EnvoyStack) -> None:
    client = envoy_stack.client()
    await _complete(client, "warm up")
    envoy_stack.picker.kill()
    with pytest.raises(openai.APIStatusError) as caught:
        await client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert caught.value.status_code == 503
    envoy_stack.restart_picker()

    async def serves() -> bool:
        try:
            await _complete(client, "back again")
        except openai.APIStatusError:
            return False
        return True

    await eventually(serves, what="requests served once the picker is back", timeout_s=30)
    await client.close()


async def test_picker_killed_fail_open_requests_go_on(tmp_path: Path) -> None:
    with _stack(tmp_path, fail_open=True) as stack:
        client = stack.client()
        await _complete(client, "warm up")
        stack.picker.kill()
        for t in range(5):
            await _complete(client, f"without a picker {t}")
        await client.close()


async def test_a_restarted_picker_resyncs_from_kv_events(envoy_stack: EnvoyStack) -> None:
    await _kv_events_known(envoy_stack)
    client = envoy_stack.client()
    prompts = [_prompt(300 + t) for t in range(4)]
    for p in prompts:
        await _complete(client, p)

    def index_entries() -> float:
        with urllib.request.urlopen(f"{envoy_stack.picker.http_url}/metrics", timeout=5) as r:
            return sample_sum(r.read().decode(), "kvstack_prefix_index_entries")

    await eventually(lambda: index_entries() > 0, what="the picker indexed the prompts", timeout_s=30)
    await asyncio.sleep(0.5)  # the last answers' BlockStored events
    known = index_entries()
    envoy_stack.picker.kill()
    envoy_stack.restart_picker()
    await _kv_events_known(envoy_stack)
    # No request since the restart: what the new picker knows comes from the engines' buffered events.
    await eventually(
        lambda: index_entries() >= known, what="the new picker's index refilled from the replay", timeout_s=30
    )
    before = _prefix_hits(envoy_stack.engines)
    cacheable = 0
    for p in prompts:
        tokens = await _complete(client, p)
        cacheable += (tokens - 1) // 16 * 16
    assert _prefix_hits(envoy_stack.engines) - before >= 0.95 * cacheable
    await client.close()
