"""PromQL expressions as the metric uses they contain, parsed with ``promql_parser``.

``uses(text)`` returns one ``MetricUse`` per metric name a selector asks for (``foo{...}``,
``{__name__="foo"}``, each name of ``{__name__=~"a|b"}``), with its label matchers and what encloses it:
functions (innermost first, with the argument position) and aggregations (with their by/without labels).
Grafana variables (``$var``, ``${var}``, ``${var:fmt}``, ``[[var]]``, ``$__rate_interval``...) are replaced
before parsing by a placeholder that fits where they stand: a duration inside ``[...]`` or after
``offset``, a label name inside ``by (...)``/``on (...)``, a word inside quotes, a metric name elsewhere
(or the number 1 where a scalar must stand). A matcher, name or label that came from a variable says so
and is not checked. A text that does not parse raises ``PromQLError`` with the parser's message and the
column it points near.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass

import promql_parser as pp

__all__ = [
    "Aggregation",
    "FunctionCall",
    "LabelMatch",
    "MetricUse",
    "PromQLError",
    "from_variable",
    "substitute_variables",
    "uses",
]

VARIABLE_MARK = "__grafana_var_"
_VARIABLE = re.compile(
    r"\$\{(?P<braced>\w+)(?::[^}]*)?\}|\[\[(?P<bracketed>\w+)(?::[^\]]*)?\]\]|\$(?P<plain>[A-Za-z_]\w*)"
)
_GROUPING_OPEN = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*$")
_OPS = (("=", pp.MatchOp.Equal), ("!=", pp.MatchOp.NotEqual), ("=~", pp.MatchOp.Re), ("!~", pp.MatchOp.NotRe))
_ALTERNATION = re.compile(r"^[\w:.\-/]+(\|[\w:.\-/]+)*$")


class PromQLError(ValueError):
    """An expression the parser rejects: its message and the 1-based column it points near."""

    def __init__(self, message: str, column: int) -> None:
        super().__init__(f"{message} (near column {column})")
        self.column = column


@dataclass(frozen=True, slots=True)
class LabelMatch:
    op: str  # "=", "!=", "=~" or "!~"
    label: str
    value: str

    @property
    def from_variable(self) -> bool:
        return from_variable(self.value)

    def values(self) -> tuple[str, ...] | None:
        """The values an ``=`` or a plain alternation ``=~"a|b"`` can match; None for any other regex."""
        if self.op == "=":
            return (self.value,)
        if self.op == "=~" and _ALTERNATION.match(self.value):
            return tuple(self.value.split("|"))
        return None


@dataclass(frozen=True, slots=True)
class FunctionCall:
    name: str
    arg: int  # which argument of the function holds the selector


@dataclass(frozen=True, slots=True)
class Aggregation:
    op: str
    labels: tuple[str, ...]
    without: bool
    node: int  # the aggregation's position in the expression, shared by every use below it


Enclosing = FunctionCall | Aggregation


@dataclass(frozen=True, slots=True)
class MetricUse:
    name: str
    matchers: tuple[LabelMatch, ...]
    enclosing: tuple[Enclosing, ...]  # innermost first
    range: bool  # a range selector (``foo[5m]``)

    def functions(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.enclosing if isinstance(e, FunctionCall))


def from_variable(text: str) -> bool:
    """True when ``text`` (a name, label or value) came from a Grafana variable."""
    return VARIABLE_MARK in text


def substitute_variables(expr: str, numbers: frozenset[int] = frozenset()) -> str:
    """``expr`` with each Grafana variable replaced by a placeholder that parses where it stands.

    A variable whose place does not say (``sum($v)``, ``x > $v``, ``topk($v, x)``) becomes a metric name,
    or the number 1 when its index (among such variables) is in ``numbers``."""
    out: list[str] = []
    pos = 0
    free = 0
    for m in _VARIABLE.finditer(expr):
        before = expr[: m.start()]
        name = VARIABLE_MARK + (m.group("braced") or m.group("bracketed") or m.group("plain")) + "__"
        if _inside_quotes(before):
            if m.group("bracketed") is None and before.endswith("\\"):
                continue
            placeholder = name
        elif before.count("[") > before.count("]") or re.search(r"\boffset\s*$", before):
            placeholder = "5m"
        elif _GROUPING_OPEN.search(before) or re.match(r"\s*[{\[]", expr[m.end() :]):
            placeholder = name
        else:
            placeholder = "1" if free in numbers else name
            free += 1
        out.append(expr[pos : m.start()])
        out.append(placeholder)
        pos = m.end()
    out.append(expr[pos:])
    return "".join(out)


def uses(text: str) -> list[MetricUse]:
    """The metric uses of one expression (Grafana variables allowed); PromQLError when it does not parse."""
    tree = _parse(text)
    found: list[MetricUse] = []
    _collect(tree, (), found, itertools.count(1))
    return found


def _parse(text: str) -> pp.Expr:
    """Parse with variables as metric names; failing that, as numbers (all, then one at a time)."""
    free = sum(1 for _ in _VARIABLE.finditer(text))  # at least the variables whose place does not say
    attempts = [frozenset(), frozenset(range(free)), *(frozenset({i}) for i in range(free) if free > 1)]
    first: ValueError | None = None
    for numbers in attempts:
        expr = substitute_variables(text, numbers)
        try:
            return pp.parse(expr)
        except ValueError as exc:
            if first is None:
                first = exc
                column = _error_column(expr, str(exc))
    assert first is not None
    raise PromQLError(str(first), column)


def _inside_quotes(before: str) -> bool:
    quote = ""
    escaped = False
    for ch in before:
        if escaped:
            escaped = False
        elif ch == "\\" and quote in ('"', "'"):
            escaped = True
        elif quote:
            if ch == quote:
                quote = ""
        elif ch in "\"'`":
            quote = ch
    return bool(quote)


def _error_column(expr: str, message: str) -> int:
    """Where the parser gave up: the end for an unfinished text, else just past the longest prefix that
    parses (the parser reports no positions)."""
    if "end of input" in message or "unclosed" in message:
        return len(expr.rstrip()) + 1
    best = 0
    for end in range(1, min(len(expr), 2000) + 1):
        try:
            pp.parse(expr[:end])
        except ValueError:
            continue
        best = end
    rest = expr[best:]
    return best + (len(rest) - len(rest.lstrip())) + 1


def _collect(
    node: object, enclosing: tuple[Enclosing, ...], found: list[MetricUse], ids: Iterator[int]
) -> None:
    if isinstance(node, pp.MatrixSelector):
        _selector(node.vector_selector, enclosing, True, found)
    elif isinstance(node, pp.VectorSelector):
        _selector(node, enclosing, False, found)
    elif isinstance(node, pp.Call):
        for i, arg in enumerate(node.args):
            _collect(arg, (FunctionCall(node.func.name, i), *enclosing), found, ids)
    elif isinstance(node, pp.AggregateExpr):
        modifier = node.modifier
        labels = tuple(modifier.labels) if modifier is not None else ()
        without = modifier is not None and modifier.type == pp.AggModifierType.Without
        agg = Aggregation(str(node.op), labels, without, next(ids))
        if isinstance(node.param, pp.Expr):
            _collect(node.param, enclosing, found, ids)
        _collect(node.expr, (agg, *enclosing), found, ids)
    elif isinstance(node, pp.BinaryExpr):
        _collect(node.lhs, enclosing, found, ids)
        _collect(node.rhs, enclosing, found, ids)
    elif isinstance(node, (pp.ParenExpr, pp.UnaryExpr, pp.SubqueryExpr)):
        _collect(node.expr, enclosing, found, ids)


def _op(op: pp.MatchOp) -> str:
    # MatchOp is not hashable: compare instead of looking up
    return next(text for text, candidate in _OPS if op == candidate)


def _selector(
    sel: pp.VectorSelector, enclosing: tuple[Enclosing, ...], is_range: bool, found: list[MetricUse]
) -> None:
    matchers = tuple(LabelMatch(_op(m.op), m.name, m.value) for m in sel.matchers.matchers)
    names: tuple[str, ...] = ()
    if sel.name:
        names = (sel.name,)
    else:
        for m in matchers:
            if m.label == "__name__" and (values := m.values()) is not None:
                names = values
    labels = tuple(m for m in matchers if m.label != "__name__")
    for name in names:
        if not from_variable(name):
            found.append(MetricUse(name, labels, enclosing, is_range))
