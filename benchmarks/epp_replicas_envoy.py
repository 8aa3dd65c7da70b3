"""Real Envoy in front of the picker replicas, for benchmarks/epp_replicas.py.

``bootstrap`` is the one place the Envoy config is written: a listener whose ext_proc filter sends each
request's headers and BUFFERED body to the ``picker`` cluster (the replicas over HTTP/2, round robin) and the
response headers too, then routes to an ORIGINAL_DST cluster at the address the picker put in
``x-gateway-destination-endpoint``. ORIGINAL_DST takes one address, so the pickers run with ``--fallbacks 0``.
The client's ``x-request-id`` is kept (the shadow asks use the same id) and every response says which engine
served it (``x-upstream-host``). ``start_envoy`` runs ``.venvs/dev/bin/envoy`` on it and waits until it is
live.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from procs import DEV_BIN, HOST, Group, get

DESTINATION = "x-gateway-destination-endpoint"
SERVED_HEADER = "x-upstream-host"


def bootstrap(pickers: list[str], listen_port: int, admin_port: int) -> dict[str, Any]:
    """The Envoy bootstrap: ext_proc to ``pickers`` (HOST:PORT), then the engine the picker named."""

    def typed(name: str, type_name: str, config: dict[str, Any]) -> dict[str, Any]:
        return {"name": name, "typed_config": {"@type": f"type.googleapis.com/envoy.{type_name}", **config}}

    def socket(host: str, port: int) -> dict[str, Any]:
        return {"socket_address": {"address": host, "port_value": port}}

    ext_proc = {
        "grpc_service": {"envoy_grpc": {"cluster_name": "picker"}},
        "failure_mode_allow": False,
        "message_timeout": "5s",
        "processing_mode": {
            "request_header_mode": "SEND",
            "request_body_mode": "BUFFERED",
            "request_trailer_mode": "SKIP",
            "response_header_mode": "SEND",
            "response_body_mode": "NONE",
            "response_trailer_mode": "SKIP",
        },
        "route_cache_action": "CLEAR",
    }
    route = {
        "match": {"prefix": "/"},
        "route": {"cluster": "engines", "timeout": "0s"},
        "response_headers_to_add": [{"header": {"key": SERVED_HEADER, "value": "%UPSTREAM_HOST%"}}],
    }
    manager = {
        "stat_prefix": "openai",
        "codec_type": "AUTO",
        "preserve_external_request_id": True,
        "route_config": {
            "name": "openai",
            "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [route]}],
        },
        "http_filters": [
            typed(
                "envoy.filters.http.ext_proc",
                "extensions.filters.http.ext_proc.v3.ExternalProcessor",
                ext_proc,
            ),
            typed("envoy.filters.http.router", "extensions.filters.http.router.v3.Router", {}),
        ],
    }
    hcm = "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
    http2 = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}},
        }
    }
    picker_endpoints = []
    for address in pickers:
        host, port = address.rsplit(":", 1)
        picker_endpoints.append({"endpoint": {"address": socket(host, int(port))}})
    return {
        "admin": {"address": socket(HOST, admin_port)},
        "static_resources": {
            "listeners": [
                {
                    "name": "openai",
                    "address": socket(HOST, listen_port),
                    "filter_chains": [
                        {"filters": [typed("envoy.filters.network.http_connection_manager", hcm, manager)]}
                    ],
                }
            ],
            "clusters": [
                {
                    "name": "picker",
                    "type": "STATIC",
                    "connect_timeout": "1s",
                    "lb_policy": "ROUND_ROBIN",
                    "typed_extension_protocol_options": http2,
                    "load_assignment": {
                        "cluster_name": "picker",
                        "endpoints": [{"lb_endpoints": picker_endpoints}],
                    },
                },
                {
                    "name": "engines",
                    "type": "ORIGINAL_DST",
                    "connect_timeout": "1s",
                    "lb_policy": "CLUSTER_PROVIDED",
                    "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION},
                },
            ],
        },
    }


def start_envoy(pickers: list[str], listen_port: int, admin_port: int, logs: Path) -> Group:
    """Envoy on ``bootstrap(...)``, one worker thread (so round robin alternates strictly), live."""
    config = logs / "envoy.json"
    config.write_text(json.dumps(bootstrap(pickers, listen_port, admin_port), indent=2))
    cmd = [str(DEV_BIN / "envoy"), "-c", str(config), "--concurrency", "1", "--disable-hot-restart"]
    group = Group.start("envoy", [[*cmd, "--log-level", "warning"]], logs / "envoy.log")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if (gone := group.exited()) is not None:
            raise RuntimeError(f"envoy: {gone}\n{group.log_text()[-2000:]}")
        try:
            status, body = get(f"http://{HOST}:{admin_port}", "/ready", timeout=1.0)
            if status == 200 and body.strip() == b"LIVE":
                return group
        except OSError:
            pass
        time.sleep(0.1)
    group.stop()
    raise RuntimeError(f"envoy not live after 30 s\n{group.log_text()[-2000:]}")
