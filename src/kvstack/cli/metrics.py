"""``kvstack metrics check PATH...``: dashboards, rule files, PromQL files and manifests against the catalogs.

Catalogs: each ``--engine TYPE[==VERSION]`` (default: the newest vllm, unless ``--live`` is given), each
``--live URL`` (the /metrics page of a running exporter; a URL without a path gets ``/metrics``) and
kvstack's own exporters (unless ``--no-kvstack``). Exit status: 0 without errors (warnings allowed), 1 with
errors, 2 on a usage error (a missing or unreadable path, a file of another kind, a bad ``--engine``, an
unreachable ``--live``).
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from kvstack.cli.front_end import UsageError, positive

LIVE_TIMEOUT_S = 5.0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("metrics", help="check what dashboards and rules read against what exporters export")
    actions = p.add_subparsers(dest="metrics_command", required=True)
    c = actions.add_parser(
        "check",
        help="check Grafana dashboards, Prometheus rule files, PromQL files and Kubernetes manifests",
        description="Report every metric name, suffix, label or label value the inputs ask for that the "
        "selected exporters cannot give. Exit 0 clean (warnings allowed), 1 with errors, 2 on usage errors.",
    )
    c.add_argument("paths", nargs="+", type=Path, metavar="PATH", help="a file or a directory to walk")
    c.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="TYPE[==VERSION]",
        help="an engine catalog, e.g. vllm==0.32 or sglang (repeat; default: the newest vllm)",
    )
    c.add_argument(
        "--live", action="append", default=[], metavar="URL", help="a running exporter's /metrics (repeat)"
    )
    c.add_argument(
        "--live-timeout", type=positive, default=LIVE_TIMEOUT_S, help="seconds a --live fetch may take"
    )
    c.add_argument(
        "--no-kvstack", dest="kvstack", action="store_false", help="leave out kvstack's own exporters"
    )
    c.add_argument("--format", choices=("text", "json"), default="text")


def run(args: argparse.Namespace) -> int:
    from kvstack.board import documents, report
    from kvstack.board.check import check

    try:
        inputs = documents.read(args.paths)
        catalogs = _catalogs(args)
    except (UsageError, documents.UnsupportedFile, OSError) as exc:
        print(f"kvstack metrics check: {exc}", file=sys.stderr)
        return 2
    findings = check(inputs, catalogs)
    render = report.as_json if args.format == "json" else report.as_text
    print(render(findings, inputs.files, len(inputs.expressions)))
    return 1 if any(f.severity == "error" for f in findings) else 0


def _catalogs(args: argparse.Namespace) -> list[Any]:
    from kvstack.board.catalogs import engine_catalog, kvstack_catalogs, live_catalog

    specs = args.engine or ([] if args.live else ["vllm"])
    catalogs = []
    for spec in specs:
        try:
            catalogs.append(engine_catalog(spec))
        except ValueError as exc:
            raise UsageError(f"--engine {spec}: {exc}") from None
    for url in args.live:
        catalogs.append(live_catalog(fetch_metrics(url, args.live_timeout), f"live {url}"))
    if args.kvstack:
        catalogs.extend(kvstack_catalogs())
    return catalogs


def fetch_metrics(url: str, timeout_s: float) -> str:
    """The text of ``url`` (``/metrics`` appended when it has no path); UsageError saying why it failed."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UsageError(f"--live {url}: not an http(s) URL")
    if parts.path in ("", "/"):
        url = urllib.parse.urlunsplit(parts._replace(path="/metrics"))
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return str(response.read().decode("utf-8", errors="replace"))
    except (urllib.error.URLError, OSError) as exc:
        raise UsageError(f"--live {url}: cannot read it ({getattr(exc, 'reason', exc)})") from None
