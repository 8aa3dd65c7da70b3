"""Which /metrics names carry each engine's load signals, per engine type and version range. Data only.

A ``MetricCatalog`` maps every field of ``LoadSignals`` to one ``MetricSource``: the name kvstack expects,
how to read it (a gauge's value, a counter's value, or a label of an info gauge such as
``vllm:cache_config_info{block_size="16",num_gpu_blocks="8192"} 1``) and known aliases, i.e. older names
with the engine version that renamed them. A signal the engine type does not export has no source.

``CATALOGS`` is built from the name tables of ``kvstack.engines.names``: how a source is read follows its
metric's kind, and its aliases are the retired names it replaced. ``vllm >= 0.10`` reads
``vllm:num_requests_waiting``/``_running``, ``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_*`` and
``vllm:cache_config_info`` (the ``vllm:gpu_*`` names renamed in 0.9.2 as aliases); ``vllm < 0.10`` expects
the old names; ``sglang`` has no prefix-cache counters, ``trtllm`` is trtllm-serve, ``triton`` gives the queue
only (no gauge of running requests). ``catalog_for(engine_type, version)`` picks the catalog, the newest
when ``version`` is None. Why catalogs, and why Triton has no running signal: docs/design/metrics-reading.md.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvstack.engines.names import (
    EngineNames,
    Kind,
    covering,
    describe_versions,
    in_versions,
    names_for,
    parse_version,
)

__all__ = [
    "CATALOGS",
    "SIGNALS",
    "SIGNAL_MEANINGS",
    "Alias",
    "MetricCatalog",
    "MetricSource",
    "Read",
    "catalog_for",
    "parse_version",
]

# The fields of LoadSignals, in the order catalogs list them.
SIGNALS: tuple[str, ...] = (
    "queue",
    "running",
    "kv_usage",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "block_size",
    "num_blocks",
)

# What a signal means to an operator, for "... KV usage unknown" messages.
SIGNAL_MEANINGS: dict[str, str] = {
    "queue": "queue length",
    "running": "running requests",
    "kv_usage": "KV usage",
    "prefix_cache_queries": "prefix-cache queries",
    "prefix_cache_hits": "prefix-cache hits",
    "block_size": "block size",
    "num_blocks": "KV block count",
}


class Read(enum.Enum):
    """How a signal's value is taken from the samples of its metric."""

    GAUGE = "gauge"  # the sample value
    COUNTER = "counter"  # the value of ``<name>_total``, or of ``<name>`` when the exporter adds no suffix
    LABEL = "label"  # a numeric label of an info gauge (whose value is 1)


@dataclass(frozen=True, slots=True)
class Alias:
    """An older name for the same quantity."""

    name: str
    renamed_in: str | None = None  # engine version that introduced the current name


@dataclass(frozen=True, slots=True)
class MetricSource:
    name: str
    read: Read = Read.GAUGE
    label: str | None = None  # for Read.LABEL
    aliases: tuple[Alias, ...] = ()


@dataclass(frozen=True, slots=True)
class MetricCatalog:
    """One engine type's metric names for versions in ``[since, until)``; None = unbounded."""

    engine_type: str
    since: str | None = None
    until: str | None = None
    queue: MetricSource | None = None
    running: MetricSource | None = None
    kv_usage: MetricSource | None = None
    prefix_cache_queries: MetricSource | None = None
    prefix_cache_hits: MetricSource | None = None
    block_size: MetricSource | None = None
    num_blocks: MetricSource | None = None

    @property
    def versions(self) -> str:
        return describe_versions(self.since, self.until)

    def sources(self) -> dict[str, MetricSource]:
        """Signal name → source, for the signals this engine type exports."""
        return {s: src for s in SIGNALS if (src := getattr(self, s)) is not None}

    def expected_names(self) -> frozenset[str]:
        return frozenset(src.name for src in self.sources().values())

    def known_names(self) -> frozenset[str]:
        """Expected names and their aliases."""
        return self.expected_names() | {a.name for src in self.sources().values() for a in src.aliases}

    def covers(self, version: str) -> bool:
        return in_versions(version, self.since, self.until)


def _source(table: EngineNames, name: str, label: str | None = None) -> MetricSource:
    """The source reading ``name`` of ``table``: how to read it follows its kind, and its aliases are the
    table's retired names that ``name`` replaced."""
    metric = table.metrics[name]  # a KeyError here: the catalog asks for a name its engine does not export
    read = Read.LABEL if label else Read.COUNTER if metric.kind is Kind.COUNTER else Read.GAUGE
    aliases = tuple(Alias(r.name, r.deprecated_in) for r in table.retired.values() if r.replacement == name)
    return MetricSource(name, read, label=label, aliases=aliases)


def _catalog(table: EngineNames, **names: str | tuple[str, str]) -> MetricCatalog:
    """The catalog of ``table``'s engine type and versions; a signal names a metric or (info gauge, label)."""
    sources = {
        signal: _source(table, *name) if isinstance(name, tuple) else _source(table, name)
        for signal, name in names.items()
    }
    return MetricCatalog(table.engine_type, since=table.since, until=table.until, **sources)


def _vllm(table: EngineNames, kv_usage: str, prefix_cache: str) -> MetricCatalog:
    return _catalog(
        table,
        queue="vllm:num_requests_waiting",
        running="vllm:num_requests_running",
        kv_usage=kv_usage,
        prefix_cache_queries=f"{prefix_cache}_queries",
        prefix_cache_hits=f"{prefix_cache}_hits",
        block_size=("vllm:cache_config_info", "block_size"),
        num_blocks=("vllm:cache_config_info", "num_gpu_blocks"),
    )


# Ordered newest first within a type: version=None picks the first.
CATALOGS: tuple[MetricCatalog, ...] = (
    _vllm(names_for("vllm"), "vllm:kv_cache_usage_perc", "vllm:prefix_cache"),
    _vllm(names_for("vllm", "0.9.1"), "vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache"),
    _catalog(
        names_for("sglang"),
        queue="sglang:num_queue_reqs",
        running="sglang:num_running_reqs",
        kv_usage="sglang:token_usage",
        block_size=("sglang:cache_config_info", "page_size"),
        num_blocks=("sglang:cache_config_info", "num_pages"),
    ),
    _catalog(
        names_for("trtllm"),
        queue="trtllm_num_requests_waiting",
        running="trtllm_num_requests_running",
        kv_usage="trtllm_kv_cache_utilization",
        block_size="trtllm_kv_cache_tokens_per_block",
        num_blocks="trtllm_kv_cache_max_blocks",
    ),
    _catalog(names_for("triton"), queue="nv_inference_pending_request_count"),
)


def catalog_for(engine_type: str, version: str | None = None) -> MetricCatalog:
    """The catalog of ``engine_type`` covering ``version`` (the newest when None)."""
    return covering(CATALOGS, engine_type, version, "metric catalog")
