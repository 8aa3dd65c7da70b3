"""Every metric an engine type exports, per version range, and the names it retired. Data only.

``EngineNames`` lists, for one engine type and versions ``[since, until)``, each metric family as the engine
defines it (``MetricName``: family name without exposition suffixes, kind, label names, help, whether it is
hidden behind ``--show-hidden-metrics-for-version``, and ``when``: the condition under which the engine
registers it, "" for always) and each name it used to export (``Retired``: replacement, versions, where the
change is recorded). Counters are exposed as ``<name>_total`` and ``<name>_created``, histograms as
``<name>_bucket``/``_sum``/``_count``: consumers apply those rules, the table does not repeat them.

Tables: vLLM >= 0.10 (the names of 0.32.0's source, checked against real vLLM by
tests/board/test_catalogs_vllm.py; 0.10 to 0.31 are not recorded apart), vLLM < 0.10 (only the names a
recorded source places there), and sglang, trtllm, triton holding only the names kvstack's router and
llm-d's engine tables read: a name of those engines missing here is "not in kvstack's table", not "does not
exist". The router's signal catalogs (``kvstack.engines.catalog``) are built
from these tables and ``kvstack metrics check`` reads them: one table for both.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

__all__ = ["ENGINE_NAMES", "EngineNames", "Kind", "MetricName", "Retired", "names_for", "parse_version"]


class Kind(enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"
    SUMMARY = "summary"
    INFO = "info"  # a gauge of value 1 whose labels carry the data (vllm:cache_config_info)

    @property
    def exposed_as(self) -> str:
        """The ``# TYPE`` a Prometheus text page gives this kind (an info gauge is a gauge there)."""
        return "gauge" if self is Kind.INFO else self.value


@dataclass(frozen=True, slots=True)
class MetricName:
    name: str  # the family name, e.g. "vllm:prompt_tokens" (scraped as vllm:prompt_tokens_total)
    kind: Kind
    labels: frozenset[str] = frozenset()
    help: str = ""
    hidden: bool = False  # exported only with --show-hidden-metrics-for-version
    when: str = ""  # "" = always registered; else the condition, e.g. "speculative decoding configured"


@dataclass(frozen=True, slots=True)
class Retired:
    """A name the engine no longer exports (or hides) in the versions of its table."""

    name: str
    replacement: str | None  # a name of the same table, or None when there is no one-to-one replacement
    deprecated_in: str | None
    removed_in: str | None  # None: hidden (still exported with --show-hidden-metrics-for-version);
    # "<= 0.32": gone by then, the removing version not recorded
    hint: str  # the fix when there is no replacement, e.g. "compute rate(hits) / rate(queries)"
    source: str  # where the change is recorded: a file of the engine's source or its release notes


@dataclass(frozen=True, slots=True)
class EngineNames:
    engine_type: str
    since: str | None = None
    until: str | None = None
    metrics: Mapping[str, MetricName] = field(default_factory=dict)
    retired: Mapping[str, Retired] = field(default_factory=dict)

    @property
    def versions(self) -> str:
        return describe_versions(self.since, self.until)

    def covers(self, version: str) -> bool:
        return in_versions(version, self.since, self.until)


class Ranged(Protocol):
    """A table for one engine type and versions ``[since, until)``: a name table or a signal catalog."""

    @property
    def engine_type(self) -> str: ...
    @property
    def versions(self) -> str: ...
    def covers(self, version: str) -> bool: ...


R = TypeVar("R", bound=Ranged)


def describe_versions(since: str | None, until: str | None) -> str:
    parts = [f">= {since}" if since else "", f"< {until}" if until else ""]
    return ", ".join(p for p in parts if p) or "all versions"


def in_versions(version: str, since: str | None, until: str | None) -> bool:
    v = parse_version(version)
    return (since is None or v >= parse_version(since)) and (until is None or v < parse_version(until))


def covering(tables: Sequence[R], engine_type: str, version: str | None, what: str) -> R:
    """The first of ``tables`` (newest first within a type) of ``engine_type`` covering ``version`` (the
    newest when None); ValueError naming the known types, or the ranges of ``what`` there are."""
    known = sorted({t.engine_type for t in tables})
    candidates = [t for t in tables if t.engine_type == engine_type]
    if not candidates:
        raise ValueError(f"unknown engine type {engine_type!r}; known engine types: {', '.join(known)}")
    if version is None:
        return candidates[0]
    for table in candidates:
        if table.covers(version):
            return table
    ranges = "; ".join(t.versions for t in candidates)
    raise ValueError(f"no {engine_type} {what} covers version {version} ({what}s: {ranges})")


_VERSION = re.compile(r"\s*v?(\d+(?:\.\d+)*)")


def parse_version(version: str) -> tuple[int, ...]:
    """``"0.10.1rc2+cpu"`` → ``(0, 10, 1)``: the leading release numbers, trailing zeros dropped."""
    m = _VERSION.match(version)
    if m is None:
        raise ValueError(f"cannot read engine version {version!r}: expected numbers like 0.10.1")
    parts = [int(p) for p in m.group(1).split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()  # so that "0.10" and "0.10.0" compare equal
    return tuple(parts)


COUNTER, GAUGE, HISTOGRAM, SUMMARY, INFO = Kind.COUNTER, Kind.GAUGE, Kind.HISTOGRAM, Kind.SUMMARY, Kind.INFO
_VLLM_LABELS = ("model_name", "engine")  # every per-engine vLLM family carries them


def _m(name: str, kind: Kind, help: str, labels: Iterable[str] = (), when: str = "") -> MetricName:
    return MetricName(name, kind, frozenset(labels), help, when=when)


def _v(name: str, kind: Kind, help: str, *labels: str, when: str = "") -> MetricName:
    """A vLLM family with the per-engine labels ``model_name`` and ``engine`` plus ``labels``."""
    return MetricName(name, kind, frozenset((*_VLLM_LABELS, *labels)), help, when=when)


def _table(*metrics: MetricName) -> dict[str, MetricName]:
    return {m.name: m for m in metrics}


def _retired(*entries: Retired) -> dict[str, Retired]:
    return {r.name: r for r in entries}


# prometheus_client's default collectors (process, GC, platform): on every page of a Python exporter.
_PYTHON_PROCESS: tuple[MetricName, ...] = (
    _m("python_gc_objects_collected", COUNTER, "Objects collected during gc", ["generation"]),
    _m("python_gc_objects_uncollectable", COUNTER, "Uncollectable objects found during GC", ["generation"]),
    _m("python_gc_collections", COUNTER, "Number of times this generation was collected", ["generation"]),
    _m(
        "python_info",
        GAUGE,
        "Python platform information",
        ["implementation", "major", "minor", "patchlevel", "version"],
    ),
    _m("process_virtual_memory_bytes", GAUGE, "Virtual memory size in bytes.", []),
    _m("process_resident_memory_bytes", GAUGE, "Resident memory size in bytes.", []),
    _m("process_start_time_seconds", GAUGE, "Start time of the process since unix epoch in seconds.", []),
    _m("process_cpu_seconds", COUNTER, "Total user and system CPU time spent in seconds.", []),
    _m("process_open_fds", GAUGE, "Number of open file descriptors.", []),
    _m("process_max_fds", GAUGE, "Maximum number of open file descriptors.", []),
)

# What vLLM's API server registers besides vllm:* (prometheus-fastapi-instrumentator, vllm/entrypoints/serve/
# instrumentator/metrics.py).
_VLLM_HTTP: tuple[MetricName, ...] = (
    _m(
        "http_requests",
        COUNTER,
        "Total number of requests by method, status and handler.",
        ["handler", "method", "status"],
    ),
    _m(
        "http_request_size_bytes",
        SUMMARY,
        (
            "Content length of incoming requests by handler. Only value of header is respected. Otherwise"
            " ignored. No percentile calculated."
        ),
        ["handler"],
    ),
    _m(
        "http_response_size_bytes",
        SUMMARY,
        (
            "Content length of outgoing responses by handler. Only value of header is respected. "
            "Otherwise ignored. No percentile calculated."
        ),
        ["handler"],
    ),
    _m(
        "http_request_duration_highr_seconds",
        HISTOGRAM,
        (
            "Latency with many buckets but no API specific labels. Made for more accurate percentile "
            "calculations."
        ),
        [],
    ),
    _m(
        "http_request_duration_seconds",
        HISTOGRAM,
        (
            "Latency with only few buckets by handler. Made to be only used if aggregation by handler is "
            "important."
        ),
        ["handler", "method"],
    ),
)

_NIXL = "kv_connector NixlConnector"
_OFFLOAD = "kv_connector OffloadingConnector"
_OFFLOAD_CPU = "kv_connector OffloadingConnector with the CPU offloading spec"
_TIERING = "kv_connector OffloadingConnector with the tiering spec"

# vLLM 0.32.0: vllm/v1/metrics/loggers.py (PrometheusStatLogger), perf.py, vllm/v1/spec_decode/metrics.py,
# the KV connectors' build_prom_metrics and vllm/entrypoints metrics modules. No family is hidden in 0.32.0.
_VLLM_0_32 = _table(
    *_PYTHON_PROCESS,
    *_VLLM_HTTP,
    _v(
        "vllm:estimated_flops_per_gpu",
        COUNTER,
        "Estimated number of floating point operations per GPU (for Model Flops Utilization calculations).",
    ),
    _v(
        "vllm:estimated_read_bytes_per_gpu",
        COUNTER,
        "Estimated number of bytes read from memory per GPU (for Model Flops Utilization calculations).",
    ),
    _v(
        "vllm:estimated_write_bytes_per_gpu",
        COUNTER,
        "Estimated number of bytes written to memory per GPU (for Model Flops Utilization calculations).",
    ),
    _v("vllm:num_requests_running", GAUGE, "Number of requests in model execution batches."),
    _v("vllm:num_requests_waiting", GAUGE, "Number of requests waiting to be processed."),
    _v(
        "vllm:num_requests_waiting_by_reason",
        GAUGE,
        (
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
            "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked "
            "status). Sum of all reasons equals vllm:num_requests_waiting."
        ),
        "reason",
    ),
    _v(
        "vllm:engine_sleep_state",
        GAUGE,
        (
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
            "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2."
        ),
        "sleep_state",
    ),
    _v("vllm:kv_cache_usage_perc", GAUGE, "KV-cache usage. 1 means 100 percent usage."),
    _v("vllm:prefix_cache_queries", COUNTER, "Prefix cache queries, in terms of number of queried tokens."),
    _v("vllm:prefix_cache_hits", COUNTER, "Prefix cache hits, in terms of number of cached tokens."),
    _v(
        "vllm:external_prefix_cache_queries",
        COUNTER,
        (
            "External prefix cache queries from KV connector cross-instance cache sharing, in terms of "
            "number of queried tokens."
        ),
    ),
    _v(
        "vllm:external_prefix_cache_hits",
        COUNTER,
        (
            "External prefix cache hits from KV connector cross-instance cache sharing, in terms of "
            "number of cached tokens."
        ),
    ),
    _v("vllm:mm_cache_queries", COUNTER, "Multi-modal cache queries, in terms of number of queried items."),
    _v("vllm:mm_cache_hits", COUNTER, "Multi-modal cache hits, in terms of number of cached items."),
    _v("vllm:num_preemptions", COUNTER, "Cumulative number of preemption from the engine."),
    _v("vllm:prompt_tokens", COUNTER, "Number of prefill tokens processed."),
    _v("vllm:prompt_tokens_by_source", COUNTER, "Number of prompt tokens by source.", "source"),
    _v("vllm:prompt_tokens_cached", COUNTER, "Number of cached prompt tokens (local + external)."),
    _v(
        "vllm:prompt_tokens_cached_by_source",
        COUNTER,
        (
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host "
            "(offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or "
            "external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + "
            "vllm:external_prefix_cache_hits."
        ),
        "source",
    ),
    _v("vllm:generation_tokens", COUNTER, "Number of generation tokens processed."),
    _v("vllm:request_success", COUNTER, "Count of successfully processed requests.", "finished_reason"),
    _m(
        "vllm:admission_rejections",
        COUNTER,
        "Number of admission attempts rejected by a queue limit, by reason.",
        ["model_name", "reason"],
    ),
    _v("vllm:request_prompt_tokens", HISTOGRAM, "Number of prefill tokens processed."),
    _v("vllm:request_generation_tokens", HISTOGRAM, "Number of generation tokens processed."),
    _v("vllm:iteration_tokens_total", HISTOGRAM, "Histogram of number of tokens per engine_step."),
    _v(
        "vllm:request_max_num_generation_tokens",
        HISTOGRAM,
        "Histogram of maximum number of requested generation tokens.",
    ),
    _v("vllm:request_params_n", HISTOGRAM, "Histogram of the n request parameter."),
    _v("vllm:request_params_max_tokens", HISTOGRAM, "Histogram of the max_tokens request parameter."),
    _v("vllm:time_to_first_token_seconds", HISTOGRAM, "Histogram of time to first token in seconds."),
    _v("vllm:inter_token_latency_seconds", HISTOGRAM, "Histogram of inter-token latency in seconds."),
    _v(
        "vllm:request_time_per_output_token_seconds",
        HISTOGRAM,
        "Histogram of time_per_output_token_seconds per request.",
    ),
    _v("vllm:e2e_request_latency_seconds", HISTOGRAM, "Histogram of e2e request latency in seconds."),
    _v("vllm:request_queue_time_seconds", HISTOGRAM, "Histogram of time spent in WAITING phase for request."),
    _v(
        "vllm:request_inference_time_seconds",
        HISTOGRAM,
        "Histogram of time spent in RUNNING phase for request.",
    ),
    _v(
        "vllm:request_prefill_time_seconds",
        HISTOGRAM,
        "Histogram of time spent in PREFILL phase for request.",
    ),
    _v("vllm:request_decode_time_seconds", HISTOGRAM, "Histogram of time spent in DECODE phase for request."),
    _v(
        "vllm:request_num_preemptions", HISTOGRAM, "Histogram of the number of times a request was preempted."
    ),
    _v(
        "vllm:request_prefill_kv_computed_tokens",
        HISTOGRAM,
        "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
    ),
    _m(
        "vllm:cache_config_info",
        INFO,
        "Information of the LLMEngine CacheConfig",
        [
            "_block_size_resolved",
            "block_size",
            "cache_dtype",
            "cache_hit_alignment_tokens",
            "effective_attention_block_size",
            "enable_mamba_shared_prefix_checkpoint",
            "enable_prefix_caching",
            "engine",
            "gpu_memory_utilization",
            "hash_block_size",
            "is_attention_free",
            "kv_cache_dtype_skip_layers",
            "kv_cache_layout",
            "kv_cache_max_concurrency",
            "kv_cache_memory_bytes",
            "kv_cache_size_tokens",
            "kv_offloading_backend",
            "kv_offloading_size",
            "kv_sharing_fast_prefill",
            "mamba_block_size",
            "mamba_cache_dtype",
            "mamba_cache_mode",
            "mamba_page_size_padded",
            "mamba_ssm_cache_dtype",
            "num_cpu_blocks",
            "num_gpu_blocks",
            "num_gpu_blocks_override",
            "prefix_cache_retention_interval",
            "prefix_caching_hash_algo",
            "prefix_match_unit",
            "replayssm_buffer_len",
            "skip_page_size_padded",
            "sliding_window",
            "swa_bounded_replay",
            "use_kda_recoverssm",
            "use_replayssm",
            "user_specified_block_size",
        ],
    ),
    # -- registered only under a condition ---------------------------------------------------------------
    _v(
        "vllm:num_requests_kv_fetch_by_stage",
        GAUGE,
        "Number of waiting requests by async KV load stage.",
        "stage",
        when="a KV consumer (kv_transfer_config.is_kv_consumer)",
    ),
    _v(
        "vllm:corrupted_requests",
        COUNTER,
        "Corrupted requests, in terms of total number of requests with NaNs in logits.",
        when="VLLM_COMPUTE_NANS_IN_LOGITS=1",
    ),
    _v(
        "vllm:watermark_requests",
        COUNTER,
        "Finished requests by watermark status (only with watermark_config).",
        "status",
        when="watermark_config set",
    ),
    *(
        _v(name, HISTOGRAM, help, when="--kv-cache-metrics")
        for name, help in (
            (
                "vllm:kv_block_lifetime_seconds",
                "Histogram of KV cache block lifetime from allocation to eviction.",
            ),
            (
                "vllm:kv_block_idle_before_evict_seconds",
                "Histogram of idle time before KV cache block eviction.",
            ),
            (
                "vllm:kv_block_reuse_gap_seconds",
                "Histogram of time gaps between consecutive KV cache block accesses.",
            ),
        )
    ),
    _m(
        "vllm:lora_requests_info",
        INFO,
        "Running stats on lora requests.",
        ("max_lora", "waiting_lora_adapters", "running_lora_adapters"),
        when="LoRA enabled (--enable-lora)",
    ),
    *(
        _v(name, COUNTER, help, when="speculative decoding configured")
        for name, help in (
            ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
            ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
            ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
        )
    ),
    _v(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        COUNTER,
        "Accepted tokens per draft position.",
        "position",
        when="speculative decoding configured",
    ),
    *(
        _v(name, COUNTER, help, when="a diffusion model")
        for name, help in (
            ("vllm:diffusion_num_denoising_steps", "Number of denoising steps."),
            ("vllm:diffusion_num_canvas_positions", "Number of canvas positions evaluated."),
            ("vllm:diffusion_num_committed_tokens", "Number of committed (finalized) tokens."),
        )
    ),
    _m(
        "vllm:tool_call_parser_invocations",
        COUNTER,
        "Total number of ToolParser invocations.",
        ("model_name", "mode", "outcome", "request_type"),
        when="a tool call parser ran (--tool-call-parser)",
    ),
    _m(
        "vllm:sleep_mode_operation_duration_seconds",
        HISTOGRAM,
        "Duration of one sleep-mode operation.",
        when="a sleep-mode operation ran (VLLM_SERVER_DEV_MODE=1, --enable-sleep-mode)",
    ),
    _m(
        "vllm:sleep_mode_operations_in_flight",
        GAUGE,
        "Sleep-mode operations currently awaited.",
        when="a sleep-mode operation ran (VLLM_SERVER_DEV_MODE=1, --enable-sleep-mode)",
    ),
    _m(
        "vllm:rl_weight_update_operation_duration_seconds",
        HISTOGRAM,
        "Duration of one weight-transfer operation.",
        when="an online RL weight update ran",
    ),
    _m(
        "vllm:rl_weight_update_operations_in_flight",
        GAUGE,
        "Weight-transfer operations currently awaited.",
        when="an online RL weight update ran",
    ),
    _m(
        "vllm:websocket_connections_active",
        GAUGE,
        "Number of currently active WebSocket connections.",
        when="the realtime speech-to-text WebSocket endpoint is served",
    ),
    _m(
        "vllm:websocket_connections",
        COUNTER,
        "Total number of WebSocket connections.",
        when="the realtime speech-to-text WebSocket endpoint is served",
    ),
    _m(
        "vllm:websocket_connection_duration_seconds",
        HISTOGRAM,
        "Duration of WebSocket connections in seconds.",
        when="the realtime speech-to-text WebSocket endpoint is served",
    ),
    # KV connectors (vllm/distributed/kv_transfer/kv_connector/v1/*/ build_prom_metrics)
    *(
        _v(name, kind, help, when=_NIXL)
        for name, kind, help in (
            (
                "vllm:nixl_xfer_time_seconds",
                HISTOGRAM,
                "Histogram of transfer duration for NIXL KV Cache transfers.",
            ),
            (
                "vllm:nixl_post_time_seconds",
                HISTOGRAM,
                "Histogram of transfer post time for NIXL KV Cache transfers.",
            ),
            (
                "vllm:nixl_bytes_transferred",
                HISTOGRAM,
                "Histogram of bytes transferred per NIXL KV Cache transfers.",
            ),
            (
                "vllm:nixl_num_descriptors",
                HISTOGRAM,
                "Histogram of number of descriptors per NIXL KV Cache transfers.",
            ),
            ("vllm:nixl_num_failed_transfers", COUNTER, "Number of failed NIXL KV Cache transfers."),
            ("vllm:nixl_num_failed_notifications", COUNTER, "Number of failed NIXL KV Cache notifications."),
            ("vllm:nixl_num_kv_expired_reqs", COUNTER, "Number of requests that had their KV expire."),
            (
                "vllm:nixl_num_notifications_after_expiry",
                COUNTER,
                "Number of completion notifications for requests that were no longer tracked.",
            ),
        )
    ),
    *(
        _v(name, kind, help, when=_OFFLOAD)
        for name, kind, help in (
            ("vllm:kv_offload_load_bytes", COUNTER, "Total bytes loaded from offload storage to GPU."),
            (
                "vllm:kv_offload_load_time",
                COUNTER,
                "Total load time from offload storage to GPU, in seconds.",
            ),
            (
                "vllm:kv_offload_load_size",
                HISTOGRAM,
                "Histogram of KV offload load operation size, in bytes.",
            ),
            ("vllm:kv_offload_store_bytes", COUNTER, "Total bytes stored from GPU to offload storage."),
            (
                "vllm:kv_offload_store_time",
                COUNTER,
                "Total store time from GPU to offload storage, in seconds.",
            ),
            (
                "vllm:kv_offload_store_size",
                HISTOGRAM,
                "Histogram of KV offload store operation size, in bytes.",
            ),
            (
                "vllm:kv_offload_lookup_sync_delay_seconds",
                HISTOGRAM,
                "Histogram of the time spent in a single offload lookup call, in seconds.",
            ),
            (
                "vllm:kv_offload_lookup_async_delay_seconds",
                HISTOGRAM,
                "Histogram of time between a request's offload lookup first deferring and it resolving.",
            ),
            (
                "vllm:kv_offload_allocation_failure",
                COUNTER,
                "Number of KV offload store allocation attempts that failed.",
            ),
        )
    ),
    *(
        _v(name, kind, help, "transfer_type", when=_OFFLOAD)
        for name, kind, help in (
            (
                "vllm:kv_offload_total_bytes",
                COUNTER,
                "Number of bytes offloaded by KV connector (deprecated in source).",
            ),
            (
                "vllm:kv_offload_total_time",
                COUNTER,
                "Total time measured by all KV offloading operations (deprecated).",
            ),
            (
                "vllm:kv_offload_size",
                HISTOGRAM,
                "Histogram of KV offload transfer size, in bytes (deprecated).",
            ),
        )
    ),
    *(
        _v(name, kind, help, when=_OFFLOAD_CPU)
        for name, kind, help in (
            (
                "vllm:kv_offload_cpu_cache_usage_perc",
                GAUGE,
                "Fraction of CPU KV-cache space pinned by active transfers.",
            ),
            (
                "vllm:kv_offload_cpu_cache_write_usage_perc",
                GAUGE,
                "Fraction of CPU KV-cache space pinned by stores.",
            ),
            (
                "vllm:kv_offload_cpu_cache_read_usage_perc",
                GAUGE,
                "Fraction of CPU KV-cache space pinned by loads.",
            ),
            (
                "vllm:kv_offload_cpu_allocation_size",
                HISTOGRAM,
                "CPU chunks requested by each prepare_store call.",
            ),
        )
    ),
    _v(
        "vllm:kv_offload_stores_skipped",
        COUNTER,
        "Number of KV offload stores skipped because the reuse threshold was not reached.",
        when=f"{_OFFLOAD_CPU} and store_threshold >= 2",
    ),
    *(
        _v(name, kind, f"{help}, by tier.", "tier", when=_TIERING)
        for name, kind, help in (
            (
                "vllm:kv_offload_tiering_lookup_sync_delay_seconds",
                HISTOGRAM,
                "Blocking time of a chunk tier lookup",
            ),
            (
                "vllm:kv_offload_tiering_lookup_async_delay_seconds",
                HISTOGRAM,
                "Time from a lookup's retry to its answer",
            ),
            (
                "vllm:kv_offload_tiering_read_bytes",
                COUNTER,
                "Bytes read from secondary tiers into the primary tier",
            ),
            ("vllm:kv_offload_tiering_read_time", COUNTER, "Seconds reading from secondary tiers"),
            (
                "vllm:kv_offload_tiering_write_bytes",
                COUNTER,
                "Bytes written from the primary tier to secondary tiers",
            ),
            ("vllm:kv_offload_tiering_write_time", COUNTER, "Seconds writing to secondary tiers"),
            ("vllm:kv_offload_tiering_promotion_job_failures", COUNTER, "Failed promotion jobs"),
            ("vllm:kv_offload_tiering_cascade_job_failures", COUNTER, "Failed cascade jobs"),
            ("vllm:kv_offload_tiering_chunk_queries", COUNTER, "Chunk lookup queries sent to a tier"),
            ("vllm:kv_offload_tiering_chunk_hits", COUNTER, "Chunk lookup hits in a tier"),
            ("vllm:kv_offload_tiering_primary_write_usage_perc", GAUGE, "Primary-tier space used by writes"),
            ("vllm:kv_offload_tiering_primary_read_usage_perc", GAUGE, "Primary-tier space used by reads"),
            ("vllm:kv_offload_tiering_active_promotion_jobs", GAUGE, "Active promotion jobs"),
            ("vllm:kv_offload_tiering_active_cascade_jobs", GAUGE, "Active cascade jobs"),
            ("vllm:kv_offload_tiering_backpressure_store_latency_ema", GAUGE, "Store latency EMA, in s/MiB"),
            (
                "vllm:kv_offload_tiering_backpressure_stores_dropped",
                COUNTER,
                "Stores dropped by back-pressure",
            ),
            (
                "vllm:kv_offload_tiering_backpressure_blocks_dropped",
                COUNTER,
                "Blocks dropped by back-pressure",
            ),
        )
    ),
    _v(
        "vllm:kv_offload_tiering_promotion_allocation_failures",
        COUNTER,
        "Promotion attempts that failed because the primary tier could not allocate space.",
        when=_TIERING,
    ),
    *(
        _v(name, kind, help, *labels, when="kv_connector SimpleCPUOffloadConnector")
        for name, kind, help, labels in (
            (
                "vllm:simple_kv_offload_save_outcomes",
                COUNTER,
                "Store admission decisions, by outcome.",
                ("outcome",),
            ),
            (
                "vllm:simple_kv_offload_load_blocks",
                COUNTER,
                "KV blocks restored to GPU from the offload pool.",
                (),
            ),
            ("vllm:simple_kv_offload_used_blocks", GAUGE, "Offload-pool blocks currently pinned.", ()),
            ("vllm:simple_kv_offload_pending_store_blocks", GAUGE, "Offload blocks in pending stores.", ()),
            (
                "vllm:simple_kv_offload_info",
                INFO,
                "SimpleCPUOffloadConnector deployment facts (value 1).",
                ("backend", "page_cache", "lazy_offload", "capacity_blocks"),
            ),
        )
    ),
    *(
        _v(name, kind, help, "operation", "status", when="kv_connector MooncakeStoreConnector")
        for name, kind, help in (
            (
                "vllm:mooncake_store_operation_time_seconds",
                HISTOGRAM,
                "Histogram of Mooncake store communication time.",
            ),
            ("vllm:mooncake_store_operation", COUNTER, "Number of Mooncake store communication operations."),
            (
                "vllm:mooncake_store_operation_keys",
                COUNTER,
                "Number of Mooncake store keys touched by operations.",
            ),
            (
                "vllm:mooncake_store_operation_bytes",
                COUNTER,
                "Bytes transferred by Mooncake store operations.",
            ),
            (
                "vllm:mooncake_store_operation_failed_keys",
                COUNTER,
                "Mooncake store keys that failed in operations.",
            ),
        )
    ),
    *(
        _v(name, kind, help, when="kv_connector HF3FSKVConnector")
        for name, kind, help in (
            (
                "vllm:hf3fs_save_duration_seconds",
                HISTOGRAM,
                "Histogram of save duration for HF3FSKVConnector.",
            ),
            (
                "vllm:hf3fs_load_duration_seconds",
                HISTOGRAM,
                "Histogram of load duration for HF3FSKVConnector.",
            ),
            ("vllm:hf3fs_num_failed_save", COUNTER, "Number of failed HF3FS KV save."),
            ("vllm:hf3fs_num_failed_load", COUNTER, "Number of failed HF3FS KV load."),
        )
    ),
    *(
        _v(name, kind, help, when="kv_connector HiSparseConnector")
        for name, kind, help in (
            ("vllm:hisparse_cache_hits", COUNTER, "Number of HiSparse device hot-buffer hits."),
            ("vllm:hisparse_cache_misses", COUNTER, "Number of HiSparse device hot-buffer misses."),
            (
                "vllm:hisparse_host_to_device_bytes",
                COUNTER,
                "Bytes transferred from host KV storage to hot buffers.",
            ),
            (
                "vllm:hisparse_host_cache_usage_perc",
                GAUGE,
                "HiSparse host KV-cache usage. 1 means 100 percent usage.",
            ),
            ("vllm:hisparse_pending_page_transfers", GAUGE, "HiSparse page transfers not yet completed."),
            (
                "vllm:hisparse_host_block_lifetime_seconds",
                HISTOGRAM,
                "HiSparse host KV block lifetime (--kv-cache-metrics).",
            ),
            (
                "vllm:hisparse_host_block_idle_before_evict_seconds",
                HISTOGRAM,
                "HiSparse host KV block idle time.",
            ),
            ("vllm:hisparse_host_block_reuse_gap_seconds", HISTOGRAM, "HiSparse host KV block reuse gaps."),
        )
    ),
)

_REF = "shared reference vllm-metrics.md (vLLM's rule: deprecated in X.Y, hidden in X.Y+1, removed in X.Y+2)"
_ABSENT = "absent from vLLM 0.32.0's source (vllm/v1/metrics/)"
_RATE_HINT = "use rate(vllm:prefix_cache_hits_total[5m]) / rate(vllm:prefix_cache_queries_total[5m])"

# Renames and removals before 0.32. ``removed_in`` "<= 0.32": gone by 0.32.0, the first version not recorded.
_VLLM_RETIRED = _retired(
    Retired(
        "vllm:gpu_cache_usage_perc",
        "vllm:kv_cache_usage_perc",
        "0.9.2",
        "0.11",
        "",
        f"deprecated in 0.9.2: {_REF}; hidden in 0.10 and removed in 0.11 by that rule; {_ABSENT}",
    ),
    *(
        Retired(
            f"vllm:gpu_prefix_cache_{what}",
            f"vllm:prefix_cache_{what}",
            "0.9.2",
            "0.11",
            "",
            f"renamed with vllm:gpu_cache_usage_perc in 0.9.2 ({_REF}; kvstack's router alias); {_ABSENT}",
        )
        for what in ("queries", "hits")
    ),
    Retired("vllm:gpu_prefix_cache_hit_rate", None, None, "<= 0.32", _RATE_HINT, f"{_REF}; {_ABSENT}"),
    Retired(
        "vllm:time_per_output_token_seconds",
        "vllm:inter_token_latency_seconds",
        "0.11",
        "0.13",
        "",
        f"deprecated in 0.11: {_REF}; removed in 0.13 by that rule; {_ABSENT}",
    ),
    Retired(
        "vllm:num_requests_swapped",
        None,
        None,
        "<= 0.32",
        "vLLM no longer swaps requests to CPU: drop the panel or use vllm:num_preemptions_total",
        f"{_REF}; {_ABSENT}",
    ),
    Retired(
        "vllm:cpu_cache_usage_perc",
        None,
        None,
        "<= 0.32",
        "no CPU KV cache gauge; with CPU offloading use vllm:kv_offload_cpu_cache_usage_perc",
        f"{_REF}; {_ABSENT}",
    ),
    Retired(
        "vllm:cpu_prefix_cache_hit_rate",
        None,
        None,
        "<= 0.32",
        "no replacement; with a KV connector use rate(vllm:external_prefix_cache_hits_total[5m]) / "
        "rate(vllm:external_prefix_cache_queries_total[5m])",
        f"{_REF}; {_ABSENT}",
    ),
    Retired(
        "vllm:kv_offload_tiering_block_hits",
        "vllm:kv_offload_tiering_chunk_hits",
        None,
        "<= 0.32",
        "",
        f"a llm-d guide reads vllm:kv_offload_tiering_block_hits_total: {_REF}; "
        "vLLM 0.32.0 defines vllm:kv_offload_tiering_chunk_hits (vllm/v1/kv_offload/tiering/base.py)",
    ),
)


def _like(
    table: Mapping[str, MetricName], name: str, replacement: str, help: str, when: str = ""
) -> MetricName:
    """``name`` with the kind and labels of ``replacement`` (old label sets unrecorded: assumed equal)."""
    m = table[replacement]
    return MetricName(name, m.kind, m.labels, help, when=when)


_SINCE_0_9_2 = "vLLM >= 0.9.2 (the version that deprecated the vllm:gpu_* names)"

# vLLM before 0.10: only names a source places there (the retired names of _VLLM_RETIRED, what consumers of
# that era read, and the 0.9.2 replacements). Other families of those versions are not recorded here.
_VLLM_BEFORE_0_10 = _table(
    _VLLM_0_32["vllm:num_requests_running"],
    _VLLM_0_32["vllm:num_requests_waiting"],
    _VLLM_0_32["vllm:cache_config_info"],
    _like(
        _VLLM_0_32,
        "vllm:gpu_cache_usage_perc",
        "vllm:kv_cache_usage_perc",
        "GPU KV-cache usage. 1 means 100 percent usage.",
    ),
    _like(
        _VLLM_0_32,
        "vllm:gpu_prefix_cache_queries",
        "vllm:prefix_cache_queries",
        "GPU prefix cache queries, in tokens.",
    ),
    _like(
        _VLLM_0_32,
        "vllm:gpu_prefix_cache_hits",
        "vllm:prefix_cache_hits",
        "GPU prefix cache hits, in tokens.",
    ),
    _like(
        _VLLM_0_32, "vllm:gpu_prefix_cache_hit_rate", "vllm:kv_cache_usage_perc", "GPU prefix cache hit rate."
    ),
    _like(_VLLM_0_32, "vllm:cpu_cache_usage_perc", "vllm:kv_cache_usage_perc", "CPU KV-cache usage."),
    _like(
        _VLLM_0_32, "vllm:cpu_prefix_cache_hit_rate", "vllm:kv_cache_usage_perc", "CPU prefix cache hit rate."
    ),
    _like(_VLLM_0_32, "vllm:num_requests_swapped", "vllm:num_requests_running", "Requests swapped to CPU."),
    _like(
        _VLLM_0_32,
        "vllm:time_per_output_token_seconds",
        "vllm:inter_token_latency_seconds",
        "Histogram of time per output token in seconds.",
    ),
    _like(
        _VLLM_0_32, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "KV-cache usage.", _SINCE_0_9_2
    ),
    _like(
        _VLLM_0_32,
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_queries",
        "Prefix cache queries.",
        _SINCE_0_9_2,
    ),
    _like(_VLLM_0_32, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits", "Prefix cache hits.", _SINCE_0_9_2),
)

# Other engine types: the names kvstack's router reads and llm-d's engine tables list (shared reference);
# label names from the engines' exposition as the router's tests sample it.
_SGLANG_LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank")
_TRTLLM_LABELS = ("model_name", "engine_type")
_TRITON_LABELS = ("model", "version")

ENGINE_NAMES: tuple[EngineNames, ...] = (  # newest first within a type
    EngineNames("vllm", since="0.10", metrics=_VLLM_0_32, retired=_VLLM_RETIRED),
    EngineNames("vllm", until="0.10", metrics=_VLLM_BEFORE_0_10),
    EngineNames(
        "sglang",
        metrics=_table(
            _m(
                "sglang:num_queue_reqs", GAUGE, "The number of requests in the waiting queue.", _SGLANG_LABELS
            ),
            _m("sglang:num_running_reqs", GAUGE, "The number of running requests.", _SGLANG_LABELS),
            _m("sglang:token_usage", GAUGE, "The token usage (KV cache), 1 = full.", _SGLANG_LABELS),
            _m(
                "sglang:cache_config_info", INFO, "Cache configuration (value 1).", ("page_size", "num_pages")
            ),
        ),
    ),
    EngineNames(
        "trtllm",
        metrics=_table(
            _m("trtllm_num_requests_waiting", GAUGE, "Requests waiting (trtllm-serve).", _TRTLLM_LABELS),
            _m("trtllm_num_requests_running", GAUGE, "Requests running (trtllm-serve).", _TRTLLM_LABELS),
            _m("trtllm_kv_cache_utilization", GAUGE, "KV cache utilization, 1 = full.", _TRTLLM_LABELS),
            _m("trtllm_kv_cache_tokens_per_block", GAUGE, "Tokens per KV cache block.", _TRTLLM_LABELS),
            _m("trtllm_kv_cache_max_blocks", GAUGE, "KV cache blocks in total.", _TRTLLM_LABELS),
        ),
    ),
    EngineNames(
        "triton",
        metrics=_table(
            _m(
                "nv_inference_pending_request_count",
                GAUGE,
                "Instantaneous number of pending requests awaiting execution.",
                _TRITON_LABELS,
            ),
            _m("nv_inference_exec_count", COUNTER, "Number of model executions performed.", _TRITON_LABELS),
        ),
    ),
)


def names_for(engine_type: str, version: str | None = None) -> EngineNames:
    """The table of ``engine_type`` covering ``version`` (the newest when None); ValueError naming the known
    types and version ranges otherwise."""
    return covering(ENGINE_NAMES, engine_type, version, "name table")
