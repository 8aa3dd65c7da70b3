"""Real Envoy on kvstack.epp.envoy_config's bootstrap, in front of small aiohttp engines, asking a
fixed-answer picker (support.fixed_picker): routing to the picked address, fallbacks, the served address
told to the client, a picker that is down or slow, the picker's own 503/429, the metadata Envoy forwards,
streaming passing through unbuffered."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvstack.epp.envoy_config import SERVED, EnvoyOptions, bootstrap
from support.envoy import EnvoyProcess, require_envoy, start_envoy
from support.fixed_picker import Answer, RunningPicker, start_fixed_picker
from support.ports import free_port

pytestmark = pytest.mark.timeout(60)

SHED = {"error": {"message": "shed under load", "type": "overloaded", "code": 429}}
NO_ENGINE = {"error": {"message": "no ready endpoint", "type": "unavailable", "code": 503}}


@dataclass
class Engine:
    """An HTTP server answering its name and the hash of the body it got, and a gated SSE stream on /sse."""

    name: str
    address: str
    runner: web.AppRunner
    release: asyncio.Event = field(default_factory=asyncio.Event)


async def start_engine(name: str) -> Engine:
    release = asyncio.Event()

    async def answer(request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response({"served_by": name, "sha256": hashlib.sha256(body).hexdigest()})

    async def sse(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"first": true}\n\n')
        await asyncio.wait_for(release.wait(), timeout=10)  # the client has the first event before the rest
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/sse", sse)
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return Engine(name, f"127.0.0.1:{port}", runner, release)


def dead_address() -> str:
    return f"127.0.0.1:{free_port()}"


@dataclass
class Front:
    envoy: EnvoyProcess
    url: str
    http: aiohttp.ClientSession

    async def post(
        self, path: str = "/v1/completions", body: bytes = b'{"prompt": "hi"}'
    ) -> tuple[int, bytes]:
        async with self.http.post(f"{self.url}{path}", data=body) as response:
            return response.status, await response.read()

    async def served_by(self, body: bytes = b'{"prompt": "hi"}') -> str:
        status, payload = await self.post(body=body)
        assert status == 200, (status, payload, self.envoy.log_tail())
        return str(json.loads(payload)["served_by"])


@asynccontextmanager
async def front(
    tmp_path: Path, pickers: list[str], engines: tuple[str, ...] = (), **options: Any
) -> AsyncIterator[Front]:
    """Envoy on free ports, on the bootstrap for these pickers, engines (none: ORIGINAL_DST) and options."""
    require_envoy()
    listen = free_port()
    config = EnvoyOptions(
        pickers=tuple(pickers), engines=engines, listen_port=listen, admin_port=free_port(), **options
    )
    envoy = await asyncio.to_thread(start_envoy, bootstrap(config), tmp_path)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            yield Front(envoy, f"http://127.0.0.1:{listen}", http)
    finally:
        envoy.stop()


@pytest.fixture
async def engines() -> AsyncIterator[list[Engine]]:
    started = [await start_engine("A"), await start_engine("B")]
    yield started
    for engine in started:
        engine.release.set()
        await engine.runner.cleanup()


@pytest.fixture
async def picker() -> AsyncIterator[RunningPicker]:
    running = await start_fixed_picker()
    yield running
    await running.stop()


def named(engines: list[Engine], *extra: str) -> tuple[str, ...]:
    return (*(e.address for e in engines), *extra)


@pytest.mark.parametrize("cluster", ["override-host", "original-dst"])
async def test_request_goes_where_the_picker_says_and_the_picker_hears_where_it_went(
    tmp_path: Path, engines: list[Engine], picker: RunningPicker, cluster: str
) -> None:
    async with front(tmp_path, [picker.address], named(engines) if cluster == "override-host" else ()) as f:
        for engine in (engines[1], engines[0], engines[1]):
            picker.picker.answer = Answer(endpoints=engine.address)
            assert await f.served_by() == engine.name
        picker.picker.answer = Answer(endpoints=f"{engines[0].address},{engines[1].address}")
        assert await f.served_by() == "A"
    last_response = picker.picker.phases("response_headers")[-1].metadata["envoy.lb"]
    assert last_response == {
        "x-gateway-destination-endpoint": f"{engines[0].address},{engines[1].address}",
        "x-gateway-destination-endpoint-served": engines[0].address,
    }


async def test_a_dead_first_address_falls_back_to_the_next_before_the_first_byte(
    tmp_path: Path, engines: list[Engine], picker: RunningPicker
) -> None:
    dead = dead_address()
    async with front(tmp_path, [picker.address], named(engines, dead)) as f:
        picker.picker.answer = Answer(endpoints=f"{dead},{engines[1].address}")
        assert await f.served_by() == "B"
        stats = f.envoy.stats("cluster.engines.")
    assert stats["cluster.engines.upstream_rq_retry"] == 1
    assert stats["cluster.engines.upstream_rq_retry_success"] == 1
    assert stats["cluster.engines.upstream_cx_connect_fail"] == 1
    served = picker.picker.phases("response_headers")[-1].metadata["envoy.lb"]
    assert served["x-gateway-destination-endpoint-served"] == engines[1].address


async def test_the_client_hears_which_engine_served_the_fallback_included(
    tmp_path: Path, engines: list[Engine], picker: RunningPicker
) -> None:
    dead = dead_address()
    async with front(tmp_path, [picker.address], named(engines, dead)) as f:
        for endpoints, served in ((engines[0].address, "A"), (f"{dead},{engines[1].address}", "B")):
            picker.picker.answer = Answer(endpoints=endpoints)
            async with f.http.post(f"{f.url}/v1/completions", data=b"{}") as response:
                assert (await response.json())["served_by"] == served
                address = {"A": engines[0].address, "B": engines[1].address}[served]
                assert response.headers[SERVED] == address


@pytest.mark.parametrize("served_header", [False, True])
async def test_without_named_engines_the_served_header_is_the_first_address_unless_off(
    tmp_path: Path, engines: list[Engine], picker: RunningPicker, served_header: bool
) -> None:
    async with front(tmp_path, [picker.address], served_header=served_header) as f:
        picker.picker.answer = Answer(endpoints=f"{engines[1].address},{engines[0].address}")
        async with f.http.post(f"{f.url}/v1/completions", data=b"{}") as response:
            assert (await response.json())["served_by"] == "B"
            assert response.headers.get(SERVED) == (engines[1].address if served_header else None)


async def test_an_address_envoy_does_not_know_is_skipped(
    tmp_path: Path, engines: list[Engine], picker: RunningPicker
) -> None:
    """With engines named, the picker can only choose among them; naming none of them leaves least request."""
    stranger = await start_engine("stranger")
    try:
        async with front(tmp_path, [picker.address], named(engines)) as f:
            picker.picker.answer = Answer(endpoints=f"{stranger.address},{engines[1].address}")
            assert await f.served_by() == "B"
            picker.picker.answer = Answer(endpoints=stranger.address)
            assert await f.served_by() in {"A", "B"}
            assert f.envoy.stat("cluster.engines.upstream_rq_retry") == 0
    finally:
        await stranger.runner.cleanup()


async def test_without_named_engines_there_is_no_fallback(
    tmp_path: Path, engines: list[Engine], picker: RunningPicker
) -> None:
    """ORIGINAL_DST serves the first address only: a dead one is retried in place, then 503."""
    dead = dead_address()
    async with front(tmp_path, [picker.address], retries=1) as f:
        picker.picker.answer = Answer(endpoints=f"{dead},{engines[1].address}")
        status, _ = await f.post()
        assert status == 503
        assert f.envoy.stat("cluster.engines.upstream_rq_retry") == 1


# 502: a kvstack sidecar whose engine failed before its first token
@pytest.mark.parametrize("status", [503, 502])
async def test_an_engine_503_or_502_is_retried_on_the_fallback(
    tmp_path: Path, picker: RunningPicker, status: int
) -> None:
    async def busy(request: web.Request) -> web.Response:
        return web.json_response(NO_ENGINE, status=status)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", busy)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    fallback = await start_engine("B")
    try:
        async with front(tmp_path, [picker.address], (f"127.0.0.1:{port}", fallback.address)) as f:
            picker.picker.answer = Answer(endpoints=f"127.0.0.1:{port},{fallback.address}")
            assert await f.served_by() == "B"
            assert f.envoy.stat("cluster.engines.upstream_rq_retry_success") == 1
    finally:
        await runner.cleanup()
        await fallback.runner.cleanup()


async def test_a_200_cut_before_its_first_token_is_not_retried(tmp_path: Path, picker: RunningPicker) -> None:
    """Envoy's limit (docs/design/envoy-front-end.md): the engine's 200, then its break, reach the client."""

    async def cut(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n')
        await asyncio.sleep(0.3)  # prefilling; then the engine dies
        assert request.transport is not None
        request.transport.abort()
        return response

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", cut)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    fallback = await start_engine("B")
    try:
        async with front(tmp_path, [picker.address], (f"127.0.0.1:{port}", fallback.address)) as f:
            picker.picker.answer = Answer(endpoints=f"127.0.0.1:{port},{fallback.address}")
            with pytest.raises(aiohttp.ClientPayloadError):
                async with f.http.post(f"{f.url}/v1/chat/completions", data=b"{}") as response:
                    assert response.status == 200
                    await response.read()
            assert f.envoy.stat("cluster.engines.upstream_rq_retry") == 0
    finally:
        await runner.cleanup()
        await fallback.runner.cleanup()


@pytest.mark.parametrize(("status", "body"), [(503, NO_ENGINE), (429, SHED)])
async def test_the_pickers_immediate_response_reaches_the_client(
    tmp_path: Path, engines: list[Engine], picker: RunningPicker, status: int, body: dict[str, Any]
) -> None:
    picker.picker.answer = Answer(status=status, body=json.dumps(body).encode())
    async with (
        front(tmp_path, [picker.address], named(engines)) as f,
        f.http.post(f"{f.url}/v1/completions", json={"prompt": "hi"}) as response,
    ):
        assert response.status == status
        assert response.headers["content-type"] == "application/json"
        assert await response.json() == body


@pytest.mark.parametrize("cluster", ["override-host", "original-dst"])
async def test_a_down_picker_fails_closed_with_503(
    tmp_path: Path, engines: list[Engine], cluster: str
) -> None:
    async with front(tmp_path, [dead_address()], named(engines) if cluster == "override-host" else ()) as f:
        status, payload = await f.post()
        assert status == 503
        assert f.envoy.stat("http.openai.ext_proc.streams_failed") == 1
        error = json.loads(payload)["error"]  # Envoy's own reply, in OpenAI's error shape
        assert error["code"] == 503 and error["type"] == "EnvoyError" and "ext_proc" in error["message"]


async def test_fail_open_sends_a_request_to_a_named_engine_by_least_request(
    tmp_path: Path, engines: list[Engine]
) -> None:
    async with front(tmp_path, [dead_address()], named(engines), fail_open=True) as f:
        assert {await f.served_by() for _ in range(4)} <= {"A", "B"}
        assert f.envoy.stat("http.openai.ext_proc.failure_mode_allowed") == 4


async def test_fail_open_without_named_engines_has_nowhere_to_go(
    tmp_path: Path, engines: list[Engine]
) -> None:
    async with front(tmp_path, [dead_address()], fail_open=True) as f:
        status, payload = await f.post()
        assert status == 503
        assert json.loads(payload)["error"] == {
            "code": 503,
            "message": "envoy: no_healthy_upstream",
            "param": None,
            "type": "EnvoyError",
        }


async def test_a_slow_picker_times_out_with_504(
    tmp_path: Path, engines: list[Engine], picker: RunningPicker
) -> None:
    picker.picker.answer = Answer(endpoints=engines[0].address, delay_s=1.0)
    async with front(tmp_path, [picker.address], named(engines), message_timeout_s=0.2) as f:
        status, _ = await f.post()
        assert status == 504
        assert f.envoy.stat("http.openai.ext_proc.message_timeouts") == 1


async def test_only_ready_picker_replicas_get_requests(tmp_path: Path, engines: list[Engine]) -> None:
    ready = await start_fixed_picker(Answer(endpoints=engines[0].address))
    follower = await start_fixed_picker(Answer(endpoints=engines[1].address), ready=False)
    try:
        pickers = [follower.address, dead_address(), ready.address]
        async with front(tmp_path, pickers, named(engines)) as f:
            assert [await f.served_by() for _ in range(6)] == ["A"] * 6
        assert follower.picker.seen == []
    finally:
        await ready.stop()
        await follower.stop()


@pytest.mark.parametrize("cluster", ["override-host", "original-dst"])
@pytest.mark.parametrize("body_mode", ["buffered", "streamed", "full-duplex-streamed"])
async def test_each_body_mode_routes_and_delivers_the_body_intact(
    tmp_path: Path, engines: list[Engine], picker: RunningPicker, body_mode: str, cluster: str
) -> None:
    body = json.dumps({"prompt": "x" * 300_000}).encode()  # several chunks
    picker.picker.answer = Answer(endpoints=f"{engines[1].address},{engines[0].address}")
    known = named(engines) if cluster == "override-host" else ()
    async with front(tmp_path, [picker.address], known, body_mode=body_mode) as f:
        status, payload = await f.post(body=body)
    assert status == 200, payload
    assert json.loads(payload) == {"served_by": "B", "sha256": hashlib.sha256(body).hexdigest()}


async def test_a_body_over_max_request_bytes_is_refused_with_413(
    tmp_path: Path, engines: list[Engine], picker: RunningPicker
) -> None:
    picker.picker.answer = Answer(endpoints=engines[0].address)
    async with front(tmp_path, [picker.address], named(engines), max_request_bytes=1024 * 1024) as f:
        assert (await f.post(body=b"x" * (1024 * 1024 - 1)))[0] == 200
        assert (await f.post(body=b"x" * (1024 * 1024 + 1)))[0] == 413


async def test_the_picker_hears_the_subset_hint_a_gateway_set(
    tmp_path: Path, engines: list[Engine], picker: RunningPicker
) -> None:
    subset = [engines[1].address]
    options = EnvoyOptions(
        pickers=(picker.address,),
        engines=tuple(e.address for e in engines),
        listen_port=free_port(),
        admin_port=free_port(),
    )
    config = bootstrap(options)
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hint = {"x-gateway-destination-endpoint-subset": subset}
    set_metadata = "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config"
    manager["http_filters"].insert(
        0,
        {
            "name": "envoy.filters.http.set_metadata",
            "typed_config": {
                "@type": set_metadata,
                "metadata": [{"metadata_namespace": "envoy.lb.subset_hint", "value": hint}],
            },
        },
    )
    picker.picker.answer = Answer(endpoints=engines[1].address)
    envoy = await asyncio.to_thread(start_envoy, config, tmp_path)
    try:
        async with aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{options.listen_port}/v1/completions"
            async with http.post(url, json={"prompt": "hi"}) as response:
                assert response.status == 200
    finally:
        envoy.stop()
    for phase in ("request_headers", "request_body", "response_headers"):
        assert picker.picker.phases(phase)[-1].metadata["envoy.lb.subset_hint"] == hint


@pytest.mark.parametrize("response_usage", [False, True])
async def test_a_streamed_response_passes_through_unbuffered(
    tmp_path: Path, engines: list[Engine], picker: RunningPicker, response_usage: bool
) -> None:
    picker.picker.answer = Answer(endpoints=engines[0].address)
    async with (
        front(tmp_path, [picker.address], named(engines), response_usage=response_usage) as f,
        f.http.post(f"{f.url}/sse", json={"prompt": "hi", "stream": True}) as response,
    ):
        assert response.status == 200
        first = await asyncio.wait_for(response.content.readuntil(b"\n\n"), timeout=5)
        assert first == b'data: {"first": true}\n\n'
        engines[0].release.set()  # the engine finishes only after the client has read the first event
        assert await response.content.read() == b"data: [DONE]\n\n"
    if response_usage:
        assert any(b"[DONE]" in s.body for s in picker.picker.phases("response_body"))


async def test_several_envoys_run_at_once_with_more_worker_threads(
    tmp_path: Path, engines: list[Engine], picker: RunningPicker
) -> None:
    require_envoy()
    picker.picker.answer = Answer(endpoints=engines[0].address)
    ports = [(free_port(), free_port()) for _ in range(2)]
    configs = [
        bootstrap(
            EnvoyOptions(
                pickers=(picker.address,), engines=(engines[0].address,), listen_port=p, admin_port=a
            )
        )
        for p, a in ports
    ]
    started = await asyncio.gather(
        *(asyncio.to_thread(start_envoy, c, tmp_path / str(i), concurrency=2) for i, c in enumerate(configs))
    )
    try:
        async with aiohttp.ClientSession() as http:
            for listen, _ in ports:
                async with http.post(f"http://127.0.0.1:{listen}/v1/completions", json={}) as response:
                    assert (await response.json())["served_by"] == "A"
        assert all(envoy.stat("server.concurrency") == 2 for envoy in started)
    finally:
        for envoy in started:
            envoy.stop()


async def test_an_unmarked_immediate_response_is_rewritten_like_envoys_own(
    tmp_path: Path, engines: list[Engine], picker: RunningPicker
) -> None:
    """Only the mark (``kvstack.epp``/``picker_reply``) keeps a picker's body: kvstack's picker sets it."""
    picker.picker.answer = Answer(status=429, body=b"plain text", mark_reply=False)
    async with front(tmp_path, [picker.address], named(engines)) as f:
        status, payload = await f.post()
        assert status == 429
        assert json.loads(payload)["error"]["type"] == "EnvoyError"
