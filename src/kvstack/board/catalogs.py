"""The exporters ``kvstack metrics check`` knows: one ``Catalog`` per engine version, kvstack component or
live /metrics page.

A ``Catalog`` maps family names (no exposition suffixes) to ``MetricName`` and retired names to ``Retired``.
``engine_catalog("vllm==0.32")`` reads ``kvstack.engines.names``. ``kvstack_catalogs()`` lists the families
kvstack's own processes export (router, Envoy picker, sidecar, cache server), read from the metrics objects
those processes build, instantiated here into fresh registries: label names come from the declarations, so
families without samples yet are complete. None of these processes registers prometheus_client's default
process/GC collectors. ``live_catalog(text, label)`` reads a /metrics page.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric

from kvstack.engines.names import ENGINE_NAMES, Kind, MetricName, Retired, names_for

__all__ = ["Catalog", "engine_catalog", "kvstack_catalogs", "live_catalog"]


@dataclass(frozen=True, slots=True)
class Catalog:
    label: str  # what a finding calls this exporter: "vllm 0.32", "kvstack router", "live http://…/metrics"
    role: str  # "engine" or "kvstack"
    metrics: Mapping[str, MetricName] = field(default_factory=dict)
    retired: Mapping[str, Retired] = field(default_factory=dict)


_SPEC = re.compile(r"([A-Za-z][\w-]*)(?:==(\S+))?")


def engine_catalog(spec: str) -> Catalog:
    """``"vllm==0.32"``, ``"vllm"`` (newest), ``"sglang"``...: ValueError with the known types otherwise."""
    m = _SPEC.fullmatch(spec.strip())
    forms = "expected TYPE or TYPE==VERSION, e.g. vllm==0.32"
    if m is None:
        types = ", ".join(dict.fromkeys(t.engine_type for t in ENGINE_NAMES))
        raise ValueError(f"cannot read engine {spec!r}: {forms}, with TYPE one of {types}")
    engine_type, version = m.groups()
    try:
        table = names_for(engine_type, version)
    except ValueError as exc:
        raise ValueError(f"engine {spec!r}: {exc} ({forms})") from None
    ranged = table.since or table.until
    label = (
        f"{engine_type} {version}"
        if version
        else f"{engine_type} ({table.versions})"
        if ranged
        else engine_type
    )
    return Catalog(label, "engine", table.metrics, table.retired)


_CACHE_EVENTS = "the cache server publishes KV events"
_WHEN = {"kvstack_cache_events": _CACHE_EVENTS, "kvstack_cache_event_batch_drops": _CACHE_EVENTS}


def kvstack_catalogs() -> tuple[Catalog, ...]:
    """kvstack's own exporters, each with the families (names, kinds, label names) its process exports."""
    from kvstack.cache.metrics import CacheMetrics
    from kvstack.cache.store import TieredStore
    from kvstack.cache.tiers import MemoryTier
    from kvstack.frontend.metrics import RouterMetrics

    # The proxy, the Envoy picker and the sidecar (after its engine's page) render RouterMetrics.
    front = _families(RouterMetrics().registry)
    cache = _families(
        CacheMetrics(TieredStore([MemoryTier(1 << 20)]), events=lambda: (0, 0)).registry, when=_WHEN
    )
    return (
        Catalog("kvstack router", "kvstack", front),
        Catalog("kvstack epp", "kvstack", front),
        Catalog("kvstack sidecar", "kvstack", front),
        Catalog("kvstack cache server", "kvstack", cache),
    )


_KINDS = {
    "counter": Kind.COUNTER,
    "gauge": Kind.GAUGE,
    "histogram": Kind.HISTOGRAM,
    "gaugehistogram": Kind.HISTOGRAM,
    "summary": Kind.SUMMARY,
    "info": Kind.INFO,
    "stateset": Kind.GAUGE,
    "unknown": Kind.GAUGE,  # untyped samples: Prometheus treats them as gauges
}
_BUCKET_LABELS = frozenset({"le", "quantile"})


def _family(metric: Metric, declared: Iterable[str] = (), when: str = "") -> MetricName:
    labels = set(declared) | set(getattr(metric, "_labelnames", ()))  # MetricFamily keeps its label names
    for sample in metric.samples:
        labels |= sample.labels.keys()
    return MetricName(
        metric.name, _KINDS[metric.type], frozenset(labels - _BUCKET_LABELS), metric.documentation, when=when
    )


def _families(registry: CollectorRegistry, when: Mapping[str, str] | None = None) -> dict[str, MetricName]:
    """Every family ``registry`` renders, with the label names its collectors declare."""
    out: dict[str, MetricName] = {}
    # prometheus_client keeps a registry's collectors in _collector_to_names; a wrapper metric (Counter...)
    # without children collects no samples, so its label names are read from its declaration.
    for collector in list(registry._collector_to_names):
        declared = collector._labelnames if isinstance(collector, MetricWrapperBase) else ()
        for metric in collector.collect():
            out[metric.name] = _family(metric, declared, (when or {}).get(metric.name, ""))
    return out


def live_catalog(text: str, label: str) -> Catalog:
    """The families of one /metrics page (OpenMetrics or Prometheus text), kinds from ``# TYPE``."""
    if text.rstrip().endswith("# EOF"):
        from prometheus_client.openmetrics.parser import text_string_to_metric_families
    else:
        from prometheus_client.parser import text_string_to_metric_families
    families = {m.name: m for m in text_string_to_metric_families(text)}
    # The Prometheus text format gives each counter's, histogram's and summary's <name>_created its own
    # gauge family: those belong to their family, not beside it.
    created = {
        f"{name}_created" for name, m in families.items() if m.type in ("counter", "histogram", "summary")
    }
    metrics = {name: _family(m) for name, m in families.items() if name not in created}
    role = "kvstack" if metrics and all(n.startswith("kvstack_") for n in metrics) else "engine"
    return Catalog(label, role, metrics)
