"""The P/D sidecar in front of one decode engine: a request naming an allowed prefill engine in
``x-prefiller-host-port`` is prefilled there and decoded with the transferred KV; an unknown prefill host is
refused (SSRF); the header never reaches the engine; everything else passes through; an engine failing
before its first token is a 502 (which Envoy retries); a failed prefill falls back; the allowlist follows
discovery; a client that leaves during the prefill aborts it."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import openai
from kvstack.engines.discovery import FileDiscovery
from kvstack.engines.state import Endpoint
from kvstack.frontend.pd import PREFILLER_HEADER, host_port
from kvstack.router.sidecar import RunningSidecar, SidecarOptions, start_sidecar
from kvstack.sim.cluster import RunningEngine, stop_engine
from kvstack.sim.scheduler import LatencyModel
from support.metrics import counter_totals, sample_sum
from support.pd import LONG_PROMPT, computed_tokens, engine_page, finished, transferred_tokens
from support.ports import free_port
from support.processes import spawn, stop_group
from support.routers import FAST, MODEL, start_sims
from support.waiting import eventually


@dataclass
class SidecarStack:
    prefill: RunningEngine
    decode: RunningEngine
    sidecar: RunningSidecar
    http: aiohttp.ClientSession

    @property
    def prefiller(self) -> dict[str, str]:
        """The header naming the prefill engine."""
        return {PREFILLER_HEADER: host_port(self.prefill.url)}

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.sidecar.url}/v1", api_key="x", max_retries=0)

    async def fallbacks(self) -> dict[tuple[str, ...], float]:
        page = await engine_page(self.http, self.sidecar.url)
        return counter_totals(page, "kvstack_pd_fallbacks", "reason")


async def sidecar_stack(**prefill_config: Any) -> AsyncIterator[SidecarStack]:
    [prefill] = await start_sims(1, **prefill_config)
    [decode] = await start_sims(1)
    opts = SidecarOptions(
        engine=decode.url,
        port=0,
        prefill_engines=[Endpoint(prefill.url)],
        timeouts=FAST,
        pd_prefill_timeout=5.0,
    )
    sidecar = await start_sidecar(opts)
    http = aiohttp.ClientSession()
    try:
        yield SidecarStack(prefill, decode, sidecar, http)
    finally:
        await http.close()
        await sidecar.stop()
        for e in (prefill, decode):
            await stop_engine(e)


@pytest.fixture
async def stack() -> AsyncIterator[SidecarStack]:
    async for s in sidecar_stack():
        yield s


# -- prefill there, decode here ----------------------------------------------------------------------------


async def test_a_named_prefill_engine_prefills_and_the_local_engine_decodes(stack: SidecarStack) -> None:
    client = stack.client()
    answer = await client.completions.create(
        model=MODEL, prompt=LONG_PROMPT, max_tokens=4, extra_headers=stack.prefiller
    )
    assert answer.usage is not None
    prompt_tokens = answer.usage.prompt_tokens
    assert await transferred_tokens(stack.http, stack.decode.url) == prompt_tokens - 1
    assert await computed_tokens(stack.http, stack.prefill.url) == prompt_tokens
    # Streaming too: the local engine's stream is relayed as it comes.
    chunks = [
        c.choices[0].text
        async for c in await client.completions.create(
            model=MODEL,
            prompt=LONG_PROMPT + " again",
            max_tokens=4,
            stream=True,
            extra_headers=stack.prefiller,
            extra_body={"ignore_eos": True},  # all 4 tokens, whatever the sim samples
        )
    ]
    await client.close()
    assert len(chunks) == 4
    assert await finished(stack.http, stack.prefill.url) == 2
    # The sidecar's /metrics: the engine's page, then its own P/D series.
    page = await engine_page(stack.http, stack.sidecar.url)
    assert sample_sum(page, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") > 2 * 300
    prefills = counter_totals(page, "kvstack_pd_prefills", "engine", "outcome")
    assert prefills == {(stack.prefill.url, "ok"): 2.0}
    assert sample_sum(page, "kvstack_pd_transferred_prompt_tokens_total") > 2 * 300


async def test_an_unknown_prefill_host_is_refused(stack: SidecarStack) -> None:
    for named in ("169.254.169.254:80", host_port(stack.decode.url)):
        async with stack.http.post(
            f"{stack.sidecar.url}/v1/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
            headers={PREFILLER_HEADER: named},
        ) as r:
            assert r.status == 403
            error = (await r.json())["error"]
        assert error["type"] == "PermissionDeniedError" and error["param"] == PREFILLER_HEADER
        assert named in error["message"]
    assert await finished(stack.http, stack.prefill.url) == 0
    assert await finished(stack.http, stack.decode.url) == 0


async def test_requests_without_the_header_pass_through(stack: SidecarStack) -> None:
    async with stack.http.get(f"{stack.sidecar.url}/v1/models") as r:
        assert r.status == 200
        assert [m["id"] for m in (await r.json())["data"]] == [MODEL]
    async with stack.http.get(f"{stack.sidecar.url}/health") as r:
        assert r.status == 200
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 3, "stream": True}
    async with stack.http.post(f"{stack.sidecar.url}/v1/completions", json=body) as r:
        assert r.status == 200
        assert (await r.read()).endswith(b"data: [DONE]\n\n")
    assert await transferred_tokens(stack.http, stack.decode.url) == 0
    assert await finished(stack.http, stack.prefill.url) == 0
    assert await stack.fallbacks() == {}


async def test_the_header_never_reaches_an_engine(stack: SidecarStack) -> None:
    heads: list[bytes] = []

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = re.search(rb"content-length: *(\d+)", head, re.I)
        await reader.readexactly(int(length.group(1)) if length else 0)
        heads.append(head.lower())
        body = b'{"id": "x", "choices": []}'
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(engine, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    opts = SidecarOptions(
        engine=f"http://127.0.0.1:{port}", port=0, prefill_engines=[Endpoint(stack.prefill.url)]
    )
    sidecar = await start_sidecar(opts)
    try:
        async with stack.http.post(
            f"{sidecar.url}/v1/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
            headers=stack.prefiller,
        ) as r:
            assert r.status == 200
    finally:
        await sidecar.stop()
        server.close()
    assert len(heads) == 1 and PREFILLER_HEADER.encode() not in heads[0]
    assert await finished(stack.http, stack.prefill.url) == 1  # prefilled, without the header either


# -- fallbacks ---------------------------------------------------------------------------------------------


async def test_an_engine_breaking_before_its_first_token_is_a_502(stack: SidecarStack) -> None:
    # Envoy can retry a 502 on its next address (kvstack.epp.envoy_config), never a 200 cut short.
    fault = {"drop_rate": 1.0, "drop_after_chunks": 1}  # the role chunk, then the connection drops
    async with stack.http.post(f"{stack.decode.url}/admin/faults", json=fault) as r:
        assert r.status == 200
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    async with stack.http.post(f"{stack.sidecar.url}/v1/chat/completions", json=body) as r:
        assert r.status == 502
        assert "failed before its first token" in (await r.json())["error"]["message"]


async def test_a_failed_or_slow_prefill_falls_back_to_the_local_engine(stack: SidecarStack) -> None:
    client = stack.client()
    async with stack.http.post(f"{stack.prefill.url}/admin/faults", json={"error_rate": 1.0}):
        pass
    await client.completions.create(
        model=MODEL, prompt=LONG_PROMPT, max_tokens=2, extra_headers=stack.prefiller
    )
    async with stack.http.post(f"{stack.prefill.url}/admin/faults", json={"error_rate": 0, "hang_rate": 1.0}):
        pass
    stack.sidecar.app.prefiller.timeout = 0.5
    await client.completions.create(
        model=MODEL, prompt=LONG_PROMPT, max_tokens=2, extra_headers=stack.prefiller
    )
    await client.close()
    assert await transferred_tokens(stack.http, stack.decode.url) == 0
    assert await computed_tokens(stack.http, stack.decode.url) > 2 * 300
    assert await stack.fallbacks() == {("error_status",): 1.0, ("timeout",): 1.0}
    await eventually(lambda: stack.prefill.engine.num_unfinished == 0, what="hung prefill ended")


# -- the allowlist follows discovery -----------------------------------------------------------------------


async def test_the_allowlist_takes_the_prefill_engines_of_the_engines_file(
    stack: SidecarStack, tmp_path: Path
) -> None:
    engines = tmp_path / "engines.yaml"
    listed = [
        f"  - url: {stack.prefill.url}\n    role: prefill",
        f"  - url: {stack.decode.url}\n    role: decode",
    ]
    engines.write_text("engines:\n" + "\n".join(listed) + "\n")
    opts = SidecarOptions(
        engine=stack.decode.url, port=0, discovery=FileDiscovery(engines, poll_interval_s=0.05)
    )
    sidecar = await start_sidecar(opts)
    try:
        await eventually(
            lambda: sidecar.allowlist.urls() == [stack.prefill.url], what="prefill engine allowed"
        )
        engines.write_text(f"engines:\n  - url: {stack.prefill.url}\n    role: decode\n")
        await eventually(lambda: sidecar.allowlist.urls() == [], what="no longer a prefill engine")
        async with stack.http.post(
            f"{sidecar.url}/v1/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
            headers=stack.prefiller,
        ) as r:
            assert r.status == 403
    finally:
        await sidecar.stop()


# -- a client that leaves ----------------------------------------------------------------------------------


@pytest.fixture
async def slow_prefill_stack() -> AsyncIterator[SidecarStack]:
    async for s in sidecar_stack(
        time_scale=1.0, latency=LatencyModel(prefill_per_token=0.02), max_num_batched_tokens=16
    ):
        yield s


async def test_a_client_leaving_during_the_prefill_aborts_it(slow_prefill_stack: SidecarStack) -> None:
    stack = slow_prefill_stack
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 20, "stream": True}
    request = asyncio.ensure_future(
        stack.http.post(f"{stack.sidecar.url}/v1/completions", json=body, headers=stack.prefiller)
    )
    await eventually(lambda: stack.prefill.engine.num_running == 1, what="prefill running")
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    await eventually(lambda: stack.prefill.engine.num_unfinished == 0, what="prefill aborted")
    assert await finished(stack.http, stack.prefill.url) == 0
    assert stack.decode.engine.num_unfinished == 0
    assert await finished(stack.http, stack.decode.url) == 0


# -- the command -------------------------------------------------------------------------------------------


def sidecar_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvstack.cli", "sidecar", "--log-level", "warning", *args]


def test_bad_arguments_exit_2_with_the_reason() -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(sidecar_command(*args), capture_output=True, text=True, timeout=60)

    missing = run("--port", "0")
    assert missing.returncode == 2 and "--engine" in missing.stderr
    bad_url = run("--engine", "ftp://x")
    assert bad_url.returncode == 2 and "ftp://x" in bad_url.stderr
    bad_prefill = run("--engine", "http://127.0.0.1:9", "--prefill-engine", "http://h:1#role=prefiller")
    assert bad_prefill.returncode == 2 and "prefiller" in bad_prefill.stderr
    selector_alone = run("--engine", "http://127.0.0.1:9", "--k8s-selector", "app=vllm")
    assert selector_alone.returncode == 2 and "--k8s-namespace" in selector_alone.stderr


async def test_kvstack_sidecar_serves_the_prefill_engines_it_is_given(
    stack: SidecarStack, tmp_path: Path
) -> None:
    port = free_port()
    args = ["--engine", stack.decode.url, "--prefill-engine", stack.prefill.url, "--port", str(port)]
    proc = spawn(sidecar_command(*args), tmp_path / "sidecar.log")
    url = f"http://127.0.0.1:{port}"

    async def healthy() -> bool:
        try:
            async with stack.http.get(f"{url}/health") as r:
                return r.status == 200
        except aiohttp.ClientError:
            return proc.poll() is not None  # exited: fail below with its log

    try:
        await eventually(healthy, what="kvstack sidecar up", timeout_s=30, interval_s=0.1)
        assert proc.poll() is None, (tmp_path / "sidecar.log").read_text()
        async with stack.http.post(
            f"{url}/v1/completions",
            json={"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 2},
            headers=stack.prefiller,
        ) as r:
            assert r.status == 200
        assert await transferred_tokens(stack.http, stack.decode.url) > 300
    finally:
        assert stop_group(proc) == 0
