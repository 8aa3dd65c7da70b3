"""``kvstack sidecar``: the P/D sidecar in front of one decode engine (kvstack.router.sidecar serves it).

Its allowlist of prefill engines: ``--prefill-engine`` (repeat), plus the engines whose role is prefill in an
engines file (``--engines-file``) or among Kubernetes pods (``--k8s-namespace``; ``--k8s-port`` is the
prefill engines' port).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from kvstack.cli import front_end
from kvstack.cli.front_end import int_in, positive
from kvstack.cli.signals import serve_until_signal

log = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "sidecar",
        help="run the P/D sidecar in front of one decode engine (Envoy mode)",
        description="Forward every request to one engine; prefill on the engine x-prefiller-host-port "
        "names (when allowed) and decode with the returned kv_transfer_params.",
    )
    p.add_argument("--engine", required=True, metavar="URL", help="the local decode engine's base URL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int_in(0, 65535), default=8000, help="0 = a free port")
    g = p.add_argument_group("allowed prefill engines")
    g.add_argument("--prefill-engine", action="append", default=[], metavar="URL", help="repeat for several")
    source = g.add_mutually_exclusive_group()
    source.add_argument("--engines-file", help="YAML engines file; its engines with role prefill")
    source.add_argument("--k8s-namespace", help="pods in this namespace with role prefill")
    g.add_argument("--k8s-selector", help="label selector of engine pods (with --k8s-namespace)")
    g.add_argument(
        "--k8s-port", type=int_in(1, 65535), help="prefill engines' port on the pods (default 8000)"
    )
    g = p.add_argument_group("timeouts")
    g.add_argument(
        "--pd-prefill-timeout",
        type=positive,
        default=30.0,
        help="seconds a prefill request may take; past it the local engine computes the prompt itself",
    )
    g.add_argument("--timeout-connect", type=positive, default=5.0)
    g.add_argument("--timeout-first-byte", type=positive, default=120.0)
    g.add_argument("--timeout-idle", type=positive, default=60.0)
    g.add_argument("--timeout-total", type=positive, default=1800.0)
    p.add_argument("--max-body-mb", type=positive, default=32.0)
    p.add_argument("--log-level", default="info")


def run(args: argparse.Namespace) -> int:
    from kvstack.engines.discovery import FileDiscovery, parse_engine_spec
    from kvstack.engines.specs import EngineSpecError, check_url, with_default_scheme
    from kvstack.router.proxy import Timeouts
    from kvstack.router.sidecar import SidecarOptions, running_sidecar

    try:
        engine = check_url(with_default_scheme(args.engine), "--engine")
        prefill = [parse_engine_spec(spec, "--prefill-engine") for spec in args.prefill_engine]
        if args.k8s_namespace is None and (args.k8s_selector is not None or args.k8s_port is not None):
            raise ValueError("--k8s-selector and --k8s-port apply only with --k8s-namespace")
    except (ValueError, EngineSpecError) as exc:
        print(f"kvstack sidecar: {exc}", file=sys.stderr)
        return 2
    discovery = None
    if args.engines_file:
        discovery = FileDiscovery(args.engines_file)
    elif args.k8s_namespace:
        discovery = front_end.kubernetes_discovery(args)
    timeouts = Timeouts(args.timeout_connect, args.timeout_first_byte, args.timeout_idle, args.timeout_total)
    opts = SidecarOptions(
        engine=engine,
        host=args.host,
        port=args.port,
        prefill_engines=prefill,
        discovery=discovery,
        timeouts=timeouts,
        pd_prefill_timeout=args.pd_prefill_timeout,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
    )

    async def serve() -> None:
        async with running_sidecar(opts) as sidecar:
            log.info("sidecar listening on %s for engine %s", sidecar.url, engine)
            print(f"kvstack sidecar: {sidecar.url} -> {engine}", flush=True)
            await asyncio.Event().wait()

    return serve_until_signal(serve())
