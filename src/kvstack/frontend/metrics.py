"""The front ends' own Prometheus metrics (the proxy's and the Envoy picker's). All names start with
``kvstack_`` and carry their unit; none reuses an engine's ``vllm:`` name, so engine and front-end series
never mix on one dashboard.

With several worker processes (``--workers``) /metrics on any worker renders every worker's values, counters
and histograms summed: prometheus_client runs in multiprocess mode (the supervisor sets
``PROMETHEUS_MULTIPROC_DIR``) and each gauge says how it combines (``multiprocess_mode``).

The five series every proxied request updates (requests, time to first byte, duration, in-flight, routing
decisions) are plain numbers that only the event loop updates (`LeanHotSeries`; per worker `WorkerHotSeries`,
summed when /metrics is read), rendered with the names, labels and samples prometheus_client would give.
Every series labelled by engine (`ENGINE_SERIES`: circuit state, upstream and scrape errors, missing metric
names, KV event counts, P/D prefills) is kept the same way so that it goes with its engine: a removed
engine's series are dropped, and updates that arrive for it afterwards (a request or scrape still in flight
at the removal) are ignored until an engine is added at that URL again. Why plain numbers:
docs/design/router-metrics.md.
"""

from __future__ import annotations

import logging
import os
import time
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from kvstack.engines.state import CircuitState

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
CIRCUIT_VALUES = {CircuitState.CLOSED: 0, CircuitState.HALF_OPEN: 1, CircuitState.OPEN: 2}


class InFlightGauge(Protocol):
    def set(self, value: float) -> None: ...


# (name, help) and label names of the hot series.
_REQUESTS = ("kvstack_router_requests", "Requests answered, by model, engine and HTTP status.")
_REQUEST_LABELS = ("model", "engine", "status")
_TTFT = ("kvstack_router_time_to_first_byte_seconds", "Time from request arrival to the first response byte.")
_E2E = ("kvstack_router_request_duration_seconds", "Time from request arrival to the last response byte.")
_IN_FLIGHT = ("kvstack_router_in_flight_requests", "Requests sent to an engine and not finished.")
_DECISIONS = ("kvstack_router_routing_decisions", "Routing decisions by scheduling profile and engine.")
_DECISION_LABELS = ("profile", "engine")
_COUNTER, _GAUGE = "counter", "gauge"
# Series labelled by engine (always their first label): name -> (help, label names, kind). Workers' counters
# are summed, their gauges take the highest value.
ENGINE_SERIES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "kvstack_router_circuit_state": (
        "Circuit breaker state: 0 closed, 1 half-open, 2 open.",
        ("engine",),
        _GAUGE,
    ),
    "kvstack_router_upstream_errors": (
        "Failed attempts against engines, by engine and reason.",
        ("engine", "reason"),
        _COUNTER,
    ),
    "kvstack_engine_scrape_errors": (
        "Failed /metrics scrapes, by engine and reason.",
        ("engine", "reason"),
        _COUNTER,
    ),
    "kvstack_engine_metric_missing": (
        "1 while an engine does not export a metric its catalog expects.",
        ("engine", "metric"),
        _GAUGE,
    ),
    "kvstack_kv_events": (
        "KV events received from engines, by engine and event type.",
        ("engine", "type"),
        _COUNTER,
    ),
    "kvstack_kv_event_gaps": (
        "Sequence gaps in an engine's KV event stream (batches missed).",
        ("engine",),
        _COUNTER,
    ),
    "kvstack_kv_event_replays": (
        "KV event replays asked of an engine, by result (ok, incomplete, failed).",
        ("engine", "result"),
        _COUNTER,
    ),
    "kvstack_kv_event_decode_errors": (
        "KV event messages that could not be decoded and were skipped.",
        ("engine",),
        _COUNTER,
    ),
    "kvstack_kv_event_resets": (
        "Times an engine's prefix index entries were dropped, by reason (gap, restart, disconnected, ...).",
        ("engine", "reason"),
        _COUNTER,
    ),
    "kvstack_prefix_entries_dropped": (
        "Prefix entries (KV-event index and routing history) dropped, by engine and reason (engine_down, "
        "restart, gap, disconnected, ...).",
        ("engine", "reason"),
        _COUNTER,
    ),
    "kvstack_engine_rejoins": (
        "Times an engine answered its metrics scrape again after it was seen down (e.g. restarted).",
        ("engine",),
        _COUNTER,
    ),
    "kvstack_kv_events_connected": (
        "1 while the router's KV event subscription to the engine is connected.",
        ("engine",),
        _GAUGE,
    ),
    "kvstack_pd_prefills": (
        "Prefill requests sent to prefill engines (P/D), by engine and outcome (ok, or the fallback reason).",
        ("engine", "outcome"),
        _COUNTER,
    ),
    "kvstack_pd_transferred_prompt_tokens": (
        "Prompt tokens prefilled for a decode engine to pull (the prefill answer's usage), by prefill engine",
        ("engine",),
        _COUNTER,
    ),
}
_FORGOTTEN_MAX = 4096  # removed engines whose late updates are ignored (the most recent ones)


class _Value:
    """One gauge value (what `engine_in_flight` returns in one process)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def set(self, value: float) -> None:
        self.value = value


class _Histogram:
    """One histogram series: a count per bucket (not cumulative: cumulated when rendered), the sum."""

    __slots__ = ("counts", "created", "total")

    def __init__(self, buckets: int, created: float | None = None) -> None:
        self.counts = [0] * (buckets + 1)  # the last one is +Inf
        self.total = 0.0
        self.created = time.time() if created is None else created


class HotSnapshot(msgspec.Struct, array_like=True):
    """The hot series' values at one moment, what a worker shares with its siblings: label values, then
    value and creation time (histograms: per-bucket counts, not cumulative, then the sum)."""

    requests: list[tuple[str, str, str, float, float]]
    decisions: list[tuple[str, str, float, float]]
    ttft: list[tuple[str, list[int], float, float]]
    e2e: list[tuple[str, list[int], float, float]]
    in_flight: list[tuple[str, float]]
    engine_series: list[tuple[str, list[str], float, float]] = []
    """(family name, label values, value, creation time; 0 for gauges) of the `ENGINE_SERIES`."""


class LeanHotSeries:
    """The hot series as plain numbers for a single-process router, rendered as a prometheus_client
    collector (registered in the router's registry). Only the event loop's thread may update them."""

    def __init__(
        self, registry: CollectorRegistry | None, buckets: tuple[float, ...] = LATENCY_BUCKETS
    ) -> None:
        self._bounds = buckets
        self._les = [*(floatToGoString(b) for b in buckets), "+Inf"]
        # Counters: label values -> [count, when the series first counted].
        self._requests: dict[tuple[str, str, str], list[float]] = {}
        self._decisions: dict[tuple[str, str], list[float]] = {}
        self._ttft: dict[str, _Histogram] = {}
        self._e2e: dict[str, _Histogram] = {}
        self._in_flight: dict[str, _Value] = {}
        # ENGINE_SERIES: family -> label values -> [value, creation time (counters; 0 for gauges)].
        self._engine_series: dict[str, dict[tuple[str, ...], list[float]]] = {n: {} for n in ENGINE_SERIES}
        # Engines removed lately, newest last: updates for them are ignored (see the module docstring).
        self.forgotten: OrderedDict[str, None] = OrderedDict()
        if registry is not None:
            registry.register(self)

    def request_done(self, model: str, engine: str, status: str) -> None:
        if engine in self.forgotten:
            return
        key = (model, engine, status)
        entry = self._requests.get(key)
        if entry is None:
            entry = self._requests[key] = [0.0, time.time()]
        entry[0] += 1.0

    def observe_latency(self, model: str, first_byte: float, total: float) -> None:
        ttft = self._ttft.get(model)
        if ttft is None:
            ttft = self._ttft[model] = _Histogram(len(self._bounds))
            self._e2e[model] = _Histogram(len(self._bounds))
        e2e = self._e2e[model]
        # A bucket holds values <= its bound ("le"): the first bound not below the value.
        ttft.counts[bisect_left(self._bounds, first_byte)] += 1
        ttft.total += first_byte
        e2e.counts[bisect_left(self._bounds, total)] += 1
        e2e.total += total

    def decision(self, profile: str, engine: str) -> None:
        if engine in self.forgotten:
            return
        key = (profile, engine)
        entry = self._decisions.get(key)
        if entry is None:
            entry = self._decisions[key] = [0.0, time.time()]
        entry[0] += 1.0

    def engine_in_flight(self, engine: str) -> InFlightGauge:
        gauge = self._in_flight.get(engine)
        if gauge is None:
            gauge = _Value()
            if engine not in self.forgotten:  # else a gauge nobody renders
                self._in_flight[engine] = gauge
        return gauge

    def count(self, family: str, labels: tuple[str, ...], n: float = 1.0) -> None:
        """Add ``n`` to a counter of `ENGINE_SERIES` (``labels[0]`` is the engine)."""
        if labels[0] in self.forgotten:
            return
        series = self._engine_series[family]
        entry = series.get(labels)
        if entry is None:
            entry = series[labels] = [0.0, time.time()]
        entry[0] += n

    def set_gauge(self, family: str, labels: tuple[str, ...], value: float | None) -> None:
        """Set a gauge of `ENGINE_SERIES` (``labels[0]`` is the engine); None removes the series."""
        if value is None:
            self._engine_series[family].pop(labels, None)
        elif labels[0] not in self.forgotten:
            self._engine_series[family][labels] = [value, 0.0]

    def engine_labels(self, family: str, engine: str) -> list[tuple[str, ...]]:
        """The label values of ``engine``'s series in ``family``."""
        return [labels for labels in self._engine_series[family] if labels[0] == engine]

    def engine_added(self, engine: str) -> None:
        self.forgotten.pop(engine, None)

    def forget_engine(self, engine: str) -> None:
        self.forgotten[engine] = None
        self.forgotten.move_to_end(engine)
        if len(self.forgotten) > _FORGOTTEN_MAX:
            self.forgotten.popitem(last=False)
        self._in_flight.pop(engine, None)
        for key in [k for k in self._requests if k[1] == engine]:
            del self._requests[key]
        for pair in [k for k in self._decisions if k[1] == engine]:
            del self._decisions[pair]
        for series in self._engine_series.values():
            for labels in [k for k in series if k[0] == engine]:
                del series[labels]

    def snapshot(self) -> HotSnapshot:
        return HotSnapshot(
            requests=[(*key, count, created) for key, (count, created) in self._requests.items()],
            decisions=[(*pair, count, created) for pair, (count, created) in self._decisions.items()],
            ttft=[(m, h.counts, h.total, h.created) for m, h in self._ttft.items()],
            e2e=[(m, h.counts, h.total, h.created) for m, h in self._e2e.items()],
            in_flight=[(engine, gauge.value) for engine, gauge in self._in_flight.items()],
            engine_series=[
                (name, list(labels), value, created)
                for name, series in self._engine_series.items()
                for labels, (value, created) in series.items()
            ],
        )

    def absorb(self, snap: HotSnapshot) -> None:
        """Add another worker's values to these: counts, sums and in-flight added, the earliest creation."""
        for counters, rows in ((self._requests, snap.requests), (self._decisions, snap.decisions)):
            for *labels, count, created in rows:
                entry = counters.setdefault(tuple(labels), [0.0, created])  # type: ignore[arg-type]
                entry[0] += count
                entry[1] = min(entry[1], created)
        for histograms, series in ((self._ttft, snap.ttft), (self._e2e, snap.e2e)):
            for model, counts, total, created in series:
                histogram = histograms.setdefault(model, _Histogram(len(self._bounds), created))
                histogram.counts = [a + b for a, b in zip(histogram.counts, counts, strict=True)]
                histogram.total += total
                histogram.created = min(histogram.created, created)
        for engine, value in snap.in_flight:
            self._in_flight.setdefault(engine, _Value()).value += value
        for name, label_values, value, created in snap.engine_series:
            family = self._engine_series.get(name)
            if family is None:
                continue  # a sibling running another version
            key = tuple(label_values)
            found = family.get(key)
            if found is None:
                family[key] = [value, created]
            elif ENGINE_SERIES[name][2] == _COUNTER:
                found[0] += value
                found[1] = min(found[1], created)
            else:
                found[0] = max(found[0], value)

    # -- prometheus_client's Collector protocol
    def describe(self) -> list[Metric]:
        return []  # nothing to check at registration: the names are the router's own

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(*_REQUESTS, labels=_REQUEST_LABELS)
        for key, (count, created) in self._requests.items():
            requests.add_metric(key, count, created=created)
        yield requests
        for (name, doc), series in ((_TTFT, self._ttft), (_E2E, self._e2e)):
            yield self._histogram_family(name, doc, series)
        in_flight = GaugeMetricFamily(*_IN_FLIGHT, labels=("engine",))
        for engine, gauge in self._in_flight.items():
            in_flight.add_metric((engine,), gauge.value)
        yield in_flight
        decisions = CounterMetricFamily(*_DECISIONS, labels=_DECISION_LABELS)
        for pair, (count, created) in self._decisions.items():
            decisions.add_metric(pair, count, created=created)
        yield decisions
        for name, (doc, label_names, kind) in ENGINE_SERIES.items():
            if kind == _COUNTER:
                counters = CounterMetricFamily(name, doc, labels=label_names)
                for labels, (count, created) in self._engine_series[name].items():
                    counters.add_metric(labels, count, created=created)
                yield counters
            else:
                gauges = GaugeMetricFamily(name, doc, labels=label_names)
                for labels, (value, _) in self._engine_series[name].items():
                    gauges.add_metric(labels, value)
                yield gauges

    def _histogram_family(self, name: str, doc: str, series: dict[str, _Histogram]) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, doc, labels=("model",))
        for model, histogram in series.items():
            cumulative, running = [], 0
            for le, count in zip(self._les, histogram.counts, strict=True):
                running += count
                cumulative.append((le, float(running)))
            family.add_metric((model,), cumulative, histogram.total)
            family.samples.append(Sample(f"{name}_created", {"model": model}, histogram.created))
        return family


class WorkerHotSeries(LeanHotSeries):
    """The hot series of one of several worker processes (``--workers``): each worker counts its own in
    plain numbers, as one process does; /metrics on any worker asks the others to write their snapshot
    (`flush`, over the group's control sockets) and renders the sum of all."""

    def __init__(self, directory: Path, index: int, count: int) -> None:
        super().__init__(None)
        self.index = index
        self._paths = [directory / f"hot-series-{i}.msgpack" for i in range(count)]

    def flush(self) -> None:
        """Write this worker's snapshot where its siblings read it (whole, by rename)."""
        path = self._paths[self.index]
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(_SNAPSHOTS.encode(self.snapshot()))
        os.replace(tmp, path)

    def collect(self) -> Iterator[Metric]:
        total = LeanHotSeries(None, self._bounds)
        total.absorb(self.snapshot())
        for i, path in enumerate(self._paths):
            if i == self.index:
                continue
            try:
                total.absorb(_SNAPSHOT_DECODER.decode(path.read_bytes()))
            except FileNotFoundError:
                continue  # a sibling that has not counted anything yet
            except (OSError, msgspec.DecodeError) as exc:
                log.warning("router metrics: cannot read worker %d's snapshot %s: %s", i, path, exc)
        yield from total.collect()


_SNAPSHOTS = msgspec.msgpack.Encoder()
_SNAPSHOT_DECODER = msgspec.msgpack.Decoder(HotSnapshot)


class RouterMetrics:
    def __init__(self, worker: tuple[Path, int, int] | None = None) -> None:
        """``worker``: (group directory, this worker's index, worker count) when running as one of
        several workers."""
        self.registry = reg = CollectorRegistry(auto_describe=True)
        # Set by the worker supervisor before this process imported prometheus_client.
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        # Plain numbers in every case; with workers, each worker's are summed when /metrics is read.
        self.hot = WorkerHotSeries(*worker) if worker else LeanHotSeries(None)
        if not self.multiprocess:  # else render() adds it to the registry of every process's values
            reg.register(self.hot)
        # The proxy calls these once or twice per request: bound straight to the series, no extra call.
        self.request_done = self.hot.request_done
        self.observe_latency = self.hot.observe_latency
        self.decision = self.hot.decision
        self.engine_in_flight = self.hot.engine_in_flight
        self.retries = Counter(
            "kvstack_router_retries",
            "Attempts retried on another engine, by the reason the previous attempt failed (connect_error, "
            "first_byte_timeout, status_503, ...; broken_before_content, timeout_before_content, "
            "ended_before_content, error_before_content: before the client got anything).",
            ["reason"],
            registry=reg,
        )
        self.hold_releases = Counter(
            "kvstack_router_hold_releases",
            "Streams whose start the proxy held back until their first content (an engine failing before "
            "then is retried: kvstack_router_retries, reasons *_before_content), by what released them: "
            "content, bytes or time (the hold's bounds; no retry after those).",
            ["cause"],
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
        self.engines = Gauge(
            "kvstack_router_engines",
            "Engines known to the router, by routability.",
            ["state"],
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
        self.tokens = Counter(
            "kvstack_router_tokens",
            "Tokens of answered requests as the engines' usage reports them, by model and kind (prompt, "
            "completion); counted where the front end reads response bodies.",
            ["model", "kind"],
            registry=reg,
        )
        self.pd_fallbacks = Counter(
            "kvstack_pd_fallbacks",
            "Requests scheduling disaggregated that the decode engine served whole (the prefill failed or "
            "was not possible), by reason.",
            ["reason"],
            registry=reg,
        )
        self.pd_prefill_seconds = Histogram(
            "kvstack_pd_prefill_seconds",
            "Time of successful prefill requests on prefill engines (P/D), from sending to the whole answer.",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.tokenize_seconds = Histogram(
            "kvstack_router_tokenize_seconds",
            "Time to get a prompt's token ids for routing, by source (local, remote, cache; "
            "local_failed, remote_failed: the time a failed attempt took).",
            ["source"],
            buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 2.5, 5.0),
            registry=reg,
        )

        # labels() takes a lock and validates on every call; repeated updates reuse children instead.
        self._children: dict[tuple[object, ...], Any] = {}
        self._circuit_states: dict[str, CircuitState] = {}

    def _child(self, metric: Any, *values: str) -> Any:
        key = (id(metric), *values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def set_circuit(self, engine: str, state: CircuitState) -> None:
        # Called after every proxied attempt; the series is set only when the state changed.
        if self._circuit_states.get(engine) is not state and engine not in self.hot.forgotten:
            self._circuit_states[engine] = state
            self.hot.set_gauge("kvstack_router_circuit_state", (engine,), CIRCUIT_VALUES[state])

    def upstream_error(self, engine: str, reason: str) -> None:
        self.hot.count("kvstack_router_upstream_errors", (engine, reason))

    def hold_released(self, cause: str) -> None:
        self._child(self.hold_releases, cause).inc()

    def engine_added(self, engine: str) -> None:
        """An engine (again) at this URL: its series count from here on."""
        self.hot.engine_added(engine)

    def forget_engine(self, engine: str) -> None:
        """Drop every series labelled with an engine when it leaves (its request counts included), and
        ignore late updates for it (see the module docstring), so engines that come and go do not grow
        /metrics without bound."""
        self._circuit_states.pop(engine, None)
        self.hot.forget_engine(engine)

    # -- ScrapeObserver (kvstack.engines.scraper) -----------------------------------------------------
    def on_scrape(self, engine: str, ok: bool, duration: float, error_reason: str | None) -> None:
        if not ok:
            self.hot.count("kvstack_engine_scrape_errors", (engine, error_reason or "unknown"))

    def on_missing(self, engine: str, names: frozenset[str]) -> None:
        family = "kvstack_engine_metric_missing"
        for labels in self.hot.engine_labels(family, engine):
            if labels[1] not in names:
                self.hot.set_gauge(family, labels, None)
        for name in names:
            self.hot.set_gauge(family, (engine, name), 1.0)

    # -- KVEventObserver (kvstack.kvevents.subscriber) ---------------------------------------------
    def kv_batch(self, engine: str, batch: Any) -> None:
        for event in batch.events:
            self.hot.count("kvstack_kv_events", (engine, type(event).__name__))

    def kv_gap(self, engine: str, missing: int) -> None:
        self.hot.count("kvstack_kv_event_gaps", (engine,), missing)

    def kv_replay(self, engine: str, result: str) -> None:
        self.hot.count("kvstack_kv_event_replays", (engine, result))

    def kv_decode_error(self, engine: str) -> None:
        self.hot.count("kvstack_kv_event_decode_errors", (engine,))

    def kv_reset(self, engine: str, reason: str) -> None:
        self.hot.count("kvstack_kv_event_resets", (engine, reason))

    def prefix_dropped(self, engine: str, reason: str, entries: int) -> None:
        self.hot.count("kvstack_prefix_entries_dropped", (engine, reason), entries)

    def engine_rejoined(self, engine: str) -> None:
        self.hot.count("kvstack_engine_rejoins", (engine,))

    def kv_connected(self, engine: str, connected: bool) -> None:
        self.hot.set_gauge("kvstack_kv_events_connected", (engine,), 1.0 if connected else 0.0)

    def usage(self, model: str, prompt_tokens: int, completion_tokens: int) -> None:
        self._child(self.tokens, model, "prompt").inc(prompt_tokens)
        self._child(self.tokens, model, "completion").inc(completion_tokens)

    def tokenized(self, source: str, seconds: float) -> None:
        self._child(self.tokenize_seconds, source).observe(seconds)

    # -- P/D disaggregation (kvstack.frontend.pd) -----------------------------------------------------
    def pd_prefill_sent(self, engine: str, outcome: str) -> None:
        self.hot.count("kvstack_pd_prefills", (engine, outcome))

    def pd_prefilled(self, engine: str, seconds: float, prompt_tokens: int | None) -> None:
        self.pd_prefill_seconds.observe(seconds)
        if prompt_tokens:
            self.hot.count("kvstack_pd_transferred_prompt_tokens", (engine,), prompt_tokens)

    def pd_fallback(self, reason: str) -> None:
        self._child(self.pd_fallbacks, reason).inc()

    def flush_hot(self) -> None:
        """Write this worker's hot series for a sibling rendering /metrics (no-op in one process)."""
        if isinstance(self.hot, WorkerHotSeries):
            self.hot.flush()

    def render(self) -> bytes:
        if self.multiprocess:
            merged = CollectorRegistry()
            MultiProcessCollector(merged)
            merged.register(self.hot)
            return generate_latest(merged)
        return generate_latest(self.registry)
