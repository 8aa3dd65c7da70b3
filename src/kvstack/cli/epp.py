"""``kvstack epp``: the Envoy endpoint picker (ext_proc), built from flags (kvstack.epp.server serves it)."""

from __future__ import annotations

import argparse
import sys

from kvstack.cli import front_end
from kvstack.cli.front_end import int_in, positive
from kvstack.cli.signals import serve_until_signal


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "epp",
        help="run the endpoint picker Envoy asks where each request goes (ext_proc gRPC)",
        description="Run kvstack as Envoy's endpoint picker (the Gateway API Inference Extension protocol).",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--grpc-port", type=int_in(0, 65535), default=9002, help="ext_proc and gRPC health (0 = a free port)"
    )
    p.add_argument(
        "--http-port",
        type=int_in(0, 65535),
        default=9090,
        help="/metrics, /engines, /health, /ready (0 = a free port)",
    )
    p.add_argument(
        "--transport",
        choices=["lean", "grpcio"],
        default="lean",
        help="the gRPC server: kvstack's own (lean: HTTP/2 on the picker's loop) or grpcio's asyncio one",
    )
    p.add_argument(
        "--fallbacks",
        type=int_in(0, 16),
        default=2,
        help="engines after the pick in x-gateway-destination-endpoint, for Envoy's retries",
    )
    p.add_argument(
        "--drain-seconds",
        type=positive,
        default=None,
        help="at shutdown, report NOT_SERVING this long before stopping (default: stop at once)",
    )
    front_end.add_engine_arguments(p)
    front_end.add_routing_arguments(p)
    front_end.add_limit_arguments(p)
    p.add_argument("--log-level", default="info")


def run(args: argparse.Namespace) -> int:
    from kvstack.epp.picker import PickerConfig
    from kvstack.epp.server import EppOptions, serve_forever
    from kvstack.scheduling.interfaces import SESSION_HEADERS

    try:
        shared = front_end.front_end_options(args)
    except front_end.UsageError as exc:
        print(f"kvstack epp: {exc}", file=sys.stderr)
        return 2
    opts = EppOptions(
        **shared,
        host=args.host,
        grpc_port=args.grpc_port,
        http_port=args.http_port,
        transport=args.transport,
        picker=PickerConfig(
            max_body_bytes=int(args.max_body_mb * 1024 * 1024),
            fallbacks=args.fallbacks,
            session_headers=tuple(args.session_header) or SESSION_HEADERS,
        ),
        drain_s=args.drain_seconds or 0.0,
    )
    return serve_until_signal(serve_forever(opts))
