"""P/D in Envoy mode, end to end: real Envoy asks kvstack's picker, which lists the decode engine at its
sidecar's URL and names the prefill engine in ``x-prefiller-host-port``; the sidecar prefills there and
decodes on its engine. The picker scrapes and learns models through the sidecar, and a client cannot pick
the prefill engine itself."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

import openai
from kvstack.engines.state import Endpoint, EngineRole
from kvstack.epp.envoy_config import EnvoyOptions, bootstrap
from kvstack.epp.server import EppOptions, RunningEpp, start_epp
from kvstack.frontend.pd import PREFILLER_HEADER, host_port
from kvstack.router.sidecar import RunningSidecar, SidecarOptions, start_sidecar
from kvstack.sim.cluster import RunningEngine, stop_engine
from support.envoy import EnvoyProcess, require_envoy, start_envoy
from support.metrics import counter_totals
from support.pd import LONG_PROMPT, FixedDecision, engine_page, finished, transferred_tokens
from support.pickers import wait_engines
from support.ports import free_port
from support.routers import MODEL, start_sims

pytestmark = pytest.mark.timeout(90)


@dataclass
class EnvoyPD:
    prefill: RunningEngine
    decode: RunningEngine
    sidecar: RunningSidecar
    epp: RunningEpp
    decision: FixedDecision
    envoy: EnvoyProcess
    url: str
    http: aiohttp.ClientSession

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture
async def envoy_pd(tmp_path: Path) -> AsyncIterator[EnvoyPD]:
    require_envoy()
    [prefill] = await start_sims(1)
    [decode] = await start_sims(1)
    sidecar = await start_sidecar(
        SidecarOptions(engine=decode.url, port=0, prefill_engines=[Endpoint(prefill.url)])
    )
    engines = [Endpoint(sidecar.url, role=EngineRole.DECODE), Endpoint(prefill.url, role=EngineRole.PREFILL)]
    epp = await start_epp(EppOptions(grpc_port=0, http_port=0, engines=engines, routing="round-robin"))
    decision = FixedDecision([sidecar.url], [prefill.url])
    epp.front.picker = decision  # type: ignore[assignment]
    envoy = None
    http = aiohttp.ClientSession()
    try:
        await wait_engines(epp, 2)  # the decode engine's metrics and models, read through its sidecar
        port = free_port()
        options = EnvoyOptions(
            pickers=(epp.grpc_address,),
            engines=(sidecar.url.removeprefix("http://"),),
            listen_host="127.0.0.1",
            listen_port=port,
            admin_port=free_port(),
        )
        # In a thread: Envoy's health checks of the picker need this event loop running.
        envoy = await asyncio.to_thread(start_envoy, bootstrap(options.validate()), tmp_path)
        yield EnvoyPD(prefill, decode, sidecar, epp, decision, envoy, f"http://127.0.0.1:{port}", http)
    finally:
        await http.close()
        if envoy is not None:
            envoy.stop()
        await epp.stop()
        await sidecar.stop()
        for e in (prefill, decode):
            await stop_engine(e)


async def test_envoy_picker_and_sidecar_prefill_then_decode(envoy_pd: EnvoyPD) -> None:
    client = envoy_pd.client()
    answer = await client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=4)
    assert answer.usage is not None
    transferred = await transferred_tokens(envoy_pd.http, envoy_pd.decode.url)
    assert transferred == answer.usage.prompt_tokens - 1
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": LONG_PROMPT}],
        max_tokens=6,
        stream=True,
        extra_body={"ignore_eos": True},  # some text, whatever the sim samples
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    await client.close()
    assert text
    assert await transferred_tokens(envoy_pd.http, envoy_pd.decode.url) > transferred + 300
    assert await finished(envoy_pd.http, envoy_pd.prefill.url) == 2
    page = await engine_page(envoy_pd.http, envoy_pd.sidecar.url)
    prefills = counter_totals(page, "kvstack_pd_prefills", "engine", "outcome")
    assert prefills == {(envoy_pd.prefill.url, "ok"): 2.0}


async def test_a_client_cannot_name_the_prefill_engine_through_envoy(envoy_pd: EnvoyPD) -> None:
    envoy_pd.decision.prefill = []  # scheduling serves the request whole
    async with envoy_pd.http.post(
        f"{envoy_pd.url}/v1/completions",
        json={"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 2},
        headers={PREFILLER_HEADER: host_port(envoy_pd.prefill.url)},
    ) as r:
        assert r.status == 200, await r.text()
    # The picker removed the header: the sidecar prefilled nowhere, its engine computed the prompt.
    assert await finished(envoy_pd.http, envoy_pd.prefill.url) == 0
    assert await transferred_tokens(envoy_pd.http, envoy_pd.decode.url) == 0
    assert await finished(envoy_pd.http, envoy_pd.decode.url) == 1
