"""``kvstack envoy-config``: Envoy's bootstrap in front of the endpoint picker (kvstack.epp.envoy_config).

Writes the bootstrap (YAML or JSON) to stdout or ``--output``, for ``envoy -c FILE``. A bad value exits with
status 2 and the reason.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvstack.epp.envoy_config import BODY_MODES, EnvoyOptions, bootstrap, render

_DEFAULTS = EnvoyOptions(pickers=())


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "envoy-config",
        help="write Envoy's bootstrap for the endpoint picker",
        description="Write Envoy's bootstrap: ext_proc to the picker replicas, then the engine it names.",
    )
    p.add_argument(
        "--picker",
        action="append",
        required=True,
        metavar="HOST:PORT",
        help="a picker replica's gRPC address; repeat for each replica",
    )
    p.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="an engine Envoy may send to (a DNS name stands for all its addresses, e.g. a headless "
        "Service); repeat for each; with engines named a dead pick falls back to the next address the "
        "picker gave, without them Envoy serves the first address only (ORIGINAL_DST)",
    )
    p.add_argument("--host", default=_DEFAULTS.listen_host, help="address Envoy listens on for clients")
    p.add_argument(
        "--port", type=int, default=_DEFAULTS.listen_port, help="port Envoy listens on for clients"
    )
    p.add_argument("--admin-host", default=_DEFAULTS.admin_host)
    p.add_argument("--admin-port", type=int, default=_DEFAULTS.admin_port)
    p.add_argument(
        "--fail-open", action="store_true", help="proxy a request the picker could not answer (default: 503)"
    )
    p.add_argument(
        "--message-timeout",
        type=float,
        default=_DEFAULTS.message_timeout_s,
        metavar="SECONDS",
        help="how long Envoy waits for each picker answer (then 504)",
    )
    p.add_argument(
        "--body-mode",
        choices=list(BODY_MODES),
        default=_DEFAULTS.body_mode,
        help="how the picker gets the request body",
    )
    p.add_argument(
        "--response-usage",
        action="store_true",
        help="also send the picker the response body and trailers as they stream (to read usage)",
    )
    p.add_argument(
        "--retries",
        type=int,
        default=_DEFAULTS.retries,
        help="attempts on the picker's fallback addresses before the first response byte",
    )
    p.add_argument("--max-request-bytes", type=int, default=_DEFAULTS.max_request_bytes)
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=_DEFAULTS.idle_timeout_s,
        metavar="SECONDS",
        help="end a stream silent this long",
    )
    p.add_argument("--output", "-o", default="-", metavar="FILE", help="where to write (default: stdout)")
    p.add_argument("--format", choices=["yaml", "json"], default="yaml")


def run(args: argparse.Namespace) -> int:
    options = EnvoyOptions(
        pickers=tuple(args.picker),
        engines=tuple(args.engine),
        listen_host=args.host,
        listen_port=args.port,
        admin_host=args.admin_host,
        admin_port=args.admin_port,
        fail_open=args.fail_open,
        message_timeout_s=args.message_timeout,
        body_mode=args.body_mode,
        max_request_bytes=args.max_request_bytes,
        response_usage=args.response_usage,
        retries=args.retries,
        idle_timeout_s=args.idle_timeout,
    )
    try:
        text = render(bootstrap(options), args.format)
    except ValueError as exc:
        print(f"kvstack envoy-config: {exc}", file=sys.stderr)
        return 2
    if args.output == "-":
        sys.stdout.write(text)
        return 0
    try:
        Path(args.output).write_text(text)
    except OSError as exc:
        print(f"kvstack envoy-config: cannot write {args.output}: {exc.strerror}", file=sys.stderr)
        return 2
    return 0
