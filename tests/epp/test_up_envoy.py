"""``kvstack up --front-end envoy``: the local stack with real Envoy on --port and kvstack's picker; with
prefill and decode engines, a sidecar in front of each decode engine sends the prefill."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

import openai
from support.engines import fresh_prompt
from support.envoy import require_envoy
from support.metrics import metrics
from support.ports import free_ports
from support.processes import group_alive, kill_group, spawn, wait_for_banner
from support.waiting import eventually

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

MODEL = "up-model"


async def test_up_with_envoy_serves_openai_through_envoy_and_stops_cleanly(tmp_path: Path) -> None:
    require_envoy()
    ports = free_ports(4)
    log_path = tmp_path / "up.log"
    cmd = [
        sys.executable, "-m", "kvstack.cli", "up", "--front-end", "envoy", "--engines", "2",
        "--port", str(ports.start), "--time-scale", "20", "--served-model-name", MODEL, "--no-cache-server",
    ]  # fmt: skip
    proc = spawn(cmd, log_path)
    try:
        banner = await asyncio.to_thread(wait_for_banner, log_path, proc)
        assert f"envoy:    http://127.0.0.1:{ports.start}" in banner
        picker_http = re.search(r"picker:   grpc://\S+\s+(http://\S+)", banner)
        assert picker_http is not None, banner
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{ports.start}/v1", api_key="x", max_retries=0)
        answer = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=3,
            extra_body={"ignore_eos": True},
        )
        assert answer.choices[0].message.content
        stream = await client.completions.create(
            model=MODEL, prompt="once upon", max_tokens=4, stream=True, extra_body={"ignore_eos": True}
        )
        texts = [c.choices[0].text async for c in stream if c.choices]
        assert "".join(texts)
        await client.close()
        async with aiohttp.ClientSession() as http, http.get(f"{picker_http.group(1)}/metrics") as r:
            assert 'status="200"' in await r.text()  # the picker made these decisions
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log_path.read_text(errors="replace")
        await eventually(lambda: not group_alive(proc), what="Envoy and the engines stopped with kvstack up")
    finally:
        if group_alive(proc):
            kill_group(proc)


async def test_up_with_envoy_and_pd_engines_prefills_long_prompts_through_the_sidecars(
    tmp_path: Path,
) -> None:
    require_envoy()
    ports = free_ports(4)
    log_path = tmp_path / "up.log"
    cmd = [
        sys.executable, "-m", "kvstack.cli", "up", "--front-end", "envoy", "--prefill-engines", "1",
        "--decode-engines", "2", "--port", str(ports.start), "--time-scale", "20",
        "--served-model-name", MODEL, "--no-cache-server",
    ]  # fmt: skip
    proc = spawn(cmd, log_path)
    url = f"http://127.0.0.1:{ports.start}"
    decoders = [f"http://127.0.0.1:{ports.start + i}" for i in (2, 3)]  # after the prefill engine
    try:
        banner = await asyncio.to_thread(wait_for_banner, log_path, proc)
        sidecars = dict(re.findall(r"sidecar:  (http://\S+)  \(P/D, for engine (http://\S+)\)", banner))
        assert sorted(sidecars.values()) == decoders, banner
        picker_http = re.search(r"picker:   grpc://\S+\s+(http://\S+)", banner)
        assert picker_http is not None, banner

        async with aiohttp.ClientSession() as http:

            async def ready() -> bool:
                assert proc.poll() is None, log_path.read_text(errors="replace")
                async with http.get(f"{picker_http.group(1)}/ready") as r:
                    return r.status == 200

            await eventually(ready, timeout_s=60, interval_s=0.05)
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            answer = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Hello"}],
                max_tokens=3,
                extra_body={"ignore_eos": True},
            )
            assert answer.choices[0].message.content
            await client.close()

            prefilled = "kvstack_pd_prefills_total{outcome=ok}"  # samples() leaves the engine label out
            transferred = "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"

            async def totals(key: str, urls: list[str]) -> list[float]:
                return [(await metrics(http, u)).get(key, 0.0) for u in urls]

            before = await totals(prefilled, list(sidecars))
            async with http.post(
                f"{url}/v1/completions",
                json={"model": MODEL, "prompt": fresh_prompt(41, 40), "max_tokens": 2},
            ) as r:
                assert r.status == 200, await r.text()
            short = await totals(prefilled, list(sidecars))
            assert short == before  # a short prompt is decoded alone
            moved_before = await totals(transferred, decoders)
            prompt = fresh_prompt(40, 600)
            async with http.post(
                f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}
            ) as r:
                assert r.status == 200, await r.text()
            long = await totals(prefilled, list(sidecars))
            assert sum(long) - sum(short) == 1
            moved = [a - b for a, b in zip(await totals(transferred, decoders), moved_before, strict=True)]
            assert sorted(moved) == [0.0, len(prompt) - 1]

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log_path.read_text(errors="replace")
        await eventually(lambda: not group_alive(proc), what="Envoy and the engines stopped with kvstack up")
    finally:
        if group_alive(proc):
            kill_group(proc)
