"""The exporters ``kvstack metrics check`` knows: one ``Catalog`` per engine version, kvstack component or
live /metrics page.

A ``Catalog`` maps family names (no exposition suffixes) to ``MetricName`` and retired names to ``Retired``.
``engine_catalog("vllm==0.32")`` reads ``kvstack.engines.names``; ``kvstack_catalogs()`` lists the families
kvstack's own processes export (router, Envoy picker, sidecar, cache server); ``live_catalog(text, label)``
reads a /metrics page.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvstack.engines.names import MetricName, Retired

__all__ = ["Catalog", "engine_catalog", "kvstack_catalogs", "live_catalog"]


@dataclass(frozen=True, slots=True)
class Catalog:
    label: str  # what a finding calls this exporter: "vllm 0.32", "kvstack router", "live http://…/metrics"
    role: str  # "engine" or "kvstack"
    metrics: Mapping[str, MetricName] = field(default_factory=dict)
    retired: Mapping[str, Retired] = field(default_factory=dict)


def engine_catalog(spec: str) -> Catalog:
    """``"vllm==0.32"``, ``"vllm"`` (newest), ``"sglang"``...: ValueError with the known types otherwise."""
    raise NotImplementedError


def kvstack_catalogs() -> tuple[Catalog, ...]:
    """kvstack's own exporters, each with the families (names, kinds, label names) its process exports."""
    raise NotImplementedError


def live_catalog(text: str, label: str) -> Catalog:
    """The families of one /metrics page (OpenMetrics or Prometheus text), kinds from ``# TYPE``."""
    raise NotImplementedError
