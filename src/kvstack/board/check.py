"""The findings of ``kvstack metrics check``: every metric use of the inputs against the selected catalogs.

``check(inputs, catalogs)`` returns ``Finding``s (severity, a stable code, file, where, expression, message,
fix). Codes: ``parse-error``, ``not-checked`` (a document of no known kind), ``unknown-metric`` (no catalog,
recording rule of the inputs or Prometheus itself writes it), ``retired-metric``, ``hidden-metric``
(``--show-hidden-metrics-for-version``), ``suffix`` (``_total``/``_bucket``/``_sum``/``_count``/``_created``
on the wrong kind), ``histogram-function``, ``rate-of-gauge``, ``unknown-label`` (a matcher, by/without or
``label_values`` label no series there carries; ``TARGET_LABELS`` always allowed), ``label-value`` (values
manifests among the inputs cannot produce) and ``ambiguous-source`` (a name two exporters share, queried
without a label telling them apart). docs/design/metrics-check.md gives each rule and why.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvstack.board.catalogs import Catalog
from kvstack.board.documents import Expression, Inputs
from kvstack.board.promql import (
    Aggregation,
    FunctionCall,
    LabelMatch,
    MetricUse,
    PromQLError,
    from_variable,
    uses,
)
from kvstack.board.series import Series, SeriesIndex, split_suffix
from kvstack.engines.names import Kind

__all__ = ["GENERATED", "TARGET_LABELS", "Finding", "check"]

# Series Prometheus itself writes: per scrape target, and per alerting rule.
GENERATED = frozenset(
    {
        "up",
        "scrape_duration_seconds",
        "scrape_samples_scraped",
        "scrape_samples_post_metric_relabeling",
        "scrape_series_added",
        "scrape_timeout_seconds",
        "scrape_sample_limit",
        "scrape_body_size_bytes",
        "ALERTS",
        "ALERTS_FOR_STATE",
    }
)
# Labels Prometheus attaches to every scraped series: job and instance always, the rest with Kubernetes
# service discovery through prometheus-operator (allowed without manifests too: a dashboard does not say
# where it is deployed).
TARGET_LABELS = frozenset({"job", "instance", "namespace", "pod", "service", "endpoint", "container"})
# Labels that tell two scrape targets apart.
_TARGET_IDENTITY = frozenset({"job", "instance", "pod", "service", "endpoint", "container"})
_RATE_FUNCTIONS = frozenset({"rate", "irate", "increase", "resets"})
_LABEL_WRITERS = frozenset({"label_replace", "label_join"})
_CHECKED_VALUES = ("endpoint", "service", "namespace", "job")
# The series to suggest for a family asked for with a suffix its kind does not export.
_FIX_SUFFIX = {
    (Kind.COUNTER, ""): "_total",
    (Kind.HISTOGRAM, ""): "_bucket",
    (Kind.HISTOGRAM, "_total"): "_count",
    (Kind.SUMMARY, "_total"): "_count",
    (Kind.SUMMARY, "_bucket"): "",
}


@dataclass(frozen=True, slots=True)
class Finding:
    severity: str  # "error" or "warning"
    code: str
    file: str
    where: str
    expression: str
    message: str
    fix: str = ""


def check(inputs: Inputs, catalogs: Sequence[Catalog]) -> list[Finding]:
    """Every finding of ``inputs`` against ``catalogs`` (in input order)."""
    checker = _Checker(inputs, SeriesIndex(catalogs))
    findings = [
        Finding(
            "error" if p.error else "warning",
            "parse-error" if p.error else "not-checked",
            p.file,
            p.where,
            "",
            p.message,
        )
        for p in inputs.problems
    ]
    for expression in inputs.expressions:
        findings.extend(checker.expression(expression))
    return findings


class _Checker:
    def __init__(self, inputs: Inputs, index: SeriesIndex) -> None:
        self.inputs = inputs
        self.index = index
        self.allowed_target_labels = TARGET_LABELS | inputs.manifests.target_labels()

    def expression(self, expr: Expression) -> list[Finding]:
        out: list[Finding] = []

        def add(severity: str, code: str, message: str, fix: str = "") -> None:
            out.append(Finding(severity, code, expr.file, expr.where, expr.text, message, fix))

        if not expr.text:
            for label in expr.labels:
                if not from_variable(label) and not self._any_carries(label):
                    add(
                        "error",
                        "unknown-label",
                        f"no metric of the selected catalogs carries the label {label!r}",
                    )
            return out
        try:
            found = uses(expr.text)
        except PromQLError as exc:
            add("error", "parse-error", f"PromQL does not parse: {exc}")
            return out
        label_sets: list[tuple[MetricUse, frozenset[str] | None]] = []
        for use in found:
            series = self._name(use, add)
            labels = self._labels(series)
            label_sets.append((use, labels))
            if series:
                self._functions(use, series, add)
                self._ambiguity(use, series, add)
            if labels is not None:
                for m in use.matchers:
                    if _requires(m) and not from_variable(m.label) and m.label not in labels:
                        add("error", "unknown-label", *_unknown_label(use.name, m.label, labels))
                for label in expr.labels:
                    if not from_variable(label) and label not in labels:
                        add("error", "unknown-label", *_unknown_label(use.name, label, labels))
            if self.inputs.has_manifests:
                self._values(use, add)
        self._groupings(label_sets, add)
        return out

    # names

    def _name(self, use: MetricUse, add: _Add) -> list[Series]:
        name = use.name
        if name in self.inputs.recorded or name in GENERATED:
            return []
        series = self.index.lookup(name)
        if series:
            self._known(name, series, add)
            return series
        retired = self.index.retired(name)
        if retired:
            catalog, record = retired[0]
            _, suffix = split_suffix(name)
            fix = record.hint
            if record.replacement:
                fix = "use " + self.index.series_name(record.replacement, suffix, catalog)
            dates = ", ".join(
                p
                for p in (
                    f"deprecated in {record.deprecated_in}" if record.deprecated_in else "",
                    f"removed in {record.removed_in}" if record.removed_in else "",
                )
                if p
            )
            change = f"was renamed to {record.replacement}" if record.replacement else "was retired"
            where = f"{catalog.label}: {dates}; " if dates else f"{catalog.label}: "
            if record.removed_in is None:
                add(
                    "error",
                    "hidden-metric",
                    f"{name} {change} and is hidden ({where}exported only with "
                    f"--show-hidden-metrics-for-version={record.deprecated_in or '<version>'}; "
                    f"source: {record.source})",
                    fix,
                )
            else:
                add("error", "retired-metric", f"{name} {change} ({where}source: {record.source})", fix)
            return []
        if not self._suffix_mistake(name, add):
            close = difflib.get_close_matches(name, self.index.names(), n=1, cutoff=0.8)
            catalogs = ", ".join(c.label for c in self.index.catalogs) or "no catalogs"
            add(
                "error",
                "unknown-metric",
                f"{name} is exported by none of {catalogs}, nor defined by a recording rule of the inputs",
                f"did you mean {close[0]}?" if close else "check the name against the exporter's /metrics",
            )
        return []

    def _known(self, name: str, series: list[Series], add: _Add) -> None:
        exporting = {s.catalog.label for s in series}
        hidden_in = {s.catalog.label for s in series if s.family.hidden}
        _, suffix = split_suffix(name)
        for catalog, record in self.index.retired(name):
            change = f"renamed to {record.replacement}" if record.replacement else "retired"
            removal = f"removed in {record.removed_in}" if record.removed_in else "hidden after deprecation"
            if catalog.label not in exporting:
                message = f"{name} works on {', '.join(sorted(exporting))}, not on {catalog.label}"
            elif catalog.label not in hidden_in:
                message = f"{name} is deprecated in {catalog.label} (since {record.deprecated_in or '?'})"
            else:
                continue
            add(
                "warning",
                "retired-metric",
                f"{message} ({change}; {removal}; source: {record.source})",
                f"use {self.index.series_name(record.replacement, suffix, catalog)}"
                if record.replacement
                else record.hint,
            )
        hidden = [s.catalog.label for s in series if s.family.hidden]
        if hidden:
            severity = "error" if len(hidden) == len(series) else "warning"
            add(
                severity,
                "hidden-metric",
                f"{name} is hidden in {', '.join(hidden)}: "
                "exported only with --show-hidden-metrics-for-version",
                "start the engine with --show-hidden-metrics-for-version or query the name that replaced it",
            )
        if any(s.suffix == "_created" for s in series):
            base = name[: -len("_created")]
            add(
                "warning",
                "suffix",
                f"{name} is the creation timestamp of {base}, not a count (and absent when created series "
                "are disabled)",
                f"use {self.index.series_name(series[0].family.name, '_total', series[0].catalog)}"
                if series[0].family.kind == Kind.COUNTER
                else f"use {base}_count",
            )

    def _suffix_mistake(self, name: str, add: _Add) -> bool:
        """A family asked for under a series name its kind does not export."""
        base, suffix = split_suffix(name)
        families = self.index.family(name) or (self.index.family(base) if suffix else [])
        if not families:
            return False
        catalog, family = families[0]
        series = list(self.index.series_names(family.name, catalog))
        wanted = _FIX_SUFFIX.get((family.kind, suffix), suffix)
        fix = self.index.series_name(family.name, wanted, catalog)
        subject = name if name == family.name else f"{name}: {family.name}"
        add(
            "error",
            "suffix",
            f"{subject} is a {family.kind.value}, exported as {', '.join(series)}",
            f"use {fix}",
        )
        return True

    def _any_carries(self, label: str) -> bool:
        if label in self.allowed_target_labels or label in ("le", "quantile", "__name__"):
            return True
        return any(label in f.labels for c in self.index.catalogs for f in c.metrics.values())

    # functions, sources, labels

    def _functions(self, use: MetricUse, series: list[Series], add: _Add) -> None:
        first = series[0]
        innermost = use.enclosing[0] if use.enclosing else None
        if (
            isinstance(innermost, FunctionCall)
            and innermost.name in _RATE_FUNCTIONS
            and first.suffix == ""
            and first.family.kind in (Kind.GAUGE, Kind.INFO)
        ):
            add(
                "warning",
                "rate-of-gauge",
                f"{innermost.name}() of the gauge {use.name}: a gauge goes up and down, "
                f"{innermost.name}() reads every drop as a counter reset",
                f"query {use.name} directly, or use deriv()/delta() for its trend",
            )
        below: list[Aggregation] = []
        for enclosing in use.enclosing:
            if isinstance(enclosing, Aggregation):
                below.append(enclosing)
            elif enclosing.name == "histogram_quantile" and enclosing.arg == 1:
                if first.suffix != "_bucket":
                    add(
                        "error",
                        "histogram-function",
                        f"histogram_quantile over {use.name}, which is not a histogram's _bucket series "
                        f"({first.family.name} is a {first.family.kind.value})",
                        f"use {first.family.name}_bucket"
                        if first.family.kind == Kind.HISTOGRAM
                        else "histogram_quantile needs a histogram's _bucket series",
                    )
                for agg in below:
                    if ("le" in agg.labels) == agg.without:
                        add(
                            "error",
                            "histogram-function",
                            f"{agg.op} {'without' if agg.without else 'by'} ({', '.join(agg.labels)}) under "
                            "histogram_quantile drops le: the quantile has no buckets to read",
                            f"keep le: {agg.op} by (le, ...)",
                        )
                break

    def _ambiguity(self, use: MetricUse, series: list[Series], add: _Add) -> None:
        sources: dict[str, list[Series]] = {}
        for s in series:
            # kvstack's processes are one source each; engines (any version) and live pages are the engine
            sources.setdefault(s.catalog.label if s.catalog.role == "kvstack" else "engine", []).append(s)
        if len(sources) < 2:
            return
        label_sets = [frozenset().union(*(s.family.labels for s in group)) for group in sources.values()]
        telling = _TARGET_IDENTITY | (frozenset().union(*label_sets) - frozenset.intersection(*label_sets))
        if any(m.label in telling and _requires(m) for m in use.matchers):
            return
        for enclosing in use.enclosing:
            if isinstance(enclosing, Aggregation):
                if enclosing.without or not telling & set(enclosing.labels):
                    break
                return
        names = " and ".join(sorted(s.catalog.label for group in sources.values() for s in group[:1]))
        add(
            "error",
            "ambiguous-source",
            f"{use.name} is exported by {names}: without a matcher on job (or another label telling them "
            "apart) the query mixes their series",
            'select the exporter, e.g. {job="..."} or {job=~"$frontend"}',
        )

    def _labels(self, series: list[Series]) -> frozenset[str] | None:
        """The labels a use's series can carry; None when unknown (recorded, generated or unknown names)."""
        if not series:
            return None
        return frozenset().union(*(s.labels() for s in series)) | self.allowed_target_labels

    def _values(self, use: MetricUse, add: _Add) -> None:
        for m in use.matchers:
            if m.label not in _CHECKED_VALUES or m.from_variable:
                continue
            values = m.values()
            known = self.inputs.manifests.values(m.label)
            if values is None or known is None:
                continue
            # An alternation offers choices (one dashboard for either front end): it fails only when no
            # choice can match.
            if not any(value in known for value in values):
                shown = f'{m.label}="{values[0]}"' if m.op == "=" else f'{m.label}=~"{m.value}"'
                add(
                    "error",
                    "label-value",
                    f"{shown} matches no target: the manifests define {m.label} {', '.join(sorted(known))}",
                    f"use one of: {', '.join(sorted(known))}",
                )

    def _groupings(self, label_sets: list[tuple[MetricUse, frozenset[str] | None]], add: _Add) -> None:
        """A by/without label no series under the aggregation carries."""
        under: dict[int, tuple[Aggregation, list[frozenset[str] | None]]] = {}
        for use, labels in label_sets:
            current = labels
            for enclosing in use.enclosing:
                if isinstance(enclosing, FunctionCall):
                    if enclosing.name in _LABEL_WRITERS:
                        current = None
                    continue
                under.setdefault(enclosing.node, (enclosing, []))[1].append(current)
                if enclosing.op == "count_values" or current is None:
                    current = None
                elif enclosing.without:
                    current = current - set(enclosing.labels)
                else:
                    current = frozenset(enclosing.labels)
        for agg, sets in under.values():
            if any(s is None for s in sets):
                continue
            carried = frozenset().union(*(s for s in sets if s is not None))
            for label in agg.labels:
                if label not in carried and not from_variable(label):
                    add(
                        "error",
                        "unknown-label",
                        f"{agg.op} {'without' if agg.without else 'by'} ({', '.join(agg.labels)}): no series "
                        f"under it carries {label!r}",
                        f"labels there: {', '.join(sorted(carried))}",
                    )


class _Add(Protocol):
    def __call__(self, severity: str, code: str, message: str, fix: str = "") -> None: ...


def _unknown_label(name: str, label: str, labels: frozenset[str]) -> tuple[str, str]:
    own = sorted(labels - TARGET_LABELS)
    return (
        f"{name} never carries the label {label!r}",
        f"labels of {name}: {', '.join(own) or 'none besides target labels'} (and target labels "
        f"{', '.join(sorted(TARGET_LABELS))})",
    )


def _requires(m: LabelMatch) -> bool:
    """True when the matcher selects only series that carry the label (``=``/``=~`` not matching "")."""
    if m.op == "=":
        return m.value != ""
    if m.op != "=~":
        return False
    try:
        return re.fullmatch(m.value, "") is None
    except re.error:
        return True
