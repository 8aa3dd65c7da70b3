"""The cache server's Prometheus metrics (``kvstack_cache_*``), in a registry of its own.

Two kinds of series: per tier (label ``tier`` = tier name), read from ``TieredStore.stats()`` at scrape
time; and the server's own counts of requests, lookups, payload bytes, protocol errors and events.
`CacheMetrics` lists every series with its labels; ``render()`` is the ``GET /metrics`` body. Per-request
counts are plain numbers exported at scrape time, so answering a request takes no metrics lock.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvstack.cache.store import TieredStore

__all__ = ["CacheMetrics"]

_LATENCY_BUCKETS = (
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)


class _StoreCollector(Collector):
    def __init__(self, store: TieredStore, events: Callable[[], tuple[int, int]] | None) -> None:
        self._store = store
        self._events = events

    def collect(self) -> Iterator[Metric]:
        stats = self._store.stats()

        def counter(name: str, doc: str) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, labels=["tier"])

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=["tier"])

        hits = counter("kvstack_cache_hits", "Chunk reads served, by tier")
        misses = counter("kvstack_cache_tier_misses", "Chunk reads a tier could not serve")
        evictions = counter("kvstack_cache_evictions", "Chunks evicted to make room")
        drops = counter("kvstack_cache_write_drops", "Writes a tier did not store")
        errors = counter("kvstack_cache_tier_errors", "I/O or connection errors")
        corrupt = counter("kvstack_cache_corrupt", "Entries that failed verification")
        size = gauge("kvstack_cache_bytes", "Bytes held")
        capacity = gauge("kvstack_cache_capacity_bytes", "Byte budget")
        entries = gauge("kvstack_cache_entries", "Chunks held")
        up = gauge("kvstack_cache_tier_up", "1 when the tier is reachable")
        page_cache = counter(
            "kvstack_cache_page_cache_reads", "Disk hits read on the event loop from the page cache"
        )
        for name, tier in stats.tiers.items():
            hits.add_metric([name], tier.hits)
            misses.add_metric([name], tier.misses)
            evictions.add_metric([name], tier.evictions)
            drops.add_metric([name], tier.write_drops)
            errors.add_metric([name], tier.errors)
            corrupt.add_metric([name], tier.corrupt)
            up.add_metric([name], 1.0 if tier.up else 0.0)
            if tier.bytes is not None:
                size.add_metric([name], tier.bytes)
            if tier.capacity_bytes is not None:
                capacity.add_metric([name], tier.capacity_bytes)
            if tier.entries is not None:
                entries.add_metric([name], tier.entries)
            if tier.page_cache_reads is not None:
                page_cache.add_metric([name], tier.page_cache_reads)
        queue_drops = counter("kvstack_cache_queue_drops", "Writes dropped: queue full")
        queued = gauge("kvstack_cache_write_queue", "Writes waiting for a lower tier")
        for name, n in stats.queue_drops.items():
            queue_drops.add_metric([name], n)
            queued.add_metric([name], stats.queued.get(name, 0))
        yield from (hits, misses, evictions, drops, errors, corrupt, size, capacity, entries, up, page_cache)
        yield from (queue_drops, queued)
        yield CounterMetricFamily(
            "kvstack_cache_promotions",
            "Chunks copied into memory after a lower-tier hit",
            value=stats.promotions,
        )
        if self._events is not None:
            sent, dropped = self._events()
            yield CounterMetricFamily("kvstack_cache_events", "KV events published", value=sent)
            yield CounterMetricFamily(
                "kvstack_cache_event_batch_drops",
                "Event batches the PUB socket refused to send",
                value=dropped,
            )


class _RequestCollector(Collector):
    """The per-request counts `CacheMetrics` keeps as plain numbers, as Prometheus metrics."""

    def __init__(self, metrics: CacheMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        chunks = CounterMetricFamily(
            "kvstack_cache_lookup_chunks", "Chunks asked about by lookups", labels=["result"]
        )
        chunks.add_metric(["hit"], m.lookup_hits)
        chunks.add_metric(["miss"], m.lookup_misses)
        requests = CounterMetricFamily("kvstack_cache_requests", "Requests handled", labels=["op", "result"])
        for (op, result), n in sorted(m._requests.items()):
            requests.add_metric([op, result], n)
        seconds = HistogramMetricFamily(
            "kvstack_cache_operation_seconds", "Request handling time", labels=["op"]
        )
        for op, counts in sorted(m._latency.items()):
            cumulative = list(itertools.accumulate(counts[:-1]))
            buckets = [(floatToGoString(le), n) for le, n in zip(_LATENCY_BUCKETS, cumulative, strict=False)]
            seconds.add_metric([op], [*buckets, ("+Inf", cumulative[-1])], sum_value=counts[-1])
        yield from (chunks, requests, seconds)


class CacheMetrics:
    """The server's metrics; ``render()`` is the /metrics body.

    Read from the store at scrape time (labels ``tier`` = tier name):

    - ``kvstack_cache_hits_total{tier}`` / ``kvstack_cache_tier_misses_total{tier}``: chunk reads each tier
      served / could not serve (a tier's own count: a get asks the lower tiers only for what memory missed).
    - ``kvstack_cache_bytes{tier}``, ``kvstack_cache_capacity_bytes{tier}``, ``kvstack_cache_entries{tier}``
    - ``kvstack_cache_evictions_total{tier}``, ``kvstack_cache_write_drops_total{tier}``,
      ``kvstack_cache_tier_errors_total{tier}``, ``kvstack_cache_corrupt_total{tier}``,
      ``kvstack_cache_tier_up{tier}``, ``kvstack_cache_page_cache_reads_total{tier}`` (disk hits read on the
      event loop because the file was wholly in the page cache)
    - ``kvstack_cache_queue_drops_total{tier}`` (write-behind queue full), ``kvstack_cache_write_queue{tier}``
      (writes waiting), ``kvstack_cache_promotions_total``.

    Counted by the server:

    - ``kvstack_cache_misses_total``: chunks a get asked for and did not receive (after the first missing
      chunk every later one counts: only a consecutive prefix is served).
    - ``kvstack_cache_lookup_chunks_total{result}`` (``hit``/``miss``): the same for lookups.
    - ``kvstack_cache_operation_seconds{op}``: request handling time by op (histogram, 50 µs to 2.5 s).
    - ``kvstack_cache_requests_total{op,result}`` (``ok``/``error``),
      ``kvstack_cache_protocol_errors_total{code}`` (every error reply and every reply that could not be
      sent, by `ErrorCode` or ``dropped``).
    - ``kvstack_cache_payload_bytes_total{op,path}``: get/put payload bytes through ``shm`` or ``socket``.
    - ``kvstack_cache_events_total``, ``kvstack_cache_event_batch_drops_total``: events published, batches
      the PUB socket refused. ZMQ drops silently for a subscriber past its high-water mark; that subscriber
      sees the sequence gap and replays, so such drops are not counted here.
    """

    def __init__(self, store: TieredStore, *, events: Callable[[], tuple[int, int]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_StoreCollector(store, events))
        r = self.registry
        self.misses = Counter(
            "kvstack_cache_misses", "Chunks a get asked for and did not receive", registry=r
        )
        # Per-request counts are plain numbers, exported at scrape time (_RequestCollector): a lookup is
        # answered in ~50 µs of Python, and each prometheus_client update (a lock, label checks) is 2-5 µs.
        self.lookup_hits = 0
        self.lookup_misses = 0
        self._requests: dict[tuple[str, str], int] = {}
        self._latency: dict[str, list[float]] = {}  # by op: count per bucket, then +Inf's, then the sum
        r.register(_RequestCollector(self))
        self.protocol_errors = Counter(
            "kvstack_cache_protocol_errors", "Error replies and dropped messages", ["code"], registry=r
        )
        self.payload_bytes = Counter(
            "kvstack_cache_payload_bytes", "Payload bytes moved", ["op", "path"], registry=r
        )
        # labels() validates and locks on every call; the request path reuses children (bounded label sets).
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def request_done(self, op: str, ok: bool, seconds: float) -> None:
        """Count one handled request (``kvstack_cache_requests_total``, ``..._operation_seconds``)."""
        key = (op, "ok" if ok else "error")
        self._requests[key] = self._requests.get(key, 0) + 1
        counts = self._latency.get(op)
        if counts is None:
            counts = self._latency[op] = [0] * (len(_LATENCY_BUCKETS) + 2)
        counts[bisect.bisect_left(_LATENCY_BUCKETS, seconds)] += 1  # le: upper bounds are inclusive
        counts[-1] += seconds

    def child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, cached."""
        key = (id(metric), values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found

    def render(self) -> bytes:
        return generate_latest(self.registry)
