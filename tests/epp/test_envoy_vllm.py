"""Real vLLM behind real Envoy and kvstack's endpoint picker: the openai client streaming and not, the
picker following vLLM's KV events, a repeated prompt served from vLLM's prefix cache."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator

import pytest

import openai
from kvstack.epp.envoy_config import EnvoyOptions, bootstrap
from support.end_to_end import MODEL
from support.engines import EngineProcess
from support.envoy import EnvoyProcess, require_envoy, start_envoy
from support.metrics import sample_sum
from support.pickers import PickerProcess, picker_engines, start_picker_process
from support.ports import free_port
from support.waiting import eventually

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def envoy_over_vllm(
    vllm_engine: EngineProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, PickerProcess]]:
    require_envoy()
    workdir = tmp_path_factory.mktemp("envoy-vllm")
    spec = f"{vllm_engine.url}#kv-events={vllm_engine.events_endpoint}"
    picker = start_picker_process(workdir, [spec], deadline_s=60)
    envoy: EnvoyProcess | None = None
    try:
        port = free_port()
        options = EnvoyOptions(
            pickers=(picker.grpc_address,),
            engines=(vllm_engine.url.removeprefix("http://"),),
            listen_host="127.0.0.1",
            listen_port=port,
            admin_port=free_port(),
            message_timeout_s=5.0,
        )
        envoy = start_envoy(bootstrap(options.validate()), workdir)
        yield f"http://127.0.0.1:{port}", picker
    finally:
        if envoy is not None:
            envoy.stop()
        picker.stop()


def _vllm_metric(engine: EngineProcess, name: str) -> float:
    with urllib.request.urlopen(f"{engine.url}/metrics", timeout=5) as r:
        return sample_sum(r.read().decode(), name)


async def test_openai_client_through_envoy_to_vllm(envoy_over_vllm: tuple[str, PickerProcess]) -> None:
    url, picker = envoy_over_vllm
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    # ignore_eos: every asked token, whatever the random weights sample
    answer = await client.completions.create(
        model=MODEL, prompt="The capital of", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert answer.usage is not None and answer.usage.completion_tokens == 5
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say something"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    finish, usage = None, None
    async for chunk in stream:
        if chunk.choices:
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    assert finish == "length" and usage is not None and usage.completion_tokens == 8
    await client.close()
    # The picker saw both requests end: nothing is left in flight on the engine.
    views = await asyncio.to_thread(picker_engines, picker)
    assert [v["in_flight"] for v in views.values()] == [0]


async def test_the_picker_follows_vllm_kv_events_and_repeats_hit_the_prefix_cache(
    envoy_over_vllm: tuple[str, PickerProcess], vllm_engine: EngineProcess
) -> None:
    url, picker = envoy_over_vllm

    def subscribed() -> bool:
        view = picker_engines(picker)[vllm_engine.url]
        return view["routing_knowledge"] == "kv-events" and bool(view["kv_events"]["connected"])

    await eventually(subscribed, what="the picker subscribed to vLLM's KV events", timeout_s=60)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    prompt = "repeat after me: " + " ".join(f"word{i}" for i in range(200))
    first = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert first.usage is not None
    before = await asyncio.to_thread(_vllm_metric, vllm_engine, "vllm:prefix_cache_hits_total")
    await client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    hits = await asyncio.to_thread(_vllm_metric, vllm_engine, "vllm:prefix_cache_hits_total") - before
    block = vllm_engine.block_size
    assert hits >= (first.usage.prompt_tokens - 1) // block * block > 0
    await client.close()

    def events_seen() -> bool:
        return picker_engines(picker)[vllm_engine.url]["kv_events"]["batches"] > 0

    await eventually(events_seen, what="vLLM's BlockStored events reached the picker", timeout_s=30)
