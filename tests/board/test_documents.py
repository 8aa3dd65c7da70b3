"""Readers: expressions and their locations from dashboards, rule files, PromQL files and manifests; the
facts manifests define."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstack.board.documents import Expression, UnsupportedFile, read
from kvstack.board.manifests import Manifests

FIXTURES = Path(__file__).parent / "fixtures"


def test_dashboard_panels_nested_rows_annotations_and_templating() -> None:
    inputs = read([FIXTURES / "clean" / "dashboard.json"])
    file = str(FIXTURES / "clean" / "dashboard.json")
    assert [(e.where, e.labels) for e in inputs.expressions] == [
        ('panel "KV usage" (id 1) target A', ()),
        ('panel "TTFT p90" (id 3) target A', ()),  # inside a collapsed row
        ('panel "Requests by front end" (id 4) target A', ()),
        ('panel "Requests by front end" (id 4) target B', ()),
        ('panel "Hit rate" (id 5) target A', ()),
        ('panel "Mixed" (id 7) target A', ()),  # Loki's queries (panel 6, target 7B) are LogQL
        ('annotation "restarts"', ()),
        ('variable "job"', ("job",)),
        ('variable "model"', ("model_name",)),
        ('variable "reason"', ("finished_reason",)),
        ('variable "top"', ()),
    ]
    assert inputs.expressions[8] == Expression(
        file, 'variable "model"', 'vllm:num_requests_running{job=~"$job"}', ("model_name",)
    )
    assert inputs.expressions[9].text == ""  # label_values(label) reads a label only
    assert inputs.expressions[10].text == "topk(5, vllm:num_requests_waiting)"
    assert not inputs.has_manifests and inputs.problems == []


def test_rule_files_define_recorded_names() -> None:
    inputs = read([FIXTURES / "clean" / "rules.yaml"])
    assert inputs.recorded == {"kvstack:prefix_hit_rate:5m"}
    assert [e.where for e in inputs.expressions] == [
        'group "kvstack-recording" record "kvstack:prefix_hit_rate:5m"',
        'group "kvstack-alerts" alert "PrefixHitRateLow"',
        'group "kvstack-alerts" alert "EngineDown"',
    ]


def test_promql_files_skip_comments_and_blank_lines() -> None:
    inputs = read([FIXTURES / "clean" / "queries.promql"])
    assert [e.where for e in inputs.expressions] == ["line 2", "line 4", "line 5", "line 6"]


def test_directories_are_walked_in_order() -> None:
    inputs = read([FIXTURES / "clean"])
    assert inputs.files == 3
    assert [Path(e.file).name for e in inputs.expressions][:1] == ["dashboard.json"]


def test_manifests_rules_and_dashboards_inside_objects() -> None:
    inputs = read([FIXTURES / "k8s" / "stack.yaml"])
    assert inputs.has_manifests
    assert [e.where for e in inputs.expressions] == [
        'ConfigMap "dashboards" key "router.json" panel "Requests" (id 1) target A',
        'ConfigMap "dashboards" key "rules.yaml" group "router" alert "RouterDown"',
        'PrometheusRule "engines" group "engines" alert "EngineQueue"',
    ]
    facts = inputs.manifests
    assert [(s.name, s.ports) for s in facts.services] == [("kvstack-router", ("http",))]
    assert facts.values("endpoint") == {"http"}
    assert facts.values("service") == {"kvstack-router"}
    assert facts.values("namespace") == {"kvstack"}
    assert facts.values("job") == {"kvstack-router"}  # a ServiceMonitor's job is the Service's name
    assert facts.values("pod") is None


def test_job_rules_of_monitors() -> None:
    facts = Manifests()
    facts.add(
        {"kind": "Service", "metadata": {"name": "vllm-0", "labels": {"app": "vllm", "tier": "engines"}}}
    )
    facts.add(
        {
            "kind": "ServiceMonitor",
            "metadata": {"name": "engines"},
            "spec": {
                "jobLabel": "tier",
                "selector": {"matchLabels": {"app": "vllm"}},
                "endpoints": [{"port": "metrics"}],
            },
        }
    )
    facts.add({"kind": "PodMonitor", "metadata": {"name": "sidecars", "namespace": "kvstack"}, "spec": {}})
    assert facts.values("job") == {"engines", "kvstack/sidecars"}
    assert facts.values("endpoint") == {"metrics"}
    facts.add(
        {
            "kind": "PodMonitor",
            "metadata": {"name": "fixed"},
            "spec": {
                "podMetricsEndpoints": [
                    {
                        "port": "http",
                        "relabelings": [
                            {"targetLabel": "job", "replacement": "vllm"},
                            {"targetLabel": "cluster", "replacement": "a"},
                        ],
                    }
                ]
            },
        }
    )
    assert facts.values("job") == {"engines", "kvstack/sidecars", "vllm"}
    assert facts.target_labels() == {"job", "cluster"}
    facts.add(
        {
            "kind": "ServiceMonitor",
            "metadata": {"name": "dyn"},
            "spec": {"endpoints": [{"relabelings": [{"targetLabel": "job", "replacement": "$1"}]}]},
        }
    )
    assert facts.values("job") is None  # a relabeling from another label: any job


def test_monitors_of_objects_elsewhere_leave_job_unknown() -> None:
    facts = Manifests()
    facts.add({"kind": "Service", "metadata": {"name": "router", "labels": {"app": "router"}}})
    router = {"selector": {"matchLabels": {"app": "router"}}, "endpoints": [{"targetPort": 9090}]}
    facts.add({"kind": "ServiceMonitor", "metadata": {"name": "r"}, "spec": router})
    assert facts.values("job") == {"router"}
    assert facts.values("endpoint") == {"9090"}
    elsewhere = {"selector": {"matchLabels": {"app": "elsewhere"}}}
    facts.add({"kind": "ServiceMonitor", "metadata": {"name": "x"}, "spec": elsewhere})
    assert facts.values("job") is None


def test_problems_and_usage_errors(tmp_path: Path) -> None:
    inputs = read([FIXTURES / "broken.json", FIXTURES / "k8s" / "unknown.yaml"])
    assert [(Path(p.file).name, p.where, p.error) for p in inputs.problems] == [
        ("broken.json", "line 2", True),
        ("unknown.yaml", "", False),
    ]
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(UnsupportedFile):
        read([tmp_path / "notes.txt"])
    with pytest.raises(FileNotFoundError):
        read([tmp_path / "missing.json"])
    assert read([tmp_path]).files == 0  # a walk skips other suffixes
    (tmp_path / "tests.yaml").write_text("rule_files: [a.yaml]\ntests: []\n")
    assert read([tmp_path / "tests.yaml"]).problems == []  # promtool's unit tests are promtool's
