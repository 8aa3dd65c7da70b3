"""kvstack's own dashboards, rules and Kubernetes manifests pass ``kvstack metrics check`` together.

Each overlay under deploy/ is rendered with ``kubectl kustomize`` and checked with the observability
kustomization (dashboards and rules inside ConfigMaps) and the plain files: every name, suffix and label they
ask for exists in vLLM's newest table or kvstack's exporters, and every endpoint/service/namespace/job value
they filter on is one the rendered Services and monitors produce. A finding of any severity fails.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kvstack import cli
from support.manifests import DEPLOY, render

OVERLAYS = ("example", "envoy", "pd", "envoy-pd")


def _check(capsys: pytest.CaptureFixture[str], *paths: Path) -> dict[str, object]:
    status = cli.main(["metrics", "check", "--format", "json", *map(str, paths)])
    report: dict[str, object] = json.loads(capsys.readouterr().out)
    assert report["findings"] == [], json.dumps(report["findings"], indent=1)
    assert status == 0
    return report


def test_dashboards_and_rules_are_clean(capsys: pytest.CaptureFixture[str]) -> None:
    report = _check(capsys, DEPLOY / "observability")
    summary = report["summary"]
    assert isinstance(summary, dict)
    assert summary["files"] >= 7  # five dashboards, two rule files
    assert summary["expressions"] >= 50


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_manifests_with_dashboards_are_clean(
    overlay: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rendered = tmp_path / f"{overlay}.yaml"
    objects = render(DEPLOY / "overlays" / overlay) + render(DEPLOY / "observability")
    rendered.write_text(yaml.safe_dump_all(objects, sort_keys=False))
    kinds = {obj["kind"] for obj in objects}
    assert {"Service", "ConfigMap"} <= kinds and kinds & {"ServiceMonitor", "PodMonitor"}
    report = _check(capsys, rendered)
    summary = report["summary"]
    assert isinstance(summary, dict)
    assert summary["expressions"] >= 50  # the dashboards and rules were read out of their ConfigMaps


def test_a_wrong_endpoint_value_is_caught(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The same check fails once a dashboard filters on a port name the manifests do not define."""
    objects = render(DEPLOY / "overlays" / "example")
    bad = tmp_path / "bad.promql"
    bad.write_text(
        'sum(rate(kvstack_router_requests_total{job="kvstack-router",endpoint="service-port"}[5m]))\n'
    )
    rendered = tmp_path / "example.yaml"
    rendered.write_text(yaml.safe_dump_all(objects, sort_keys=False))
    status = cli.main(["metrics", "check", "--format", "json", str(rendered), str(bad)])
    report = json.loads(capsys.readouterr().out)
    assert status == 1
    assert [f["code"] for f in report["findings"]] == ["label-value"]
