"""The simulator's fault injection (flags and /admin/faults) and what a client disconnect does to the engine.

Every sim here is a subprocess on free loopback ports. Checks read the engine's side from /metrics:
a dropped or abandoned request must leave no running request behind and, as in vLLM, not count as a
finished request (vLLM does not add client aborts to ``request_success_total``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

import openai
from support.engines import EngineProcess, start_sim

# Wall-clock deadline for the engine to reach a state; only a liveness bound, never a speed assertion.
SETTLE_S = 10.0


# -- helpers -----------------------------------------------------------------------------------------
def sample(text: str, name: str, **labels: str) -> float:
    """Value of the sample ``name`` (exposition name, e.g. ``..._total``) whose labels include ``labels``."""
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise KeyError(f"/metrics has no sample {name} with labels {labels}")


async def metrics_text(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(f"{url}/metrics") as r:
        assert r.status == 200
        return await r.text()


async def finished(http: aiohttp.ClientSession, url: str) -> float:
    """Requests the engine counts as finished, over every reason."""
    return sample(await metrics_text(http, url), "vllm:request_success_total")


async def wait_until_idle(
    http: aiohttp.ClientSession, url: str, finished_before: float, deadline_s: float = SETTLE_S
) -> str:
    """Poll /metrics until nothing runs or waits; the abandoned request must not count as finished."""
    deadline = time.monotonic() + deadline_s
    while True:
        text = await metrics_text(http, url)
        running = sample(text, "vllm:num_requests_running")
        waiting = sample(text, "vllm:num_requests_waiting")
        if running == 0 and waiting == 0:
            assert sample(text, "vllm:request_success_total") == finished_before, (
                "an abort counted as finished"
            )
            return text
        if time.monotonic() > deadline:
            raise AssertionError(
                f"engine not idle {deadline_s:.0f}s after the client left: "
                f"running={running} waiting={waiting}"
            )
        await asyncio.sleep(0.05)


async def read_sse(resp: aiohttp.ClientResponse, chunks: list[dict[str, Any]]) -> bool:
    """Append the JSON chunks of an SSE response to ``chunks``; True if it ended with ``data: [DONE]``.

    Chunks read before a broken connection raises stay in ``chunks``.
    """
    done = False
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[len(b"data: ") :]
        if data == b"[DONE]":
            done = True
        else:
            chunks.append(json.loads(data))
    return done


def completion(prompt: str = "hello world", max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra}


def assert_openai_error(body: Any, status: int, err_type: str) -> None:
    assert set(body) == {"error"}, body
    assert list(body["error"]) == ["message", "type", "param", "code"], body
    assert body["error"]["code"] == status and body["error"]["type"] == err_type, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body


def set_faults(url: str, method: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{url}/admin/faults", data=data, method=method)
    with urllib.request.urlopen(req, timeout=10) as r:
        result: dict[str, Any] = json.loads(r.read())
        return result


def openai_client(url: str, timeout: float = 30.0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout)


# -- fixtures ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shared_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """One sim for the runtime-fault tests; 8192-token context for the long stream."""
    engine = start_sim(tmp_path_factory.mktemp("sim-faults"), replay=False, max_model_len=8192)
    yield engine
    engine.stop()


@pytest.fixture
def sim(shared_sim: EngineProcess) -> Iterator[EngineProcess]:
    """``shared_sim`` with its faults cleared after the test, whatever the test set."""
    yield shared_sim
    set_faults(shared_sim.url, "DELETE")


@pytest.fixture
def sim_factory(tmp_path: Path) -> Iterator[Callable[..., EngineProcess]]:
    """Start sims with extra flags; stop them at teardown, killing after 1 s (a hung handler never ends)."""
    started: list[EngineProcess] = []

    def start(*args: str, max_model_len: int = 2048) -> EngineProcess:
        engine = start_sim(
            tmp_path / f"sim{len(started)}", replay=False, max_model_len=max_model_len, extra_args=list(args)
        )
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.stop(timeout=1.0)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


# -- injected errors ---------------------------------------------------------------------------------
ERRORS = [
    (429, openai.RateLimitError, "RateLimitError"),
    (500, openai.InternalServerError, "InternalServerError"),
    (503, openai.InternalServerError, "ServiceUnavailableError"),
]


async def check_injected_error(
    http: aiohttp.ClientSession, url: str, code: int, exc_type: type[openai.APIStatusError], err_type: str
) -> None:
    async with http.post(f"{url}/v1/completions", json=completion()) as r:
        assert r.status == code
        assert r.content_type == "application/json"
        assert_openai_error(await r.json(), code, err_type)
    client = openai_client(url)
    for stream in (False, True):
        with pytest.raises(exc_type) as info:
            await client.completions.create(model="tiny", prompt="hello", max_tokens=4, stream=stream)
        assert info.value.status_code == code
        assert isinstance(info.value.body, dict) and info.value.body["code"] == code
        assert info.value.type == err_type
    await client.close()


@pytest.mark.parametrize(("code", "exc_type", "err_type"), ERRORS)
async def test_error_rate_flag_returns_openai_error(
    sim_factory: Callable[..., EngineProcess],
    http: aiohttp.ClientSession,
    code: int,
    exc_type: type[openai.APIStatusError],
    err_type: str,
) -> None:
    engine = sim_factory("--error-rate", "1", "--error-codes", str(code))
    await check_injected_error(http, engine.url, code, exc_type, err_type)
    # Errors never reach the engine.
    text = await metrics_text(http, engine.url)
    assert sample(text, "vllm:prompt_tokens_total") == 0


@pytest.mark.parametrize(("code", "exc_type", "err_type"), ERRORS)
async def test_error_rate_set_at_runtime_and_cleared(
    sim: EngineProcess,
    http: aiohttp.ClientSession,
    code: int,
    exc_type: type[openai.APIStatusError],
    err_type: str,
) -> None:
    async with http.post(f"{sim.url}/admin/faults", json={"error_rate": 1, "error_codes": [code]}) as r:
        assert r.status == 200
        assert (await r.json())["error_codes"] == [code]
    async with http.get(f"{sim.url}/admin/faults") as r:
        got = await r.json()
        assert got["error_rate"] == 1.0 and got["error_codes"] == [code]
    await check_injected_error(http, sim.url, code, exc_type, err_type)
    async with http.delete(f"{sim.url}/admin/faults") as r:
        assert r.status == 200 and (await r.json())["error_rate"] == 0.0
    async with http.post(f"{sim.url}/v1/completions", json=completion(max_tokens=3)) as r:
        assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 3


# -- dropped streams, delays, hangs ------------------------------------------------------------------
async def test_drop_after_chunks_cuts_the_stream_and_engine_recovers(
    sim_factory: Callable[..., EngineProcess], http: aiohttp.ClientSession
) -> None:
    engine = sim_factory("--drop-rate", "1", "--drop-after-chunks", "2")
    url = engine.url
    finished_before = await finished(http, url)
    chunks: list[dict[str, Any]] = []
    done = False
    async with http.post(f"{url}/v1/completions", json=completion(max_tokens=50, stream=True)) as r:
        assert r.status == 200
        # The usual outcome is ClientPayloadError (the chunked body lacks its terminating chunk); a plain
        # EOF is acceptable too, as long as [DONE] never came.
        with contextlib.suppress(aiohttp.ClientPayloadError):
            done = await read_sse(r, chunks)
    assert not done
    assert len(chunks) == 2
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
    await wait_until_idle(http, url, finished_before)
    # Still serving: a non-streaming request is never dropped, and streams complete once faults are cleared.
    async with http.post(f"{url}/v1/completions", json=completion(max_tokens=5)) as r:
        assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 5
    async with http.delete(f"{url}/admin/faults") as r:
        assert r.status == 200 and (await r.json())["drop_rate"] == 0.0
    chunks = []
    async with http.post(f"{url}/v1/completions", json=completion(max_tokens=5, stream=True)) as r:
        done = await read_sse(r, chunks)
    assert done and len(chunks) == 5


async def test_first_token_delay_holds_back_the_first_byte(
    sim: EngineProcess, http: aiohttp.ClientSession
) -> None:
    async with http.post(f"{sim.url}/admin/faults", json={"first_token_delay": 0.5}) as r:
        assert r.status == 200 and (await r.json())["first_token_delay"] == 0.5
    start = time.monotonic()
    async with http.post(f"{sim.url}/v1/completions", json=completion(max_tokens=3, stream=True)) as r:
        first = await r.content.readline()
        elapsed = time.monotonic() - start
        rest_chunks: list[dict[str, Any]] = []
        done = await read_sse(r, rest_chunks)
    assert first.startswith(b"data: ")
    # A lower bound only (10 ms for timer granularity): it holds however fast the machine is.
    assert elapsed >= 0.49, f"first byte after {elapsed:.3f}s, before the injected 0.5s delay"
    assert done and len(rest_chunks) == 2


async def test_hang_gets_no_response_and_server_keeps_serving(
    sim_factory: Callable[..., EngineProcess], http: aiohttp.ClientSession
) -> None:
    engine = sim_factory("--hang-rate", "1")
    url = engine.url
    with pytest.raises(TimeoutError):
        async with http.post(
            f"{url}/v1/completions", json=completion(), timeout=aiohttp.ClientTimeout(total=1.0)
        ) as r:
            await r.read()
    async with http.get(f"{url}/health") as r:
        assert r.status == 200
    # The hung request never reached the engine.
    text = await metrics_text(http, url)
    assert sample(text, "vllm:num_requests_running") == 0
    assert sample(text, "vllm:num_requests_waiting") == 0
    async with http.get(f"{url}/admin/faults") as r:
        assert (await r.json())["hang_rate"] == 1.0
    async with http.delete(f"{url}/admin/faults") as r:
        assert r.status == 200 and (await r.json())["hang_rate"] == 0.0
    async with http.post(
        f"{url}/v1/completions", json=completion(max_tokens=4), timeout=aiohttp.ClientTimeout(total=30)
    ) as r:
        assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 4


async def test_hung_request_does_not_block_shutdown(
    sim_factory: Callable[..., EngineProcess], http: aiohttp.ClientSession
) -> None:
    engine = sim_factory("--hang-rate", "1")
    with pytest.raises(TimeoutError):
        async with http.post(
            f"{engine.url}/v1/completions", json=completion(), timeout=aiohttp.ClientTimeout(total=1.0)
        ) as r:
            await r.read()
    # The client is gone, so nothing is in flight: SIGTERM should end the process promptly (an idle
    # sim stops in well under a second; 3 s is a generous bound), not by EngineProcess.stop's SIGKILL.
    # Stop from a thread: blocking this event loop would keep the client's socket from closing.
    await asyncio.to_thread(engine.stop, 3.0)
    assert engine.proc.returncode == 0, f"sim did not exit on SIGTERM (returncode {engine.proc.returncode})"


# -- /admin/faults input -----------------------------------------------------------------------------
BAD_FAULTS: list[tuple[str, bytes]] = [
    ("unknown-field", b'{"bogus": 1}'),
    ("unknown-field-with-valid-one", b'{"error_rate": 0.5, "bogus": 1}'),
    ("error-rate-above-1", b'{"error_rate": 2}'),
    ("negative-drop-rate", b'{"drop_rate": -0.1}'),
    ("error-code-404", b'{"error_codes": [404]}'),
    ("error-codes-empty", b'{"error_codes": []}'),
    ("error-rate-string", b'{"error_rate": "high"}'),
    ("error-rate-bool", b'{"error_rate": true}'),
    ("negative-delay", b'{"first_token_delay": -1}'),
    ("not-an-object", b"[1, 2]"),
    ("not-json", b"{error_rate: 1"),
]


@pytest.mark.parametrize("body", [b for _, b in BAD_FAULTS], ids=[name for name, _ in BAD_FAULTS])
async def test_bad_admin_input_is_refused_and_changes_nothing(
    sim: EngineProcess, http: aiohttp.ClientSession, body: bytes
) -> None:
    # A distinctive but harmless configuration, so that "unchanged" is not just "still the defaults".
    async with http.post(
        f"{sim.url}/admin/faults", json={"drop_after_chunks": 7, "error_codes": [429, 503]}
    ) as r:
        assert r.status == 200
        before = await r.json()
    async with http.post(
        f"{sim.url}/admin/faults", data=body, headers={"Content-Type": "application/json"}
    ) as r:
        assert r.status == 400
        assert_openai_error(await r.json(), 400, "BadRequestError")
    async with http.get(f"{sim.url}/admin/faults") as r:
        assert await r.json() == before
    async with http.post(f"{sim.url}/v1/completions", json=completion(max_tokens=2)) as r:
        assert r.status == 200


# -- client disconnects ------------------------------------------------------------------------------
async def test_client_disconnect_mid_stream_aborts_the_engine_request(
    sim: EngineProcess, http: aiohttp.ClientSession
) -> None:
    finished_before = await finished(http, sim.url)
    # 5000 tokens at ~9 ms of modelled time each (time scale 1): the stream would run for ~45 s.
    body = completion(max_tokens=5000, stream=True)
    r = await http.post(f"{sim.url}/v1/completions", json=body)
    try:
        assert r.status == 200
        seen = 0
        while seen < 3:
            line = await r.content.readline()
            assert line, "stream ended early"
            seen += line.startswith(b"data: ")
        text = await metrics_text(http, sim.url)
        assert sample(text, "vllm:num_requests_running") == 1
    finally:
        r.close()  # drops the connection: the body was not read to the end
    text = await wait_until_idle(http, sim.url, finished_before)
    assert sample(text, "vllm:generation_tokens_total") < 5000
    assert sample(text, "vllm:kv_cache_usage_perc") == 0.0


async def test_client_disconnect_aborts_a_non_streaming_request(
    sim_factory: Callable[..., EngineProcess], http: aiohttp.ClientSession
) -> None:
    engine = sim_factory(max_model_len=8192)
    finished_before = await finished(http, engine.url)
    with pytest.raises(TimeoutError):
        async with http.post(
            f"{engine.url}/v1/completions",
            json=completion(max_tokens=5000),
            timeout=aiohttp.ClientTimeout(total=1.0),
        ) as r:
            await r.read()
    # vLLM aborts as soon as it sees the disconnect; 2 s is generous.
    await wait_until_idle(http, engine.url, finished_before, deadline_s=2.0)
