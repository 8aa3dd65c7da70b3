"""``kvstack up --front-end envoy``: the local stack with real Envoy on --port and kvstack's picker."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

import openai
from support.envoy import require_envoy
from support.ports import free_ports
from support.processes import group_alive, kill_group, spawn
from support.waiting import eventually

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

MODEL = "up-model"


def _wait_banner(log_path: Path, proc: subprocess.Popen[bytes], budget_s: float = 60.0) -> str:
    deadline = time.monotonic() + budget_s
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace") if log_path.exists() else ""
        if "OpenAI base URL" in text:
            return text
        assert proc.poll() is None, text
        time.sleep(0.1)
    raise AssertionError(f"no banner: {log_path.read_text(errors='replace')}")


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
        banner = await asyncio.to_thread(_wait_banner, log_path, proc)
        assert f"envoy:    http://127.0.0.1:{ports.start}" in banner
        picker_http = re.search(r"picker:   grpc://\S+\s+(http://\S+)", banner)
        assert picker_http is not None, banner
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{ports.start}/v1", api_key="x", max_retries=0)
        answer = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=3
        )
        assert answer.choices[0].message.content
        stream = await client.completions.create(model=MODEL, prompt="once upon", max_tokens=4, stream=True)
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
