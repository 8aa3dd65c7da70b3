"""Envoy in front of an endpoint picker, as ``epp_transport.py`` runs it: one bootstrap, one process.

``bootstrap`` is the whole Envoy configuration in one function (kvstack's own config generator can take its
place): a listener whose HTTP connection manager runs the ext_proc filter, then the router; the route goes to
an ORIGINAL_DST cluster (``lb_policy: CLUSTER_PROVIDED``) that connects to the address in the request header
``x-gateway-destination-endpoint`` the picker set. ext_proc talks to the picker over gRPC (``grpc_service``,
HTTP/2 cluster) or ``http_service`` (each ProcessingRequest POSTed as JSON over HTTP/1.1); request headers
SEND, request body BUFFERED, the response skipped; dynamic metadata is accepted in the ``envoy.lb``
namespace. ``start`` runs ``.venvs/dev/bin/envoy`` with ``--concurrency 1`` (one worker thread) and no hot
restart (other Envoys on the machine do not collide), admin on its own port.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from procs import DEV_BIN, HOST, Group

ENVOY = DEV_BIN / "envoy"
HEADER = "x-gateway-destination-endpoint"
HCM = "envoy.filters.network.http_connection_manager"
ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
TRANSPORTS = ("grpcio", "lean", "http", "none")  # none: Envoy alone, no ext_proc filter


def _address(port: int) -> dict[str, Any]:
    return {"socket_address": {"address": HOST, "port_value": port}}


def _static_cluster(name: str, port: int, http2: bool) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(port)}}]}],
        },
    }
    if http2:
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    return cluster


def bootstrap(
    listen_port: int,
    picker_port: int,
    transport: str,
    admin_port: int,
    *,
    request_body_mode: str = "BUFFERED",
    route_by: str = "header",
    message_timeout_s: float = 5.0,
    request_timeout_s: float = 10.0,
    allow_refused: bool = False,
) -> dict[str, Any]:
    """Envoy's bootstrap: listener -> ext_proc (to the picker) -> router -> ORIGINAL_DST by header.

    ``transport="none"`` leaves ext_proc (and the picker's cluster) out: the client sets the header.
    ``route_by="metadata"`` makes the ORIGINAL_DST cluster read the picker's ``envoy.lb`` dynamic metadata
    first (the header only when the metadata is absent). ``allow_refused`` writes a configuration Envoy
    refuses (http_service with a body mode), to record its refusal.
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"transport {transport!r}: one of {TRANSPORTS}")
    if route_by not in ("header", "metadata"):
        raise ValueError(f"route_by {route_by!r}: header or metadata")
    if transport == "http" and request_body_mode != "NONE" and not allow_refused:
        # Envoy 1.40 refuses it at start-up: "If the ext_proc filter is configured with http_service instead
        # of gRPC service, then the processing modes of this filter can not be configured to send body or
        # trailer."
        raise ValueError("Envoy's ext_proc http_service sends no body: use request_body_mode NONE")
    by: dict[str, Any] = {"use_http_header": True, "http_header_name": HEADER}
    if route_by == "metadata":
        by["metadata_key"] = {"key": "envoy.lb", "path": [{"key": HEADER}]}
    engines = {
        "name": "engines",
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": "1s",
        "original_dst_lb_config": by,
    }
    ext_proc: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "failure_mode_allow": False,
        "message_timeout": f"{message_timeout_s:g}s",
        "processing_mode": {
            "request_header_mode": "SEND",
            "request_body_mode": request_body_mode,
            "request_trailer_mode": "SKIP",
            "response_header_mode": "SKIP",
            "response_body_mode": "NONE",
            "response_trailer_mode": "SKIP",
        },
        "metadata_options": {"receiving_namespaces": {"untyped": ["envoy.lb"]}},
    }
    if transport == "http":
        ext_proc["http_service"] = {
            "http_service": {
                "http_uri": {
                    "uri": f"http://{HOST}:{picker_port}/process",
                    "cluster": "picker",
                    "timeout": f"{message_timeout_s:g}s",
                }
            }
        }
    else:
        ext_proc["grpc_service"] = {
            "envoy_grpc": {"cluster_name": "picker"},
            "timeout": f"{message_timeout_s:g}s",
        }
    manager: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
        ".HttpConnectionManager",
        "stat_prefix": "ingress",
        "route_config": {
            "name": "local",
            "virtual_hosts": [
                {
                    "name": "all",
                    "domains": ["*"],
                    "routes": [
                        {
                            "match": {"prefix": "/"},
                            "route": {"cluster": "engines", "timeout": f"{request_timeout_s:g}s"},
                        }
                    ],
                }
            ],
        },
        "http_filters": [
            {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc},
            {"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER}},
        ],
    }
    clusters: list[dict[str, Any]] = [engines]
    if transport == "none":
        manager["http_filters"] = manager["http_filters"][1:]
    else:
        clusters.append(_static_cluster("picker", picker_port, http2=transport != "http"))
    listener = {
        "name": "ingress",
        "address": _address(listen_port),
        "filter_chains": [{"filters": [{"name": HCM, "typed_config": manager}]}],
    }
    return {
        "admin": {"address": _address(admin_port)},
        "static_resources": {"listeners": [listener], "clusters": clusters},
    }


def start(name: str, config: dict[str, Any], logs: Path) -> Group:
    """Envoy on ``config`` (written next to its log), one worker thread, no hot restart."""
    path = logs / f"{name}.yaml"
    path.write_text(json.dumps(config, indent=2) + "\n")  # JSON is YAML
    cmd = [
        str(ENVOY),
        "-c",
        str(path),
        "--concurrency",
        "1",
        "--disable-hot-restart",
        "--log-level",
        "warning",
    ]
    return Group.start(name, [cmd], logs / f"{name}.log")
