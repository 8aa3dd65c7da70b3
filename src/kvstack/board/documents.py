"""Readers that turn files into the PromQL expressions they hold, each with where it stands.

``read(paths)`` walks directories (``.json``, ``.yaml``, ``.yml``, ``.promql``) and reads:
- Grafana dashboards (``.json``, also wrapped as ``{"dashboard": ...}``): every panel's ``targets[].expr``
  (but those of a datasource of another type, e.g. Loki),
  panels nested in rows (collapsed or old-style ``rows``), annotations' ``expr`` and templating queries
  (``label_values(metric, label)`` is a use of the metric and the label, ``label_values(label)`` of the
  label, ``query_result(expr)`` of the expression; ``metrics()``/``label_names()`` are not checked);
- Prometheus rule files (YAML with ``groups``): each rule's ``expr``; ``record`` names are defined names;
- raw PromQL (``.promql``): one expression per line, ``#`` starts a comment line, blank lines are skipped;
- Kubernetes manifests (YAML documents with ``kind``, also ``kind: List``): PrometheusRule ``spec.groups``,
  ConfigMap values that are a dashboard or a rule file, and the facts of ``kvstack.board.manifests``.
A file named explicitly with another suffix raises ``UnsupportedFile``; a missing or unreadable path raises
OSError. A malformed or unrecognised document becomes a ``Problem`` (promtool test files are skipped).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvstack.board.manifests import Manifests

__all__ = ["SUFFIXES", "Expression", "Inputs", "Problem", "UnsupportedFile", "read"]

SUFFIXES = (".json", ".yaml", ".yml", ".promql")
_LABEL_VALUES = re.compile(r"^\s*label_values\s*\((?P<args>.*)\)\s*$", re.S)
_QUERY_RESULT = re.compile(r"^\s*query_result\s*\((?P<expr>.*)\)\s*$", re.S)


class UnsupportedFile(ValueError):
    """A file named on the command line whose suffix says nothing the checker reads."""


@dataclass(frozen=True, slots=True)
class Expression:
    file: str
    where: str  # 'panel "KV usage" (id 3) target A', 'alert "EngineDown"', 'line 4'
    text: str  # PromQL; "" for label_values(label), which reads a label only
    labels: tuple[str, ...] = ()  # labels the query reads from the result (label_values)


@dataclass(frozen=True, slots=True)
class Problem:
    file: str
    where: str
    message: str
    error: bool  # False: skipped with a warning


@dataclass(slots=True)
class Inputs:
    expressions: list[Expression] = field(default_factory=list)
    recorded: set[str] = field(default_factory=set)  # names recording rules define
    manifests: Manifests = field(default_factory=Manifests)
    has_manifests: bool = False
    problems: list[Problem] = field(default_factory=list)
    files: int = 0


def read(paths: Sequence[Path]) -> Inputs:
    """Every expression and fact of ``paths`` (files, or directories walked for the suffixes above)."""
    inputs = Inputs()
    for path in paths:
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such file or directory")
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
        elif path.suffix in SUFFIXES:
            files = [path]
        else:
            raise UnsupportedFile(
                f"{path}: not a dashboard (.json), rule file or manifest (.yaml, .yml) or PromQL (.promql)"
            )
        for file in files:
            _read_file(file, inputs)
    return inputs


def _read_file(path: Path, inputs: Inputs) -> None:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise OSError(f"{path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    inputs.files += 1
    file = str(path)
    if path.suffix == ".promql":
        _promql(file, text, inputs)
    elif path.suffix == ".json":
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            inputs.problems.append(Problem(file, f"line {exc.lineno}", f"not valid JSON: {exc.msg}", True))
            return
        if not _is_dashboard(doc):
            inputs.problems.append(
                Problem(file, "", "not a Grafana dashboard (no panels): not checked", False)
            )
            return
        _dashboard(file, "", doc, inputs)
    else:
        try:
            docs = [d for d in yaml.safe_load_all(text) if d is not None]
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"line {mark.line + 1}" if mark is not None else ""
            inputs.problems.append(Problem(file, where, f"not valid YAML: {exc}", True))
            return
        _yaml(file, docs, inputs)


def _promql(file: str, text: str, inputs: Inputs) -> None:
    for number, line in enumerate(text.splitlines(), start=1):
        expr = line.strip()
        if expr and not expr.startswith("#"):
            inputs.expressions.append(Expression(file, f"line {number}", expr))


def _yaml(file: str, docs: list[Any], inputs: Inputs) -> None:
    for doc in docs:
        if isinstance(doc, Mapping) and "kind" in doc:
            inputs.has_manifests = True
            _manifest(file, doc, inputs)
        elif isinstance(doc, Mapping) and isinstance(doc.get("groups"), list):
            _rules(file, "", doc["groups"], inputs)
        elif isinstance(doc, Mapping) and "rule_files" in doc and "tests" in doc:
            continue  # a promtool unit test file: its expressions are promtool's to check
        else:
            inputs.problems.append(
                Problem(file, "", "not a Prometheus rule file or Kubernetes manifest: not checked", False)
            )


def _manifest(file: str, obj: Mapping[str, Any], inputs: Inputs) -> None:
    kind = obj.get("kind")
    name = str((obj.get("metadata") or {}).get("name", ""))
    if kind == "List":
        for item in obj.get("items") or []:
            if isinstance(item, Mapping):
                _manifest(file, item, inputs)
        return
    inputs.manifests.add(obj)
    if kind == "PrometheusRule":
        groups = (obj.get("spec") or {}).get("groups")
        _rules(file, f'PrometheusRule "{name}" ', groups if isinstance(groups, list) else [], inputs)
    elif kind == "ConfigMap":
        for key, value in (obj.get("data") or {}).items():
            _config_value(file, f'ConfigMap "{name}" key "{key}" ', str(value), inputs)


def _config_value(file: str, prefix: str, value: str, inputs: Inputs) -> None:
    """A ConfigMap value is checked when its content is a dashboard or a rule file."""
    try:
        doc = json.loads(value)
    except ValueError:
        try:
            doc = yaml.safe_load(value)
        except yaml.YAMLError:
            return
        if isinstance(doc, Mapping) and isinstance(doc.get("groups"), list):
            _rules(file, prefix, doc["groups"], inputs)
        return
    if _is_dashboard(doc):
        _dashboard(file, prefix, doc, inputs)


def _rules(file: str, prefix: str, groups: Iterable[Any], inputs: Inputs) -> None:
    for group in groups:
        if not isinstance(group, Mapping):
            continue
        for rule in group.get("rules") or []:
            if not isinstance(rule, Mapping) or "expr" not in rule:
                continue
            if "record" in rule:
                inputs.recorded.add(str(rule["record"]))
                where = f'{prefix}group "{group.get("name", "")}" record "{rule["record"]}"'
            else:
                where = f'{prefix}group "{group.get("name", "")}" alert "{rule.get("alert", "")}"'
            inputs.expressions.append(Expression(file, where, str(rule["expr"])))


def _is_dashboard(doc: object) -> bool:
    if isinstance(doc, Mapping) and isinstance(doc.get("dashboard"), Mapping):
        doc = doc["dashboard"]
    return isinstance(doc, Mapping) and any(k in doc for k in ("panels", "rows", "templating"))


def _dashboard(file: str, prefix: str, doc: Mapping[str, Any], inputs: Inputs) -> None:
    if isinstance(doc.get("dashboard"), Mapping):
        doc = doc["dashboard"]
    panels = list(doc.get("panels") or [])
    for row in doc.get("rows") or []:  # dashboards older than schema 16
        if isinstance(row, Mapping):
            panels.extend(row.get("panels") or [])
    _panels(file, prefix, panels, inputs)
    for annotation in (doc.get("annotations") or {}).get("list") or []:
        if isinstance(annotation, Mapping) and annotation.get("expr"):
            where = f'{prefix}annotation "{annotation.get("name", "")}"'
            inputs.expressions.append(Expression(file, where, str(annotation["expr"])))
    for variable in (doc.get("templating") or {}).get("list") or []:
        if isinstance(variable, Mapping) and variable.get("type") == "query":
            _variable(file, f'{prefix}variable "{variable.get("name", "")}"', variable, inputs)


def _panels(file: str, prefix: str, panels: Iterable[Any], inputs: Inputs) -> None:
    for panel in panels:
        if not isinstance(panel, Mapping):
            continue
        _panels(file, prefix, panel.get("panels") or [], inputs)  # a collapsed row holds its panels
        for number, target in enumerate(panel.get("targets") or [], 1):
            if not isinstance(target, Mapping) or not target.get("expr"):
                continue
            datasource = target.get("datasource")
            if _prometheus(datasource if isinstance(datasource, Mapping) else panel.get("datasource")):
                panel_id = f'panel "{panel.get("title", "")}" (id {panel.get("id")})'
                where = f"{prefix}{panel_id} target {target.get('refId') or f'#{number}'}"
                inputs.expressions.append(Expression(file, where, str(target["expr"])))


def _prometheus(datasource: object) -> bool:
    """False for a datasource whose type says it is not Prometheus (Loki's expr is LogQL)."""
    # "datasource" is the type of Grafana's "-- Mixed --" and "-- Dashboard --" sources
    return not isinstance(datasource, Mapping) or datasource.get("type") in (None, "prometheus", "datasource")


def _variable(file: str, where: str, variable: Mapping[str, Any], inputs: Inputs) -> None:
    if not _prometheus(variable.get("datasource")):
        return
    query = variable.get("query")
    if isinstance(query, Mapping):
        query = query.get("query")
    if not isinstance(query, str):
        return
    if m := _LABEL_VALUES.match(query):
        args = m.group("args").strip()
        metric, comma, label = args.rpartition(",")
        if not comma:
            inputs.expressions.append(Expression(file, where, "", (args,)))
        else:
            inputs.expressions.append(Expression(file, where, metric.strip(), (label.strip(),)))
    elif m := _QUERY_RESULT.match(query):
        inputs.expressions.append(Expression(file, where, m.group("expr").strip()))
