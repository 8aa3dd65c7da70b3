"""The checker's catalogs: engine specs, live pages, kvstack's own exporters; and conformance both ways
between the tables and real pages of the simulator (current and legacy names), the router, the Envoy picker
and the cache server after some traffic."""

from __future__ import annotations

import aiohttp
import pytest

from kvstack.board.catalogs import engine_catalog, kvstack_catalogs, live_catalog
from kvstack.cache import KVLayout, chunk_keys
from kvstack.cache.client import AsyncCacheClient
from kvstack.engines.names import Kind, names_for
from kvstack.engines.state import Endpoint
from kvstack.sim.cluster import stop_engine
from kvstack.sim.metrics import EngineMetrics
from support.cache import serving
from support.catalogs import disagreements
from support.ext_proc import body_message, headers_message, response_headers_message
from support.pickers import picking_over
from support.routers import MODEL, router_for, start_sims, wait_models

# -- engine_catalog ------------------------------------------------------------------------------------


def test_engine_catalog_specs() -> None:
    new = engine_catalog("vllm==0.32")
    assert new.label == "vllm 0.32" and new.role == "engine"
    assert "vllm:kv_cache_usage_perc" in new.metrics and "vllm:gpu_cache_usage_perc" in new.retired
    assert engine_catalog("vllm").metrics is new.metrics
    assert engine_catalog("vllm").label == "vllm (>= 0.10)"
    old = engine_catalog("vllm==0.9.1")
    assert "vllm:gpu_cache_usage_perc" in old.metrics and "vllm:kv_cache_usage_perc" in old.metrics
    assert old.metrics["vllm:kv_cache_usage_perc"].when.startswith("vLLM >= 0.9.2")
    assert engine_catalog("sglang").label == "sglang"
    assert set(engine_catalog("trtllm").metrics) >= {
        "trtllm_kv_cache_utilization",
        "trtllm_num_requests_running",
    }
    assert engine_catalog("triton").metrics["nv_inference_exec_count"].kind is Kind.COUNTER


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "vllm==abc",
            r"engine 'vllm==abc': cannot read engine version 'abc'.*expected TYPE or TYPE==VERSION",
        ),
        ("foo", r"unknown engine type 'foo'; known engine types: sglang, triton, trtllm, vllm"),
        (
            "vllm>=1",
            r"cannot read engine 'vllm>=1': expected TYPE or TYPE==VERSION, e.g. vllm==0.32, with TYPE",
        ),
        ("", r"cannot read engine ''"),
    ],
)
def test_engine_catalog_errors_say_what_is_accepted(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        engine_catalog(spec)


# -- live_catalog ---------------------------------------------------------------------------------------

PAGE = """\
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 12.0
# HELP vllm:prompt_tokens_created Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_created gauge
vllm:prompt_tokens_created{engine="0",model_name="m"} 1.7e9
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="1.0",model_name="m"} 1.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 1.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 1.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} 0.5
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
vllm:num_requests_waiting{engine="1",model_name="m",extra="x"} 0.0
# HELP vllm:lonely_created A gauge that only looks like a creation time.
# TYPE vllm:lonely_created gauge
vllm:lonely_created 1.0
# HELP kvstack_router_requests_total Requests.
# TYPE kvstack_router_requests_total counter
untyped_thing 3
"""


def test_live_catalog_reads_families_kinds_and_labels() -> None:
    page = live_catalog(PAGE, "live http://e:8000/metrics")
    assert page.label == "live http://e:8000/metrics" and page.role == "engine"
    m = page.metrics
    assert set(m) == {
        "vllm:prompt_tokens",
        "vllm:e2e_request_latency_seconds",
        "vllm:num_requests_waiting",
        "vllm:lonely_created",
        "kvstack_router_requests",
        "untyped_thing",
    }
    assert m["vllm:prompt_tokens"].kind is Kind.COUNTER
    assert m["vllm:prompt_tokens"].labels == {"engine", "model_name"}
    assert m["vllm:e2e_request_latency_seconds"].kind is Kind.HISTOGRAM
    assert m["vllm:e2e_request_latency_seconds"].labels == {"engine", "model_name"}  # no "le"
    assert m["vllm:num_requests_waiting"].labels == {"engine", "model_name", "extra"}  # the union
    assert m["kvstack_router_requests"].kind is Kind.COUNTER and m["kvstack_router_requests"].labels == set()
    assert m["untyped_thing"].kind is Kind.GAUGE


def test_live_catalog_reads_openmetrics() -> None:
    text = (
        "# TYPE kvstack_router_requests counter\n"
        'kvstack_router_requests_total{status="200"} 1.0\n'
        'kvstack_router_requests_created{status="200"} 1.7e9\n'
        "# TYPE vllm:cache_config_info info\n"
        'vllm:cache_config_info_info{block_size="16"} 1\n'
        "# EOF\n"
    )
    m = live_catalog(text, "x").metrics
    assert m["kvstack_router_requests"].kind is Kind.COUNTER and m["kvstack_router_requests"].labels == {
        "status"
    }
    assert m["vllm:cache_config_info"].kind is Kind.INFO


# -- kvstack_catalogs -----------------------------------------------------------------------------------


def test_kvstack_catalogs() -> None:
    catalogs = {c.label: c for c in kvstack_catalogs()}
    assert set(catalogs) == {"kvstack router", "kvstack epp", "kvstack sidecar", "kvstack cache server"}
    assert {c.role for c in catalogs.values()} == {"kvstack"}
    router = catalogs["kvstack router"].metrics
    assert router["kvstack_router_requests"].kind is Kind.COUNTER
    assert router["kvstack_router_requests"].labels == {"model", "engine", "status"}
    assert router["kvstack_router_time_to_first_byte_seconds"].kind is Kind.HISTOGRAM
    assert router["kvstack_router_time_to_first_byte_seconds"].labels == {"model"}
    # Families without a sample until an engine is seen still list their labels.
    assert router["kvstack_kv_event_resets"].labels == {"engine", "reason"}
    assert router["kvstack_router_tokens"].labels == {"model", "kind"}
    assert router["kvstack_router_queued_requests"].kind is Kind.GAUGE
    assert catalogs["kvstack epp"].metrics == router  # the picker exports the front end's families
    cache = catalogs["kvstack cache server"].metrics
    assert cache["kvstack_cache_hits"].labels == {"tier"}
    assert cache["kvstack_cache_payload_bytes"].labels == {"op", "path"}
    assert cache["kvstack_cache_operation_seconds"].kind is Kind.HISTOGRAM
    assert cache["kvstack_cache_events"].when and not cache["kvstack_cache_hits"].when
    assert all(n.startswith("kvstack_") for c in catalogs.values() for n in c.metrics)


# -- conformance: the simulator -------------------------------------------------------------------------


def _sim_page(*, legacy: bool) -> str:
    metrics = EngineMetrics("m", max_model_len=2048, block_size=16, num_gpu_blocks=64, legacy_names=legacy)
    return metrics.render().decode()


def test_sim_exports_only_names_of_the_vllm_0_32_table() -> None:
    assert disagreements(_sim_page(legacy=False), names_for("vllm", "0.32").metrics, conditional=False) == [
        # What vLLM 0.32 always registers and the simulator does not model:
        *(
            f"{n} ({names_for('vllm').metrics[n].kind.value}) is in the table and not on the page"
            for n in sorted(_NOT_SIMULATED)
        )
    ]


_NOT_SIMULATED = {
    "vllm:mm_cache_queries",
    "vllm:mm_cache_hits",
    "vllm:estimated_flops_per_gpu",
    "vllm:estimated_read_bytes_per_gpu",
    "vllm:estimated_write_bytes_per_gpu",
    # vLLM's API server page: the HTTP instrumentator and prometheus_client's process collectors.
    *(m.name for m in names_for("vllm").metrics.values() if not m.name.startswith("vllm:")),
}


def test_legacy_sim_names_are_those_of_the_older_table() -> None:
    """The legacy mode swaps the renamed names in: each is in the < 0.10 table (same kind, labels within its
    own) and is a retired name of the 0.32 table whose replacement the current mode exports instead. The other
    families it keeps are 0.32's (the < 0.10 table records only what a source places there)."""
    new, old = names_for("vllm", "0.32"), names_for("vllm", "0.9.1")
    legacy = live_catalog(_sim_page(legacy=True), "legacy").metrics
    current = live_catalog(_sim_page(legacy=False), "current").metrics
    swapped = set(legacy) - set(current)
    assert swapped == {
        "vllm:gpu_cache_usage_perc",
        "vllm:gpu_prefix_cache_queries",
        "vllm:gpu_prefix_cache_hits",
        "vllm:time_per_output_token_seconds",
    }
    # Page to tables: every family known, of its kind, with known labels (no direction back: see above).
    assert disagreements(_sim_page(legacy=True), {**new.metrics, **old.metrics}, missing=False) == []
    for name in swapped:
        found, want = legacy[name], old.metrics[name]
        assert found.kind.exposed_as == want.kind.exposed_as and found.labels <= want.labels, name
        replacement = new.retired[name].replacement
        assert replacement in current and replacement not in legacy, name
    for name in set(legacy) - swapped:
        assert name in new.metrics and name not in new.retired, name


# -- conformance: kvstack's own processes ---------------------------------------------------------------


async def test_router_page_is_its_catalog() -> None:
    engines = await start_sims(1, time_scale=100.0)
    router = await router_for(Endpoint(engines[0].url))
    try:
        await wait_models(router, 1)
        async with aiohttp.ClientSession() as http:
            body = {"model": MODEL, "prompt": "hello there", "max_tokens": 3}
            async with http.post(f"{router.url}/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
            async with http.post(f"{router.url}/v1/completions", json={"model": "no-such"}) as r:
                assert r.status >= 400
            async with http.get(f"{router.url}/metrics") as r:
                page = await r.text()
    finally:
        await router.stop()
        for e in engines:
            await stop_engine(e)
    declared = next(c for c in kvstack_catalogs() if c.label == "kvstack router").metrics
    assert disagreements(page, declared) == []
    live = live_catalog(page, "router").metrics
    assert live["kvstack_router_requests"].labels == {"model", "engine", "status"}  # traffic flowed


async def test_picker_page_is_its_catalog() -> None:
    engines = await start_sims(1, time_scale=100.0)
    try:
        async with picking_over(engines, routing="round-robin") as stack:
            stream = stack.client.stream()
            await stream.exchange(headers_message())
            await stream.exchange(body_message({"model": MODEL, "prompt": "hello there", "max_tokens": 3}))
            await stream.exchange(response_headers_message(200))
            await stream.close()
            async with aiohttp.ClientSession() as http, http.get(f"{stack.epp.http_url}/metrics") as r:
                page = await r.text()
    finally:
        for e in engines:
            await stop_engine(e)
    declared = next(c for c in kvstack_catalogs() if c.label == "kvstack epp").metrics
    assert disagreements(page, declared) == []
    assert live_catalog(page, "epp").metrics["kvstack_router_routing_decisions"].labels == {
        "profile",
        "engine",
    }


async def test_cache_server_page_is_its_catalog() -> None:
    layout = KVLayout("test-model", num_layers=2, num_kv_heads=2, head_size=8, dtype="float16")
    async with serving(http_port=0) as srv, AsyncCacheClient(srv.endpoint or "") as client:
        keys = chunk_keys(list(range(12)), layout, 4)
        assert await client.put(keys[:2], [b"a" * 4000, b"b" * 4000])
        chunks = await client.get(keys)
        assert chunks is not None
        chunks.release()
        assert await client.lookup(keys) == 2
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{srv.http_port}/metrics") as r,
        ):
            page = await r.text()
    declared = next(c for c in kvstack_catalogs() if c.label == "kvstack cache server").metrics
    # This server publishes no KV events: its conditional families are absent, reported only when asked.
    assert disagreements(page, declared) == []
    assert disagreements(page, declared, conditional=True) == [
        "kvstack_cache_event_batch_drops (counter) is in the table and not on the page",
        "kvstack_cache_events (counter) is in the table and not on the page",
    ]
    assert live_catalog(page, "cache").metrics["kvstack_cache_payload_bytes"].labels == {"op", "path"}
