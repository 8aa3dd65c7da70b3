"""The router's admission control and admin API: the in-flight and queue limits (429 with Retry-After),
admin and API keys, adding engines (every field checked, unusable URLs refused, given models kept),
draining and removing them."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from kvstack.engines.state import Endpoint
from kvstack.router.app import RouterConfig
from kvstack.router.server import RouterOptions, start_router
from kvstack.sim.cluster import RunningEngine, stop_engine
from support.routers import (
    MODEL,
    router_for,
    start_sims,
    wait_models,
)

# -- admission -----------------------------------------------------------------------------------------------


async def test_admission_queue_full_gives_429_with_retry_after() -> None:
    engines = await start_sims(1, time_scale=2.0)
    opts = RouterOptions(port=0, engines=[Endpoint(engines[0].url)], max_in_flight=2, max_queue=2)
    router = await start_router(opts)
    await wait_models(router, 1)
    try:
        async with aiohttp.ClientSession() as http:

            async def one() -> tuple[int, str | None]:
                body = {"model": MODEL, "prompt": "x", "max_tokens": 20, "ignore_eos": True}
                async with http.post(f"{router.url}/v1/completions", json=body) as r:
                    await r.read()
                    return r.status, r.headers.get("Retry-After")

            results = await asyncio.gather(*(one() for _ in range(8)))
        ok = [r for r in results if r[0] == 200]
        limited = [r for r in results if r[0] == 429]
        assert len(ok) == 4 and len(limited) == 4
        assert all(ra is not None and int(ra) >= 1 for _, ra in limited)
    finally:
        await router.stop()
        await stop_engine(engines[0])


# -- admin access --------------------------------------------------------------------------------------------


async def test_admin_endpoints_need_the_key_and_drain_works() -> None:
    engines = await start_sims(2)
    opts = RouterOptions(
        port=0,
        engines=[Endpoint(engines[0].url)],
        app=RouterConfig(admin_key="s3cret", api_keys=frozenset({"k1"})),
    )
    router = await start_router(opts)
    try:
        async with aiohttp.ClientSession() as http:
            add = {"url": engines[1].url}
            async with http.post(f"{router.url}/admin/engines", json=add) as r:
                assert r.status == 401
            admin = {"Authorization": "Bearer s3cret"}
            async with http.post(f"{router.url}/admin/engines", json=add, headers=admin) as r:
                assert r.status == 200
            await wait_models(router, 2)
            async with http.post(
                f"{router.url}/admin/engines/drain", json={"url": engines[0].url}, headers=admin
            ) as r:
                assert r.status == 200 and (await r.json())["draining"] is True
            client_auth = {"Authorization": "Bearer k1"}
            body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
            async with http.post(f"{router.url}/v1/completions", json=body) as r:
                assert r.status == 401
            for _ in range(5):
                async with http.post(f"{router.url}/v1/completions", json=body, headers=client_auth) as r:
                    assert r.status == 200
            async with http.get(f"{engines[1].url}/metrics") as r:
                text = await r.text()
            assert (
                'vllm:request_success_total{engine="0",finished_reason="length",model_name="sim-model"} 5.0'
                in text
            )
            async with http.delete(
                f"{router.url}/admin/engines", params={"url": engines[1].url}, headers=admin
            ) as r:
                assert r.status == 200
            async with http.get(f"{router.url}/ready") as r:
                assert r.status == 503  # the only engine left is draining
    finally:
        await router.stop()
        for e in engines:
            await stop_engine(e)


@pytest.mark.parametrize(("api_keys", "protected"), [(frozenset({"k1"}), True), (frozenset(), False)])
async def test_admin_routes_without_an_admin_key_need_an_api_key_if_there_are_any(
    sims: list[RunningEngine], api_keys: frozenset[str], protected: bool
) -> None:
    router = await router_for(Endpoint(sims[0].url), app=RouterConfig(api_keys=api_keys))
    try:
        async with aiohttp.ClientSession() as http:
            admin = f"{router.url}/admin/engines"
            async with http.post(admin, json={"url": sims[1].url}) as r:
                assert r.status == (401 if protected else 200)
            async with http.delete(admin, params={"url": "http://127.0.0.1:1"}) as r:
                assert r.status == (401 if protected else 404)
            key = {"Authorization": "Bearer k1"}
            async with http.post(admin, json={"url": sims[1].url}, headers=key) as r:
                assert r.status == 200
            async with http.post(
                f"{admin}/drain", json={"url": sims[1].url}, headers={"Authorization": "Bearer k2"}
            ) as r:
                assert r.status == (401 if protected else 200)
    finally:
        await router.stop()


# -- adding engines ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    ["http:", "http://127.0.0.1:99999", "http://[::1", "http://127.0.0.1:0", "ftp://x", "http://a b:1", "x"],
)
async def test_admin_add_refuses_an_unusable_url(sims: list[RunningEngine], bad: str) -> None:
    router = await router_for(Endpoint(sims[0].url))
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{router.url}/admin/engines", json={"url": bad}) as r:
                body = await r.json()
                assert r.status == 400 and body["error"]["param"] == "url", body
            assert [e.state.url for e in router.app.registry] == [sims[0].url]
    finally:
        await router.stop()


@pytest.mark.parametrize(
    ("field", "value"),
    [("type", "nonsense"), ("type", 5), ("node", 5), ("node", ""), ("kv_events_endpoint", "127.0.0.1:5557")],
)
async def test_admin_add_checks_every_field(sims: list[RunningEngine], field: str, value: Any) -> None:
    router = await router_for(Endpoint(sims[0].url))
    try:
        async with aiohttp.ClientSession() as http:
            add = {"url": sims[1].url, field: value}
            async with http.post(f"{router.url}/admin/engines", json=add) as r:
                body = await r.json()
                assert r.status == 400 and body["error"]["param"] == field, body
            # An engine type in another case is the same type (as on the command line and in YAML).
            async with http.post(
                f"{router.url}/admin/engines", json={"url": sims[1].url, "type": "VLLM"}
            ) as r:
                assert r.status == 200
            entry = router.app.registry.get(sims[1].url)
            assert entry is not None and entry.state.endpoint.engine_type == "vllm"
    finally:
        await router.stop()


async def test_models_given_for_an_engine_are_kept_not_replaced_by_its_own_list(
    sims: list[RunningEngine],
) -> None:
    router = await router_for(Endpoint(sims[0].url, models=frozenset({"only-this"})), Endpoint(sims[1].url))
    try:
        await wait_models(router, 2)  # the second engine's models are learned from its /v1/models
        await asyncio.sleep(0.5)  # past the first /v1/models refresh, which used to overwrite given models
        models = {e.state.url: e.state.endpoint.models for e in router.app.registry}
        assert models == {sims[0].url: {"only-this"}, sims[1].url: {MODEL}}
    finally:
        await router.stop()
