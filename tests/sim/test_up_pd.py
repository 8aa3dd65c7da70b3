"""``kvstack up`` with prefill and decode engines: which flag combinations make a stack, the roles and
routing they give, and a stack with one prefill and two decode simulated engines serving the openai client."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

import openai
from kvstack.cli.up import default_routing, engine_roles
from kvstack.engines.state import EngineRole
from support.engines import fresh_prompt
from support.metrics import metrics
from support.ports import free_ports
from support.processes import group_alive, kill_group, spawn, wait_for_banner
from support.waiting import eventually

MODEL = "up-pd-model"
BOTH, PREFILL, DECODE = EngineRole.BOTH, EngineRole.PREFILL, EngineRole.DECODE


@pytest.mark.parametrize(
    ("engines", "prefill", "decode", "roles", "routing"),
    [
        (None, 0, 0, [BOTH, BOTH], "auto"),  # the default stack
        (3, 0, 0, [BOTH] * 3, "auto"),
        (None, 1, 2, [PREFILL, DECODE, DECODE], "pd"),  # --engines defaults to 0 with P/D engines
        (1, 1, 1, [BOTH, PREFILL, DECODE], "pd"),  # colocated engines next to P/D ones, in port order
    ],
)
def test_engine_counts_give_roles_in_port_order_and_the_default_routing(
    engines: int | None, prefill: int, decode: int, roles: list[EngineRole], routing: str
) -> None:
    assert engine_roles(engines, prefill, decode) == roles
    assert default_routing(roles) == routing


@pytest.mark.parametrize(
    ("engines", "prefill", "decode", "says"),
    [
        (None, 1, 0, "--prefill-engines needs --decode-engines"),
        (None, 0, 2, "--decode-engines needs --prefill-engines"),
        (2, 0, 1, "use --engines"),
        (0, 0, 0, "no engines"),
        (-1, 0, 0, "must not be negative"),
        (None, -1, 1, "must not be negative"),
    ],
)
def test_counts_that_make_no_stack_are_refused(
    engines: int | None, prefill: int, decode: int, says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        engine_roles(engines, prefill, decode)


def test_up_refuses_them_before_starting_anything() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "kvstack.cli", "up", "--prefill-engines", "2", "--no-cache-server"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "--prefill-engines needs --decode-engines" in run.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_up_with_one_prefill_and_two_decode_engines_serves_and_reports_roles(tmp_path: Path) -> None:
    ports = free_ports(4)
    log_path = tmp_path / "up.log"
    cmd = [
        sys.executable, "-m", "kvstack.cli", "up", "--prefill-engines", "1", "--decode-engines", "2",
        "--port", str(ports.start), "--time-scale", "20", "--served-model-name", MODEL,
    ]  # fmt: skip
    proc = spawn(cmd, log_path)
    url = f"http://127.0.0.1:{ports.start}"
    engine_urls = [f"http://127.0.0.1:{ports.start + i}" for i in (1, 2, 3)]
    try:
        banner = await asyncio.to_thread(wait_for_banner, log_path, proc)
        assert "3 simulated engine(s) (1 prefill, 2 decode) + KV cache server" in banner
        for i, (engine, role) in enumerate(zip(engine_urls, ("prefill", "decode", "decode"), strict=True)):
            assert re.search(rf"engine {i}: {engine}\s+{role}\s", banner), banner

        async with aiohttp.ClientSession() as http:

            async def ready() -> bool:
                assert proc.poll() is None, log_path.read_text(errors="replace")
                async with http.get(f"{url}/ready") as r:
                    return r.status == 200

            await eventually(ready, timeout_s=60, interval_s=0.05)
            async with http.get(f"{url}/engines") as r:
                roles = {e["url"]: e["role"] for e in (await r.json())["engines"]}
            assert roles == dict(zip(engine_urls, ("prefill", "decode", "decode"), strict=True))

            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            answer = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Hello"}],
                max_tokens=3,
                extra_body={"ignore_eos": True},
            )
            assert answer.choices[0].message.content
            await client.close()

            # Routing "pd" (the default with P/D engines): a short prompt is decoded alone, a long one is
            # prefilled on the prefill engine first, and its decode engine counts the prompt as transferred.
            before = await metrics(http, url)
            async with http.post(
                f"{url}/v1/completions",
                json={"model": MODEL, "prompt": fresh_prompt(41, 40), "max_tokens": 2},
            ) as r:
                assert r.status == 200, await r.text()
            short = await metrics(http, url)
            prefilled = "kvstack_pd_prefills_total{outcome=ok}"  # samples() leaves the engine label out
            assert short.get(prefilled, 0.0) == before.get(prefilled, 0.0)
            decoders = [await metrics(http, e) for e in engine_urls[1:]]
            prompt = fresh_prompt(40, 600)
            async with http.post(
                f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}
            ) as r:
                assert r.status == 200, await r.text()
            long = await metrics(http, url)
            assert long[prefilled] - short.get(prefilled, 0.0) == 1
            key = "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"
            moved = [
                (await metrics(http, e)).get(key, 0.0) - d.get(key, 0.0)
                for e, d in zip(engine_urls[1:], decoders, strict=True)
            ]
            assert sorted(moved) == [0.0, len(prompt) - 1]

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log_path.read_text(errors="replace")
        await eventually(
            lambda: not group_alive(proc), what="the engines and cache server stopped with kvstack up"
        )
    finally:
        if group_alive(proc):
            kill_group(proc)
