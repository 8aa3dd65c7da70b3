"""Kubernetes discovery end to end against a fake API server: a pod becomes routable once Ready and is
dropped once deleted."""

from __future__ import annotations

import asyncio

import aiohttp
from kubernetes_asyncio.client import ApiClient, Configuration

from kvstack.backoff import Backoff
from kvstack.engines.discovery import KubernetesDiscovery
from kvstack.router.server import RouterOptions, start_router
from support.end_to_end import MODEL, completion, inprocess_sims, post_status
from support.fake_k8s import FakeKubeApi, make_pod
from support.waiting import eventually


async def test_kubernetes_pod_ready_then_deleted() -> None:
    fake = FakeKubeApi()
    await fake.start()
    try:
        async with (
            inprocess_sims(1, time_scale=50) as (sim,),
            ApiClient(configuration=Configuration(host=fake.url)) as api,
            aiohttp.ClientSession() as http,
        ):
            # discovery builds http://<podIP>:<port>: the pod's IP is loopback, the port the simulator's.
            port = int(sim.url.rsplit(":", 1)[1])
            labels = {"app": "engine"}
            fake.add_pod(make_pod("engine-0", "127.0.0.1", ready=False, labels=labels))
            fake.add_pod(make_pod("other-0", "127.0.0.1", labels={"app": "something-else"}))
            fast = Backoff(initial_s=0.02, max_s=0.2)
            discovery = KubernetesDiscovery("default", "app=engine", port, api_client=api, backoff=fast)
            router = await start_router(
                RouterOptions(port=0, discovery=discovery, expected_models=frozenset({MODEL}))
            )
            try:
                await asyncio.wait_for(discovery.wait_synced(), 10)

                async def ready_status() -> int:
                    async with http.get(f"{router.url}/ready") as r:
                        return r.status

                assert await ready_status() == 503  # the only matching pod is not Ready
                assert len(router.app.registry) == 0

                fake.set_ready("engine-0", True)

                async def routable() -> bool:
                    return await ready_status() == 200

                await eventually(routable, what="/ready once the pod is Ready", timeout_s=15, interval_s=0.05)
                assert [e.state.url for e in router.app.registry] == [sim.url]
                for i in range(3):
                    assert await post_status(http, router, completion(2, prompt=f"k8s {i}")) == 200

                fake.delete_pod("engine-0")

                async def gone() -> bool:
                    return await ready_status() == 503

                await eventually(
                    gone, what="/ready 503 once the pod is deleted", timeout_s=15, interval_s=0.05
                )
                async with http.post(f"{router.url}/v1/completions", json=completion(2)) as r:
                    body = await r.json()
                    assert r.status == 404 and body["error"]["param"] == "model", body
                assert len(router.app.registry) == 0
            finally:
                await router.stop()
    finally:
        await fake.close()
