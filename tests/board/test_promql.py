"""PromQL expressions as metric uses: names, matchers, enclosing functions and aggregations, Grafana
variables, parse errors."""

from __future__ import annotations

import pytest

from kvstack.board.promql import (
    Aggregation,
    FunctionCall,
    LabelMatch,
    PromQLError,
    substitute_variables,
    uses,
)


def test_selector_with_functions_and_aggregations() -> None:
    (use,) = uses('histogram_quantile(0.9, sum by (le) (rate(foo_bucket{job="a", le!="1"}[5m])))')
    assert use.name == "foo_bucket"
    assert use.matchers == (LabelMatch("=", "job", "a"), LabelMatch("!=", "le", "1"))
    assert use.range
    assert use.enclosing == (
        FunctionCall("rate", 0),
        Aggregation("sum", ("le",), False, 1),
        FunctionCall("histogram_quantile", 1),
    )
    assert use.functions() == ("rate", "histogram_quantile")


def test_name_matchers_and_binary_operands() -> None:
    found = uses('{__name__=~"a|b", job="x"} / on (job) {__name__="c"} - d offset 5m')
    assert [u.name for u in found] == ["a", "b", "c", "d"]
    assert found[0].matchers == (LabelMatch("=", "job", "x"),)
    assert uses('{__name__=~"vllm:.*"}') == []  # a real regex names no checkable metric


def test_without_subquery_unary_and_parameters() -> None:
    (inner, outer) = uses("-max_over_time(sum without (pod) (x)[1h:1m]) + topk(3, y)")
    assert inner.enclosing == (Aggregation("sum", ("pod",), True, 1), FunctionCall("max_over_time", 0))
    assert outer.name == "y" and outer.enclosing[0] == Aggregation("topk", (), False, 2)


@pytest.mark.parametrize(
    ("expr", "parsed"),
    [
        ("rate(x[$__rate_interval])", "rate(x[5m])"),
        ("rate(x[${__interval}:$__interval])", "rate(x[5m:5m])"),
        (
            'x{job=~"$job", a="${model:regex}", b="[[var]]"}',
            'x{job=~"__grafana_var_job__", a="__grafana_var_model__", b="__grafana_var_var__"}',
        ),
        ("sum by ($label) (x)", "sum by (__grafana_var_label__) (x)"),
        ("$metric{a='1'}", "__grafana_var_metric__{a='1'}"),
        ("x > $threshold", "x > __grafana_var_threshold__"),
        ("sum($metric)", "sum(__grafana_var_metric__)"),
        ("topk($n, x)", "topk(__grafana_var_n__, x)"),  # parsed with 1 in its place
        ("x offset $__range", "x offset 5m"),
        ('label_replace(x, "a", "$1", "b", "(.*)")', 'label_replace(x, "a", "$1", "b", "(.*)")'),
    ],
)
def test_grafana_variables_become_placeholders(expr: str, parsed: str) -> None:
    assert substitute_variables(expr) == parsed
    uses(expr)  # and parse


def test_variables_where_a_scalar_must_stand() -> None:
    assert substitute_variables("topk($n, x)", frozenset({0})) == "topk(1, x)"
    assert [u.name for u in uses("topk($n, x) > $threshold")] == ["x"]
    assert [u.name for u in uses("histogram_quantile($q, sum by (le) (rate(h_bucket[5m]))) > $t")] == [
        "h_bucket"
    ]
    assert [u.name for u in uses("clamp_max($metric, $max)")] == []


def test_variable_values_and_names_are_marked() -> None:
    (use,) = uses('x{job=~"$job", model="m"}')
    assert [m.from_variable for m in use.matchers] == [True, False]
    assert uses("$metric{a='1'}") == []  # a metric named by a variable is not checked


def test_matcher_values() -> None:
    assert LabelMatch("=", "job", "a").values() == ("a",)
    assert LabelMatch("=~", "job", "a|b-c|d.e").values() == ("a", "b-c", "d.e")
    assert LabelMatch("=~", "job", "a.*").values() is None
    assert LabelMatch("!=", "job", "a").values() is None


@pytest.mark.parametrize(
    ("expr", "message", "column"),
    [
        ("rate(foo[5m", "unexpected end of input inside brackets", 12),
        ("sum(x) by (a) bar", "invalid promql query", 15),
        ("rate(foo[5x])", "bad number or duration syntax: 5x", 5),
    ],
)
def test_parse_errors_name_a_column(expr: str, message: str, column: int) -> None:
    with pytest.raises(PromQLError) as caught:
        uses(expr)
    assert str(caught.value) == f"{message} (near column {column})"
    assert caught.value.column == column
