"""Read an engine's Prometheus text exposition through its metric catalog into ``LoadSignals``. Pure; no I/O.

- Unknown is never zero: a name the engine does not export leaves its signal None. When an alias (an older
  name) is exported instead, its value is used and the pair is reported. NaN and infinite values are unknown.
- Series of one name are combined: summed across label values (several ``model_name`` values, vLLM's
  data-parallel ``engine`` ranks), except ``kv_usage``, a 0..1 ratio, which is averaged, and ``block_size``,
  which the ranks share, so the largest is taken. ``num_blocks`` is summed over the ``engine`` ranks.
- Only the lines of names the catalog knows go through prometheus_client's parser: a vLLM dump is mostly
  histogram buckets, and parsing all of it costs about 10 ms of the router's event loop per engine and scrape.
  Every other line is only checked to start with a metric name, so an HTML error page or binary junk is still
  rejected. Malformed text raises ``MetricsParseError``; no other error escapes.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvstack.engines.catalog import SIGNAL_MEANINGS, Alias, MetricCatalog, MetricSource, Read
from kvstack.engines.state import LoadSignals

__all__ = ["CatalogReading", "MetricsParseError", "MissingName", "read_signals"]

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_INT_SIGNALS = frozenset({"block_size", "num_blocks"})
# Summed unless listed: a ratio is averaged, a shared setting taken once.
_COMBINE: dict[str, Callable[[list[float]], float]] = {"kv_usage": statistics.fmean, "block_size": max}


class MetricsParseError(ValueError):
    """The body is not Prometheus text exposition; the message names the line."""


@dataclass(frozen=True, slots=True)
class MissingName:
    """An expected name the engine does not export, the signals it would feed, and what was read instead."""

    metric: str
    signals: tuple[str, ...]
    found_instead: Alias | None = None
    label: str | None = None  # set when the info gauge is exported but lacks this label

    @property
    def name(self) -> str:
        return self.metric if self.label is None else f"{self.metric}{{{self.label}}}"

    def message(self, engine: str, engine_type: str) -> str:
        """The warning an operator reads: what is missing, what kvstack does about it."""
        if self.found_instead is not None:
            alias = self.found_instead
            renamed = f", renamed in {engine_type} {alias.renamed_in}" if alias.renamed_in else ""
            return f"engine {engine} exports no {self.metric} (found legacy {alias.name}{renamed}; using it)"
        unknown = " and ".join(SIGNAL_MEANINGS[s] for s in self.signals)
        if self.label is not None:
            return f"engine {engine} exports {self.metric} without label {self.label}; {unknown} unknown"
        return f"engine {engine} exports no {self.metric} and no known alias; {unknown} unknown"


@dataclass(frozen=True, slots=True)
class CatalogReading:
    """Load signals from one exposition, and the catalog names it lacked."""

    signals: LoadSignals
    gaps: tuple[MissingName, ...] = ()

    @property
    def missing(self) -> frozenset[str]:
        """Expected names not exported, whether or not an alias stood in."""
        return frozenset(g.name for g in self.gaps)

    @property
    def aliases_used(self) -> tuple[tuple[str, str], ...]:
        """(expected name, legacy name read instead)."""
        return tuple((g.name, g.found_instead.name) for g in self.gaps if g.found_instead is not None)


def read_signals(text: str, catalog: MetricCatalog) -> CatalogReading:
    """Map ``text`` (a /metrics body) to load signals through ``catalog``."""
    sources = catalog.sources()
    samples = _parse(text, _sample_names(sources.values()))
    values: dict[str, Any] = {}  # LoadSignals keyword arguments
    gaps: dict[str, MissingName] = {}
    for signal, src in sources.items():
        usable, value = _read(samples, src.name, src, signal)
        if usable:
            values[signal] = value
            continue
        found: Alias | None = None
        for alias in src.aliases:
            usable, value = _read(samples, alias.name, src, signal)
            if usable:
                found, values[signal] = alias, value
                break
        # An info gauge that is there but lacks the label is reported as such, not as an absent metric.
        label = src.label if src.read is Read.LABEL and src.name in samples else None
        gap = MissingName(src.name, (signal,), found, label)
        if (prev := gaps.get(gap.name)) is not None:
            gap = MissingName(src.name, (*prev.signals, signal), prev.found_instead or found, label)
        gaps[gap.name] = gap
    return CatalogReading(LoadSignals(**values), tuple(gaps.values()))


def _sample_names(sources: Iterable[MetricSource]) -> frozenset[str]:
    names: set[str] = set()
    for src in sources:
        for name in (src.name, *(a.name for a in src.aliases)):
            names.add(name)
            if src.read is Read.COUNTER:
                names.add(f"{name}_total")
    return frozenset(names)


def _parse(text: str, wanted: frozenset[str]) -> dict[str, list[Sample]]:
    """Samples of the ``wanted`` names, by sample name."""
    out: dict[str, list[Sample]] = {}
    # Split on newlines only: str.splitlines() also breaks at characters a label value may hold (U+2028, ...).
    for lineno, raw in enumerate(text.split("\n"), 1):
        line = raw.lstrip()
        if not line or line.startswith("#"):
            continue
        m = _METRIC_NAME.match(line)
        if m is None:
            raise MetricsParseError(f"line {lineno} is not Prometheus text exposition: {line[:80]!r}")
        if m.group() not in wanted:
            continue
        try:
            families = list(text_string_to_metric_families(line + "\n"))
        except Exception as exc:  # the parser reports bad input as ValueError, IndexError, ... alike
            raise MetricsParseError(f"line {lineno}: {exc or type(exc).__name__}: {line[:120]!r}") from exc
        for family in families:
            for sample in family.samples:
                out.setdefault(sample.name, []).append(sample)
    return out


def _read(
    samples: dict[str, list[Sample]], name: str, src: MetricSource, signal: str
) -> tuple[bool, float | int | None]:
    """(usable, value): usable is False when ``name`` is not exported (or lacks the label)."""
    if src.read is Read.COUNTER:
        series = samples.get(f"{name}_total") or samples.get(name)
    else:
        series = samples.get(name)
    if not series:
        return False, None
    if src.read is Read.LABEL:
        assert src.label is not None
        raw = [_number(s.labels.get(src.label)) for s in series]
        numbers = [v for v in raw if v is not None]
        if not numbers:
            return False, None
    else:
        numbers = [s.value for s in series]
    finite = [float(v) for v in numbers if math.isfinite(v)]
    if not finite:
        return True, None
    value = _COMBINE.get(signal, math.fsum)(finite)
    return True, (int(value) if signal in _INT_SIGNALS else value)


def _number(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        return None
