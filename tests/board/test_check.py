"""Findings: one fixture file per kind of mistake, each asserting the exact codes and locations."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstack.board.catalogs import Catalog
from kvstack.board.check import Finding, check
from kvstack.board.documents import Expression, Inputs, read
from kvstack.engines.names import Kind, MetricName
from support.board_catalogs import DEFAULT, EPP, ROUTER, VLLM_NEW, VLLM_OLD

FIXTURES = Path(__file__).parent / "fixtures"


def findings(*paths: str, catalogs: tuple[Catalog, ...] = DEFAULT) -> list[Finding]:
    return check(read([FIXTURES / p for p in paths]), catalogs)


def codes(found: list[Finding]) -> list[tuple[str, str, str]]:
    return [(f.severity, f.code, f.where) for f in found]


def of_promql(*lines: str, catalogs: tuple[Catalog, ...] = DEFAULT) -> list[Finding]:
    inputs = Inputs(expressions=[Expression("q.promql", f"line {i}", t) for i, t in enumerate(lines, 1)])
    return check(inputs, catalogs)


def test_clean_files_give_no_findings() -> None:
    assert findings("clean") == []


def test_names() -> None:
    found = findings("names.promql")
    assert codes(found) == [
        ("error", "retired-metric", "line 1"),
        ("error", "retired-metric", "line 2"),
        ("error", "hidden-metric", "line 3"),
        ("error", "hidden-metric", "line 4"),
        ("error", "unknown-metric", "line 5"),
    ]
    renamed, no_replacement, hidden_renamed, hidden, unknown = found
    assert renamed.message == (
        "vllm:gpu_cache_usage_perc was renamed to vllm:kv_cache_usage_perc "
        "(vllm 0.32: deprecated in 0.9.2, removed in 0.11; source: vllm/v1/metrics/loggers.py)"
    )
    assert renamed.fix == "use vllm:kv_cache_usage_perc"
    assert renamed.expression == "vllm:gpu_cache_usage_perc"
    assert no_replacement.fix.startswith("compute rate(vllm:prefix_cache_hits_total[5m])")
    assert "--show-hidden-metrics-for-version=0.31" in hidden_renamed.message
    assert hidden_renamed.fix == "use vllm:inter_token_latency_seconds_bucket"  # the suffix carries over
    assert "hidden in vllm 0.32" in hidden.message
    assert unknown.fix == "did you mean vllm:num_requests_running?"


def test_suffixes_and_histogram_functions() -> None:
    found = findings("suffix.promql")
    assert codes(found) == [
        ("error", "suffix", "line 1"),
        ("error", "suffix", "line 2"),
        ("error", "suffix", "line 3"),
        ("error", "suffix", "line 4"),
        ("error", "histogram-function", "line 5"),
        ("error", "histogram-function", "line 6"),
        ("warning", "rate-of-gauge", "line 7"),
        ("warning", "suffix", "line 8"),
    ]
    assert [f.fix for f in found[:4]] == [
        "use vllm:prompt_tokens_total",
        "use vllm:kv_cache_usage_perc",
        "use vllm:num_requests_running",
        "use vllm:time_to_first_token_seconds_bucket",
    ]
    assert found[0].message == (
        "vllm:prompt_tokens is a counter, exported as vllm:prompt_tokens_total, vllm:prompt_tokens_created"
    )
    assert found[4].fix == "use vllm:time_to_first_token_seconds_bucket"
    assert "drops le" in found[5].message


def test_labels() -> None:
    found = findings("labels.promql")
    assert codes(found) == [
        ("error", "unknown-label", "line 1"),
        ("error", "unknown-label", "line 2"),
        ("error", "unknown-label", "line 3"),
    ]  # line 4 (server="": the label is absent) and line 5 (target labels) are fine
    assert found[0].message == "vllm:num_requests_running never carries the label 'server'"
    assert found[1].message == "sum by (le): no series under it carries 'le'"


def test_bucket_and_quantile_labels() -> None:
    summary = Catalog("s", "engine", {"rpc_seconds": MetricName("rpc_seconds", Kind.SUMMARY)})
    assert of_promql(
        'rpc_seconds{quantile="0.5"}', 'rpc_seconds_count{quantile="0.5"}', catalogs=(summary,)
    ) == [
        Finding(
            "error",
            "unknown-label",
            "q.promql",
            "line 2",
            'rpc_seconds_count{quantile="0.5"}',
            "rpc_seconds_count never carries the label 'quantile'",
            "labels of rpc_seconds_count: none besides target labels (and target labels container, endpoint, "
            "instance, job, namespace, pod, service)",
        )
    ]
    assert of_promql('vllm:time_to_first_token_seconds_bucket{le="+Inf"}') == []


def test_label_values_labels() -> None:
    inputs = Inputs(
        expressions=[
            Expression("d.json", 'variable "a"', "", ("nonsense",)),
            Expression("d.json", 'variable "b"', "", ("finished_reason",)),
            Expression("d.json", 'variable "c"', "vllm:kv_cache_usage_perc", ("finished_reason",)),
        ]
    )
    assert codes(check(inputs, DEFAULT)) == [
        ("error", "unknown-label", 'variable "a"'),
        ("error", "unknown-label", 'variable "c"'),
    ]


def test_recorded_and_generated_names_are_known() -> None:
    found = findings("rules.yaml")
    assert codes(found) == [
        ("warning", "rate-of-gauge", 'group "engines" record "engine:ttft:p90"'),
        ("error", "histogram-function", 'group "engines" record "engine:ttft:p90"'),
        ("error", "retired-metric", 'group "engines" alert "KvCacheFull"'),
    ]  # engine:ttft:p90 is defined by the file itself
    assert of_promql("up", "ALERTS_FOR_STATE", "scrape_duration_seconds{job='x'}") == []


def test_dashboard() -> None:
    assert codes(findings("dashboard.json")) == [
        ("error", "retired-metric", 'panel "GPU cache" (id 11) target B'),
        ("error", "suffix", 'panel "Tokens" (id 13) target A'),
        ("error", "unknown-label", 'variable "model"'),
        ("error", "unknown-metric", 'variable "bad"'),
    ]


def test_ambiguous_sources() -> None:
    found = findings("sources.promql")
    assert codes(found) == [("error", "ambiguous-source", "line 1"), ("error", "ambiguous-source", "line 2")]
    assert found[0].message.startswith(
        "kvstack_router_requests_total is exported by kvstack epp and kvstack router"
    )
    # one exporter, or two versions of one engine, are one source
    assert of_promql("rate(kvstack_router_requests_total[5m])", catalogs=(ROUTER,)) == []
    assert of_promql("vllm:num_requests_running", catalogs=(VLLM_NEW, VLLM_OLD, EPP)) == []
    live = Catalog("live http://127.0.0.1:8000/metrics", "engine", VLLM_NEW.metrics)
    assert of_promql("vllm:num_requests_running", catalogs=(VLLM_NEW, live)) == []


def test_several_engine_versions() -> None:
    found = of_promql("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc", catalogs=(VLLM_OLD, VLLM_NEW))
    assert codes(found) == [("warning", "retired-metric", "line 1")]
    assert found[0].message == (
        "vllm:gpu_cache_usage_perc works on vllm 0.8, not on vllm 0.32 (renamed to vllm:kv_cache_usage_perc; "
        "removed in 0.11; source: vllm/v1/metrics/loggers.py)"
    )
    assert found[0].fix == "use vllm:kv_cache_usage_perc"


def test_deprecated_names_still_exported() -> None:
    retired = VLLM_NEW.retired["vllm:gpu_cache_usage_perc"]
    old = VLLM_OLD.metrics["vllm:gpu_cache_usage_perc"]
    deprecating = Catalog("vllm 0.10", "engine", {old.name: old}, {retired.name: retired})
    (found,) = of_promql("vllm:gpu_cache_usage_perc", catalogs=(deprecating,))
    assert (found.severity, found.code) == ("warning", "retired-metric")
    assert found.message.startswith("vllm:gpu_cache_usage_perc is deprecated in vllm 0.10 (since 0.9.2)")


def test_label_values_against_manifests() -> None:
    found = findings("k8s")
    assert codes(found) == [
        ("warning", "not-checked", ""),
        ("error", "label-value", 'ConfigMap "dashboards" key "router.json" panel "Requests" (id 1) target A'),
        ("error", "label-value", 'ConfigMap "dashboards" key "rules.yaml" group "router" alert "RouterDown"'),
        ("error", "label-value", 'PrometheusRule "engines" group "engines" alert "EngineQueue"'),
    ]
    endpoint = found[1]
    assert endpoint.message == 'endpoint="service-port" matches no target: the manifests define endpoint http'
    assert endpoint.fix == "use one of: http"
    assert 'namespace=~"staging|other" matches no target' in found[3].message
    # without manifests, values are not checked
    assert codes(of_promql('up{endpoint="service-port", job="anything"}')) == []


def test_parse_errors() -> None:
    found = findings("broken.promql", "broken.json")
    assert codes(found) == [
        ("error", "parse-error", "line 2"),  # the file-level problem comes first
        ("error", "parse-error", "line 1"),
        ("error", "parse-error", "line 2"),
    ]
    assert found[0].file.endswith("broken.json") and found[0].message.startswith("not valid JSON")
    assert found[1].message == "PromQL does not parse: unclosed left parenthesis (near column 44)"


@pytest.mark.parametrize(
    "expr",
    [
        'sum by (job) (rate(kvstack_router_requests_total{job=~"$frontend"}[$__rate_interval]))',
        "label_replace(vllm:num_requests_running, 'x', '$1', 'pod', '(.*)')",
        "sum by (x) (label_replace(vllm:num_requests_running, 'x', '$1', 'pod', '(.*)'))",
        "sum by (v) (count_values('v', vllm:num_requests_running))",
        "sum by ($label) (vllm:num_requests_running)",
        "vllm:num_requests_running{model_name=~'$m'}",
    ],
)
def test_clean_expressions(expr: str) -> None:
    assert of_promql(expr) == []
