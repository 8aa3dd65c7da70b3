"""Router overhead against a zero-delay backend: kvstack router, Rust routers, Envoy with kvstack's picker.

One run, one backend (``backend_zero.py``, ``--backend-procs`` processes on one port) and every target in turn
on free 127.0.0.1 ports, each command in its own process group: ``direct`` (wrk to the backend, the floor),
``kvstack`` and ``kvstack xW`` (``kvstack router`` with its defaults, one worker per usable core, and
with ``--workers W``, default 1), ``vllm-router`` (default and ``rr``
policy) and ``sglang-router`` from ``.venvs/peers`` (``peers.py``; installed only when chosen), and
``envoy+kvstack-epp`` (``... cN``: Envoy ``--concurrency N`` asking one ``kvstack epp``;
``router_overhead_envoy.py``). ``--targets`` runs a subset (direct always runs).

Per target, plain and 64-chunk streamed completions: wrk ``-c 4`` at ``--rate``/``--stream-rate`` (added
latency = target - direct) and ``-c 64`` (2xx requests/s), with CPU per request from ``/proc`` (per process
for Envoy and its picker). Then interleaved latency rounds (every target at 500 req/s in rotating order, the
machine's idle-timer lag first) and, with ``kvstack`` chosen, a ``--rss-requests`` memory soak. Every run is
bounded (``-d``, timeouts, ``--deadline``). Results: tables on stdout, ``bench-results/router_overhead.json``,
logs in ``bench-results/router_overhead/``; what each number means and the current result:
``docs/benchmarks/router-overhead.md``.

    .venvs/dev/bin/python benchmarks/router_overhead.py [--quick] [--skip-peers] [--workers 1]
        [--targets kvstack,vllm-router-rr,envoy+kvstack-epp] [--envoy-concurrency 1,2] [--epp-transport T]
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from machine_info import machine
from peers import ensure_peers, ensure_wrk
from procs import DEV_BIN, KVSTACK, REPO, Group, kvstack_build_env
from results import write_json
from rich.console import Console
from router_overhead_envoy import envoy_target, envoy_version, picker_transport
from router_overhead_report import (
    envoy_table,
    envoy_verdict,
    results_table,
    rounds_table,
    runs_table,
    summarize,
    targets_verdict,
)
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

    targets: list[Target | None] = [None, *chosen_targets(args, console)]
    out["target_keys"] = [t.key for t in targets if t is not None]
    out["kvstack_build"] = args.build
    if any(t is not None and t.processes for t in targets):
        out["envoy"] = {"version": envoy_version(), "epp_transport": args.epp_transport}

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
        if args.rss_requests and "kvstack" not in out["target_keys"]:
            out["skipped"].append("rss (kvstack not among --targets)")
        elif args.rss_requests and time_left() > 40:
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
                env=args.build_env,
            )
        elif args.rss_requests:
            out["skipped"].append("rss")
    finally:
        backend.stop()


PEER_KEYS = ("vllm-router", "vllm-router-rr", "sglang-router")


def chosen_targets(args: argparse.Namespace, console: Console) -> list[Target]:
    """The targets ``--targets`` names (default: every one the other flags allow), in run order; the peers
    are installed only when one of them is chosen."""
    makers: dict[str, Callable[[Path], Target]] = {
        "kvstack": lambda _: kvstack_target(None, args.build_env),
        f"kvstack-x{args.workers}": lambda _: kvstack_target(args.workers, args.build_env),
    }
    if not args.skip_peers:
        makers["vllm-router"] = lambda peers: vllm_router_target(peers, None)
        makers["vllm-router-rr"] = lambda peers: vllm_router_target(peers, "round_robin")
        makers["sglang-router"] = sglang_router_target
    envoys = {t.key: t for t in (envoy_target(c, args.epp_transport) for c in args.envoy_concurrency)}
    keys = [*makers, *envoys]
    if args.targets is not None:
        unknown = [k for k in args.targets if k not in keys and k != "direct"]
        if unknown:
            raise SystemExit(
                f"--targets: no target {', '.join(unknown)} in this run; choose from {','.join(keys)}"
            )
        keys = [k for k in keys if k in args.targets]
    peers = ensure_peers(console, not args.no_install) if set(keys) & set(PEER_KEYS) else Path()
    return [envoys[k] if k in envoys else makers[k](peers) for k in keys]


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
        "--workers", type=int, default=1, help="--workers of the 'kvstack xW' target ('kvstack': the default)"
    )
    parser.add_argument(
        "--targets",
        type=lambda text: [k.strip() for k in text.split(",") if k.strip()],
        default=None,
        help="comma-separated subset: kvstack, kvstack-xW, vllm-router, vllm-router-rr, sglang-router, "
        "envoy+kvstack-epp, envoy+kvstack-epp-cN (default all; direct always runs)",
    )
    parser.add_argument(
        "--envoy-concurrency",
        type=lambda text: [int(c) for c in text.split(",")],
        default=[1, 2],
        help="Envoy --concurrency of each envoy+kvstack-epp target (comma-separated; default 1,2)",
    )
    parser.add_argument(
        "--epp-transport",
        default=None,
        help="kvstack epp --transport of the Envoy targets (default: kvstack epp's default)",
    )
    parser.add_argument(
        "--build",
        choices=["compiled", "source"],
        default="compiled",
        help="the kvstack router run: as `pip install .` builds it (default, `make compiled`) or the sources",
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
    parser.add_argument("--deadline", type=float, default=1200.0, help="seconds the whole run may take")
    parser.add_argument("--results", type=Path, default=REPO / "bench-results" / "router_overhead.json")
    args = parser.parse_args(argv)
    args.results = args.results.resolve()
    args.epp_transport = picker_transport(args.epp_transport)
    args.build_env = kvstack_build_env(args.build)
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
    envoy = envoy_verdict(rows, args.rate, out["rounds"])
    verdict.update(envoy)
    console.print(runs_table(out["runs"]))
    console.print(results_table(rows, args.rate, args.stream_rate))
    if out["rounds"]:
        console.print(rounds_table(out["rounds"]))
    if any(name.startswith("envoy") for name in names):
        console.print(envoy_table(rows, args.rate, envoy, out["rounds"]))
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
            "kvstack_build": out.get("kvstack_build"),
            "wrk": out.get("wrk"),
            "envoy": out.get("envoy"),
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
