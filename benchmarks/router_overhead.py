"""Router overhead against a zero-delay backend: kvstack router, vllm-router and sglang-router side by side.

One run, one backend (``benchmarks/backend_zero.py``: answers at once, ``--backend-procs`` processes on one
port), and every target in turn on free 127.0.0.1 ports, each in its own process group (stopped by that
group's id):

- ``direct``: wrk straight to the backend (the floor every router adds to);
- ``kvstack``: ``kvstack router --engine <backend>`` (default routing preset), one process;
- ``kvstack xW``: ``kvstack router --workers W`` (W processes sharing the port through SO_REUSEPORT);
- ``vllm-router``: ``vllm-router==0.1.17``, default policy (``cache_aware``: it asks the engine's
  ``/v1/completions/render`` for token ids before every request, as it would ask vLLM);
- ``vllm-router rr``: the same with ``--policy round_robin`` (no render call: its bare proxy cost);
- ``sglang-router``: ``sglang-router==0.3.2`` (``python -m sglang_router.launch_router``), default policy.

The peers are Rust routers installed in ``.venvs/peers`` (created here when missing) and given no model or
tokenizer path: nothing is downloaded. wrk comes from Debian (installed here with apt-get when missing).

Per target and response kind (``plain`` JSON, ``stream`` = 64 SSE chunks + ``[DONE]``, each its own
socket write on the backend):

1. *low load*: wrk ``-c 4`` with a Lua ``delay()`` think time calibrated so that the offered rate is
   ``--rate`` (500 req/s, plain) or ``--stream-rate`` (100 req/s, stream); latency percentiles from wrk's
   histogram; *added* latency = target percentile - direct percentile;
2. *throughput*: wrk ``-c 64``, no think time, requests/s.

Then *interleaved latency rounds* (``--latency-rounds``, 5): every target runs at once, and each round
measures the low plain load on direct and on every target one after the other (``--round-duration`` s
each, the order rotating), so a noisy minute on this shared machine falls on all of them alike. The added
p99 the verdict reads is the median over rounds of (target p99 - direct p99 of the same round).
Each round starts with 3 s of an idle event loop's 1 ms timer (``machine_info.timer_wakeup_lag``): its
p99 lag is the machine's own wake-up floor in that minute, shown under the rounds.

Each run also records the CPU seconds of the target's processes, the backend's, wrk's and the machine's
busy share (``/proc``): load generator, routers and backend share the machine's cores, so the CPU cost per
request is the comparison that contention distorts least. The backend counts the requests it answered by
path, so upstream calls per client request are checked, not assumed.

Last, *memory*: a fresh one-process ``kvstack router`` serves ``--rss-requests`` (200k) requests (wrk
``-c 64``, every ``--rss-stream-every``-th request streamed) while its RSS is sampled from
``/proc/<pid>/status``; flat means every sample after warm-up within +-10% of the first.

Bounded: all traffic on 127.0.0.1, every wrk run has ``-d`` and a subprocess timeout, every HTTP check a
timeout, and the run skips what is left once ``--deadline`` (900 s) is near. Results: a table on stdout and
``bench-results/router_overhead.json``; logs and the Lua script in ``bench-results/router_overhead/``.

The current result, its command, machine and limits: ``docs/benchmarks/router-overhead.md``.

    .venvs/dev/bin/python benchmarks/router_overhead.py [--quick] [--skip-peers] [--workers 2]
"""

# kvstack ships no py.typed marker, so mypy run on this file alone would refuse its (typed) modules.
# mypy: disable-error-code="import-untyped"
from __future__ import annotations

import argparse
import re
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from machine_info import machine
from peers import ensure_peers, ensure_wrk
from procs import DEV_BIN, KVSTACK, REPO, Group
from results import write_json
from rich.console import Console
from router_overhead_report import results_table, rounds_table, runs_table, summarize, targets_verdict
from router_overhead_targets import (
    Target,
    kvstack_target,
    latency_rounds,
    measure_target,
    rss_soak,
    sglang_router_target,
    vllm_router_target,
)
from router_overhead_wrk import CHUNKS, LOW_CONNECTIONS, LUA_SCRIPT, MAX_CONNECTIONS, PLAIN_BODY, STREAM_BODY

BACKEND = Path(__file__).resolve().parent / "backend_zero.py"


# -- the run --------------------------------------------------------------------------------------
def run(args: argparse.Namespace, console: Console, out: dict[str, Any]) -> None:
    started = time.monotonic()

    def time_left() -> float:
        return float(args.deadline) - (time.monotonic() - started)

    wrk = ensure_wrk(console, not args.no_install)
    out["wrk"] = (
        subprocess.run([wrk, "--version"], capture_output=True, text=True).stdout.split("\n")[0].strip()
    )
    logs = args.results.parent / "router_overhead"
    logs.mkdir(parents=True, exist_ok=True)
    for old in logs.glob("*.log"):
        old.unlink()
    lua = logs / "load.lua"
    lua.write_text(
        LUA_SCRIPT.replace("__PLAIN__", PLAIN_BODY.decode()).replace("__STREAM__", STREAM_BODY.decode())
    )
    out["lua_script"] = str(lua)

    targets: list[Target | None] = [None, kvstack_target(1)]
    if args.workers > 1:
        targets.append(kvstack_target(args.workers))
    if not args.skip_peers:
        peers_python = ensure_peers(console, not args.no_install)
        targets += [
            vllm_router_target(peers_python, None),
            vllm_router_target(peers_python, "round_robin"),
            sglang_router_target(peers_python),
        ]

    backend_cmd = [str(DEV_BIN / "python"), str(BACKEND), "--port", "0", "--procs", str(args.backend_procs)]
    backend_cmd += ["--chunks", str(CHUNKS)]
    backend = Group.start("backend", [backend_cmd], logs / "backend.log")
    out["backend_command"] = shlex.join(backend_cmd)
    try:
        backend_url = _wait_banner(backend, r"backend_zero: (http://\S+)", 15)
        for target in targets:
            name = "direct" if target is None else target.name
            if time_left() < 60:
                console.print(f"[yellow]skipping {name}: run deadline near[/]")
                out["skipped"].append(name)
                continue
            measure_target(args, console, out, wrk, lua, logs, name, target, backend, backend_url)
        if args.latency_rounds and time_left() > 90:
            out["rounds"] = latency_rounds(
                args, console, wrk, lua, logs, targets, backend, backend_url, time_left
            )
        elif args.latency_rounds:
            out["skipped"].append("latency rounds")
        if args.rss_requests and time_left() > 40:
            console.print(f"memory: kvstack router, up to {args.rss_requests} requests ...")
            out["rss"] = rss_soak(
                wrk=wrk,
                lua=lua,
                backend_url=backend_url,
                logs=logs,
                requests=args.rss_requests,
                warmup=args.rss_warmup,
                stream_every=args.rss_stream_every,
                budget_s=min(args.rss_budget, time_left() - 25),
                console=console,
            )
        elif args.rss_requests:
            out["skipped"].append("rss")
    finally:
        backend.stop()


def _wait_banner(group: Group, pattern: str, budget_s: float) -> str:
    deadline = time.monotonic() + budget_s
    while time.monotonic() < deadline:
        m = re.search(pattern, group.log_text())
        if m:
            return m.group(1)
        if (why := group.exited()) is not None:
            raise RuntimeError(f"{group.name}: {why}\n{group.log_text()[-2000:]}")
        time.sleep(0.1)
    raise RuntimeError(f"{group.name}: no start-up banner after {budget_s:.0f}s\n{group.log_text()[-2000:]}")


# -- main ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="short runs and a 20k-request memory soak")
    parser.add_argument("--skip-peers", action="store_true", help="only direct and kvstack")
    parser.add_argument(
        "--no-install", action="store_true", help="fail instead of installing wrk or the peers"
    )
    parser.add_argument(
        "--workers", type=int, default=2, help="processes of the 'kvstack xW' target (1 = none)"
    )
    parser.add_argument("--backend-procs", type=int, default=2, help="backend_zero processes (SO_REUSEPORT)")
    parser.add_argument("--rate", type=float, default=500.0, help="offered req/s of the low-load plain runs")
    parser.add_argument("--stream-rate", type=float, default=100.0, help="offered req/s of low-load streams")
    parser.add_argument("--low-duration", type=float, default=10.0, help="seconds of each low-load run")
    parser.add_argument("--max-duration", type=float, default=8.0, help="seconds of each -c 64 run")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of warm-up before each run")
    parser.add_argument(
        "--latency-rounds", type=int, default=5, help="interleaved low-load rounds of every target (0 = none)"
    )
    parser.add_argument("--round-duration", type=float, default=6.0, help="seconds of each round's run")
    parser.add_argument("--rss-requests", type=int, default=200_000, help="memory soak length (0 = skip)")
    parser.add_argument("--rss-warmup", type=int, default=10_000, help="requests before the RSS baseline")
    parser.add_argument("--rss-stream-every", type=int, default=8, help="every Nth soak request streams")
    parser.add_argument("--rss-budget", type=float, default=240.0, help="seconds the memory soak may take")
    parser.add_argument("--deadline", type=float, default=900.0, help="seconds the whole run may take")
    parser.add_argument("--results", type=Path, default=REPO / "bench-results" / "router_overhead.json")
    args = parser.parse_args(argv)
    args.results = args.results.resolve()
    if args.quick:
        args.low_duration, args.max_duration, args.warmup = 4.0, 3.0, 1.0
        args.rss_requests, args.rss_warmup, args.rss_budget = 20_000, 2_000, 60.0
        args.latency_rounds, args.round_duration = min(args.latency_rounds, 2), 4.0
    console = Console() if sys.stdout.isatty() else Console(width=220)
    command = shlex.join([sys.executable, *sys.argv])
    console.print(f"command: {command}")
    if not KVSTACK.exists():
        raise SystemExit(f"{KVSTACK} not found: run `make dev` first")
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    args.results.parent.mkdir(parents=True, exist_ok=True)
    host, t0 = machine(), time.monotonic()
    console.print(
        f"machine: {host['cpus']} cores ({host['cpu_model']}), busy {host['busy_pct_before_start']:.0f}% "
        "before the run; wrk, the routers and the backend share these cores"
    )
    if host["busy_pct_before_start"] > 20:
        console.print(
            f"[yellow]the machine was {host['busy_pct_before_start']:.0f}% busy before the run (other "
            "processes): latencies and throughput will be skewed; see the machine busy% column[/]"
        )
    out: dict[str, Any] = {
        "targets": [],
        "runs": [],
        "skipped": [],
        "rss": None,
        "rounds": None,
        "stopped": None,
    }
    try:
        run(args, console, out)
    except KeyboardInterrupt:
        out["stopped"] = "interrupted; results are partial"
    except Exception as exc:  # keep and report what was measured before the failure
        out["stopped"] = f"run failed: {type(exc).__name__}: {exc}"
        console.print_exception()

    names = [t["name"] for t in out["targets"]]
    rows = summarize(out["runs"], names)
    verdict = targets_verdict(rows, args.rate, out["rounds"])
    console.print(runs_table(out["runs"]))
    console.print(results_table(rows, args.rate, args.stream_rate))
    if out["rounds"]:
        console.print(rounds_table(out["rounds"]))
    for t in out["targets"]:
        if t.get("failure") or t.get("failures") or t.get("responses_check", "ok") != "ok":
            console.print(
                f"[red]{t['name']}: {t.get('failure') or t.get('failures') or t['responses_check']}[/]"
            )
        if t.get("waits_before_runs_s"):
            console.print(
                f"{t['name']}: waited {t['waits_before_runs_s']} s before runs for it to serve again"
            )
    for name, v in verdict.items():
        console.print(f"targets, {name}: {v}")
    rss = out["rss"]
    if rss and rss.get("flat") is not None:
        console.print(
            f"memory, kvstack router: {rss['requests_done']} requests; RSS {rss['start_mb']} MB at "
            f"{rss['start_at_requests']} requests, {rss['end_mb']} MB at the end, max {rss['max_mb']} MB "
            f"({rss['max_vs_start_pct']:+.1f}%): {'flat' if rss['flat'] else 'NOT flat'} (+-10%)"
        )
    elif rss:
        console.print(f"[red]memory soak: {rss.get('failure', 'no samples')}[/]")
    report = {
        "command": command,
        "machine": host,
        "setup": {
            "backend": out.get("backend_command"),
            "wrk": out.get("wrk"),
            "lua_script": out.get("lua_script"),
            "plain_body": PLAIN_BODY.decode(),
            "stream_body": STREAM_BODY.decode(),
            "chunks_per_stream": CHUNKS,
            "low_load": {
                "connections": LOW_CONNECTIONS,
                "plain_rate": args.rate,
                "stream_rate": args.stream_rate,
            },
            "max_load": {"connections": MAX_CONNECTIONS},
            "durations_s": {"low": args.low_duration, "max": args.max_duration, "warmup": args.warmup},
        },
        "targets": out["targets"],
        "summary": rows,
        "verdict": verdict,
        "runs": out["runs"],
        "rss": rss,
        "latency_rounds": out["rounds"],
        "skipped": out["skipped"],
        "stopped": out["stopped"],
        "elapsed_s": round(time.monotonic() - t0, 1),
    }
    write_json(args.results, report)
    console.print(f"results: {args.results} ({report['elapsed_s']} s)")
    return 1 if out["stopped"] else 0


if __name__ == "__main__":
    sys.exit(main())
