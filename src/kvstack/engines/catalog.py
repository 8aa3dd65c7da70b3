"""Which /metrics names carry each engine's load signals, per engine type and version range. Data only.

A ``MetricCatalog`` maps every field of ``LoadSignals`` to one ``MetricSource``: the name kvstack expects,
how to read it (a gauge's value, a counter's value, or a label of an info gauge such as
``vllm:cache_config_info{block_size="16",num_gpu_blocks="8192"} 1``) and known aliases, i.e. older names
with the engine version that renamed them. A signal the engine type does not export has no source.

``CATALOGS`` lists every name: ``vllm >= 0.10`` (``vllm:num_requests_waiting``/``_running``,
``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_queries``/``_hits``, ``vllm:cache_config_info``; the
``vllm:gpu_*`` names renamed in 0.9.2 as aliases), ``vllm < 0.10`` (the old names expected), ``sglang``
(no prefix-cache counters), ``trtllm`` (trtllm-serve) and ``triton`` (the queue only: Triton has no gauge of
running requests). ``catalog_for(engine_type, version)`` picks the catalog; ``version=None`` means the
newest. Why catalogs, and why Triton has no running signal: docs/design/metrics-reading.md.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, replace

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
        parts = [f">= {self.since}" if self.since else "", f"< {self.until}" if self.until else ""]
        return ", ".join(p for p in parts if p) or "all versions"

    def sources(self) -> dict[str, MetricSource]:
        """Signal name → source, for the signals this engine type exports."""
        return {s: src for s in SIGNALS if (src := getattr(self, s)) is not None}

    def expected_names(self) -> frozenset[str]:
        return frozenset(src.name for src in self.sources().values())

    def known_names(self) -> frozenset[str]:
        """Expected names and their aliases."""
        return self.expected_names() | {a.name for src in self.sources().values() for a in src.aliases}

    def covers(self, version: str) -> bool:
        v = parse_version(version)
        return (self.since is None or v >= parse_version(self.since)) and (
            self.until is None or v < parse_version(self.until)
        )


def _gauge(name: str, *aliases: Alias) -> MetricSource:
    return MetricSource(name, Read.GAUGE, aliases=aliases)


def _counter(name: str, *aliases: Alias) -> MetricSource:
    return MetricSource(name, Read.COUNTER, aliases=aliases)


def _label(name: str, label: str) -> MetricSource:
    return MetricSource(name, Read.LABEL, label=label)


_VLLM = MetricCatalog(
    "vllm",
    since="0.10",
    queue=_gauge("vllm:num_requests_waiting"),
    running=_gauge("vllm:num_requests_running"),
    kv_usage=_gauge("vllm:kv_cache_usage_perc", Alias("vllm:gpu_cache_usage_perc", "0.9.2")),
    prefix_cache_queries=_counter(
        "vllm:prefix_cache_queries", Alias("vllm:gpu_prefix_cache_queries", "0.9.2")
    ),
    prefix_cache_hits=_counter("vllm:prefix_cache_hits", Alias("vllm:gpu_prefix_cache_hits", "0.9.2")),
    block_size=_label("vllm:cache_config_info", "block_size"),
    num_blocks=_label("vllm:cache_config_info", "num_gpu_blocks"),
)

# Ordered newest first within a type: version=None picks the first.
CATALOGS: tuple[MetricCatalog, ...] = (
    _VLLM,
    replace(
        _VLLM,
        since=None,
        until="0.10",
        kv_usage=_gauge("vllm:gpu_cache_usage_perc"),
        prefix_cache_queries=_counter("vllm:gpu_prefix_cache_queries"),
        prefix_cache_hits=_counter("vllm:gpu_prefix_cache_hits"),
    ),
    MetricCatalog(
        "sglang",
        queue=_gauge("sglang:num_queue_reqs"),
        running=_gauge("sglang:num_running_reqs"),
        kv_usage=_gauge("sglang:token_usage"),
        block_size=_label("sglang:cache_config_info", "page_size"),
        num_blocks=_label("sglang:cache_config_info", "num_pages"),
    ),
    MetricCatalog(
        "trtllm",
        queue=_gauge("trtllm_num_requests_waiting"),
        running=_gauge("trtllm_num_requests_running"),
        kv_usage=_gauge("trtllm_kv_cache_utilization"),
        block_size=_gauge("trtllm_kv_cache_tokens_per_block"),
        num_blocks=_gauge("trtllm_kv_cache_max_blocks"),
    ),
    MetricCatalog("triton", queue=_gauge("nv_inference_pending_request_count")),
)

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


def catalog_for(engine_type: str, version: str | None = None) -> MetricCatalog:
    """The catalog of ``engine_type`` covering ``version`` (the newest when None)."""
    candidates = [c for c in CATALOGS if c.engine_type == engine_type]
    if not candidates:
        known = ", ".join(sorted({c.engine_type for c in CATALOGS}))
        raise ValueError(f"unknown engine type {engine_type!r}; known engine types: {known}")
    if version is None:
        return candidates[0]
    for catalog in candidates:
        if catalog.covers(version):
            return catalog
    ranges = "; ".join(c.versions for c in candidates)
    raise ValueError(f"no {engine_type} metric catalog covers version {version} (catalogs: {ranges})")
