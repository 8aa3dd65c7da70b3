"""The router's engine registry as discovery, scrapes and admins change it: an engine whose connects never
complete turns unhealthy, a drain survives a pod readiness flap, an admin removal ends a drain, a
removed engine's routing history is forgotten, and the send times kept per engine stay bounded."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kubernetes_asyncio.client import ApiClient, Configuration

from kvstack.backoff import Backoff
from kvstack.engines.discovery import KubernetesDiscovery
from kvstack.engines.state import RECENT_SENDS, Endpoint, EngineState
from kvstack.frontend.registry import RECENT_SLACK, EngineRegistry
from kvstack.router.server import RouterOptions, running_router, start_router
from kvstack.scheduling.scorers.least_qps import LeastQPSScorer
from support.fake_k8s import FakeKubeApi, make_pod
from support.waiting import eventually

FAST = Backoff(initial_s=0.02, max_s=0.2)
MODEL = "m"


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


# -- health --------------------------------------------------------------------------------------------------


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


# -- drains and removals -------------------------------------------------------------------------------------


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


async def test_without_kv_events_a_removed_engines_history_is_forgotten() -> None:
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


def test_send_times_stay_bounded_and_least_qps_counts_at_most_the_kept_ones() -> None:
    state = EngineState(Endpoint("http://e:1"))
    now = 1000.0
    sizes = []
    for _ in range(50_000):  # 5 kHz for 10 s: far more sends than are kept
        now += 0.0002
        EngineRegistry.note_sent(state, now)
        sizes.append(len(state.recent_requests))
    assert RECENT_SENDS <= max(sizes[RECENT_SENDS + RECENT_SLACK :]) <= RECENT_SENDS + RECENT_SLACK
    assert min(sizes[RECENT_SENDS + RECENT_SLACK :]) >= RECENT_SENDS  # cut in batches, never below
    assert state.recent_requests == sorted(state.recent_requests)
    assert LeastQPSScorer().qps(state, now) == RECENT_SENDS / 10  # however many above the cap are kept
    # A quiet engine keeps only its last window's.
    for t in (now + 30, now + 45, now + 52):
        EngineRegistry.note_sent(state, t)
    assert state.recent_requests == [now + 45, now + 52]
