"""The simulated engine's /metrics: vLLM 0.32's names, types and labels for what the simulator models.

Every series carries ``model_name`` and ``engine`` labels like vLLM's. ``legacy_names=True`` exports the
names vLLM used before the renames (``vllm:gpu_cache_usage_perc``, ``vllm:gpu_prefix_cache_*``,
``vllm:time_per_output_token_seconds``) instead of the current ones, so that consumers can be tested
against an engine that lacks the names they expect.
Histogram buckets are vLLM's defaults.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvstack.sim.scheduler import SimRequest, StepStats

REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHED_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")


def one_two_five_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value``: vLLM's token-count buckets."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(float(m * scale))
        scale *= 10


class EngineMetrics:
    """One engine's Prometheus registry, updated by the engine loop."""

    def __init__(
        self,
        model_name: str,
        *,
        max_model_len: int,
        block_size: int,
        num_gpu_blocks: int,
        enable_prefix_caching: bool = True,
        legacy_names: bool = False,
        engine_index: str = "0",
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.legacy_names = legacy_names
        labels = {"model_name": model_name, "engine": engine_index}
        names = ["model_name", "engine"]
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=reg).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=reg).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] | list[float]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=reg).labels(**labels)

        token_buckets = one_two_five_buckets(max_model_len)
        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Waiting requests by reason.",
            [*names, "reason"],
            registry=reg,
        )
        self.waiting_capacity = by_reason.labels(**labels, reason="capacity")
        self.waiting_deferred = by_reason.labels(**labels, reason="deferred")
        self.waiting_deferred.set(0)
        sleep = Gauge("vllm:engine_sleep_state", "Engine sleep state.", [*names, "sleep_state"], registry=reg)
        for state, value in (("awake", 1), ("weights_offloaded", 0), ("discard_all", 0)):
            sleep.labels(**labels, sleep_state=state).set(value)
        if legacy_names:
            self.kv_usage = gauge("vllm:gpu_cache_usage_perc", "KV cache usage, 1 = full (legacy name).")
            self.prefix_queries = counter("vllm:gpu_prefix_cache_queries", "Prefix cache queries in tokens.")
            self.prefix_hits = counter("vllm:gpu_prefix_cache_hits", "Prefix cache hits in tokens.")
        else:
            self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV cache usage, 1 = full.")
            self.prefix_queries = counter("vllm:prefix_cache_queries", "Prefix cache queries in tokens.")
            self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits in tokens.")
        self.external_queries = counter(
            "vllm:external_prefix_cache_queries",
            "Prefix cache queries answered through a KV connector, in tokens.",
        )
        self.external_hits = counter(
            "vllm:external_prefix_cache_hits", "Prefix cache hits supplied through a KV connector, in tokens."
        )
        self.preemptions = counter("vllm:num_preemptions", "Preemptions since start.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed.")
        by_source = Counter(
            "vllm:prompt_tokens_by_source", "Prompt tokens by source.", [*names, "source"], registry=reg
        )
        self.prompt_by_source = {s: by_source.labels(**labels, source=s) for s in PROMPT_SOURCES}
        self.prompt_cached = counter(
            "vllm:prompt_tokens_cached", "Prompt tokens not computed (local + external)."
        )
        cached_by = Counter(
            "vllm:prompt_tokens_cached_by_source",
            "Cached prompt tokens by tier.",
            [*names, "source"],
            registry=reg,
        )
        self.cached_by_source = {s: cached_by.labels(**labels, source=s) for s in CACHED_SOURCES}
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        success = Counter(
            "vllm:request_success", "Finished requests by reason.", [*names, "finished_reason"], registry=reg
        )
        self.success = {r: success.labels(**labels, finished_reason=r) for r in FINISHED_REASONS}
        rejections = Counter(
            "vllm:admission_rejections",
            "Requests refused by a queue limit.",
            ["model_name", "reason"],
            registry=reg,
        )
        self.admission_rejected = rejections.labels(model_name=model_name, reason="max_num_queued_reqs")
        rejections.labels(model_name=model_name, reason="max_num_queued_tokens")
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per request.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Generated tokens per request.", token_buckets
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Tokens per engine step.", ITERATION_TOKENS_BUCKETS
        )
        self.max_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens", "Requested maximum generated tokens.", token_buckets
        )
        self.params_n = histogram("vllm:request_params_n", "The n parameter of requests.", PARAMS_N_BUCKETS)
        self.params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "The max_tokens parameter of requests.", token_buckets
        )
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        itl_name = (
            "vllm:time_per_output_token_seconds" if legacy_names else "vllm:inter_token_latency_seconds"
        )
        self.itl = histogram(itl_name, "Time between output tokens.", ITL_BUCKETS)
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Mean time per output token per request.",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end request time.", REQUEST_LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds", "Time a request waited.", REQUEST_LATENCY_BUCKETS
        )
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds", "Time a request ran.", REQUEST_LATENCY_BUCKETS
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds", "Time a request spent in prefill.", REQUEST_LATENCY_BUCKETS
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds", "Time a request spent decoding.", REQUEST_LATENCY_BUCKETS
        )
        self.request_preemptions = histogram(
            "vllm:request_num_preemptions", "Preemptions per request.", PREEMPTIONS_BUCKETS
        )
        self.prefill_computed = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Prompt tokens computed (not cached) per request.",
            token_buckets,
        )
        info = Gauge(
            "vllm:cache_config_info",
            "KV cache configuration.",
            ["block_size", "num_gpu_blocks", "enable_prefix_caching", "prefix_caching_hash_algo", "engine"],
            registry=reg,
        )
        info.labels(
            block_size=str(block_size),
            num_gpu_blocks=str(num_gpu_blocks),
            enable_prefix_caching=str(enable_prefix_caching),
            prefix_caching_hash_algo="xxhash",
            engine=engine_index,
        ).set(1)

    def observe_step(self, stats: StepStats, *, running: int, waiting: int, kv_usage: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.waiting_capacity.set(waiting)
        self.kv_usage.set(kv_usage)
        if stats.batch_size:
            self.iteration_tokens.observe(stats.prefill_tokens + stats.decode_seqs)
        if stats.preempted:
            self.preemptions.inc(stats.preempted)
        for prompt, hit, _ in stats.admitted:
            self.prefix_queries.inc(prompt)
            self.prefix_hits.inc(hit)
            self.cached_by_source["device"].inc(hit)
        for query in stats.connector:
            self.external_queries.inc(query.queries)
            self.external_hits.inc(query.hits)
            for source, tokens in query.hits_by_source.items():
                by_source = self.cached_by_source.get(source, self.cached_by_source["external_unspecified"])
                by_source.inc(tokens)

    def observe_new_request(self, *, n: int, max_tokens: int) -> None:
        self.params_n.observe(n)
        self.params_max_tokens.observe(max_tokens)
        self.max_generation_tokens.observe(max_tokens)

    def observe_token(self, req: SimRequest) -> None:
        self.generation_tokens.inc()
        if req.prev_token_time is not None and req.last_token_time is not None:
            self.itl.observe(req.last_token_time - req.prev_token_time)

    def observe_first_token(self, req: SimRequest) -> None:
        """Prompt accounting happens when the prompt is done, as vLLM counts it from the prefill output."""
        prompt, cached, external = (
            req.num_prompt_tokens,
            max(req.num_cached_tokens, 0),
            req.num_external_tokens,
        )
        computed = prompt - cached
        self.prompt_tokens.inc(prompt)
        self.prompt_by_source["local_compute"].inc(computed)
        self.prompt_by_source["local_cache_hit"].inc(cached - external)
        self.prompt_by_source["external_kv_transfer"].inc(external)
        self.prompt_cached.inc(cached)
        self.request_prompt_tokens.observe(prompt)
        self.prefill_computed.observe(computed)
        if req.first_token_time is not None:
            self.ttft.observe(req.first_token_time - req.arrival_time)

    def observe_finished(self, req: SimRequest) -> None:
        self.success[req.finish_reason or "stop"].inc()
        n_out = len(req.output_token_ids)
        self.request_generation_tokens.observe(n_out)
        self.request_preemptions.observe(req.num_preemptions)
        end = req.finish_time or req.last_token_time or req.arrival_time
        self.e2e.observe(end - req.arrival_time)
        start = req.first_scheduled_time or req.arrival_time
        self.queue_time.observe(start - req.arrival_time)
        self.inference_time.observe(end - start)
        first = req.first_token_time or end
        self.prefill_time.observe(first - start)
        self.decode_time.observe(end - first)
        if n_out > 1:
            self.tpot.observe((end - first) / (n_out - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
