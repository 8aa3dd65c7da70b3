"""Chaos: faults under streaming load, router by router, as the official ``openai`` client sees them.

Routers, one after another in front of the same engines: ``kvstack router --routing kv-aware``, vllm-router
and sglang-router (``.venvs/peers``, default policy), and production-stack's router when
``--production-stack-router CMD`` starts it (``{port}``, ``{backends}``, ``{models}`` filled in; it is not on
PyPI, and this script neither installs nor ships it). Faults (`chaos_faults`) under 6 streaming users
(`chaos_load`): one of 2 real vLLM engines SIGKILLed and restarted on its ports (its KV-event publisher
with it); on 2 ``kvstack sim`` engines a first-token delay and 503s on one; for kvstack only, the sims'
cache server SIGKILLed and its Redis tier stopped, each then restarted. kvstack's targets: no request failed
before its first token, none truncated, none hung, a restarted engine serving within two scrape intervals
of being healthy. Output: ``bench-results/chaos.json`` and ``chaos.md`` (the page's tables, as
docs/benchmarks/chaos.md shows them); logs in ``.cache/bench/chaos/<UTC time>/``.

    .venvs/dev/bin/python benchmarks/chaos.py                 # ~10-15 min
    .venvs/dev/bin/python benchmarks/chaos.py --routers kvstack --faults engine-kill,engine-503
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from chaos_faults import Stage, engine_kill, service_restart, with_faults
from chaos_report import COUNTS, FAULTS, markdown, rich_tables, tables, targets
from chaos_setup import (
    Engine,
    Router,
    cache_server,
    kvstack_router,
    peer_router,
    production_stack_router,
    redis_server,
    router_not_ready,
    sim_engine,
    vllm_engine,
    wait_for,
)
from machine_info import machine, machine_cpu_ticks
from peers import ensure_peers
from procs import HOST, REPO, Group, free_port
from results import git_state, write_json
from rich.console import Console

from kvstack.devtools.tiny_model import make_tiny_model

OUT_ROOT = REPO / ".cache" / "bench" / "chaos"
RESULTS = REPO / "bench-results"
ROUTERS = ("kvstack", "vllm-router", "sglang-router")
KVSTACK_ONLY = ("cache-server-kill", "redis-stop")
SIM_FAULTS = ("slow-engine", "engine-503", *KVSTACK_ONLY)
RESTART_BUDGET_S = 300.0  # a killed vLLM engine's restart, under load, on a busy 2-core machine
SCRAPE_S = 1.0  # kvstack router's default --scrape-interval
SLOW_S = 5.0  # the slow engine's first-token delay


async def run_router(
    router: Router,
    engines: list[Engine],
    faults: dict[str, Callable[[Stage], Awaitable[dict[str, Any]]]],
    args: argparse.Namespace,
    logs: Path,
    console: Console,
) -> dict[str, dict[str, Any]]:
    """``router`` started in front of ``engines``, each of ``faults`` run through it, the router stopped."""
    port, metrics_port = free_port(), free_port()
    urls = [e.url for e in engines]
    group = Group.start(router.name, [router.command(port, metrics_port, urls)], logs / f"{router.name}.log")
    url = f"http://{HOST}:{port}"
    out: dict[str, dict[str, Any]] = {}
    try:
        why: list[str | None] = ["not asked"]

        def ready() -> bool:
            if (gone := group.exited()) is not None:
                raise RuntimeError(f"{gone}: {group.log_text()[-600:]}")
            why[0] = router_not_ready(router, url, metrics_port, urls)
            return why[0] is None

        try:
            await asyncio.to_thread(wait_for, ready, 90.0, f"{router.name} ready")
        except RuntimeError as exc:
            reason = f"not ready: {why[0]}; {group.exited() or ''} {exc}".strip()
            return {fault: {"failure": reason} for fault in faults}
        stage = Stage(
            router, url, engines, args.users, args.max_tokens, args.request_deadline, args.think, args.seed
        )
        for fault, run in faults.items():
            console.print(f"  {router.name}: {fault} ...")
            t0 = time.monotonic()
            try:
                out[fault] = await run(stage)
            except Exception as exc:  # one fault's failure is a result; the next fault still runs
                out[fault] = {"failure": f"{type(exc).__name__}: {exc}"}
            r = out[fault]
            if "failure" in r:
                console.print(f"    [red]{r['failure'][:300]}[/]")
            else:
                counts = ", ".join(f"{k} {r[k]}" for k in COUNTS)
                console.print(f"    {counts} ({time.monotonic() - t0:.0f} s)")
            if (gone := group.exited()) is not None:
                console.print(f"    [red]{router.name} exited: {gone}[/]")
                break
    finally:
        await asyncio.to_thread(group.stop)
    return out


Results = dict[str, dict[str, dict[str, Any]]]  # fault -> router -> its numbers


async def run_sims(
    args: argparse.Namespace, routers: list[Router], model_dir: Path, logs: Path, console: Console
) -> Results:
    """The faults on 2 ``kvstack sim`` engines whose connector uses a cache server over Redis."""
    wanted = [f for f in args.faults.split(",") if f in SIM_FAULTS]
    if not wanted:
        return {}
    redis = redis_server(logs)
    cache = cache_server(logs, redis.port)
    engines = [sim_engine(f"sim-{i}", model_dir, logs, f"tcp://{HOST}:{cache.port}") for i in range(2)]
    results: Results = {f: {} for f in wanted}
    try:
        redis.start()
        await asyncio.to_thread(wait_for, redis.answers, 15.0, "redis-server", redis)
        cache.start()
        await asyncio.to_thread(wait_for, cache.answers, 30.0, "cache-server", cache)
        for e in engines:
            e.start()
        for e in engines:
            await asyncio.to_thread(e.wait_healthy, 60.0)
        span, warm = args.warm * 2, args.warm / 2
        faults: dict[str, Callable[[Stage], Awaitable[dict[str, Any]]]] = {
            "slow-engine": lambda s: with_faults(s, {"first_token_delay": SLOW_S}, span),
            "engine-503": lambda s: with_faults(s, {"error_rate": 1.0, "error_codes": [503]}, span),
            "cache-server-kill": lambda s: service_restart(
                s, cache, kill=True, before_s=warm, down_s=args.warm, after_s=warm
            ),
            "redis-stop": lambda s: service_restart(
                s, redis, kill=False, before_s=warm, down_s=args.warm, after_s=warm
            ),
        }
        for router in routers:
            chosen = {f: faults[f] for f in wanted if router.kind == "kvstack" or f not in KVSTACK_ONLY}
            ran = await run_router(router, engines, chosen, args, logs, console)
            for fault in wanted:
                results[fault][router.name] = ran.get(fault, {"skipped": "kvstack components only"})
    finally:
        for proc in [*engines, cache, redis]:
            await asyncio.to_thread(proc.stop)
    return results


async def run_vllm(
    args: argparse.Namespace, routers: list[Router], model_dir: Path, logs: Path, console: Console
) -> Results:
    """The engine kill on 2 real vLLM engines; routers past ``--budget`` are skipped."""
    if "engine-kill" not in args.faults.split(","):
        return {}
    engines = [vllm_engine(f"vllm-{i}", model_dir, logs, core=i) for i in range(2)]
    results: Results = {"engine-kill": {}, "kv-publisher-restart": {}}

    async def kill(stage: Stage) -> dict[str, Any]:
        return await engine_kill(stage, args.warm, 3.0, args.warm, RESTART_BUDGET_S)

    try:
        console.print("starting 2 real vLLM engines (~1 min on an idle machine) ...")
        for e in engines:
            e.start()
        for e in engines:
            await asyncio.to_thread(e.wait_healthy, 600.0)
        for router in routers:
            if time.monotonic() > args.deadline_at:
                skipped = {"skipped": f"past --budget ({args.budget:g} s)"}
                results["engine-kill"][router.name] = results["kv-publisher-restart"][router.name] = skipped
                continue
            ran = (await run_router(router, engines, {"engine-kill": kill}, args, logs, console))[
                "engine-kill"
            ]
            results["engine-kill"][router.name] = ran
            publisher: dict[str, Any] = {"skipped": "does not consume vLLM KV events"}
            if router.kv_events:
                publisher = {"kv_events_resumed_s": ran.get("kv_events_resumed_s")}
            results["kv-publisher-restart"][router.name] = publisher
    finally:
        for e in engines:
            await asyncio.to_thread(e.stop)
    return results


async def run(
    args: argparse.Namespace, routers: list[Router], model_dir: Path, logs: Path, console: Console
) -> Results:
    vllm = await run_vllm(args, routers, model_dir, logs, console)
    sims = await run_sims(args, routers, model_dir, logs, console)
    return {f: {**sims.get(f, {}), **vllm.get(f, {})} for f in FAULTS if f in sims or f in vllm}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--routers", default=",".join(ROUTERS), help=f"subset of {','.join(ROUTERS)}")
    parser.add_argument(
        "--production-stack-router",
        metavar="CMD",
        help="command line starting production-stack's router; {port}, {backends} (engine URLs, comma-"
        "separated) and {models} are filled in",
    )
    parser.add_argument("--faults", default="engine-kill,slow-engine,engine-503,cache-server-kill,redis-stop")
    parser.add_argument("--users", type=int, default=6, help="concurrent streaming users (default 6)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per answer (ignore_eos)")
    parser.add_argument(
        "--request-deadline", type=float, default=30.0, help="a request not ended by then hung"
    )
    parser.add_argument("--warm", type=float, default=6.0, help="seconds of load before and after a fault")
    parser.add_argument("--think", type=float, default=0.5, help="seconds a user waits between requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--budget", type=float, default=660.0, help="skip routers' engine kills after this many s"
    )
    parser.add_argument("--no-install", action="store_true", help="fail instead of installing the peers")
    args = parser.parse_args(argv)

    console = Console() if sys.stdout.isatty() else Console(width=200)
    command = shlex.join([os.path.relpath(sys.executable, REPO), os.path.relpath(__file__, REPO), *argv])
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    logs = OUT_ROOT / stamp
    console.print(f"command: {command}\nlogs: {logs}")
    unknown = set(args.faults.split(",")) - (set(FAULTS) - {"kv-publisher-restart"})
    if unknown:
        raise SystemExit(f"--faults: unknown {sorted(unknown)}; choose from {', '.join(FAULTS)}")
    model_dir = OUT_ROOT / "tiny-model"
    if not (model_dir / "tokenizer.json").is_file():
        make_tiny_model(model_dir, model_name="tiny")

    routers: list[Router] = []
    for name in [r.strip() for r in args.routers.split(",") if r.strip()]:
        if name == "kvstack":
            routers.append(kvstack_router(model_dir))
        elif name in ("vllm-router", "sglang-router"):
            routers.append(peer_router(name, ensure_peers(console, not args.no_install)))
        else:
            raise SystemExit(f"--routers: unknown {name!r}; choose from {', '.join(ROUTERS)}")
    if args.production_stack_router:
        routers.append(production_stack_router(args.production_stack_router))

    host = machine()
    console.print(
        f"machine: {host['cpus']} cores ({host['cpu_model']}), busy {host['busy_pct_before_start']:.0f}% "
        "before the run; engines, routers and the client share these cores"
    )
    started, ticks0 = time.monotonic(), machine_cpu_ticks()
    args.deadline_at = started + args.budget
    # SIGTERM unwinds like Ctrl-C, so that every process group this run started is stopped.
    signal.signal(signal.SIGTERM, _interrupted)
    results = asyncio.run(run(args, routers, model_dir, logs, console))
    busy1, all1 = machine_cpu_ticks()
    busy_pct = round(100 * (busy1 - ticks0[0]) / max(1, all1 - ticks0[1]), 1)

    rendered = tables(results)
    checks = targets(results, "kvstack", SCRAPE_S) if any("kvstack" in by for by in results.values()) else []
    for table in rich_tables(rendered):
        console.print(table)
    for c in checks:
        console.print(f"kvstack target {'PASS' if c['pass'] else 'FAIL'}: {c['target']} ({c['value']})")
    elapsed = round(time.monotonic() - started, 1)
    git = git_state()
    report = {
        "command": command,
        "started_at": stamp,
        "elapsed_s": elapsed,
        "machine": host,
        "machine_busy_pct_during_run": busy_pct,
        "git": git,
        "routers": [{"name": r.name, "note": r.note} for r in routers],
        "settings": {**vars(args), "scrape_interval_s": SCRAPE_S, "slow_engine_delay_s": SLOW_S},
        "results": results,
        "targets": checks,
        "logs": str(logs),
    }
    write_json(RESULTS / "chaos.json", report)
    head = (
        f"Run {stamp} UTC, commit {git['commit'][:10]}, {elapsed:.0f} s, {host['cpus']} cores "
        f"({host['cpu_model']}), machine busy {busy_pct:.0f}% during the run.\n\n```sh\n{command}\n```\n\n"
    )
    (RESULTS / "chaos.md").write_text(head + markdown(rendered, checks, "kvstack"))
    console.print(f"results: {RESULTS / 'chaos.json'}, {RESULTS / 'chaos.md'}; elapsed {elapsed} s")
    return 0


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
