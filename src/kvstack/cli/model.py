"""``kvstack model make-tiny``: a dummy-weight model directory that real vLLM and the simulator both serve."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    model = sub.add_parser("model", help="model directories for tests and benchmarks")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    tiny = model_sub.add_parser("make-tiny", help="write a dummy-weight model directory (no network)")
    tiny.add_argument("directory")
    tiny.add_argument("--shape", choices=["tiny", "qwen2-0.5b"], default="tiny")
    tiny.add_argument("--name", default="kvstack-tiny")
    tiny.add_argument("--quiet", action="store_true")


def run(args: argparse.Namespace) -> int:
    from kvstack.devtools.tiny_model import SHAPES, make_tiny_model

    path = make_tiny_model(Path(args.directory), shape=SHAPES[args.shape], model_name=args.name)
    if not args.quiet:
        print(json.dumps({"model_dir": str(path), "shape": args.shape}))
    return 0
