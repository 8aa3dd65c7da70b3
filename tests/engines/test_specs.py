"""One rule per engine field, whichever way the engine is described: ``--engine`` strings, the engines file,
Kubernetes pods and ``POST /admin/engines`` all go through kvstack.engines.specs."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from kubernetes_asyncio.client import (
    V1Container,
    V1ObjectMeta,
    V1Pod,
    V1PodCondition,
    V1PodSpec,
    V1PodStatus,
)

from kvstack.engines.discovery import (
    DiscoveryConfigError,
    PodKeys,
    parse_engine_spec,
    parse_engines_file,
    pod_endpoint,
)
from kvstack.engines.specs import ENGINE_TYPES, EngineSpecError, build_endpoint
from kvstack.engines.state import Endpoint, EngineRole
from kvstack.openai.errors import OpenAIError
from kvstack.router import app
from kvstack.router.app import _endpoint_of

URL = "http://10.0.0.5:8000"
KEYS = PodKeys()


def pod(labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None) -> V1Pod:
    """A Running, Ready pod at 10.0.0.5."""
    return V1Pod(
        metadata=V1ObjectMeta(name="engine-0", namespace="llm", labels=labels, annotations=annotations),
        spec=V1PodSpec(containers=[V1Container(name="engine")], node_name="node-a"),
        status=V1PodStatus(
            phase="Running", pod_ip="10.0.0.5", conditions=[V1PodCondition(type="Ready", status="True")]
        ),
    )


# How each entry point says "this field has this value" (None: it cannot say it).
def spec_of(field: str, value: Any) -> str | None:
    if field == "url":
        return value
    option = {"type": "type", "role": "role", "node": "node", "kv_events": "kv-events"}.get(field)
    return None if option is None or not isinstance(value, str) or not value else f"{URL}#{option}={value}"


def file_of(field: str, value: Any) -> str:
    entry = {"url": URL} | {field: value}
    return yaml.safe_dump({"engines": [entry]})


def pod_of(field: str, value: Any) -> V1Pod | None:
    if field == "type":
        return pod(labels={KEYS.engine_type_label: value})
    if field == "role":
        return pod(labels={KEYS.role_label: value})
    if field == "kv_events":
        return pod(annotations={KEYS.kv_events_annotation: value})
    return None  # the URL comes from the pod IP, models from a comma list, the node from the pod spec


def admin_of(field: str, value: Any) -> dict[str, Any]:
    return {"url": URL} | {field: value}


def spec_error(field: str, value: Any) -> str | None:
    spec = spec_of(field, value)
    if spec is None:
        return None
    with pytest.raises(DiscoveryConfigError) as info:
        parse_engine_spec(spec)
    return str(info.value)


def file_error(field: str, value: Any) -> str:
    with pytest.raises(DiscoveryConfigError) as info:
        parse_engines_file(file_of(field, value), "e.yaml")
    return str(info.value)


def pod_error(field: str, value: Any) -> str | None:
    given = pod_of(field, value)
    if given is None:
        return None
    warnings: list[str] = []
    endpoint = pod_endpoint(given, 8000, warn=warnings.append)
    # A pod is not refused for a bad label or annotation: the field keeps its default, with a warning.
    assert endpoint is not None
    assert (endpoint.engine_type, endpoint.role, endpoint.kv_events_endpoint) == (
        "vllm",
        EngineRole.BOTH,
        None,
    )
    (warning,) = warnings
    return warning


def admin_error(field: str, value: Any) -> str:
    with pytest.raises(OpenAIError) as info:
        _endpoint_of(admin_of(field, value))
    assert info.value.status == 400
    assert info.value.param == field
    return info.value.message


ENTRY_POINTS: dict[str, Callable[[str, Any], str | None]] = {
    "--engine": spec_error,
    "engines file": file_error,
    "pod": pod_error,
    "admin": admin_error,
}

# (field, bad value, the rule's words)
BAD_VALUES = [
    ("url", "ftp://h:8000", "'ftp://h:8000' is not an engine base URL"),
    ("url", "http://h:8000?x=1", "a base URL has no query string"),
    ("url", "http://h:0", "the port must be 1-65535"),
    ("type", "vlm", f"engine type 'vlm' is not one of {', '.join(sorted(ENGINE_TYPES))}"),
    ("role", "prefil", "role 'prefil' is not one of both, prefill, decode"),
    (
        "kv_events",
        "127.0.0.1:5557",
        "KV-event endpoint '127.0.0.1:5557' must be tcp://host:port or ipc://path",
    ),
    ("models", ["m", ""], "'models' must be a list of model names"),
    ("node", "", "'node' must be a non-empty string"),
    ("labels", {"zone": ["a"]}, "'labels' must map names to string values"),
]


def expressible(entry_point: str, field: str, value: Any) -> bool:
    """Can this entry point's syntax carry the value at all? (A pod's URL comes from its IP, its models from
    a comma list and its node from the pod spec; an --engine string has no labels.)"""
    if entry_point == "--engine":
        return spec_of(field, value) is not None
    if entry_point == "pod":
        return pod_of(field, value) is not None
    return True


@pytest.mark.parametrize(
    ("entry_point", "field", "value", "rule"),
    [
        pytest.param(entry_point, field, value, rule, id=f"{entry_point}-{field}-{value!r}")
        for field, value, rule in BAD_VALUES
        for entry_point in ENTRY_POINTS
        if expressible(entry_point, field, value)
    ],
)
def test_every_entry_point_refuses_a_bad_value_with_the_same_rule(
    entry_point: str, field: str, value: Any, rule: str
) -> None:
    message = ENTRY_POINTS[entry_point](field, value)
    assert message is not None
    assert rule in message
    where = {"--engine": "--engine", "engines file": "e.yaml: engines[0]", "pod": "pod llm/engine-0"}
    assert message.startswith(where.get(entry_point, "POST /admin/engines"))


def test_the_same_fields_build_the_same_endpoint_everywhere() -> None:
    expected = Endpoint(
        URL,
        engine_type="sglang",
        role=EngineRole.DECODE,
        models=frozenset({"qwen"}),
        node="node-a",
        kv_events_endpoint="tcp://10.0.0.5:5557",
    )
    spec = f"{URL}/#type=SGLang,role=Decode,model=qwen,node=node-a,kv-events=tcp://10.0.0.5:5557"
    assert parse_engine_spec(spec) == expected
    fields = {"type": "SGLang", "role": "Decode", "node": "node-a", "kv_events": "tcp://10.0.0.5:5557"}
    entry = {"url": URL, "models": ["qwen"], **fields}
    assert parse_engines_file(yaml.safe_dump({"engines": [entry]})) == [expected]
    assert _endpoint_of({**entry, "url": URL + "/"}) == expected
    labels = {KEYS.engine_type_label: "SGLang", KEYS.role_label: "Decode"}
    annotations = {KEYS.models_annotation: "qwen", KEYS.kv_events_annotation: "5557"}
    found = pod_endpoint(pod(labels, annotations), 8000)
    assert found == dataclasses.replace(expected, labels=tuple(sorted(labels.items())))


def test_build_endpoint_names_the_bad_field() -> None:
    with pytest.raises(EngineSpecError) as info:
        build_endpoint("here", URL, engine_type=5)
    assert info.value.field == "type"
    assert str(info.value) == f"here ({URL}): 'type' must be a string, not int"
    with pytest.raises(EngineSpecError) as info:
        build_endpoint("here", None)
    assert (info.value.field, str(info.value)) == ("url", "here: 'url' is required and must be a string")


def test_admin_kv_events_and_its_deprecated_alias(caplog: pytest.LogCaptureFixture) -> None:
    app._warn_kv_events_alias.cache_clear()
    endpoint = "tcp://10.0.0.5:5557"
    assert _endpoint_of({"url": URL, "kv_events": endpoint}).kv_events_endpoint == endpoint
    assert not caplog.records
    with caplog.at_level(logging.WARNING, "kvstack.router.app"):
        for _ in range(3):
            assert _endpoint_of({"url": URL, "kv_events_endpoint": endpoint}).kv_events_endpoint == endpoint
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "kv_events_endpoint is deprecated; send kv_events instead" in warning
    # An error names the key the client sent.
    with pytest.raises(OpenAIError) as info:
        _endpoint_of({"url": URL, "kv_events_endpoint": "127.0.0.1:5557"})
    assert info.value.param == "kv_events_endpoint"
    with pytest.raises(OpenAIError) as info:
        _endpoint_of({"url": URL, "kv_events": endpoint, "kv_events_endpoint": endpoint})
    assert (info.value.status, info.value.param) == (400, "kv_events_endpoint")
