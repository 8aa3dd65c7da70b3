"""The router's own Prometheus metrics. All names start with ``kvstack_`` and carry their unit; none reuses
an engine's ``vllm:`` name, so engine and router series never mix on one dashboard.

With several worker processes (``--workers``) prometheus_client runs in multiprocess mode (the supervisor
sets ``PROMETHEUS_MULTIPROC_DIR``): /metrics on any worker renders every worker's values, counters and
histograms summed; each gauge says how it combines (``multiprocess_mode``).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from kvstack.engines.state import CircuitState

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
CIRCUIT_VALUES = {CircuitState.CLOSED: 0, CircuitState.HALF_OPEN: 1, CircuitState.OPEN: 2}


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = reg = CollectorRegistry(auto_describe=True)
        # Set by the worker supervisor before this process imported prometheus_client.
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self.requests = Counter(
            "kvstack_router_requests",
            "Requests answered, by model, engine and HTTP status.",
            ["model", "engine", "status"],
            registry=reg,
        )
        self.ttft = Histogram(
            "kvstack_router_time_to_first_byte_seconds",
            "Time from request arrival to the first response byte.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "kvstack_router_request_duration_seconds",
            "Time from request arrival to the last response byte.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.in_flight = Gauge(
            "kvstack_router_in_flight_requests",
            "Requests sent to an engine and not finished.",
            ["engine"],
            multiprocess_mode="livesum",
            registry=reg,
        )
        self.retries = Counter(
            "kvstack_router_retries",
            "Attempts retried on another engine, by reason.",
            ["reason"],
            registry=reg,
        )
        self.circuit = Gauge(
            "kvstack_router_circuit_state",
            "Circuit breaker state: 0 closed, 1 half-open, 2 open.",
            ["engine"],
            multiprocess_mode="livemax",
            registry=reg,
        )
        self.decisions = Counter(
            "kvstack_router_routing_decisions",
            "Routing decisions by scheduling profile and engine.",
            ["profile", "engine"],
            registry=reg,
        )
        self.admission_rejections = Counter(
            "kvstack_router_admission_rejections",
            "Requests refused by admission control.",
            ["reason"],
            registry=reg,
        )
        self.queue_depth = Gauge(
            "kvstack_router_queued_requests",
            "Requests waiting for admission.",
            multiprocess_mode="livesum",
            registry=reg,
        )
        self.upstream_errors = Counter(
            "kvstack_router_upstream_errors",
            "Failed attempts against engines, by engine and reason.",
            ["engine", "reason"],
            registry=reg,
        )
        self.scrape_errors = Counter(
            "kvstack_engine_scrape_errors",
            "Failed /metrics scrapes, by engine and reason.",
            ["engine", "reason"],
            registry=reg,
        )
        self.metric_missing = Gauge(
            "kvstack_engine_metric_missing",
            "1 while an engine does not export a metric its catalog expects.",
            ["engine", "metric"],
            multiprocess_mode="livemax",
            registry=reg,
        )
        self.engines = Gauge(
            "kvstack_router_engines",
            "Engines known to the router, by routability.",
            ["state"],
            multiprocess_mode="livemax",
            registry=reg,
        )
        self.kv_events = Counter(
            "kvstack_kv_events",
            "KV events received from engines, by engine and event type.",
            ["engine", "type"],
            registry=reg,
        )
        self.kv_event_gaps = Counter(
            "kvstack_kv_event_gaps",
            "Sequence gaps in an engine's KV event stream (batches missed).",
            ["engine"],
            registry=reg,
        )
        self.kv_event_replays = Counter(
            "kvstack_kv_event_replays",
            "KV event replays asked of an engine, by result (ok, incomplete, failed).",
            ["engine", "result"],
            registry=reg,
        )
        self.kv_event_decode_errors = Counter(
            "kvstack_kv_event_decode_errors",
            "KV event messages that could not be decoded and were skipped.",
            ["engine"],
            registry=reg,
        )
        self.kv_event_resets = Counter(
            "kvstack_kv_event_resets",
            "Times an engine's prefix index entries were dropped, by reason (gap, restart, resync).",
            ["engine", "reason"],
            registry=reg,
        )
        self.kv_events_connected = Gauge(
            "kvstack_kv_events_connected",
            "1 while the router's KV event subscription to the engine is connected.",
            ["engine"],
            multiprocess_mode="livemax",
            registry=reg,
        )
        self.prefix_index_entries = Gauge(
            "kvstack_prefix_index_entries",
            "(engine, block) entries in the prefix index.",
            multiprocess_mode="livemax",
            registry=reg,
        )
        self.prefix_index_evictions = Gauge(
            "kvstack_prefix_index_evicted_entries",
            "Entries evicted from the prefix index by its memory bound, since start.",
            multiprocess_mode="livemax",
            registry=reg,
        )
        self.tokenize_seconds = Histogram(
            "kvstack_router_tokenize_seconds",
            "Time to get a prompt's token ids for routing, by source (local, remote, cache).",
            ["source"],
            buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
            registry=reg,
        )

        # labels() takes a lock and validates on every call; the hot path reuses children instead.
        self._children: dict[tuple[object, ...], Any] = {}

    def _child(self, metric: Any, *values: str) -> Any:
        key = (id(metric), *values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def engine_in_flight(self, engine: str) -> Gauge:
        gauge: Gauge = self._child(self.in_flight, engine)
        return gauge

    def request_done(self, model: str, engine: str, status: str) -> None:
        self._child(self.requests, model, engine, status).inc()

    def observe_latency(self, model: str, first_byte: float, total: float) -> None:
        self._child(self.ttft, model).observe(first_byte)
        self._child(self.e2e, model).observe(total)

    def decision(self, profile: str, engine: str) -> None:
        self._child(self.decisions, profile, engine).inc()

    def set_circuit(self, engine: str, state: CircuitState) -> None:
        self._child(self.circuit, engine).set(CIRCUIT_VALUES[state])

    def forget_engine(self, engine: str) -> None:
        """Drop an engine's labelled series when it leaves, so removed engines do not linger (bounded)."""
        self._children = {k: v for k, v in self._children.items() if engine not in k[1:]}
        for metric in (self.in_flight, self.circuit):
            with contextlib.suppress(KeyError):
                metric.remove(engine)
        for series in (
            self.metric_missing,
            self.scrape_errors,
            self.upstream_errors,
            self.kv_events,
            self.kv_event_gaps,
            self.kv_event_replays,
            self.kv_event_decode_errors,
            self.kv_event_resets,
            self.kv_events_connected,
        ):
            self._drop_series(series, engine)

    @staticmethod
    def _drop_series(metric: Gauge | Counter, engine: str) -> None:
        # prometheus_client has no "remove by partial labels": find this engine's label sets.
        for sample_labels in [
            dict(zip(metric._labelnames, key, strict=True)) for key in list(metric._metrics)
        ]:
            if sample_labels.get("engine") == engine:
                with contextlib.suppress(KeyError):
                    metric.remove(*sample_labels.values())

    # -- ScrapeObserver (kvstack.engines.scraper) -----------------------------------------------------
    def on_scrape(self, engine: str, ok: bool, duration: float, error_reason: str | None) -> None:
        if not ok:
            self.scrape_errors.labels(engine=engine, reason=error_reason or "unknown").inc()

    def on_missing(self, engine: str, names: frozenset[str]) -> None:
        for sample_labels in [
            dict(zip(self.metric_missing._labelnames, k, strict=True))
            for k in list(self.metric_missing._metrics)
        ]:
            if sample_labels["engine"] == engine and sample_labels["metric"] not in names:
                self.metric_missing.remove(engine, sample_labels["metric"])
        for name in names:
            self.metric_missing.labels(engine=engine, metric=name).set(1)

    # -- KVEventObserver (kvstack.engines.kv_subscriber) ---------------------------------------------
    def kv_batch(self, engine: str, batch: Any) -> None:
        for event in batch.events:
            self._child(self.kv_events, engine, type(event).__name__).inc()

    def kv_gap(self, engine: str, missing: int) -> None:
        self._child(self.kv_event_gaps, engine).inc(missing)

    def kv_replay(self, engine: str, result: str) -> None:
        self._child(self.kv_event_replays, engine, result).inc()

    def kv_decode_error(self, engine: str) -> None:
        self._child(self.kv_event_decode_errors, engine).inc()

    def kv_reset(self, engine: str, reason: str) -> None:
        self._child(self.kv_event_resets, engine, reason).inc()

    def kv_connected(self, engine: str, connected: bool) -> None:
        self._child(self.kv_events_connected, engine).set(1 if connected else 0)

    def tokenized(self, source: str, seconds: float) -> None:
        self._child(self.tokenize_seconds, source).observe(seconds)

    def render(self) -> bytes:
        if self.multiprocess:
            merged = CollectorRegistry()
            MultiProcessCollector(merged)
            return generate_latest(merged)
        return generate_latest(self.registry)
