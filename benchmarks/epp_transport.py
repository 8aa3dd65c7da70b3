"""The floor of three transports between Envoy's ext_proc filter and an endpoint picker, side by side.

A TRIVIAL picker (a fixed answer: the zero-delay backend's address, as the header mutation
``x-gateway-destination-endpoint`` and the dynamic metadata ``envoy.lb``; ``epp_transport_pickers.py``)
behind real Envoy 1.40 (``.venvs/dev/bin/envoy``, ``--concurrency 1``, bootstrap from
``epp_transport_envoy.bootstrap``; the route goes to an ORIGINAL_DST cluster that connects to the header's
address), over:

- ``grpcio``: grpcio's asyncio server; request body BUFFERED (Envoy sends headers, then the whole body);
- ``lean``: ``kvstack.http.grpc_server``; body BUFFERED;
- ``http``: Envoy's ``http_service`` (work in progress in 1.40: each ProcessingRequest POSTed as JSON),
  served by ``kvstack.http.server``; headers only, since Envoy refuses a body mode with it;
- ``lean headers``: the lean server with headers only, the like-for-like comparison with ``http``;

and two references: ``envoy alone`` (no ext_proc; wrk sends the header: Envoy's own cost) and ``kvstack``
(``kvstack router --routing round-robin``: kvstack's whole HTTP/1.1 proxy). Every target runs at once (idle
but for its turn) against one backend (``backend_zero.py``); each of ``--rounds`` rounds measures every
target in a rotating order: wrk ``-c 64`` POSTs of a small ``/v1/completions`` JSON for ``--duration`` s
after ``--warmup`` s, with the CPU of the picker (or router), Envoy, the backend and wrk read from /proc
around the run, Envoy's ext_proc counters (ProcessingResponses per request, failures) and the backend's
request count (one completion per request). Results are medians over rounds and medians of per-round ratios
to ``grpcio`` (the machine is shared and noisy). Before the rounds, ``probe`` checks per transport, with
real Envoy, that the dynamic metadata routes and whether a buffered body is accepted.

Results: a table on stdout and ``bench-results/epp_transport.json``; logs, configs and the Lua script in
``bench-results/epp_transport/``. The current answer: ``docs/benchmarks/epp-transport.md``.

    .venvs/dev/bin/python benchmarks/epp_transport.py [--rounds 4] [--duration 5] [--targets grpcio,lean]
"""

# mypy: disable-error-code="import-untyped"
from __future__ import annotations

import argparse
import re
import resource
import shlex
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from epp_transport_envoy import ENVOY, HEADER
from epp_transport_report import summarize, table, verdict
from epp_transport_targets import TARGETS, Running, Target, measure, probe, start, wait_serving
from machine_info import machine
from peers import ensure_wrk
from procs import DEV_BIN, KVSTACK, REPO, Group
from results import git_state, write_json
from rich.console import Console
from router_overhead_wrk import LUA_SCRIPT, PLAIN_BODY, STREAM_BODY

BACKEND = Path(__file__).resolve().parent / "backend_zero.py"
PICKER_TARGET_US = 250.0  # the full picker's budget of CPU per request, scheduling included


def lua_scripts(logs: Path, destination: str) -> tuple[Path, Path]:
    """router_overhead's load script as is, and the same with the destination header (Envoy alone)."""
    text = LUA_SCRIPT.replace("__PLAIN__", PLAIN_BODY.decode()).replace("__STREAM__", STREAM_BODY.decode())
    plain, with_header = logs / "load.lua", logs / "load-header.lua"
    plain.write_text(text)
    with_header.write_text(text + f'wrk.headers["{HEADER}"] = "{destination}"\n')
    return plain, with_header


def run(args: argparse.Namespace, console: Console, out: dict[str, Any]) -> None:
    started = time.monotonic()
    wrk = ensure_wrk(console, not args.no_install)
    out["wrk"] = subprocess.run([wrk, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    out["envoy"] = subprocess.run([str(ENVOY), "--version"], capture_output=True, text=True).stdout.strip()
    logs = args.results.parent / "epp_transport"
    logs.mkdir(parents=True, exist_ok=True)
    for old in [*logs.glob("*.log"), *logs.glob("*.yaml")]:
        old.unlink()
    backend_cmd = [str(DEV_BIN / "python"), str(BACKEND), "--port", "0", "--procs", "1"]
    backend = Group.start("backend", [backend_cmd], logs / "backend.log")
    running: list[Running] = []
    try:
        backend_url = _wait_banner(backend, r"backend_zero: (http://\S+)", 15)
        destination = backend_url.removeprefix("http://")
        plain_lua, header_lua = lua_scripts(logs, destination)
        out["setup"] = {
            "backend": shlex.join(backend_cmd),
            "lua": str(plain_lua),
            "body": PLAIN_BODY.decode(),
        }
        targets = [TARGETS[name] for name in args.targets]
        for target in targets:
            running.append(start(target, destination, logs))
        for r in list(running):
            headers = {HEADER: destination} if r.target.transport == "none" else {}
            problem = wait_serving(r, 30, headers)
            info: dict[str, Any] = {"name": r.target.name, "note": r.target.note}
            info["commands"] = [shlex.join(c) for g in r.groups() for c in g.cmds]
            if problem:
                info["failure"] = f"not serving: {problem}"
                console.print(f"[red]{r.target.name}: not serving: {problem}[/]")
                r.stop()
                running.remove(r)
            out["targets"].append(info)
        if args.probe:
            probed: dict[str, Target] = {}  # per transport, its first target (the body-buffering one first)
            for t in targets:
                if t.transport not in (None, "none"):
                    probed.setdefault(str(t.transport), t)
            for transport, target in probed.items():
                console.print(f"probe: {transport} ({target.route_on}) ...")
                out["probes"][transport] = probe(target, destination, logs)
        log = logs / "wrk.log"
        for i in range(args.rounds):
            left = args.deadline - (time.monotonic() - started)
            if left < len(running) * (args.duration + args.warmup + 1.5) + 10:
                out["skipped"].append(f"rounds {i + 1}-{args.rounds}: run deadline near")
                break
            order = running[i % len(running) :] + running[: i % len(running)]
            console.print(f"round {i + 1}/{args.rounds}: {', '.join(r.target.name for r in order)}")
            for r in order:
                result = measure(
                    wrk=wrk,
                    lua=header_lua if r.target.transport == "none" else plain_lua,
                    running=r,
                    backend=backend,
                    backend_url=backend_url,
                    round_no=i + 1,
                    connections=args.connections,
                    duration_s=args.duration,
                    warmup_s=args.warmup,
                    log=log,
                )
                out["runs"].append(asdict(result))
                if result.failure or result.errors or result.ext_proc_failures:
                    failure = result.failure or result.errors or result.ext_proc_failures
                    console.print(f"[yellow]  {r.target.name}: {failure}[/]")
        for r in running:
            info = next(t for t in out["targets"] if t["name"] == r.target.name)
            info["log_tail"] = [g.log_text()[-600:] for g in r.groups()]
    finally:
        for r in running:
            r.stop()
        backend.stop()


def _wait_banner(group: Group, pattern: str, budget_s: float) -> str:
    deadline = time.monotonic() + budget_s
    while time.monotonic() < deadline:
        if m := re.search(pattern, group.log_text()):
            return m.group(1)
        if (why := group.exited()) is not None:
            raise RuntimeError(f"{group.name}: {why}\n{group.log_text()[-2000:]}")
        time.sleep(0.1)
    raise RuntimeError(f"{group.name}: no start-up banner after {budget_s:.0f}s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=4, help="rounds over every target")
    # wrk takes whole seconds only.
    parser.add_argument("--duration", type=int, default=5, help="seconds of each measured wrk run")
    parser.add_argument("--warmup", type=int, default=2, help="seconds of wrk before each measured run")
    parser.add_argument("--connections", type=int, default=64, help="wrk connections")
    parser.add_argument(
        "--targets", default=",".join(TARGETS), help=f"comma-separated, of: {', '.join(TARGETS)}"
    )
    parser.add_argument("--no-probe", dest="probe", action="store_false", help="skip the capability probes")
    parser.add_argument("--no-install", action="store_true", help="fail instead of installing wrk")
    parser.add_argument("--deadline", type=float, default=290.0, help="seconds the whole run may take")
    parser.add_argument("--results", type=Path, default=REPO / "bench-results" / "epp_transport.json")
    args = parser.parse_args(argv)
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if unknown := [t for t in args.targets if t not in TARGETS]:
        parser.error(f"unknown targets {unknown}; known: {', '.join(TARGETS)}")
    args.results = args.results.resolve()
    console = Console() if sys.stdout.isatty() else Console(width=200)
    command = shlex.join([sys.executable, *sys.argv])
    console.print(f"command: {command}")
    if not KVSTACK.exists() or not ENVOY.exists():
        raise SystemExit(f"{KVSTACK} or {ENVOY} not found: run `make dev` first")
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    host, t0 = machine(), time.monotonic()
    console.print(
        f"machine: {host['cpus']} cores ({host['cpu_model']}), busy {host['busy_pct_before_start']:.0f}% "
        "before the run; wrk, Envoy, the pickers and the backend share these cores"
    )
    out: dict[str, Any] = {"targets": [], "probes": {}, "runs": [], "skipped": [], "stopped": None}
    try:
        run(args, console, out)
    except KeyboardInterrupt:
        out["stopped"] = "interrupted; results are partial"
    except Exception as exc:  # keep and report what was measured before the failure
        out["stopped"] = f"run failed: {type(exc).__name__}: {exc}"
        console.print_exception()
    names = [t.name for t in (TARGETS[n] for n in args.targets)]
    rows = summarize(out["runs"], names)
    console.print(table(rows))
    for transport, p in out["probes"].items():
        console.print(f"probe {transport}: {p}")
    decided = verdict(rows, PICKER_TARGET_US)
    console.print(f"verdict: {decided}")
    report = {
        "command": command,
        "machine": host,
        "git": git_state(),
        "envoy": out.get("envoy"),
        "wrk": out.get("wrk"),
        "setup": {
            **out.get("setup", {}),
            "connections": args.connections,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "rounds": args.rounds,
            "envoy_concurrency": 1,
        },
        "targets": out["targets"],
        "probes": out["probes"],
        "summary": rows,
        "verdict": decided,
        "runs": out["runs"],
        "skipped": out["skipped"],
        "stopped": out["stopped"],
        "elapsed_s": round(time.monotonic() - t0, 1),
    }
    write_json(args.results, report)
    console.print(f"results: {args.results} ({report['elapsed_s']} s)")
    return 1 if out["stopped"] else 0


if __name__ == "__main__":
    sys.exit(main())
