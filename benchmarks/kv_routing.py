"""KV-aware routing experiment: seven routers, one seeded workload, fresh simulated engines for each.

Question (from the issue): with 4-8 engines whose KV capacity is smaller than the working set, how do
kvstack's routing policies compare with the Rust routers' ``cache_aware`` and with an oracle that knows
every engine's cache? Routers, each run alone against a FRESH ``kvstack sim --engines N`` process (empty
caches, counters from zero), on free 127.0.0.1 ports, each in its own process group (stopped by that id):

- ``kvstack kv-aware``: ``kvstack router --routing kv-aware`` (KV events from the sims' /kv_event_sources);
- ``envoy kv-aware``: real Envoy (``--concurrency 1``) asking ``kvstack epp --routing kv-aware`` (the same
  scheduling as the proxy, KV events likewise), bootstrap from ``kvstack.epp.envoy_config`` with the engines
  listed (the picker's fallbacks for Envoy's retries);
- ``kvstack prefix``: ``--routing prefix --no-kv-events`` (approximate: the router's own routing history,
  what the preset is for: engines that publish no events);
- ``kvstack round-robin``: ``--routing round-robin`` (the baseline of the TTFT ratio);
- ``vllm-router``: ``vllm-router==0.1.17``, default policy ``cache_aware`` (before each request it asks
  every worker's ``/v1/chat/completions/render`` for the prompt's token ids);
- ``sglang-router``: ``sglang-router==0.3.2``, default policy ``cache_aware`` (radix tree over text);
- ``oracle``: ``benchmarks/oracle_router.py``: kvstack's router with the kv-aware load policy whose prefix
  knowledge comes from asking every engine (``POST /admin/prefix_match``) before each decision.

The Rust routers get no model or tokenizer path and run with ``HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1``.
Every router is ready before load starts: /v1/models answers (and lists the model, or for sglang-router
its Prometheus gauge shows every worker healthy); a kvstack router's /engines shows fresh metrics for
every engine, and kv-aware's shows ``routing_knowledge: kv-events`` and a connected subscriber for all;
for Envoy the picker's /engines says the same, Envoy's admin /ready answers and /v1/models passes through.

Workload: ``MultiRoundQA`` (``kvstack.bench``), chat API, streaming, ``ignore_eos``, Poisson arrivals, the
same seed for every router. The number of users is odd on purpose: with U users a multiple of the
engine count, plain round-robin would send every round of a user to the same engine by accident.
Engine-side numbers (prefix-cache hit rate in tokens, finished requests per engine) come from the sims'
/metrics read before and after each run; the served engine's response header (``x-kvstack-engine`` from
kvstack's router, ``x-gateway-destination-endpoint-served`` from Envoy) and
``usage.prompt_tokens_details.cached_tokens`` (every router) give the per-request view.

Targets (for ``kvstack kv-aware``): hit rate >= 0.95 x the oracle's; TTFT p50 <= 0.5 x round-robin's;
hit rate >= 1.2 x and TTFT p90 below each Rust router's ``cache_aware``; max engine share <= 1.3 x mean.
For ``envoy kv-aware``: hit rate >= 0.97 x the proxy's (``kvstack kv-aware``); TTFT p50 <= 0.5 x
round-robin's.

Output: ``.cache/bench/kv_routing/<UTC timestamp>/``: ``results.json`` (everything), ``results.md`` (the
tables as markdown), per router a ``kvstack.bench`` report directory (requests.csv, summary.json, PNGs),
``compare/`` (``kvstack.bench.compare`` against round-robin), ``summary.png`` and ``logs/``.

The current result, its command, machine and limits: ``docs/benchmarks/kv-routing.md``.

    .venvs/dev/bin/python benchmarks/kv_routing.py            # ~8.5 min
    .venvs/dev/bin/python benchmarks/kv_routing.py --quick    # ~2 min smoke run
    .venvs/dev/bin/python benchmarks/kv_routing.py --kv-routing least-qps --routers kv-aware,oracle
    .venvs/dev/bin/python benchmarks/kv_routing.py --routers kv-aware,envoy-kv-aware   # ~2.5 min
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kv_routing_report import (
    BASELINE,
    evaluate,
    evaluate_envoy,
    markdown,
    ms,
    pct,
    rich_table,
    row_of,
    summary_png,
    verdict_line,
)
from kv_routing_routers import MODEL, Target, envoy_target, kvstack_target, oracle_target, peer_target
from kv_routing_run import FULL, QUICK, run_target, working_set
from machine_info import machine
from peers import PEER_VERSIONS, ensure_peers
from procs import KVSTACK, REPO
from results import git_state, write_json
from rich.console import Console

from kvstack.bench import BenchResult, compare

OUT_ROOT = REPO / ".cache" / "bench" / "kv_routing"
ROUTERS = ("round-robin", "kv-aware", "envoy-kv-aware", "prefix", "oracle", "vllm-router", "sglang-router")
KV_AWARE = "kvstack kv-aware"
ENVOY_KV_AWARE = "envoy kv-aware"


# Alternatives to the kv-aware preset's weights, tried with --kv-routing NAME (written to the run directory
# and passed as a YAML file to `kvstack router --routing` and to the oracle). Same format as the preset.
_VARIANT_TEMPLATE = """\
plugins:
- type: saturation-filter
  parameters:
    queueThreshold: {queue_threshold}
    kvUsageThreshold: {kv_threshold}
- type: precise-prefix-scorer
- type: no-hit-lru-scorer
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: active-requests-scorer
{extra_plugins}- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: saturation-filter
  - pluginRef: precise-prefix-scorer
    weight: {prefix_weight}
  - pluginRef: no-hit-lru-scorer
    weight: 1
  - pluginRef: queue-scorer
    weight: 1
  - pluginRef: kv-cache-utilization-scorer
    weight: {kv_weight}
  - pluginRef: active-requests-scorer
    weight: 1
{extra_refs}  - pluginRef: max-score-picker
"""


def _variant(
    *,
    queue_threshold: float = 5,
    kv_threshold: float = 0.8,
    prefix_weight: float = 3,
    kv_weight: float = 1,
    least_qps: tuple[float, float] | None = None,  # (weight, windowSeconds)
) -> str:
    extra_plugins = extra_refs = ""
    if least_qps is not None:
        weight, window = least_qps
        extra_plugins = f"- type: least-qps-scorer\n  parameters:\n    windowSeconds: {window:g}\n"
        extra_refs = f"  - pluginRef: least-qps-scorer\n    weight: {weight:g}\n"
    return _VARIANT_TEMPLATE.format(
        queue_threshold=queue_threshold,
        kv_threshold=kv_threshold,
        prefix_weight=prefix_weight,
        kv_weight=kv_weight,
        extra_plugins=extra_plugins,
        extra_refs=extra_refs,
    )


VARIANTS: dict[str, str] = {
    # The preset itself, through the YAML path (a check that the file route changes nothing).
    "preset": _variant(),
    # Spread new sessions by request rate: the shared system prompt is a partial hit on every engine that
    # has served once, so no-hit-lru never fires after the first requests, and an engine that has not
    # served yet loses 3 x (system prompt / prompt) on prefix for every new session. The window is 10 s
    # because the router keeps only the last 10 s of send times (RECENT_WINDOW_S in router/registry.py).
    "least-qps": _variant(least_qps=(1, 10)),
    "least-qps-2": _variant(least_qps=(2, 10)),
    # A lighter prefix weight shrinks that penalty, and the margin that keeps a conversation in place.
    "prefix-2": _variant(prefix_weight=2),
}


# -- the run --------------------------------------------------------------------------------------
def ensure_model(console: Console) -> Path:
    model_dir = OUT_ROOT / "tiny-model"
    if not (model_dir / "tokenizer.json").is_file():
        console.print(f"writing a tiny model directory (tokenizer + chat template): {model_dir}")
        subprocess.run(
            [str(KVSTACK), "model", "make-tiny", str(model_dir), "--name", MODEL, "--quiet"],
            check=True,
            timeout=120,
        )
    return model_dir


def build_targets(
    args: argparse.Namespace, model_dir: Path, kv_routing: str, console: Console
) -> list[Target]:
    suffix = "" if args.kv_routing == "kv-aware" else f" [{args.kv_routing}]"
    wanted = [r.strip() for r in args.routers.split(",") if r.strip()]
    unknown = set(wanted) - set(ROUTERS)
    if unknown:
        raise SystemExit(f"--routers: unknown {sorted(unknown)}; choose from {', '.join(ROUTERS)}")
    peers_python = None
    if {"vllm-router", "sglang-router"} & set(wanted):
        peers_python = ensure_peers(console, not args.no_install)
    out: list[Target] = []
    for name in wanted:
        if name == "kv-aware":
            out.append(
                kvstack_target(
                    KV_AWARE + suffix,
                    kv_routing,
                    model_dir,
                    kv_events=True,
                    note=f"kvstack router --routing {args.kv_routing} (KV events)",
                )
            )
        elif name == "envoy-kv-aware":
            out.append(envoy_target(ENVOY_KV_AWARE + suffix, kv_routing, model_dir))
        elif name == "prefix":
            note = "kvstack router --routing prefix --no-kv-events (routing history)"
            out.append(kvstack_target("kvstack prefix", "prefix", model_dir, kv_events=False, note=note))
        elif name == "round-robin":
            note = "kvstack router --routing round-robin"
            out.append(kvstack_target(BASELINE, "round-robin", model_dir, kv_events=False, note=note))
        elif name == "oracle":
            out.append(oracle_target("oracle" + suffix, kv_routing, model_dir))
        elif name in PEER_VERSIONS and peers_python is not None:
            out.append(peer_target(name, peers_python, shlex.split(args.peer_args)))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="9 users x 4 rounds, 450 blocks: ~2 min")
    parser.add_argument("--routers", default=",".join(ROUTERS), help=f"subset of {','.join(ROUTERS)}")
    parser.add_argument(
        "--kv-routing",
        default="kv-aware",
        help=f"load policy of 'kvstack kv-aware' and the oracle: kv-aware (the preset), one of "
        f"{', '.join(VARIANTS)} (YAML kept in this script), or a YAML file",
    )
    parser.add_argument(
        "--peer-args", default="", help="extra arguments for both Rust routers, e.g. '--cache-threshold 0.5'"
    )
    parser.add_argument("--engines", type=int, help="simulated engines (default 4)")
    parser.add_argument("--num-gpu-blocks", type=int, help="KV blocks per engine (default 900; quick 450)")
    parser.add_argument("--prefill-per-token", type=float, help="sim prefill seconds/token (default 0.0002)")
    parser.add_argument("--users", type=int, help="conversations (default 23; quick 9)")
    parser.add_argument("--rounds", type=int, help="rounds per conversation (default 6; quick 4)")
    parser.add_argument("--qps", type=float, help="request rate (default 2; quick 3)")
    parser.add_argument("--seed", type=int, help="workload seed (default 0)")
    parser.add_argument("--deadline", type=float, default=1200.0, help="skip routers after this many s")
    parser.add_argument("--no-install", action="store_true", help="fail instead of installing the peers")
    parser.add_argument("--out", type=Path, default=None, help="default .cache/bench/kv_routing/<UTC time>")
    args = parser.parse_args(argv)

    settings = QUICK if args.quick else FULL
    overrides = {
        "engines": args.engines,
        "num_gpu_blocks": args.num_gpu_blocks,
        "prefill_per_token": args.prefill_per_token,
        "users": args.users,
        "rounds": args.rounds,
        "qps": args.qps,
        "seed": args.seed,
    }
    settings = replace(settings, **{k: v for k, v in overrides.items() if v is not None})
    console = Console() if sys.stdout.isatty() else Console(width=240)
    command = shlex.join([os.path.relpath(sys.executable, REPO), os.path.relpath(__file__, REPO), *argv])
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    out_dir = (args.out or OUT_ROOT / stamp).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    console.print(f"command: {command}\nresults: {out_dir}")

    model_dir = ensure_model(console)
    kv_routing = args.kv_routing
    if kv_routing in VARIANTS:
        path = out_dir / f"routing-{kv_routing}.yaml"
        path.write_text(VARIANTS[kv_routing])
        kv_routing = str(path)
    host = machine()
    console.print(
        f"machine: {host['cpus']} cores ({host['cpu_model']}), Python {host['python']}, busy "
        f"{host['busy_pct_before_start']:.0f}% before the run; sims, router and client share these cores"
    )
    if host["busy_pct_before_start"] > 20:
        console.print("[yellow]the machine is busy with other work: latencies will be skewed[/]")
    sizing = working_set(settings, model_dir)
    console.print(f"workload: {settings.workload().describe()}")
    console.print(f"sizing: {sizing}")
    targets = build_targets(args, model_dir, kv_routing, console)

    started = time.monotonic()
    infos: list[dict[str, Any]] = []
    results: dict[str, BenchResult] = {}
    for target in targets:
        if time.monotonic() - started > args.deadline:
            console.print(f"[yellow]skipping {target.name}: past --deadline[/]")
            infos.append({"name": target.name, "failure": "skipped: past --deadline"})
            continue
        info, result = run_target(target, settings, model_dir, out_dir, console)
        infos.append(info)
        if result is not None:
            results[target.name] = result
            engine = result.summary.get("engine") or {}
            console.print(
                f"  {target.name}: hit rate {pct(engine.get('prefix_hit_rate'))}"
                f", TTFT p50 {ms(result.summary['ttft_s']['p50'])} ms, {result.summary['errors']} errors, "
                f"{info['bench_wall_s']} s, machine busy {info['machine_busy_pct']}%"
            )

    rows = [row_of(info, results.get(info["name"])) for info in infos]
    by_name = {r["router"]: r for r in rows}
    suffix = "" if args.kv_routing == "kv-aware" else f" [{args.kv_routing}]"
    subject = KV_AWARE + suffix
    verdicts = {subject: evaluate(by_name, subject, "oracle" + suffix)}
    if ENVOY_KV_AWARE + suffix in by_name:
        verdicts[ENVOY_KV_AWARE + suffix] = evaluate_envoy(by_name, ENVOY_KV_AWARE + suffix, subject)
    if results:
        base = BASELINE if BASELINE in results else next(iter(results))
        compare(results, out_dir / "compare", baseline=base, console=console)
    title = (
        f"KV-aware routing: {settings.engines} engines x {settings.num_gpu_blocks} blocks of "
        f"{settings.block_size}, {settings.users} users x {settings.rounds} rounds at {settings.qps:g} req/s"
    )
    console.print(rich_table(rows, title))
    for subject_name, checks in verdicts.items():
        console.print(f"targets for {subject_name}:")
        for c in checks:
            console.print("  " + verdict_line(c).replace("**", ""))
    png = summary_png(out_dir / "summary.png", rows)
    report = {
        "command": command,
        "started_at": stamp,
        "elapsed_s": round(time.monotonic() - started, 1),
        "machine": host,
        "git": git_state(),
        "settings": settings.__dict__,
        "sim_command": shlex.join(settings.sim_command(model_dir)),
        "kv_routing": args.kv_routing,
        "kv_routing_yaml": Path(kv_routing).read_text() if Path(kv_routing).is_file() else None,
        "workload": settings.workload().describe(),
        "sizing": sizing,
        "targets": infos,
        "rows": rows,
        "verdicts": verdicts,
        "summaries": {name: r.summary for name, r in results.items()},
    }
    write_json(out_dir / "results.json", report, default=_jsonable)
    (out_dir / "results.md").write_text(f"{title}\n\n```sh\n{command}\n```\n\n" + markdown(rows, verdicts))
    console.print(f"results: {out_dir}/results.json, results.md{', summary.png' if png else ''}")
    console.print(f"elapsed {report['elapsed_s']} s; command: {command}")
    return 0 if results else 1


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
