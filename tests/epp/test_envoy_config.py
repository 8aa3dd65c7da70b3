"""The Envoy bootstrap kvstack.epp.envoy_config builds: its structure per option, validation, and real Envoy's
``--mode validate`` on every combination of options."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvstack.epp.envoy_config import EnvoyOptions, bootstrap, parse_address, render
from support.envoy import validate, write_config

PICKERS = ("10.0.0.7:9002",)


def http_filters(config: dict[str, Any]) -> list[dict[str, Any]]:
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    return list(manager["typed_config"]["http_filters"])


def ext_proc(config: dict[str, Any]) -> dict[str, Any]:
    (found,) = [f["typed_config"] for f in http_filters(config) if f["name"] == "envoy.filters.http.ext_proc"]
    return dict(found)


def cluster(config: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in config["static_resources"]["clusters"] if c["name"] == name]
    return dict(found)


def route(config: dict[str, Any]) -> dict[str, Any]:
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (host,) = manager["route_config"]["virtual_hosts"]
    (only,) = host["routes"]
    return dict(only)


def test_defaults_fail_closed_buffer_the_request_and_see_the_response_headers() -> None:
    config = bootstrap(EnvoyOptions(pickers=PICKERS))
    listener = config["static_resources"]["listeners"][0]
    assert listener["address"]["socket_address"] == {"address": "0.0.0.0", "port_value": 8080}
    assert config["admin"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 9901}
    proc = ext_proc(config)
    assert proc["failure_mode_allow"] is False
    assert proc["status_on_error"] == {"code": 503}
    assert proc["grpc_service"] == {"envoy_grpc": {"cluster_name": "picker"}}
    assert proc["message_timeout"] == "1s"
    assert proc["route_cache_action"] == "CLEAR"
    assert proc["processing_mode"] == {
        "request_header_mode": "SEND",
        "request_body_mode": "BUFFERED",
        "request_trailer_mode": "SKIP",
        "response_header_mode": "SEND",
        "response_body_mode": "NONE",
        "response_trailer_mode": "SKIP",
    }
    assert proc["metadata_options"] == {
        "forwarding_namespaces": {"untyped": ["envoy.lb", "envoy.lb.subset_hint"]},
        "receiving_namespaces": {"untyped": ["envoy.lb", "kvstack.epp"]},
    }
    names = [f["name"] for f in http_filters(config)]
    assert names[0] == "envoy.filters.http.header_mutation"  # before anything reads the destination
    assert http_filters(config)[0]["typed_config"]["mutations"] == {
        "request_mutations": [{"remove": "x-gateway-destination-endpoint"}]
    }
    assert names[-1] == "envoy.filters.http.router"
    assert route(config)["request_body_buffer_limit"] == 32 * 1024 * 1024


def test_picker_cluster_is_http2_health_checked_on_readiness_with_room_for_thousands_of_streams() -> None:
    picker = cluster(bootstrap(EnvoyOptions(pickers=("10.0.0.7:9002", "10.0.0.8:9002"))), "picker")
    assert picker["type"] == "STATIC"
    hosts = [
        e["endpoint"]["address"]["socket_address"]
        for e in picker["load_assignment"]["endpoints"][0]["lb_endpoints"]
    ]
    assert hosts == [{"address": "10.0.0.7", "port_value": 9002}, {"address": "10.0.0.8", "port_value": 9002}]
    options = picker["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    assert "http2_protocol_options" in options["explicit_http_config"]
    (check,) = picker["health_checks"]
    assert check["grpc_health_check"] == {"service_name": "readiness"}
    assert picker["common_lb_config"]["healthy_panic_threshold"] == {"value": 0}
    (limits,) = picker["circuit_breakers"]["thresholds"]
    assert min(limits["max_requests"], limits["max_pending_requests"], limits["max_connections"]) >= 10_000


def test_a_picker_named_by_dns_is_resolved_strictly() -> None:
    picker = cluster(bootstrap(EnvoyOptions(pickers=("picker.kvstack.svc:9002",))), "picker")
    assert picker["type"] == "STRICT_DNS"


def test_named_engines_walk_the_fallback_list_by_override_host() -> None:
    config = bootstrap(EnvoyOptions(pickers=PICKERS, engines=("10.0.1.1:8000", "10.0.1.2:8000"), retries=3))
    engines = cluster(config, "engines")
    assert engines["type"] == "STATIC"
    (policy,) = engines["load_balancing_policy"]["policies"]
    override = policy["typed_extension_config"]
    assert override["name"] == "envoy.load_balancing_policies.override_host"
    lb_key = {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}
    assert override["typed_config"]["override_host_sources"] == [{"metadata": lb_key}]
    served = {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint-served"}]}
    assert override["typed_config"]["selected_host_key"] == served
    retry = route(config)["route"]["retry_policy"]
    assert retry["num_retries"] == 3
    assert set(retry["retry_on"].split(",")) == {
        "connect-failure",
        "reset",
        "refused-stream",
        "retriable-status-codes",
    }
    assert retry["retriable_status_codes"] == [502, 503]
    assert retry["retry_host_predicate"][0]["name"] == "envoy.retry_host_predicates.previous_hosts"
    assert "envoy.filters.http.header_to_metadata" not in [f["name"] for f in http_filters(config)]
    (limits,) = engines["circuit_breakers"]["thresholds"]
    assert limits["max_retries"] >= 1000


def test_engines_named_by_dns_are_resolved_strictly() -> None:
    engines = cluster(bootstrap(EnvoyOptions(pickers=PICKERS, engines=("vllm.models.svc:8000",))), "engines")
    assert engines["type"] == "STRICT_DNS"


def test_without_engines_the_first_address_goes_to_an_original_dst_cluster() -> None:
    config = bootstrap(EnvoyOptions(pickers=PICKERS))
    engines = cluster(config, "engines")
    assert (engines["type"], engines["lb_policy"]) == ("ORIGINAL_DST", "CLUSTER_PROVIDED")
    served = {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint-served"}]}
    assert engines["original_dst_lb_config"] == {"metadata_key": served}
    names = [f["name"] for f in http_filters(config)]
    assert names.index("envoy.filters.http.ext_proc") < names.index("envoy.filters.http.header_to_metadata")
    (copy,) = [f for f in http_filters(config) if f["name"] == "envoy.filters.http.header_to_metadata"]
    (rule,) = copy["typed_config"]["request_rules"]
    assert rule["header"] == "x-gateway-destination-endpoint"
    rewrite = rule["on_header_present"]["regex_value_rewrite"]
    first = re.compile(rewrite["pattern"]["regex"])
    substitution = rewrite["substitution"]
    assert first.sub(substitution, "10.0.1.1:8000,10.0.1.2:8000") == "10.0.1.1:8000"
    assert first.sub(substitution, " 10.0.1.1:8000 , 10.0.1.2:8000") == "10.0.1.1:8000"
    assert first.sub(substitution, "[fd00::1]:8000") == "[fd00::1]:8000"


def test_no_overall_timeout_on_a_streaming_response_only_an_idle_one() -> None:
    config = bootstrap(EnvoyOptions(pickers=PICKERS, idle_timeout_s=120))
    assert route(config)["route"]["timeout"] == "0s"
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert manager["stream_idle_timeout"] == "120s"


def test_access_log_on_stdout_by_default_and_off_when_asked() -> None:
    def manager(options: EnvoyOptions) -> dict[str, Any]:
        listener = bootstrap(options)["static_resources"]["listeners"][0]
        return dict(listener["filter_chains"][0]["filters"][0]["typed_config"])

    (log,) = manager(EnvoyOptions(pickers=PICKERS))["access_log"]
    assert log["name"] == "envoy.access_loggers.stdout"
    assert "picked=%DYNAMIC_METADATA(envoy.lb:x-gateway-destination-endpoint)%" in json.dumps(log)
    assert "access_log" not in manager(EnvoyOptions(pickers=PICKERS, access_log=False))


@pytest.mark.parametrize(
    ("body_mode", "envoy_mode", "trailers"),
    [
        ("buffered", "BUFFERED", "SKIP"),
        ("streamed", "STREAMED", "SKIP"),
        ("full-duplex-streamed", "FULL_DUPLEX_STREAMED", "SEND"),
    ],
)
def test_body_modes(body_mode: str, envoy_mode: str, trailers: str) -> None:
    mode = ext_proc(bootstrap(EnvoyOptions(pickers=PICKERS, body_mode=body_mode)))["processing_mode"]
    assert (mode["request_body_mode"], mode["request_trailer_mode"]) == (envoy_mode, trailers)


def test_options_fail_open_response_usage_message_timeout() -> None:
    options = EnvoyOptions(pickers=PICKERS, fail_open=True, response_usage=True, message_timeout_s=0.25)
    proc = ext_proc(bootstrap(options))
    assert proc["failure_mode_allow"] is True
    assert proc["message_timeout"] == "0.25s"
    mode = proc["processing_mode"]
    assert (mode["response_body_mode"], mode["response_trailer_mode"]) == ("STREAMED", "SEND")


@pytest.mark.parametrize("engines", [(), ("10.0.1.1:8000",)])
def test_the_response_names_the_upstream_that_served_unless_served_header_is_off(
    tmp_path: Path, engines: tuple[str, ...]
) -> None:
    (added,) = route(bootstrap(EnvoyOptions(pickers=PICKERS, engines=engines)))["response_headers_to_add"]
    assert added == {
        "header": {"key": "x-gateway-destination-endpoint-served", "value": "%UPSTREAM_HOST%"},
        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
    }
    off = bootstrap(EnvoyOptions(pickers=PICKERS, engines=engines, served_header=False))
    assert "response_headers_to_add" not in route(off)
    result = validate(write_config(off, tmp_path / "envoy.yaml"))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("fmt", ["yaml", "json"])
def test_render_round_trips(fmt: str) -> None:
    config = bootstrap(EnvoyOptions(pickers=PICKERS, engines=("10.0.1.1:8000",)))
    text = render(config, "json" if fmt == "json" else "yaml")
    assert (json.loads(text) if fmt == "json" else yaml.safe_load(text)) == config


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"pickers": ()}, "no picker"),
        ({"pickers": ("10.0.0.7",)}, "expected HOST:PORT"),
        ({"pickers": ("10.0.0.7:0",)}, "port in 1..65535"),
        ({"pickers": ("10.0.0.7:http",)}, "expected HOST:PORT"),
        ({"engines": ("fd00::1:8000",)}, "IPv6 address in brackets"),
        ({"listen_port": 70000}, "listen_port 70000"),
        ({"admin_port": 8080}, "different ports"),
        ({"body_mode": "chunked"}, "buffered, streamed, full-duplex-streamed"),
        ({"message_timeout_s": 0}, "message_timeout_s 0"),
        ({"idle_timeout_s": -1.0}, "idle_timeout_s -1.0"),
        ({"retries": -1}, "retries -1"),
        ({"max_request_bytes": 10}, "max_request_bytes 10"),
    ],
)
def test_bad_options_say_what_to_fix(changes: dict[str, Any], message: str) -> None:
    options = EnvoyOptions(**{"pickers": PICKERS, **changes})
    with pytest.raises(ValueError, match=re.escape(message)):
        bootstrap(options)


def test_addresses() -> None:
    assert parse_address("10.0.0.7:9002") == ("10.0.0.7", 9002)
    assert parse_address("[fd00::7]:9002") == ("fd00::7", 9002)
    assert parse_address("picker.kvstack.svc:9002") == ("picker.kvstack.svc", 9002)


ENGINES = {"original-dst": (), "ips": ("10.0.1.1:8000", "10.0.1.2:8000"), "dns": ("vllm.models.svc:8000",)}
COMBINATIONS = list(
    itertools.product(ENGINES, ["buffered", "streamed", "full-duplex-streamed"], [False, True], [False, True])
)


@pytest.mark.parametrize(("engines", "body_mode", "fail_open", "response_usage"), COMBINATIONS)
def test_real_envoy_accepts_every_combination(
    tmp_path: Path, engines: str, body_mode: str, fail_open: bool, response_usage: bool
) -> None:
    options = EnvoyOptions(
        pickers=("10.0.0.7:9002", "picker.kvstack.svc:9002"),
        engines=ENGINES[engines],
        body_mode=body_mode,
        fail_open=fail_open,
        response_usage=response_usage,
    )
    result = validate(write_config(bootstrap(options), tmp_path / "envoy.yaml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout + result.stderr


def test_real_envoy_accepts_no_access_log(tmp_path: Path) -> None:
    options = EnvoyOptions(pickers=PICKERS, engines=ENGINES["ips"], access_log=False)
    result = validate(write_config(bootstrap(options), tmp_path / "envoy.yaml"))
    assert result.returncode == 0, result.stdout + result.stderr
