"""Small metric catalogs for the order board's tests: two vLLM versions and two kvstack front ends sharing
``kvstack_router_*`` families (the real catalogs are ``kvstack.board.catalogs``'s)."""

from __future__ import annotations

from kvstack.board.catalogs import Catalog
from kvstack.engines.names import Kind, MetricName, Retired

ENGINE = frozenset({"model_name", "engine"})
SOURCE = "vllm/v1/metrics/loggers.py"


def _by_name(*metrics: MetricName) -> dict[str, MetricName]:
    return {m.name: m for m in metrics}


VLLM_NEW = Catalog(
    "vllm 0.32",
    "engine",
    _by_name(
        MetricName("vllm:kv_cache_usage_perc", Kind.GAUGE, ENGINE),
        MetricName("vllm:num_requests_running", Kind.GAUGE, ENGINE),
        MetricName("vllm:num_requests_waiting", Kind.GAUGE, ENGINE),
        MetricName("vllm:prompt_tokens", Kind.COUNTER, ENGINE),
        MetricName("vllm:prefix_cache_queries", Kind.COUNTER, ENGINE),
        MetricName("vllm:prefix_cache_hits", Kind.COUNTER, ENGINE),
        MetricName("vllm:request_success", Kind.COUNTER, ENGINE | {"finished_reason"}),
        MetricName("vllm:time_to_first_token_seconds", Kind.HISTOGRAM, ENGINE),
        MetricName("vllm:inter_token_latency_seconds", Kind.HISTOGRAM, ENGINE),
        MetricName("vllm:cache_config_info", Kind.INFO, frozenset({"block_size", "num_gpu_blocks"})),
        MetricName("vllm:legacy_swap_space", Kind.GAUGE, ENGINE, hidden=True),
    ),
    {
        "vllm:gpu_cache_usage_perc": Retired(
            "vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc", "0.9.2", "0.11", "", SOURCE
        ),
        "vllm:gpu_prefix_cache_hit_rate": Retired(
            "vllm:gpu_prefix_cache_hit_rate",
            None,
            "0.9.2",
            "0.11",
            "compute rate(vllm:prefix_cache_hits_total[5m]) / rate(vllm:prefix_cache_queries_total[5m])",
            SOURCE,
        ),
        "vllm:time_per_output_token_seconds": Retired(
            "vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds", "0.31", None, "", SOURCE
        ),
    },
)

VLLM_OLD = Catalog(
    "vllm 0.8",
    "engine",
    _by_name(
        MetricName("vllm:gpu_cache_usage_perc", Kind.GAUGE, ENGINE),
        MetricName("vllm:num_requests_running", Kind.GAUGE, ENGINE),
        MetricName("vllm:prompt_tokens", Kind.COUNTER, ENGINE),
    ),
)

ROUTER = Catalog(
    "kvstack router",
    "kvstack",
    _by_name(
        MetricName("kvstack_router_requests", Kind.COUNTER, frozenset({"route", "status"})),
        MetricName("kvstack_router_request_seconds", Kind.HISTOGRAM, frozenset({"route"})),
    ),
)

EPP = Catalog(
    "kvstack epp",
    "kvstack",
    _by_name(
        MetricName("kvstack_router_requests", Kind.COUNTER, frozenset({"route", "status"})),
        MetricName("kvstack_epp_picks", Kind.COUNTER, frozenset({"routing"})),
    ),
)

DEFAULT = (VLLM_NEW, ROUTER, EPP)
