"""Prefill/decode disaggregation against colocated engines: same engines, same seeded load, one run.

Setups, each on 4 fresh ``kvstack sim`` processes (one engine each, KV events on) with its own
``kvstack router``, on free 127.0.0.1 ports, each process in its own group (stopped by that id):
colocated (``--routing kv-aware``), P/D 1P+3D and 2P+2D (``--routing pd``, ``--engine URL#role=...``),
and colocated and 1P+3D again at 1.4x the load. The latency model (`pd_run.FULL`, modelled seconds, run
2x faster with ``--time-scale``) makes prefill interfere with decode: a step costs 0.001 + 0.0001 per
prefill token + (0.02 + 0.0002 per running sequence), at most 2,048 tokens a step, so a prefill chunk
sharing a step makes every running sequence's token ~10x late. Workload (`pd_workload.LongAndShort`):
Poisson, 5 requests per modelled second, 30% long prompts (3,000-5,000 fresh tokens, 256 output tokens),
70% short chats (40-160 tokens, 64 output tokens, under the ``pd`` preset's 256-token threshold).

Reported (`pd_report`): TTFT p50/p99 of long and short requests, ITL (client, and the engines' own
histograms), throughput, the router's ``kvstack_pd_*`` prefills and fallbacks, P/D / colocated ratios.
Output in ``.cache/bench/pd/<UTC time>/`` (results.json, results.md, ttft_cdf.png, itl_ccdf.png, a
``kvstack.bench`` report per setup, logs). The current result: ``docs/benchmarks/pd.md``.

    .venvs/dev/bin/python benchmarks/pd.py            # ~6 min
    .venvs/dev/bin/python benchmarks/pd.py --quick    # colocated and 1P+3D, 40 modelled s: ~1 min
    .venvs/dev/bin/python benchmarks/pd.py --setups colocated-high,pd-high
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from machine_info import machine
from pd_report import itl_ccdf_png, markdown, ratios, rich_tables, row_of, ttft_cdf_png
from pd_run import FULL, QUICK, Setup, run_setup
from procs import REPO
from results import git_state, write_json
from rich.console import Console

from kvstack.bench import BenchResult
from kvstack.devtools.tiny_model import make_tiny_model

OUT_ROOT = REPO / ".cache" / "bench" / "pd"
HIGH = 1.4  # the second load level, times the base rate
_COLOCATED = Setup("colocated", ("both",) * 4, "kv-aware")
_PD = Setup("P/D 1P+3D", ("prefill", "decode", "decode", "decode"), "pd")
SETUPS: dict[str, Setup] = {
    "colocated": _COLOCATED,
    "pd": _PD,
    "pd-2p2d": Setup("P/D 2P+2D", ("prefill", "prefill", "decode", "decode"), "pd"),
    "colocated-high": replace(_COLOCATED, load=HIGH),
    "pd-high": replace(_PD, load=HIGH),
}
QUICK_SETUPS = ("colocated", "pd")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="colocated and pd, 40 modelled s: ~1 min")
    parser.add_argument("--setups", help=f"subset of {','.join(SETUPS)} (default: all; quick: colocated,pd)")
    parser.add_argument("--rate", type=float, help="requests per modelled second at load 1 (default 5)")
    parser.add_argument("--duration", type=float, help="modelled seconds of arrivals (default 120; quick 40)")
    parser.add_argument("--time-scale", type=float, help="the sims' --time-scale (default 2)")
    parser.add_argument("--seed", type=int, help="workload seed (default 0)")
    parser.add_argument("--deadline", type=float, default=480.0, help="skip setups after this many s")
    parser.add_argument("--out", type=Path, default=None, help="default .cache/bench/pd/<UTC time>")
    args = parser.parse_args(argv)

    settings = QUICK if args.quick else FULL
    overrides = {
        "rate": args.rate,
        "duration": args.duration,
        "time_scale": args.time_scale,
        "seed": args.seed,
    }
    settings = replace(settings, **{k: v for k, v in overrides.items() if v is not None})
    wanted = args.setups.split(",") if args.setups else list(QUICK_SETUPS if args.quick else SETUPS)
    unknown = set(wanted) - set(SETUPS)
    if unknown:
        raise SystemExit(f"--setups: unknown {sorted(unknown)}; choose from {', '.join(SETUPS)}")
    console = Console() if sys.stdout.isatty() else Console(width=240)
    command = shlex.join([os.path.relpath(sys.executable, REPO), os.path.relpath(__file__, REPO), *argv])
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    out_dir = (args.out or OUT_ROOT / stamp).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    console.print(f"command: {command}\nresults: {out_dir}")

    model_dir = REPO / ".cache" / "tiny-model"
    if not (model_dir / "tokenizer.json").is_file():  # shared with other scripts: never rewritten under them
        make_tiny_model(model_dir)
    host = machine()
    console.print(
        f"machine: {host['cpus']} cores ({host['cpu_model']}), load average "
        f"{' '.join(host['loadavg_at_start'])}, busy {host['busy_pct_before_start']:.0f}% before the run; "
        "sims, router and client share these cores"
    )
    if host["busy_pct_before_start"] > 20:
        console.print("[yellow]the machine is busy with other work: latencies will be skewed[/]")
    console.print(f"offered load at 1x (modelled): {settings.offered()}")

    started = time.monotonic()
    infos: list[dict[str, Any]] = []
    results: dict[str, BenchResult] = {}
    for key in wanted:
        setup = SETUPS[key]
        if time.monotonic() - started > args.deadline:
            console.print(f"[yellow]skipping {setup.label}: past --deadline[/]")
            infos.append({"name": setup.label, "load": setup.load, "failure": "skipped: past --deadline"})
            continue
        info, result = run_setup(setup, settings, model_dir, out_dir, console)
        infos.append(info)
        if result is not None:
            results[setup.label] = result
            console.print(
                f"  {setup.label}: {result.summary['requests_ok']} ok, {result.summary['errors']} errors, "
                f"{info['bench_wall_s']} s, machine busy {info['machine_busy_pct']}%, CPU s {info['cpu_s']}"
            )

    rows = [row_of(info, results.get(info["name"]), settings) for info in infos]
    ratio_rows = ratios(rows)
    title = (
        f"P/D vs colocated: 4 engines, {settings.rate:g} req/s (modelled) x {settings.duration:g} s, "
        f"{settings.long_share:.0%} long; times in modelled ms (wall x {settings.time_scale:g})"
    )
    for table in rich_tables(rows, ratio_rows, title):
        console.print(table)
    pngs = []
    if results:
        pngs = [
            ttft_cdf_png(out_dir / "ttft_cdf.png", results, settings.time_scale),
            itl_ccdf_png(out_dir / "itl_ccdf.png", results, settings.time_scale),
        ]
    report = {
        "command": command,
        "started_at": stamp,
        "elapsed_s": round(time.monotonic() - started, 1),
        "machine": host,
        "git": git_state(),
        "settings": settings.__dict__,
        "offered": {
            f"{load:g}x": settings.offered(load) for load in sorted({SETUPS[k].load for k in wanted})
        },
        "sim_command": shlex.join(settings.sim_command(model_dir)),
        "workload": settings.workload().describe(),
        "setups": infos,
        "rows": rows,
        "ratios": ratio_rows,
        "summaries": {name: r.summary for name, r in results.items()},
    }
    write_json(out_dir / "results.json", report, default=_jsonable)
    (out_dir / "results.md").write_text(f"{title}\n\n```sh\n{command}\n```\n\n" + markdown(rows, ratio_rows))
    console.print(f"results: {out_dir}/results.json, results.md, {', '.join(p.name for p in pngs)}")
    console.print(f"elapsed {report['elapsed_s']} s; command: {command}")
    return 0 if len(results) == len(wanted) else 1


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
