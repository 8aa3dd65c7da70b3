"""Router control plane, fixes from an audit: engines-file reload survives bad entries, remote tokenization
avoids hung engines, black-holed engines turn unhealthy, router options are checked, a drain outlives a
pod readiness flap."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from kubernetes_asyncio.client import ApiClient, Configuration

from kvstack import cli
from kvstack.engines.discovery import (
    Backoff,
    DiscoveryConfigError,
    DiscoveryUpdate,
    FileDiscovery,
    KubernetesDiscovery,
    UpdateKind,
    parse_engines_file,
)
from kvstack.engines.prompt_tokens import PromptTokenizer, TextPrompt
from kvstack.engines.state import Endpoint
from kvstack.router.server import RouterOptions, running_router
from support.fake_k8s import FakeKubeApi, make_pod
from support.waiting import eventually

FAST = Backoff(initial_s=0.02, max_s=0.2)
MODEL = "m"
METRICS = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0.1\n"


@asynccontextmanager
async def fake_engine(*, hang: bool = False) -> AsyncIterator[tuple[str, list[str]]]:
    """An engine on 127.0.0.1 answering /metrics, /v1/models and /tokenize, or (``hang``) never answering.
    Yields its URL and the paths asked."""
    asked: list[str] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        asked.append(request.path)
        if hang:
            await asyncio.Event().wait()
        if request.path == "/metrics":
            return web.Response(text=METRICS)
        if request.path == "/v1/models":
            return web.json_response({"data": [{"id": MODEL}]})
        return web.json_response({"tokens": [1, 2, 3]})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    site = web.SockSite(runner, sock)
    await site.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", asked
    finally:
        await runner.cleanup()


@contextmanager
def black_hole() -> Iterator[str]:
    """A port whose accept queue is full and never drained: SYNs are dropped, so connecting hangs as it
    does to a host that drops packets."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(3):
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        fillers.append(filler)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        for s in (*fillers, listener):
            s.close()


# -- F1, F13: engines file -----------------------------------------------------------------------------


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


async def test_bad_url_in_engines_file_is_reported_and_reloading_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "engines.yaml"
    _write(path, "engines:\n  - url: http://127.0.0.1:18101\n")
    discovery = FileDiscovery(path, poll_interval_s=0.02)
    seen: dict[str, Endpoint] = {}

    def apply(update: DiscoveryUpdate) -> None:
        if update.kind is UpdateKind.REMOVED:
            del seen[update.endpoint.url]
        else:
            seen[update.endpoint.url] = update.endpoint

    discovery.start(apply)
    try:
        await discovery.wait_synced()
        assert list(seen) == ["http://127.0.0.1:18101"]
        with caplog.at_level(logging.ERROR, "kvstack.engines.discovery"):
            _write(path, 'engines:\n  - url: http://127.0.0.1:18101\n  - url: "http://[::1:18102"\n')
            await eventually(lambda: any("engines[1]" in r.getMessage() for r in caplog.records))
            await asyncio.sleep(0.1)  # a few more polls: the task must still be alive
        (error,) = [r.getMessage() for r in caplog.records]
        assert f"engines file {path}: engines[1]: 'http://[::1:18102' is not an engine base URL" in error
        assert "Invalid IPv6 URL" in error and "keeping the last good list (1 engines)" in error
        assert list(seen) == ["http://127.0.0.1:18101"]
        _write(path, "engines:\n  - url: http://127.0.0.1:18101\n  - url: http://[::1]:18102\n")
        await eventually(lambda: "http://[::1]:18102" in seen)
    finally:
        await discovery.stop()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://127.0.0.1:18102#role=decode", "options after '#' are read only in the string form"),
        ("http://127.0.0.1 :18101", "contains whitespace"),
        ("http://[::1:18102", "Invalid IPv6 URL"),
        ("http://h:0", "port 0"),
    ],
)
def test_mapping_entry_url_with_options_or_whitespace_is_refused(url: str, message: str) -> None:
    with pytest.raises(DiscoveryConfigError) as info:
        parse_engines_file(f'engines:\n  - url: "{url}"\n    models: [m]\n', "e.yaml")
    assert str(info.value).startswith(f"e.yaml: engines[0]: {url!r} is not an engine base URL")
    assert message in str(info.value)


# -- F2: remote tokenization ---------------------------------------------------------------------------


async def test_remote_tokenize_rotates_and_rests_an_engine_that_does_not_answer() -> None:
    observed: list[tuple[str, float]] = []
    async with (
        fake_engine(hang=True) as (hung, hung_asked),
        fake_engine() as (good, good_asked),
        aiohttp.ClientSession() as session,
    ):
        prompts = PromptTokenizer(
            session=session,
            engines_for=lambda _model: [hung, good],
            remote_timeout=0.3,
            remote_cooldown=60.0,
            observe=lambda source, seconds: observed.append((source, seconds)),
        )
        answers = [await prompts.token_ids(MODEL, TextPrompt(f"prompt {i}")) for i in range(8)]
    # The hung engine cost one request its timeout; then it rested and the other engine answered.
    assert hung_asked == ["/tokenize"] and len(good_asked) == 7
    assert answers.count(None) == 1 and answers.count((1, 2, 3)) == 7
    failed = [seconds for source, seconds in observed if source == "remote_failed"]
    assert len(failed) == 1 and failed[0] >= 0.3
    assert [source for source, _ in observed].count("remote") == 7


async def test_router_tokenizes_with_an_engine_that_answers_scrapes() -> None:
    async with fake_engine(hang=True) as (hung, _), fake_engine() as (good, good_asked):
        opts = RouterOptions(
            port=0,
            routing="default",
            kv_events=False,
            engines=[Endpoint(hung, models=frozenset({MODEL})), Endpoint(good, models=frozenset({MODEL}))],
            scrape_interval=0.05,
            scrape_timeout=0.1,
        )
        async with running_router(opts) as router:
            entry = router.app.registry.get(good)
            assert entry is not None and router.prompts is not None
            await eventually(lambda: not entry.state.metrics_stale)
            started = time.monotonic()
            for i in range(4):
                assert await router.prompts.token_ids(MODEL, TextPrompt(f"prompt {i}")) == (1, 2, 3)
            assert time.monotonic() - started < 1.0  # the hung engine, registered first, was never asked
            assert good_asked.count("/tokenize") == 4


# -- F3: a host that drops packets ---------------------------------------------------------------------


async def test_engine_whose_connects_never_complete_becomes_unhealthy() -> None:
    with black_hole() as url:
        opts = RouterOptions(
            port=0,
            routing="default",
            kv_events=False,
            engines=[Endpoint(url, models=frozenset({MODEL}))],
            scrape_interval=0.05,
            scrape_timeout=0.2,
        )
        async with running_router(opts) as router:
            entry = router.app.registry.get(url)
            assert entry is not None
            await eventually(lambda: not entry.state.healthy, timeout_s=3.0)


# -- F8, F9: router options ----------------------------------------------------------------------------


@pytest.fixture
def no_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    """A router the options let start is a test failure, not a server running until the test times out."""

    def refuse(opts: RouterOptions) -> None:
        raise AssertionError("the router started")

    monkeypatch.setattr("kvstack.router.server.serve_forever", refuse)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--max-queue", "-1", "must be >= 0, got -1"),
        ("--max-in-flight", "-2", "must be >= 0, got -2"),
        ("--queue-timeout", "-1", "must be positive"),
        ("--index-max-entries", "0", "must be >= 1, got 0"),
        ("--max-attempts", "0", "must be >= 1, got 0"),
        ("--timeout-total", "-1", "must be positive"),
        ("--timeout-connect", "0", "must be positive"),
        ("--timeout-first-byte", "nan", "must be positive"),
        ("--timeout-idle", "inf", "must be positive and finite"),
        ("--max-body-mb", "-1", "must be positive"),
        ("--circuit-open-seconds", "-5", "must be positive"),
        ("--circuit-failures", "0", "must be >= 1, got 0"),
        ("--scrape-interval", "0", "must be positive"),
        ("--scrape-timeout", "-0.5", "must be positive"),
        ("--workers", "0", "must be >= 1, got 0"),
        ("--port", "70000", "must be from 0 to 65535"),
        ("--k8s-port", "0", "must be from 1 to 65535"),
        ("--max-queue", "many", "'many' is not an integer"),
        ("--timeout-total", "soon", "'soon' is not a number"),
    ],
)
def test_router_numeric_options_are_checked(
    option: str, value: str, message: str, capsys: pytest.CaptureFixture[str], no_serving: None
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["router", "--port", "0", "--engine", "http://127.0.0.1:9", option, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: {message}" in err and "Traceback" not in err


def test_discovery_sources_that_cannot_be_combined_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_serving: None
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(
            ["router", "--port", "0", "--engines-file", str(tmp_path / "e.yaml"), "--k8s-namespace", "llm"]
        )
    assert info.value.code == 2
    assert "argument --k8s-namespace: not allowed with argument --engines-file" in capsys.readouterr().err
    for option, value in (("--k8s-selector", "app=vllm"), ("--k8s-port", "8000")):
        assert cli.main(["router", "--port", "0", "--engine", "http://127.0.0.1:9", option, value]) == 2
        assert "apply only with --k8s-namespace" in capsys.readouterr().err


# -- F14: drains belong to the URL ---------------------------------------------------------------------


async def test_drain_survives_a_pod_readiness_flap() -> None:
    api = FakeKubeApi()
    await api.start()
    try:
        async with ApiClient(configuration=Configuration(host=api.url)) as client:
            api.add_pod(
                make_pod("a", "127.0.0.1", labels={"app": "engine"}, annotations={"kvstack.io/models": MODEL})
            )
            discovery = KubernetesDiscovery(
                "default", "app=engine", 9, api_client=client, backoff=FAST, model_backoff=FAST
            )
            opts = RouterOptions(port=0, routing="default", kv_events=False, discovery=discovery)
            async with running_router(opts) as router:
                registry, url = router.app.registry, "http://127.0.0.1:9"
                await eventually(lambda: url in registry)
                assert registry.set_draining(url, True)
                api.set_ready("a", False)
                await eventually(lambda: url not in registry)
                api.set_ready("a", True)
                await eventually(lambda: url in registry)
                entry = registry.get(url)
                assert entry is not None and entry.state.draining and not entry.state.routable
                # An undrain while the engine is away is kept too.
                api.set_ready("a", False)
                await eventually(lambda: url not in registry)
                assert registry.set_draining(url, False)
                assert not registry.set_draining(url, False)  # nothing left to undrain
                api.set_ready("a", True)
                await eventually(lambda: url in registry)
                entry = registry.get(url)
                assert entry is not None and not entry.state.draining
    finally:
        await api.close()


async def test_an_admin_removal_ends_a_drain() -> None:
    from kvstack.engines.state import Endpoint
    from kvstack.router.server import RouterOptions, start_router

    url = "http://127.0.0.1:9"
    router = await start_router(RouterOptions(port=0, engines=[Endpoint(url, models=frozenset({"m"}))]))
    try:
        router.app._apply_admin("drain", {"url": url})
        router.app._apply_admin("remove", {"url": url})
        router.app._apply_admin("add", {"url": url, "models": ["m"]})
        entry = router.app.registry.get(url)
        assert entry is not None and not entry.state.draining
    finally:
        await router.stop()


@pytest.mark.parametrize("where", ["spec", "file"])
def test_a_kv_events_endpoint_must_be_tcp_or_ipc(where: str) -> None:
    from kvstack.engines.discovery import parse_engine_spec

    with pytest.raises(DiscoveryConfigError, match="must be tcp://host:port or ipc://path"):
        if where == "spec":
            parse_engine_spec("http://h:8000#kv-events=127.0.0.1:5557")
        else:
            parse_engines_file("engines:\n  - {url: 'http://h:8000', kv_events: '127.0.0.1:5557'}\n")
    assert parse_engine_spec("http://h:8000#kv-events=ipc:///tmp/e").kv_events_endpoint == "ipc:///tmp/e"


async def test_without_kv_events_a_removed_engines_history_is_forgotten() -> None:
    from kvstack.router.server import start_router

    url = "http://127.0.0.1:9"
    router = await start_router(
        RouterOptions(
            port=0, engines=[Endpoint(url, models=frozenset({"m"}))], kv_events=False, routing="prefix"
        )
    )
    try:
        assert router.locator is not None
        router.locator.history.record(url, [1, 2, 3], time.monotonic())
        assert url in router.locator.history.locations()
        router.app.remove_engine(url)
        assert url not in router.locator.history.locations()
    finally:
        await router.stop()
