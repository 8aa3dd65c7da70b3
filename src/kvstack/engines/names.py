"""Every metric an engine type exports, per version range, and the names it retired. Data only.

``EngineNames`` lists, for one engine type and versions ``[since, until)``, each metric family as the engine
defines it (``MetricName``: family name without exposition suffixes, kind, label names, whether it is hidden
behind ``--show-hidden-metrics-for-version``) and each name it used to export (``Retired``: replacement,
versions, where the change is recorded). Counters are exposed as ``<name>_total`` and ``<name>_created``,
histograms as ``<name>_bucket``/``_sum``/``_count``: consumers of this table apply those rules, the table does
not repeat them.

The router's signal catalogs (``kvstack.engines.catalog``) read names from these tables, and
``kvstack metrics check`` checks dashboards and rules against them: one table for both.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["ENGINE_NAMES", "EngineNames", "Kind", "MetricName", "Retired", "names_for"]


class Kind(enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"
    SUMMARY = "summary"
    INFO = "info"  # a gauge of value 1 whose labels carry the data (vllm:cache_config_info)


@dataclass(frozen=True, slots=True)
class MetricName:
    name: str  # the family name, e.g. "vllm:prompt_tokens" (scraped as vllm:prompt_tokens_total)
    kind: Kind
    labels: frozenset[str] = frozenset()
    help: str = ""
    hidden: bool = False  # exported only with --show-hidden-metrics-for-version


@dataclass(frozen=True, slots=True)
class Retired:
    """A name the engine no longer exports (or hides) in the versions of its table."""

    name: str
    replacement: str | None  # a name of the same table, or None when there is no one-to-one replacement
    deprecated_in: str | None
    removed_in: str | None  # None: hidden (still exported with --show-hidden-metrics-for-version)
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
        parts = [f">= {self.since}" if self.since else "", f"< {self.until}" if self.until else ""]
        return ", ".join(p for p in parts if p) or "all versions"


ENGINE_NAMES: tuple[EngineNames, ...] = ()  # newest first within a type


def names_for(engine_type: str, version: str | None = None) -> EngineNames:
    """The table of ``engine_type`` covering ``version`` (the newest when None); ValueError naming the known
    types and version ranges otherwise."""
    raise NotImplementedError
