"""Discovery: static specs, the polled engines file (bad entries reported, the last good list kept), and
Kubernetes pods through the real kubernetes_asyncio client talking to support/fake_k8s.py over HTTP (list,
watch, expiry, dropped streams, flapping pods)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Collection
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio.client import ApiClient, Configuration

from kvstack.backoff import Backoff
from kvstack.engines.discovery import (
    Discovery,
    DiscoveryConfigError,
    DiscoveryUpdate,
    FileDiscovery,
    KubernetesDiscovery,
    PodKeys,
    StaticDiscovery,
    UpdateKind,
    parse_engine_spec,
    parse_engines_file,
)
from kvstack.engines.state import Endpoint, EngineRole
from support.fake_k8s import FakeKubeApi, make_pod, selector_matches
from support.waiting import eventually

FAST = Backoff(initial_s=0.02, max_s=0.2)
LOGGER = "kvstack.engines.discovery"


class Registry:
    """Applies updates as the router's registry does; records the events and any protocol violation."""

    def __init__(self) -> None:
        self.endpoints: dict[str, Endpoint] = {}
        self.events: list[DiscoveryUpdate] = []
        self.violations: list[str] = []

    def __call__(self, update: DiscoveryUpdate) -> None:
        self.events.append(update)
        url = update.endpoint.url
        if update.kind is UpdateKind.REMOVED:
            if url not in self.endpoints:
                self.violations.append(f"removed unknown {url}")
            self.endpoints.pop(url, None)
            return
        if (update.kind is UpdateKind.ADDED) == (url in self.endpoints):
            self.violations.append(f"{update.kind.value} {url} while known={url in self.endpoints}")
        self.endpoints[url] = update.endpoint

    def kinds(self) -> list[tuple[str, str]]:
        return [(e.kind.value, e.endpoint.url) for e in self.events]


@asynccontextmanager
async def running(discovery: Discovery) -> AsyncIterator[Registry]:
    registry = Registry()
    discovery.start(registry)
    try:
        yield registry
    finally:
        await discovery.stop()
    assert registry.violations == []
    assert registry.endpoints == discovery.endpoints()


# -- static ------------------------------------------------------------------------------------------------


def test_engine_spec_plain_url() -> None:
    assert parse_engine_spec("http://10.0.0.5:8000/") == Endpoint("http://10.0.0.5:8000")
    assert parse_engine_spec("h:8000").url == "http://h:8000"
    assert parse_engine_spec("https://gw.example/engine-1").url == "https://gw.example/engine-1"


def test_engine_spec_options() -> None:
    spec = "http://h:8000#type=SGLang, role=prefill,model=a,model=b,node=n1,kv-events=tcp://h:5557"
    assert parse_engine_spec(spec) == Endpoint(
        url="http://h:8000",
        engine_type="sglang",
        role=EngineRole.PREFILL,
        models=frozenset({"a", "b"}),
        node="n1",
        kv_events_endpoint="tcp://h:5557",
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("http://h:8000#role=prefil", "role 'prefil' is not one of both, prefill, decode"),
        ("http://h:8000#type=vlm", "engine type 'vlm' is not one of"),
        ("http://h:8000#colour=red", "unknown option 'colour'"),
        ("http://h:8000#role", "option 'role' should be key=value"),
        ("http://h:port", "is not an engine base URL"),
        ("ftp://h:8000", "is not an engine base URL"),
        ("http://h:8000?x=1", "is not an engine base URL"),
    ],
)
def test_engine_spec_errors_say_what_and_where(spec: str, message: str) -> None:
    with pytest.raises(DiscoveryConfigError, match="--engine") as info:
        parse_engine_spec(spec)
    assert message in str(info.value)


def test_static_rejects_duplicates() -> None:
    with pytest.raises(DiscoveryConfigError, match="http://h:8000 is listed twice"):
        StaticDiscovery(["http://h:8000", "h:8000/#role=decode"])


async def test_static_publishes_and_fetches_models() -> None:
    calls: list[str] = []

    async def fetch(url: str) -> Collection[str]:
        calls.append(url)
        if len(calls) < 3 and url.endswith(":1"):
            raise ConnectionRefusedError("engine not up yet")
        return [f"model-of-{url[-1]}"]

    discovery = StaticDiscovery(
        ["http://a:1", "http://b:2#model=given"], fetch_models=fetch, model_backoff=FAST
    )
    async with running(discovery) as registry:
        await discovery.wait_synced()
        assert registry.kinds() == [("added", "http://a:1"), ("added", "http://b:2")]
        await eventually(lambda: registry.endpoints["http://a:1"].models == {"model-of-1"})
        assert registry.kinds()[-1] == ("updated", "http://a:1")
        assert registry.endpoints["http://b:2"].models == {"given"}
        assert calls == ["http://a:1"] * 3  # retried; the engine with a configured model is never asked


# -- file --------------------------------------------------------------------------------------------------

FILE_V1 = """
engines:
  - url: http://10.0.0.1:8000
    type: vllm
    role: prefill
    models: [m1]
    node: node-a
    kv_events: tcp://10.0.0.1:5557
    labels: {zone: a, tier: 1}
  - url: http://10.0.0.2:8000
    models: m1
  - "http://10.0.0.3:8000#role=decode,model=m1"
"""

FILE_V2 = """
engines:
  - url: http://10.0.0.1:8000
    role: decode
    models: [m1]
    node: node-a
    kv_events: tcp://10.0.0.1:5557
    labels: {zone: a, tier: 1}
  - "http://10.0.0.3:8000#role=decode,model=m1"
  - {url: "http://10.0.0.4:8000", models: [m2]}
"""


def test_engines_file_parses_every_field() -> None:
    first, second, third = parse_engines_file(FILE_V1)
    assert first == Endpoint(
        url="http://10.0.0.1:8000",
        engine_type="vllm",
        role=EngineRole.PREFILL,
        models=frozenset({"m1"}),
        labels=(("tier", "1"), ("zone", "a")),
        node="node-a",
        kv_events_endpoint="tcp://10.0.0.1:5557",
    )
    assert second == Endpoint("http://10.0.0.2:8000", models=frozenset({"m1"}))
    assert third.role is EngineRole.DECODE


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("engines:\n  - url: [unclosed\n", "e.yaml: invalid YAML at line 3, column 1"),
        ("", "e.yaml: file is empty; write 'engines: []'"),
        ("- http://h:1\n", "expected a mapping with the key 'engines'"),
        ("engines: []\nengine: []\n", "unknown top-level key(s) engine"),
        ("engines:\n  - {url: http://h:1, rol: decode}\n", "engines[0]: unknown key(s) rol"),
        (
            "engines:\n  - {url: http://h:1}\n  - {url: http://h:2, role: x}\n",
            "engines[1] (http://h:2): role 'x' is not one of",
        ),
        ("engines:\n  - {type: vllm}\n", "engines[0]: 'url' is required"),
        ("engines:\n  - http://h:1\n  - http://h:1/\n", "http://h:1 is listed twice"),
        ("engines:\n  - {url: http://h:1, models: [1, 2]}\n", "'models' must be a list of model names"),
    ],
)
def test_engines_file_errors_say_what_and_where(text: str, message: str) -> None:
    with pytest.raises(DiscoveryConfigError) as info:
        parse_engines_file(text, "e.yaml")
    assert message in str(info.value)


def write(path: Path, text: str) -> None:
    """Replace the file atomically, as config management tools do."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


async def test_file_reload_emits_only_differences(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "engines.yaml"
    write(path, FILE_V1)
    discovery = FileDiscovery(path, poll_interval_s=0.02)
    async with running(discovery) as registry:
        await discovery.wait_synced()
        assert sorted(registry.endpoints) == [
            "http://10.0.0.1:8000",
            "http://10.0.0.2:8000",
            "http://10.0.0.3:8000",
        ]

        registry.events.clear()
        write(path, FILE_V2)
        await eventually(lambda: len(registry.events) == 3)
        await asyncio.sleep(0.1)
        assert registry.kinds() == [
            ("removed", "http://10.0.0.2:8000"),
            ("updated", "http://10.0.0.1:8000"),
            ("added", "http://10.0.0.4:8000"),
        ]
        assert registry.endpoints["http://10.0.0.1:8000"].role is EngineRole.DECODE

        # Same content rewritten in place: new mtime, same hash, nothing to publish.
        registry.events.clear()
        path.write_text(FILE_V2)
        await asyncio.sleep(0.1)
        assert registry.events == []

        # An invalid file keeps the last good state and says once what is wrong and where.
        caplog.clear()
        good = dict(registry.endpoints)
        with caplog.at_level(logging.ERROR, LOGGER):
            write(path, FILE_V2.replace("role: decode", "role: decoder"))
            await asyncio.sleep(0.2)
            write(
                path, FILE_V2.replace("role: decode", "role: decoder")
            )  # rewritten: same error, not repeated
            await asyncio.sleep(0.2)
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1, errors
        assert f"engines file {path}: engines[0] (http://10.0.0.1:8000): role 'decoder'" in errors[0]
        assert "keeping the last good list (3 engines)" in errors[0]
        assert registry.endpoints == good and registry.events == []

        # A missing file is one error too, and also keeps the engines.
        caplog.clear()
        with caplog.at_level(logging.ERROR, LOGGER):
            path.unlink()
            await asyncio.sleep(0.2)
        assert [r.getMessage() for r in caplog.records if "cannot read it" in r.getMessage()] != []
        assert len(caplog.records) == 1
        assert registry.endpoints == good

        # Fixed: back to publishing differences.
        write(path, "engines:\n  - http://10.0.0.9:8000\n")
        await eventually(lambda: list(registry.endpoints) == ["http://10.0.0.9:8000"])


async def test_file_invalid_from_the_start_then_fixed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "engines.yaml"
    write(path, "engines:\n  - {url: http://h:1, role: x}\n")
    discovery = FileDiscovery(path, poll_interval_s=0.02)
    with caplog.at_level(logging.ERROR, LOGGER):
        async with running(discovery) as registry:
            await discovery.wait_synced()
            assert registry.endpoints == {}
            write(path, "engines:\n  - {url: http://h:1, role: decode}\n")
            await eventually(lambda: "http://h:1" in registry.endpoints)
    assert "no engines loaded from it yet" in caplog.records[0].getMessage()


async def test_bad_url_in_engines_file_is_reported_and_reloading_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "engines.yaml"
    write(path, "engines:\n  - url: http://127.0.0.1:18101\n")
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
            write(path, 'engines:\n  - url: http://127.0.0.1:18101\n  - url: "http://[::1:18102"\n')
            await eventually(lambda: any("engines[1]" in r.getMessage() for r in caplog.records))
            await asyncio.sleep(0.1)  # a few more polls: the task must still be alive
        (error,) = [r.getMessage() for r in caplog.records]
        assert f"engines file {path}: engines[1]: 'http://[::1:18102' is not an engine base URL" in error
        assert "Invalid IPv6 URL" in error and "keeping the last good list (1 engines)" in error
        assert list(seen) == ["http://127.0.0.1:18101"]
        write(path, "engines:\n  - url: http://127.0.0.1:18101\n  - url: http://[::1]:18102\n")
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


@pytest.mark.parametrize("where", ["spec", "file"])
def test_a_kv_events_endpoint_must_be_tcp_or_ipc(where: str) -> None:
    with pytest.raises(DiscoveryConfigError, match="must be tcp://host:port or ipc://path"):
        if where == "spec":
            parse_engine_spec("http://h:8000#kv-events=127.0.0.1:5557")
        else:
            parse_engines_file("engines:\n  - {url: 'http://h:8000', kv_events: '127.0.0.1:5557'}\n")
    assert parse_engine_spec("http://h:8000#kv-events=ipc:///tmp/e").kv_events_endpoint == "ipc:///tmp/e"


# -- kubernetes --------------------------------------------------------------------------------------------

SELECTOR = "app=engine"
LABELS = {"app": "engine", "kvstack.io/engine-type": "vllm", "kvstack.io/role": "both"}


@pytest.fixture
async def fake_k8s() -> AsyncIterator[FakeKubeApi]:
    api = FakeKubeApi()
    await api.start()
    yield api
    await api.close()


@pytest.fixture
async def k8s_client(fake_k8s: FakeKubeApi) -> AsyncIterator[ApiClient]:
    async with ApiClient(configuration=Configuration(host=fake_k8s.url)) as client:
        yield client


def k8s_discovery(client: ApiClient, **kwargs: Any) -> KubernetesDiscovery:
    kwargs.setdefault("backoff", FAST)
    kwargs.setdefault("model_backoff", FAST)
    return KubernetesDiscovery("default", SELECTOR, 8000, api_client=client, **kwargs)


def test_fake_label_selector() -> None:
    labels = {"app": "engine", "tier": "gpu"}
    assert selector_matches("app=engine,tier in (gpu, cpu)", labels)
    assert selector_matches("app==engine,!missing,tier", labels)
    assert not selector_matches("app!=engine", labels)
    assert not selector_matches("tier notin (gpu)", labels)


async def test_pods_appear_when_ready_and_leave_on_not_ready_or_deletion(
    fake_k8s: FakeKubeApi, k8s_client: ApiClient
) -> None:
    labels = {"app": "engine", "kvstack.io/engine-type": "sglang", "kvstack.io/role": "prefill"}
    fake_k8s.add_pod(
        make_pod(
            "e1",
            "10.1.0.1",
            ready=False,
            labels=labels,
            annotations={"kvstack.io/kv-events": "5557", "kvstack.io/models": "m1, m2"},
        )
    )
    fake_k8s.add_pod(make_pod("pending", None, phase="Pending", labels=LABELS))
    fake_k8s.add_pod(make_pod("other-app", "10.1.0.9", labels={"app": "web"}))
    discovery = k8s_discovery(k8s_client)
    async with running(discovery) as registry:
        await discovery.wait_synced()
        assert registry.endpoints == {}

        fake_k8s.set_ready("e1", True)
        await eventually(lambda: "http://10.1.0.1:8000" in registry.endpoints)
        assert registry.endpoints["http://10.1.0.1:8000"] == Endpoint(
            url="http://10.1.0.1:8000",
            engine_type="sglang",
            role=EngineRole.PREFILL,
            models=frozenset({"m1", "m2"}),
            labels=tuple(sorted(labels.items())),
            node="node-a",
            kv_events_endpoint="tcp://10.1.0.1:5557",
        )

        fake_k8s.set_ready("e1", False)
        await eventually(lambda: registry.endpoints == {})
        fake_k8s.set_ready("e1", True)
        await eventually(lambda: len(registry.endpoints) == 1)

        # Deletion with a grace period: deletionTimestamp first (traffic stops), the DELETED event later.
        fake_k8s.mark_terminating("e1")
        await eventually(lambda: registry.endpoints == {})
        fake_k8s.delete_pod("e1")

        # A pending pod gets an IP and becomes Ready; a pod relabelled into the selector joins.
        def run(pod: dict[str, Any]) -> None:
            pod["status"].update(phase="Running", podIP="10.1.0.2")

        fake_k8s.update_pod("pending", run)
        fake_k8s.update_pod("other-app", lambda pod: pod["metadata"]["labels"].update(app="engine"))
        await eventually(
            lambda: sorted(registry.endpoints) == ["http://10.1.0.2:8000", "http://10.1.0.9:8000"]
        )
        fake_k8s.update_pod("other-app", lambda pod: pod["metadata"]["labels"].update(app="web"))
        await eventually(lambda: sorted(registry.endpoints) == ["http://10.1.0.2:8000"])
        fake_k8s.delete_pod("pending")  # forced deletion: DELETED with no terminating phase first
        await eventually(lambda: registry.endpoints == {})
        assert registry.kinds()[:4] == [
            ("added", "http://10.1.0.1:8000"),
            ("removed", "http://10.1.0.1:8000"),
            ("added", "http://10.1.0.1:8000"),
            ("removed", "http://10.1.0.1:8000"),
        ]
        assert discovery.resyncs == 1  # all of this came through one watch


async def test_labels_and_annotations_map_to_endpoint_fields(
    fake_k8s: FakeKubeApi, k8s_client: ApiClient, caplog: pytest.LogCaptureFixture
) -> None:
    fake_k8s.add_pod(
        make_pod(
            "decode",
            "10.2.0.1",
            labels={**LABELS, "kvstack.io/role": "decode"},
            annotations={"kvstack.io/kv-events": "tcp://*:6000"},
        )
    )
    fake_k8s.add_pod(make_pod("plain", "10.2.0.2", labels={"app": "engine"}, node="node-b"))
    fake_k8s.add_pod(make_pod("typo", "10.2.0.3", labels={"app": "engine", "kvstack.io/role": "prefil"}))
    fake_k8s.add_pod(
        make_pod(
            "v6",
            "fd00::7",
            labels={"app": "engine", "engine": "trtllm"},
            annotations={"kvstack.io/kv-events": "5557"},
        )
    )
    with caplog.at_level(logging.WARNING, LOGGER):
        discovery = k8s_discovery(k8s_client, keys=PodKeys(engine_type_label="engine"))
        async with running(discovery) as registry:
            await discovery.wait_synced()
    eps = registry.endpoints
    assert eps["http://10.2.0.1:8000"].role is EngineRole.DECODE
    assert eps["http://10.2.0.1:8000"].kv_events_endpoint == "tcp://10.2.0.1:6000"
    assert eps["http://10.2.0.2:8000"] == Endpoint(
        "http://10.2.0.2:8000", labels=(("app", "engine"),), node="node-b"
    )
    assert eps["http://10.2.0.3:8000"].role is EngineRole.BOTH
    assert eps["http://[fd00::7]:8000"].engine_type == "trtllm"
    assert eps["http://[fd00::7]:8000"].kv_events_endpoint == "tcp://[fd00::7]:5557"
    warnings = [r.getMessage() for r in caplog.records]
    assert any(
        "pod default/typo: role 'prefil' is not one of" in w and "treating it as both" in w for w in warnings
    )


async def test_models_from_the_injected_fetcher(fake_k8s: FakeKubeApi, k8s_client: ApiClient) -> None:
    calls: list[str] = []

    async def fetch(url: str) -> Collection[str]:
        calls.append(url)
        if calls.count(url) == 1:
            raise TimeoutError("first try times out")
        return ["served-" + url.rsplit(".", 1)[1]]

    fake_k8s.add_pod(make_pod("a", "10.3.0.1", labels=LABELS))
    fake_k8s.add_pod(make_pod("b", "10.3.0.2", labels=LABELS, annotations={"kvstack.io/models": "annotated"}))
    discovery = k8s_discovery(k8s_client, fetch_models=fetch)
    async with running(discovery) as registry:
        await discovery.wait_synced()
        assert registry.endpoints["http://10.3.0.1:8000"].models == frozenset()  # published before it answers
        await eventually(lambda: registry.endpoints["http://10.3.0.1:8000"].models == {"served-1:8000"})
        assert registry.endpoints["http://10.3.0.2:8000"].models == {"annotated"}
        assert calls == ["http://10.3.0.1:8000"] * 2


async def test_flapping_pods_end_in_the_right_state(fake_k8s: FakeKubeApi, k8s_client: ApiClient) -> None:
    async def fetch(url: str) -> Collection[str]:
        await asyncio.sleep(0.01)  # long enough for flaps to land while a fetch is in flight
        return ["m"]

    names = [f"f{i}" for i in range(6)]
    for i, name in enumerate(names):
        fake_k8s.add_pod(make_pod(name, f"10.4.0.{i}", labels=LABELS))
    discovery = k8s_discovery(k8s_client, fetch_models=fetch)
    async with running(discovery) as registry:
        await discovery.wait_synced()
        for flap in range(7):
            for i, name in enumerate(names):
                fake_k8s.set_ready(name, (flap + i) % 2 == 1)
            await asyncio.sleep(0.003 * (flap % 3))  # some flaps in one burst, some spread out
        # After 7 rounds, pod i is ready when (6 + i) is odd.
        expected = {f"http://10.4.0.{i}:8000" for i in range(6) if (6 + i) % 2 == 1}
        await eventually(
            lambda: (
                set(registry.endpoints) == expected
                and all(ep.models == {"m"} for ep in registry.endpoints.values())
            )
        )
        await asyncio.sleep(0.1)
        assert set(registry.endpoints) == expected
        assert discovery.resyncs == 1


async def test_watch_expiry_resyncs_with_the_right_set(fake_k8s: FakeKubeApi, k8s_client: ApiClient) -> None:
    for i in range(3):
        fake_k8s.add_pod(make_pod(f"p{i}", f"10.5.0.{i}", labels=LABELS))
    discovery = k8s_discovery(k8s_client)
    async with running(discovery) as registry:
        await discovery.wait_synced()
        assert len(registry.endpoints) == 3
        await eventually(lambda: fake_k8s.open_watches == 1)
        lists = fake_k8s.list_calls

        # The watch stalls, misses changes, then the server says its version is gone.
        fake_k8s.pause_watches()
        fake_k8s.delete_pod("p0")
        fake_k8s.set_ready("p1", False)
        fake_k8s.add_pod(make_pod("p3", "10.5.0.3", labels=LABELS))
        fake_k8s.delete_pod("p2")  # its IP goes to a new pod: same URL, different engine
        fake_k8s.add_pod(make_pod("p2-new", "10.5.0.2", labels={**LABELS, "kvstack.io/role": "decode"}))
        await asyncio.sleep(0.05)
        assert len(registry.endpoints) == 3  # nothing seen yet
        registry.events.clear()
        fake_k8s.pause_watches(False)
        fake_k8s.expire_watches()

        await eventually(lambda: discovery.resyncs == 2)
        assert fake_k8s.list_calls == lists + 1
        assert sorted(registry.endpoints) == ["http://10.5.0.2:8000", "http://10.5.0.3:8000"]
        assert registry.endpoints["http://10.5.0.2:8000"].role is EngineRole.DECODE
        assert registry.kinds() == [
            ("removed", "http://10.5.0.0:8000"),
            ("removed", "http://10.5.0.1:8000"),
            ("removed", "http://10.5.0.2:8000"),
            ("added", "http://10.5.0.2:8000"),
            ("added", "http://10.5.0.3:8000"),
        ]

        # The new watch works.
        fake_k8s.set_ready("p1", True)
        await eventually(lambda: "http://10.5.0.1:8000" in registry.endpoints)
        assert discovery.resyncs == 2


@pytest.mark.parametrize("abrupt", [False, True], ids=["stream-closed", "connection-cut"])
async def test_dropped_watch_resyncs(fake_k8s: FakeKubeApi, k8s_client: ApiClient, abrupt: bool) -> None:
    fake_k8s.add_pod(make_pod("a", "10.6.0.1", labels=LABELS))
    fake_k8s.add_pod(make_pod("b", "10.6.0.2", labels=LABELS))
    discovery = k8s_discovery(k8s_client)
    async with running(discovery) as registry:
        await discovery.wait_synced()
        await eventually(lambda: fake_k8s.open_watches == 1)
        watches = fake_k8s.watch_calls
        fake_k8s.pause_watches()
        fake_k8s.delete_pod("b")
        fake_k8s.add_pod(make_pod("c", "10.6.0.3", labels=LABELS))
        fake_k8s.pause_watches(False)
        fake_k8s.drop_watches(abrupt=abrupt)
        await eventually(
            lambda: sorted(registry.endpoints) == ["http://10.6.0.1:8000", "http://10.6.0.3:8000"]
        )
        assert discovery.resyncs == 2
        await eventually(lambda: fake_k8s.watch_calls == watches + 1)


async def test_api_server_outage_backs_off_then_resyncs(
    fake_k8s: FakeKubeApi, k8s_client: ApiClient, caplog: pytest.LogCaptureFixture
) -> None:
    fake_k8s.add_pod(make_pod("a", "10.7.0.1", labels=LABELS))
    fake_k8s.add_pod(make_pod("b", "10.7.0.2", labels=LABELS))
    discovery = k8s_discovery(k8s_client)
    async with running(discovery) as registry:
        await discovery.wait_synced()
        await eventually(lambda: fake_k8s.open_watches == 1)
        with caplog.at_level(logging.WARNING, LOGGER):
            fake_k8s.set_available(False)  # cuts the watch; re-lists get 503
            fake_k8s.delete_pod("b")  # while nobody can see it
            await asyncio.sleep(0.3)
            assert "http://10.7.0.2:8000" in registry.endpoints  # last known state is kept during the outage
            fake_k8s.set_available(True)
            await eventually(lambda: sorted(registry.endpoints) == ["http://10.7.0.1:8000"])
        assert any("API error 503" in r.getMessage() for r in caplog.records)
        fake_k8s.add_pod(make_pod("c", "10.7.0.3", labels=LABELS))
        await eventually(lambda: "http://10.7.0.3:8000" in registry.endpoints)
