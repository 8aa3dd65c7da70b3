"""Every kustomization under deploy/ renders offline, and every object it renders is well-formed.

Built-in kinds are validated by kubernetes-validate against the OpenAPI schemas of Kubernetes ``K8S_VERSION``
(strict: unknown fields fail). ServiceMonitor and PodMonitor are validated against
prometheus_operator.schema.yaml, a hand-written subset of the Prometheus Operator's documented fields (unknown
fields fail there too); that is a check of shape and spelling, not of the operator's full CRD. Any other kind
fails the test: it has no schema here yet.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from support.manifests import DASHBOARDS, DEPLOY, RULE_FILES, of_kind, render

K8S_VERSION = "1.32"  # kubectl's minor version here; kubernetes-validate bundles its schemas
KUSTOMIZATIONS = ["base", "overlays/example", "overlays/envoy", "overlays/pd", "overlays/envoy-pd"]
CRD_KINDS = ("ServiceMonitor", "PodMonitor")


@functools.cache
def crd_schemas() -> dict[str, Any]:
    document = yaml.safe_load((Path(__file__).parent / "prometheus_operator.schema.yaml").read_text())
    return {kind: {**schema, "$defs": document["$defs"]} for kind, schema in document["kinds"].items()}


def check(obj: dict[str, Any]) -> None:
    kind = obj["kind"]
    if kind in CRD_KINDS:
        jsonschema.Draft202012Validator(crd_schemas()[kind]).validate(obj)
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_each_kustomization_renders_objects_that_validate(path: str) -> None:
    objects = render(DEPLOY / path)
    assert objects
    for obj in objects:
        check(obj)
    names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names)), "an object is rendered twice"


def test_observability_renders_dashboards_and_rules_as_config_maps() -> None:
    objects = render(DEPLOY / "observability")
    for obj in objects:
        check(obj)
    maps = {o["metadata"]["name"]: o for o in of_kind(objects, "ConfigMap")}
    dashboards = {
        k: v
        for m in maps.values()
        if m["metadata"]["labels"].get("grafana_dashboard") == "1"
        for k, v in m["data"].items()
    }
    assert sorted(dashboards) == sorted(f"{name}.json" for name in DASHBOARDS)
    for name, text in dashboards.items():
        assert json.loads(text) == json.loads((DEPLOY / "observability/dashboards" / name).read_text())
    rules = maps["kvstack-prometheus-rules"]["data"]
    assert sorted(rules) == sorted(f"{name}.yaml" for name in RULE_FILES)
    for text in rules.values():
        assert "groups" in yaml.safe_load(text)


def test_the_crd_schema_refuses_a_misspelt_field() -> None:
    (monitor,) = [o for o in render(DEPLOY / "base") if o["kind"] == "PodMonitor"]
    monitor["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError, match="intervall"):
        check(monitor)


def test_an_unknown_field_of_a_built_in_kind_fails() -> None:
    (service, *_) = [o for o in render(DEPLOY / "base") if o["kind"] == "Service"]
    service["spec"]["portz"] = []
    with pytest.raises(kubernetes_validate.ValidationError, match="portz"):
        check(service)
