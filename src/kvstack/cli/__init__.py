"""The ``kvstack`` command: the composition root that builds every object from flags.

Subcommands: ``sim`` (simulated vLLM engines), ``router``, ``epp`` (Envoy's endpoint picker), ``sidecar``
(the P/D sidecar in front of a decode engine), ``envoy-config`` (Envoy's bootstrap for the picker), ``up`` (a
local stack: simulated engines, a KV cache server and a front end), ``cache-server``, ``bench``, ``model
make-tiny`` (a dummy-weight model directory that real vLLM and the simulator both serve), ``metrics check``
(dashboards, rules and manifests against the metric catalogs), ``version``. Each lives in its own
module (``kvstack.cli.sim``, ``.router``, ``.epp``, ``.sidecar``, ``.envoy_config``, ``.up``, ``.model``,
``.metrics``; ``kvstack.cache.cli``, ``kvstack.bench.cli``) with its parser and its run function; the flags
both front ends take are in ``.front_end``. This module assembles the parser and dispatches.
"""

from __future__ import annotations

import argparse
import logging
import sys

from kvstack import __version__
from kvstack.bench.cli import add_bench_parser
from kvstack.bench.cli import run_bench as run_bench_command
from kvstack.cache.cli import add_cache_server_parser, run_cache_server
from kvstack.cli import envoy_config, epp, metrics, model, router, sidecar, sim, up


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstack", description="KV-cache-aware serving stack around vLLM.")
    sub = parser.add_subparsers(dest="command", required=True)
    sim.add_parser(sub)
    router.add_parser(sub)
    epp.add_parser(sub)
    sidecar.add_parser(sub)
    up.add_parser(sub)
    add_bench_parser(sub)
    add_cache_server_parser(sub)
    model.add_parser(sub)
    envoy_config.add_parser(sub)
    metrics.add_parser(sub)
    sub.add_parser("version", help="print the kvstack version")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "version":
        print(f"kvstack {__version__}")
        return 0
    if args.command == "model":
        return model.run(args)
    if args.command == "envoy-config":
        return envoy_config.run(args)
    if args.command == "metrics":
        return metrics.run(args)
    if args.command == "bench":
        return run_bench_command(args)
    if args.command == "cache-server":
        return run_cache_server(args)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO))
    if args.command == "router":
        return router.run(args, list(sys.argv[1:] if argv is None else argv))
    if args.command == "epp":
        return epp.run(args)
    if args.command == "sidecar":
        return sidecar.run(args)
    if args.command == "up":
        return up.run(args)
    return sim.run(args)
