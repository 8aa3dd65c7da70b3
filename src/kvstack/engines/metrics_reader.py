"""Read an engine's Prometheus text exposition through its metric catalog into ``LoadSignals``. Pure; no I/O.

- Unknown is never zero: a name the engine does not export leaves its signal None. When an alias (an older
  name) is exported instead, its value is used and the pair is reported. NaN and infinite values are unknown.
- Series of one name are combined: summed across label values (several ``model_name`` values, vLLM's
  data-parallel ``engine`` ranks), except ``kv_usage``, a 0..1 ratio, which is averaged, and ``block_size``,
  which the ranks share, so the largest is taken. ``num_blocks`` is summed over the ``engine`` ranks.
- Only the lines of names the catalog knows are parsed (a vLLM page is mostly histogram buckets), but every
  other line must start like a metric name, a comment or a blank, so an HTML error page or binary junk is
  still rejected. Malformed text raises ``MetricsParseError`` naming the line; no other error escapes.

Why one regular-expression pass rather than a full Prometheus parser: docs/design/metrics-reading.md.
"""

from __future__ import annotations

import functools
import math
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstack.engines.catalog import SIGNAL_MEANINGS, Alias, MetricCatalog, MetricSource, Read
from kvstack.engines.state import LoadSignals

__all__ = ["CatalogReading", "MetricsParseError", "MissingName", "read_signals", "sample_names"]

# One label pair with its separator; a value holds anything but a bare quote, backslash or newline.
_LABEL_PAIR = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\\n]|\\.)*)"[ \t]*(,|(?=\}))')
_LABELS_END = re.compile(r"[ \t]*\}")
# The value and an optional integer timestamp in milliseconds, after at least one blank (or a closing brace).
_VALUE = re.compile(r"[ \t]*([^ \t]+)(?:[ \t]+-?[0-9]+)?[ \t]*\Z")
_ESCAPE = re.compile(r"\\(.)")
_UNESCAPED = {"n": "\n", "\\": "\\", '"': '"'}
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
    samples = _parse(text, sample_names(catalog))
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


@functools.lru_cache(maxsize=64)
def sample_names(catalog: MetricCatalog) -> frozenset[str]:
    """The sample names ``catalog`` reads: each source's name and aliases, counters also with ``_total``
    (computed once per catalog: every scrape of every engine asks)."""
    names: set[str] = set()
    for src in catalog.sources().values():
        for name in (src.name, *(a.name for a in src.aliases)):
            names.add(name)
            if src.read is Read.COUNTER:
                names.add(f"{name}_total")
    return frozenset(names)


@dataclass(frozen=True, slots=True)
class Sample:
    """One sample line: its labels and value."""

    labels: dict[str, str]
    value: float


def _parse(text: str, wanted: frozenset[str]) -> dict[str, list[Sample]]:
    """Samples of the ``wanted`` names, by sample name."""
    # One regular-expression pass over the text visits each line start once (the engine skips from newline
    # to newline by itself) and stops only at a line of a wanted name or at a line that does not start
    # like a metric name, a comment or a blank; a page is mostly histogram buckets, passed over in C.
    # Newlines only: str.splitlines() also breaks at characters a label value may hold (U+2028, ...).
    framed = "\n" + text
    out: dict[str, list[Sample]] = {}
    for m in _line_finder(wanted).finditer(framed):
        name, rest, bad = m.groups()
        if bad is not None:
            lineno = framed.count("\n", 0, m.start() + 1)
            line = text.split("\n")[lineno - 1].strip()
            raise MetricsParseError(f"line {lineno} is not Prometheus text exposition: {line[:80]!r}")
        try:
            sample = _sample(rest.rstrip(), 0)
        except ValueError as exc:
            lineno = framed.count("\n", 0, m.start() + 1)
            raise MetricsParseError(f"line {lineno}: {exc}: {(name + rest).strip()[:120]!r}") from None
        out.setdefault(name, []).append(sample)
    return out


@functools.lru_cache(maxsize=64)
def _line_finder(wanted: frozenset[str]) -> re.Pattern[str]:
    """After a newline and blanks: a wanted name (the whole name) and the rest of its line; or a character
    no line may start with."""
    names = "|".join(re.escape(n) for n in sorted(wanted, key=len, reverse=True)) or "(?!)"
    return re.compile(rf"\n[ \t\r\f\v]*(?:({names})(?![a-zA-Z0-9_:])([^\n]*)|([^a-zA-Z_:# \t\r\f\v\n]))")


def _sample(line: str, pos: int) -> Sample:
    """Labels and value of a sample line; ``line[pos:]`` is what follows its metric name. ValueError if
    malformed."""
    labels: dict[str, str] = {}
    if line.startswith("{", pos):
        pos += 1
        while (end := _LABELS_END.match(line, pos)) is None:
            pair = _LABEL_PAIR.match(line, pos)
            if pair is None:
                raise ValueError("malformed label set")
            key, value, _ = pair.groups()
            if key in labels:
                raise ValueError(f"label {key} given twice")
            labels[key] = _ESCAPE.sub(_unescape, value) if "\\" in value else value
            pos = pair.end()
        pos = end.end()
    elif pos < len(line) and line[pos] not in " \t":
        raise ValueError("no blank after the metric name")
    rest = _VALUE.match(line, pos)
    if rest is None:
        raise ValueError("expected a value and at most a timestamp")
    text = rest.group(1)
    if "_" in text:  # float() takes digit separators; the exposition format does not
        raise ValueError(f"invalid value {text!r}")
    return Sample(labels, float(text))  # float() raises ValueError with the text itself


def _unescape(m: re.Match[str]) -> str:
    c = m.group(1)
    return _UNESCAPED.get(c, "\\" + c)


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
