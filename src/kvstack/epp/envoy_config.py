"""Envoy's bootstrap in front of kvstack's endpoint picker: ``bootstrap(EnvoyOptions)`` -> dict, ``render``.

Every request goes through ``envoy.filters.http.ext_proc`` to the ``picker`` cluster (the replicas over
HTTP/2, gRPC-health-checked on ``readiness``; fail closed with 503 unless ``fail_open``), then to the
``engines`` cluster at the address the picker named in ``x-gateway-destination-endpoint`` (header and
``envoy.lb`` metadata); a client's own header of that name is dropped first: only the picker names engines.

With ``engines`` named (IP or DNS HOST:PORT; a headless Service's name stands for its pods), the
``override_host`` policy walks the picker's comma-separated list from the metadata, one address per attempt
(``retries`` before the first response byte, on connect failure, reset, refused stream, 502 or 503); least
request when the picker named no known engine. Without, ORIGINAL_DST serves the header's first address only.
Either way ``envoy.lb``/``x-gateway-destination-endpoint-served`` says which address served; the picker gets
it with the response headers (and ``envoy.lb.subset_hint``, when a gateway set one, with the request), and
with ``served_header`` the client gets it too, as a response header of that name. The picker gets the request
body as ``body_mode`` says (buffered by default, up to ``max_request_bytes``); ``response_usage``
adds the response body and trailers. No overall timeout: ``idle_timeout_s`` ends a silent stream. Each
request is logged on Envoy's stdout (picked and served address, attempts) unless ``access_log`` is off.
Reasons: docs/design/envoy-front-end.md.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from typing import Any, Literal

import yaml

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
# The picker marks its own ImmediateResponse in this namespace: Envoy rewrites only its own local replies.
PICKER_NAMESPACE = "kvstack.epp"
PICKER_REPLY = "picker_reply"
BODY_MODES = {"buffered": "BUFFERED", "streamed": "STREAMED", "full-duplex-streamed": "FULL_DUPLEX_STREAMED"}
Format = Literal["yaml", "json"]

# Per-cluster limits: Envoy's defaults (1024 requests, 3 retries at once) would throttle thousands of streams.
_MAX_STREAMS = 65536
_MAX_RETRIES = 1024
# Connecting stays within a cluster network: a dead engine should cost little before its fallback is tried.
_ENGINE_CONNECT_TIMEOUT = "1s"
_PICKER_CONNECT_TIMEOUT = "0.25s"
_RETRY_ON = "connect-failure,reset,refused-stream,retriable-status-codes"


@dataclass(frozen=True)
class EnvoyOptions:
    """What varies between deployments; ``validate()`` names the fix for a bad value."""

    pickers: tuple[str, ...]
    engines: tuple[str, ...] = ()
    listen_host: str = "0.0.0.0"
    listen_port: int = 8080
    admin_host: str = "127.0.0.1"
    admin_port: int = 9901
    fail_open: bool = False
    message_timeout_s: float = 1.0
    body_mode: str = "buffered"
    max_request_bytes: int = 32 * 1024 * 1024
    response_usage: bool = False
    retries: int = 2
    idle_timeout_s: float = 300.0
    access_log: bool = True  # one line per request on Envoy's stdout
    served_header: bool = True

    def validate(self) -> EnvoyOptions:
        if not self.pickers:
            raise ValueError("no picker: name at least one picker replica as HOST:PORT")
        for address in (*self.pickers, *self.engines):
            parse_address(address)
        for name in ("listen_port", "admin_port"):
            port = getattr(self, name)
            if not 1 <= port <= 65535:
                raise ValueError(f"{name} {port}: expected a port in 1..65535")
        if self.listen_port == self.admin_port:
            raise ValueError(
                f"listen_port and admin_port are both {self.listen_port}: give them different ports"
            )
        if self.body_mode not in BODY_MODES:
            raise ValueError(f"body mode {self.body_mode!r}: expected one of {', '.join(BODY_MODES)}")
        for name in ("message_timeout_s", "idle_timeout_s"):
            if not getattr(self, name) >= 0.001:
                raise ValueError(f"{name} {getattr(self, name)}: expected at least 0.001 seconds")
        if self.retries < 0:
            raise ValueError(f"retries {self.retries}: expected 0 or more")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes {self.max_request_bytes}: expected at least 1024")
        return self


def parse_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPv6]:PORT`` as (host, port); ValueError says what is wrong."""
    host, sep, port_text = address.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    if not sep or not host or not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"address {address!r}: expected HOST:PORT with a port in 1..65535")
    if ":" in host and not (bracketed and _is_ip(host)):
        raise ValueError(f"address {address!r}: write an IPv6 address in brackets, [ADDR]:PORT")
    return host, int(port_text)


def bootstrap(options: EnvoyOptions) -> dict[str, Any]:
    """The whole static bootstrap for ``options`` (validated first)."""
    options.validate()
    return {
        "node": {"id": "kvstack-envoy", "cluster": "kvstack"},
        "admin": {"address": _socket(options.admin_host, options.admin_port)},
        "static_resources": {
            "listeners": [_listener(options)],
            "clusters": [_picker_cluster(options), _engine_cluster(options)],
        },
    }


def render(config: dict[str, Any], fmt: Format = "yaml") -> str:
    if fmt == "json":
        return json.dumps(config, indent=2) + "\n"
    return yaml.safe_dump(config, sort_keys=False)


def _listener(options: EnvoyOptions) -> dict[str, Any]:
    filters = [_drop_client_destination(), _ext_proc(options)]
    if not options.engines:
        filters.append(_first_address_as_served())
    filters.append(_typed("envoy.filters.http.router", "extensions.filters.http.router.v3.Router", {}))
    manager = {
        "stat_prefix": "openai",
        "codec_type": "AUTO",
        "use_remote_address": True,
        "stream_idle_timeout": _seconds(options.idle_timeout_s),
        **({"access_log": [_access_log()]} if options.access_log else {}),
        "route_config": {"name": "openai", "virtual_hosts": [_virtual_host(options)]},
        "local_reply_config": _openai_local_replies(),
        "http_filters": filters,
    }
    hcm = "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
    return {
        "name": "openai",
        "address": _socket(options.listen_host, options.listen_port),
        "filter_chains": [
            {"filters": [_typed("envoy.filters.network.http_connection_manager", hcm, manager)]}
        ],
    }


def _virtual_host(options: EnvoyOptions) -> dict[str, Any]:
    retry_policy: dict[str, Any] = {
        "retry_on": _RETRY_ON,
        # 502: a kvstack sidecar's engine failed before its first token (nothing was sent: safe to retry).
        "retriable_status_codes": [502, 503],
        "num_retries": options.retries,
        "retry_back_off": {"base_interval": "0.01s", "max_interval": "0.1s"},
    }
    if options.engines:
        retry_policy["retry_host_predicate"] = [
            _typed(
                "envoy.retry_host_predicates.previous_hosts",
                "extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate",
                {},
            )
        ]
        retry_policy["host_selection_retry_max_attempts"] = 3
    route = {
        "cluster": "engines",
        "timeout": "0s",
        "retry_policy": retry_policy,
    }
    entry: dict[str, Any] = {
        "match": {"prefix": "/"},
        "route": route,
        # What a request body may buffer: for the picker (BUFFERED, else 413) and for retries (beyond it a
        # request is not retried).
        "request_body_buffer_limit": options.max_request_bytes,
    }
    if options.served_header:
        # The upstream that answered (a fallback when Envoy retried), as the client's per-request attribution.
        served = {
            "header": {"key": SERVED, "value": "%UPSTREAM_HOST%"},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
        }
        entry["response_headers_to_add"] = [served]
    return {"name": "engines", "domains": ["*"], "routes": [entry]}


def _ext_proc(options: EnvoyOptions) -> dict[str, Any]:
    full_duplex = options.body_mode == "full-duplex-streamed"
    mode: dict[str, str] = {
        "request_header_mode": "SEND",
        "request_body_mode": BODY_MODES[options.body_mode],
        # Envoy requires the trailers with a full-duplex body: they close the picker's half of the exchange.
        "request_trailer_mode": "SEND" if full_duplex else "SKIP",
        "response_header_mode": "SEND",
        "response_body_mode": "STREAMED" if options.response_usage else "NONE",
        "response_trailer_mode": "SEND" if options.response_usage else "SKIP",
    }
    config = {
        "grpc_service": {"envoy_grpc": {"cluster_name": "picker"}},
        "failure_mode_allow": options.fail_open,
        # Envoy's default is 500; an unreachable or failing picker is the service being unavailable.
        "status_on_error": {"code": 503},
        "message_timeout": _seconds(options.message_timeout_s),
        "processing_mode": mode,
        "allow_mode_override": True,
        "route_cache_action": "CLEAR",
        "metadata_options": {
            "forwarding_namespaces": {"untyped": [LB_NAMESPACE, SUBSET_NAMESPACE]},
            "receiving_namespaces": {"untyped": [LB_NAMESPACE, PICKER_NAMESPACE]},
        },
    }
    return _typed(
        "envoy.filters.http.ext_proc", "extensions.filters.http.ext_proc.v3.ExternalProcessor", config
    )


def _drop_client_destination() -> dict[str, Any]:
    """Only the picker names the engine: a client's own destination header goes before anything reads it."""
    return _typed(
        "envoy.filters.http.header_mutation",
        "extensions.filters.http.header_mutation.v3.HeaderMutation",
        {"mutations": {"request_mutations": [{"remove": DESTINATION}]}},
    )


def _first_address_as_served() -> dict[str, Any]:
    """ORIGINAL_DST takes one address: the list's first goes to ``envoy.lb`` / ``-served``, which it reads."""
    rule = {
        "header": DESTINATION,
        "on_header_present": {
            "metadata_namespace": LB_NAMESPACE,
            "key": SERVED,
            "type": "STRING",
            "regex_value_rewrite": {
                "pattern": {"regex": r"^\s*([^,\s]+).*$"},
                "substitution": r"\1",
            },
        },
        "remove": False,
    }
    return _typed(
        "envoy.filters.http.header_to_metadata",
        "extensions.filters.http.header_to_metadata.v3.Config",
        {"request_rules": [rule]},
    )


def _picker_cluster(options: EnvoyOptions) -> dict[str, Any]:
    protocol = {
        "explicit_http_config": {
            "http2_protocol_options": {"connection_keepalive": {"interval": "10s", "timeout": "5s"}}
        }
    }
    return {
        "name": "picker",
        **_endpoints("picker", options.pickers),
        "connect_timeout": _PICKER_CONNECT_TIMEOUT,
        "lb_policy": "LEAST_REQUEST",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                **protocol,
            }
        },
        "health_checks": [
            {
                "timeout": "1s",
                "interval": "2s",
                "no_traffic_interval": "2s",
                "unhealthy_threshold": 2,
                "healthy_threshold": 1,
                "grpc_health_check": {"service_name": "readiness"},
            }
        ],
        # A replica that is not ready (e.g. a follower) never gets requests, however few are ready.
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
        "circuit_breakers": _limits(),
    }


def _engine_cluster(options: EnvoyOptions) -> dict[str, Any]:
    common = {"connect_timeout": _ENGINE_CONNECT_TIMEOUT, "circuit_breakers": _limits()}
    if not options.engines:
        return {
            "name": "engines",
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "original_dst_lb_config": {"metadata_key": _metadata_key(SERVED)},
            **common,
        }
    least_request = _typed(
        "envoy.load_balancing_policies.least_request",
        "extensions.load_balancing_policies.least_request.v3.LeastRequest",
        {},
    )
    override_host = {
        "override_host_sources": [{"metadata": _metadata_key(DESTINATION)}],
        "selected_host_key": _metadata_key(SERVED),
        "fallback_policy": {"policies": [{"typed_extension_config": least_request}]},
    }
    policy = _typed(
        "envoy.load_balancing_policies.override_host",
        "extensions.load_balancing_policies.override_host.v3.OverrideHost",
        override_host,
    )
    return {
        "name": "engines",
        **_endpoints("engines", options.engines),
        "load_balancing_policy": {"policies": [{"typed_extension_config": policy}]},
        **common,
    }


def _endpoints(cluster: str, addresses: tuple[str, ...]) -> dict[str, Any]:
    """A STATIC cluster for IP addresses; STRICT_DNS (every address a name resolves to) otherwise."""
    hosts = [parse_address(a) for a in addresses]
    endpoints = [{"endpoint": {"address": _socket(host, port)}} for host, port in hosts]
    kind = "STATIC" if all(_is_ip(host) for host, _ in hosts) else "STRICT_DNS"
    return {
        "type": kind,
        "load_assignment": {"cluster_name": cluster, "endpoints": [{"lb_endpoints": endpoints}]},
    }


def _limits() -> dict[str, Any]:
    return {
        "thresholds": [
            {
                "max_connections": _MAX_STREAMS,
                "max_pending_requests": _MAX_STREAMS,
                "max_requests": _MAX_STREAMS,
                "max_retries": _MAX_RETRIES,
            }
        ]
    }


def _openai_local_replies() -> dict[str, Any]:
    """Envoy's own replies (no picker, no healthy engine, timeouts) as OpenAI error JSON; the picker's answers
    (marked ``kvstack.epp``/``picker_reply``) are already OpenAI JSON and pass unchanged."""
    not_the_picker = {
        "metadata_filter": {
            "matcher": {
                "filter": PICKER_NAMESPACE,
                "path": [{"key": PICKER_REPLY}],
                "value": {"bool_match": False},
            },
            "match_if_key_not_found": True,
        }
    }
    error = {
        "error": {
            "message": "envoy: %RESPONSE_CODE_DETAILS%",
            "type": "EnvoyError",
            "param": None,
            "code": "%RESPONSE_CODE%",
        }
    }
    return {
        "mappers": [
            {
                "filter": not_the_picker,
                "body_format_override": {"json_format": error, "content_type": "application/json"},
            }
        ]
    }


def _access_log() -> dict[str, Any]:
    line = (
        '[%START_TIME%] "%REQ(:METHOD)% %REQ(X-ENVOY-ORIGINAL-PATH?:PATH)%" %RESPONSE_CODE% %RESPONSE_FLAGS% '
        f"picked=%DYNAMIC_METADATA({LB_NAMESPACE}:{DESTINATION})% served=%UPSTREAM_HOST% "
        "attempts=%UPSTREAM_REQUEST_ATTEMPT_COUNT% %DURATION%ms\n"
    )
    return _typed(
        "envoy.access_loggers.stdout",
        "extensions.access_loggers.stream.v3.StdoutAccessLog",
        {"log_format": {"text_format_source": {"inline_string": line}}},
    )


def _metadata_key(key: str) -> dict[str, Any]:
    return {"key": LB_NAMESPACE, "path": [{"key": key}]}


def _typed(name: str, type_name: str, config: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "typed_config": {"@type": f"type.googleapis.com/envoy.{type_name}", **config}}


def _socket(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _seconds(value: float) -> str:
    return f"{value:.3f}".rstrip("0").rstrip(".") + "s"


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
