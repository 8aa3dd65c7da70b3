"""The ``kvstack bench`` subcommand: one subcommand per workload, and ``compare`` for saved reports.

    kvstack bench multi-round-qa --url http://127.0.0.1:8080 --model tiny --num-users 10 --qps 2 --out out/kv
    kvstack bench shared-prefix --url ... --model ... --groups 8 --zipf 1.1 --max-requests 500
    kvstack bench long-doc-qa --url ... --model ... --documents 8 --document-len 8000
    kvstack bench compare kvstack=out/kv round-robin=out/rr --out out/compare

Exit status: 0 when the run finished with at least one successful request (errors are in the report),
1 when every request failed, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Any

__all__ = ["add_bench_parser", "run_bench"]

WORKLOADS = ("multi-round-qa", "shared-prefix", "long-doc-qa")


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--url", required=True, help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8080")
    g.add_argument("--model", required=True, help="model name to send")
    g.add_argument("--api-key", default=None, help="sent as a bearer token")
    g.add_argument(
        "--api", choices=("chat", "completions"), default="chat", help="chat messages or a flattened prompt"
    )
    g = p.add_argument_group("load")
    g.add_argument("--qps", type=float, default=1.0, help="total request rate; <= 0 sends as fast as allowed")
    g.add_argument("--arrival", choices=("poisson", "uniform"), default="poisson")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--answer-len", type=int, default=100, help="max_tokens of each request")
    g.add_argument("--max-concurrency", type=int, default=64, help="requests in flight at most")
    g.add_argument("--duration", type=float, default=None, help="send nothing after this many seconds")
    g.add_argument("--max-requests", type=int, default=None, help="send at most this many requests")
    g.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    g.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let the model stop before max_tokens",
    )
    g = p.add_argument_group("engine-side view")
    g.add_argument(
        "--engine-metrics",
        action="append",
        default=[],
        metavar="URL",
        help="an engine's base URL whose /metrics is read before and after the run (repeatable)",
    )
    g.add_argument("--engine-type", default="vllm", help="metric catalog: vllm, sglang, trtllm, triton")
    g.add_argument("--engine-version", default=None, help="engine version for the catalog (default newest)")
    g = p.add_argument_group("output")
    g.add_argument(
        "--out", default=None, metavar="DIR", help="write requests.csv, summary.json and PNG plots"
    )
    g.add_argument("--label", default=None, help="a name for this run in reports")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.add_argument("--log-level", default="warning")


def add_bench_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench`` and its workload subcommands to ``sub``."""
    bench = sub.add_parser(
        "bench",
        help="load generator for KV-cache-aware routing experiments",
        description="Send a seeded workload of streaming requests to an OpenAI-compatible server and report "
        "TTFT, ITL, throughput, cache hit rates and per-engine load share.",
    )
    wsub = bench.add_subparsers(dest="bench_command", required=True)
    p = wsub.add_parser("multi-round-qa", help="users in multi-round conversations (production-stack shape)")
    p.add_argument("--num-users", type=int, default=10)
    p.add_argument("--num-rounds", type=int, default=5)
    p.add_argument("--system-prompt-len", type=int, default=1000, help="words shared by all users")
    p.add_argument("--user-history-len", type=int, default=2000, help="words of each user's own context")
    p.add_argument("--question-len", type=int, default=20, help="words per question")
    _common(p)
    p = wsub.add_parser("shared-prefix", help="requests sharing one of G prefixes (uniform or Zipf)")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=1000, help="words of each group's prefix")
    p.add_argument("--suffix-len", type=int, default=50, help="fresh words per request")
    p.add_argument("--zipf", type=float, default=None, metavar="S", help="Zipf exponent (default: uniform)")
    _common(p)
    p = wsub.add_parser("long-doc-qa", help="questions on long documents, interleaved across documents")
    p.add_argument("--documents", type=int, default=8)
    p.add_argument("--document-len", type=int, default=10000, help="words per document")
    p.add_argument("--questions-per-document", type=int, default=4)
    p.add_argument("--question-len", type=int, default=20, help="words per question")
    _common(p)
    p = wsub.add_parser("compare", help="saved reports side by side")
    p.add_argument("runs", nargs="+", metavar="NAME=DIR", help="a run's name and its --out directory")
    p.add_argument("--baseline", default=None, help="name the TTFT ratios divide by (default: the first)")
    p.add_argument("--out", default=None, metavar="DIR", help="write compare.json and compare_ttft_cdf.png")
    p.add_argument("--log-level", default="warning")


def _workload(args: argparse.Namespace) -> Any:
    from kvstack.bench.workloads import LongDocQA, MultiRoundQA, SharedPrefix

    common = {"answer_len": args.answer_len, "qps": args.qps, "arrival": args.arrival, "seed": args.seed}
    if args.bench_command == "multi-round-qa":
        return MultiRoundQA(
            num_users=args.num_users,
            num_rounds=args.num_rounds,
            system_prompt_len=args.system_prompt_len,
            user_history_len=args.user_history_len,
            question_len=args.question_len,
            **common,
        )
    if args.bench_command == "shared-prefix":
        return SharedPrefix(
            groups=args.groups,
            prefix_len=args.prefix_len,
            suffix_len=args.suffix_len,
            zipf=args.zipf,
            **common,
        )
    return LongDocQA(
        documents=args.documents,
        document_len=args.document_len,
        questions_per_document=args.questions_per_document,
        question_len=args.question_len,
        **common,
    )


def _compare(args: argparse.Namespace) -> int:
    from kvstack.bench.report import compare, load_result

    results = {}
    for run in args.runs:
        name, sep, directory = run.partition("=")
        if not sep or not name or not directory:
            print(f"kvstack bench compare: expected NAME=DIR, got {run!r}", file=sys.stderr)
            return 2
        try:
            results[name] = load_result(directory)
        except (OSError, ValueError, KeyError) as exc:
            print(f"kvstack bench compare: cannot read the report in {directory}: {exc}", file=sys.stderr)
            return 2
    try:
        compare(results, args.out, baseline=args.baseline)
    except ValueError as exc:
        print(f"kvstack bench compare: {exc}", file=sys.stderr)
        return 2
    return 0


def run_bench(args: argparse.Namespace) -> int:
    """Run the ``kvstack bench`` subcommand parsed into ``args``; return the exit status."""
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING))
    if args.bench_command == "compare":
        return _compare(args)
    from kvstack.bench.records import BenchConfig
    from kvstack.bench.report import print_summary, write_report
    from kvstack.bench.runner import run_bench as run

    try:
        config = BenchConfig(
            url=args.url,
            model=args.model,
            workload=_workload(args),
            api=args.api,
            api_key=args.api_key,
            max_concurrency=args.max_concurrency,
            duration=args.duration,
            max_requests=args.max_requests,
            request_timeout=args.request_timeout,
            ignore_eos=args.ignore_eos,
            engine_metrics=tuple(args.engine_metrics),
            engine_type=args.engine_type,
            engine_version=args.engine_version,
            progress=not args.quiet and sys.stdout.isatty(),
            label=args.label,
        ).validate()
        from kvstack.engines.catalog import catalog_for

        catalog_for(config.engine_type, config.engine_version)
    except ValueError as exc:
        print(f"kvstack bench {args.bench_command}: {exc}", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(run(config))
    except KeyboardInterrupt:
        print("kvstack bench: interrupted; no report written", file=sys.stderr)
        return 130
    print_summary(result)
    if args.out:
        paths = write_report(result, args.out)
        print(f"report: {', '.join(str(p) for p in paths)}")
    if result.summary["requests_sent"] and not result.summary["requests_ok"]:
        print("kvstack bench: every request failed (see the errors above)", file=sys.stderr)
        return 1
    return 0
