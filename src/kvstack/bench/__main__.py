"""``python -m kvstack.bench WORKLOAD ...``: the same as ``kvstack bench WORKLOAD ...``."""

from __future__ import annotations

import argparse
import sys

from kvstack.bench.cli import add_bench_parser, run_bench


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstack")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
