"""The series names a set of catalogs exports, and what a queried name is to each catalog.

Exposition rules (prometheus_client's, which vLLM and kvstack use): a counter family ``foo`` is scraped as
``foo_total`` and ``foo_created``; a histogram as ``foo_bucket`` (label ``le``), ``foo_sum``, ``foo_count``,
``foo_created``; a summary as ``foo`` (label ``quantile``), ``foo_sum``, ``foo_count``, ``foo_created``; a
gauge or info family as ``foo``. ``SeriesIndex.lookup(name)`` gives every catalog's ``Series`` for a
queried name; ``family(name)`` and ``retired(name)`` find what a name without its suffix was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstack.board.catalogs import Catalog
from kvstack.engines.names import Kind, MetricName, Retired

__all__ = ["SUFFIXES", "Series", "SeriesIndex", "exposed", "split_suffix"]

SUFFIXES = ("_total", "_created", "_bucket", "_sum", "_count")
_BY_KIND: dict[Kind, tuple[str, ...]] = {
    Kind.COUNTER: ("_total", "_created"),
    Kind.GAUGE: ("",),
    Kind.INFO: ("",),
    Kind.HISTOGRAM: ("_bucket", "_sum", "_count", "_created"),
    Kind.SUMMARY: ("", "_sum", "_count", "_created"),
}


@dataclass(frozen=True, slots=True)
class Series:
    """One catalog's family behind a queried series name."""

    catalog: Catalog
    family: MetricName
    suffix: str  # "" or one of SUFFIXES

    def labels(self) -> frozenset[str]:
        """The family's own labels plus ``le`` on buckets and ``quantile`` on a summary's quantiles."""
        extra = {"le"} if self.suffix == "_bucket" else set()
        if self.family.kind == Kind.SUMMARY and self.suffix == "":
            extra.add("quantile")
        return self.family.labels | extra


def exposed(family: MetricName) -> dict[str, str]:
    """The series names of ``family``, each with its suffix."""
    base = family.name
    if family.kind == Kind.COUNTER and base.endswith("_total"):
        base = base[: -len("_total")]
    return {base + suffix: suffix for suffix in _BY_KIND[family.kind]}


def split_suffix(name: str) -> tuple[str, str]:
    """``("foo", "_bucket")`` for ``foo_bucket``; ``(name, "")`` without a known suffix."""
    for suffix in SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)], suffix
    return name, ""


class SeriesIndex:
    def __init__(self, catalogs: Sequence[Catalog]) -> None:
        self.catalogs = tuple(catalogs)
        self._series: dict[str, list[Series]] = {}
        self._families: dict[str, list[tuple[Catalog, MetricName]]] = {}
        for catalog in self.catalogs:
            for family in catalog.metrics.values():
                self._families.setdefault(family.name, []).append((catalog, family))
                base, _ = split_suffix(family.name) if family.kind == Kind.COUNTER else (family.name, "")
                if base != family.name:
                    self._families.setdefault(base, []).append((catalog, family))
                for name, suffix in exposed(family).items():
                    self._series.setdefault(name, []).append(Series(catalog, family, suffix))

    def lookup(self, name: str) -> list[Series]:
        return self._series.get(name, [])

    def names(self) -> list[str]:
        return sorted(self._series)

    def family(self, name: str) -> list[tuple[Catalog, MetricName]]:
        """The families named ``name`` exactly (a counter also under its name without ``_total``)."""
        return self._families.get(name, [])

    def retired(self, name: str) -> list[tuple[Catalog, Retired]]:
        """Retired records for ``name`` or for ``name`` without its suffix, in every catalog."""
        base, _ = split_suffix(name)
        found = []
        for catalog in self.catalogs:
            record = catalog.retired.get(name) or catalog.retired.get(base)
            if record is not None:
                found.append((catalog, record))
        return found

    def series_name(self, family_name: str, suffix: str, catalog: Catalog) -> str:
        """How ``catalog`` exports ``family_name`` with ``suffix`` if it can, else its first series name."""
        names = self.series_names(family_name, catalog)
        return next((n for n in names if names[n] == suffix), next(iter(names), family_name))

    def series_names(self, family_name: str, catalog: Catalog) -> dict[str, str]:
        """``catalog``'s series names of ``family_name`` with their suffixes (empty if unknown)."""
        for candidate, family in self.family(family_name):
            if candidate is catalog:
                return exposed(family)
        return {}
