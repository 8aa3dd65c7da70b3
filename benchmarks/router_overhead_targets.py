"""The routers measured, and what runs against each: its wrk runs, the interleaved rounds, the memory soak.

A `Target` starts its processes against the backend's URL and returns their group and its own URL:
kvstack router (default settings, or ``--workers W``), vllm-router (default policy or round-robin) and
sglang-router from ``.venvs/peers`` (Envoy with kvstack's picker: ``router_overhead_envoy.py``).
``measure_target`` runs the low-load and ``-c 64`` runs on one target;
``latency_rounds`` measures every target at the low plain rate in rotating rounds; ``rss_soak`` samples a
fresh kvstack router's RSS under a long mixed load.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from machine_info import timer_wakeup_lag
from procs import HOST, KVSTACK, OFFLINE, Group, free_port
from rich.console import Console
from router_overhead_wrk import (
    LOW_CONNECTIONS,
    MAX_CONNECTIONS,
    backend_counts,
    check_responses,
    measure,
    rss_bytes,
    wait_serving,
    wrk_command,
)

WAKEUP_PROBE_S = 3.0  # per interleaved round: machine_info.timer_wakeup_lag


# -- targets --------------------------------------------------------------------------------------
@dataclass
class Target:
    name: str
    start: Callable[[str, Path], tuple[Group, str]]  # (backend url, log dir) -> (processes, base url)
    note: str
    processes: tuple[str, ...] = ()  # names of the group's commands, in order, to report CPU per process

    @property
    def key(self) -> str:
        """The name ``--targets`` takes: spaces as hyphens."""
        return self.name.replace(" ", "-")


def kvstack_target(workers: int | None, env: dict[str, str]) -> Target:
    """kvstack router with its defaults (``workers`` None: ``--workers auto``, one per usable core) or
    ``--workers W``; ``env`` picks the build (procs.kvstack_build_env)."""

    def start(backend: str, logs: Path) -> tuple[Group, str]:
        port = free_port()
        args = ["router", "--port", str(port), "--engine", backend, "--log-level", "warning"]
        cmds = [[str(KVSTACK), *args, *([] if workers is None else ["--workers", str(workers)])]]
        name = "kvstack" if workers is None else f"kvstack-x{workers}"
        return Group.start(name, cmds, logs / f"{name}.log", env), f"http://{HOST}:{port}"

    if workers is None:
        cores = len(os.sched_getaffinity(0))
        return Target("kvstack", start, f"kvstack router, default settings (--workers auto: {cores} here)")
    return Target(
        f"kvstack x{workers}",
        start,
        f"kvstack router, default routing preset, --workers {workers} "
        + ("(one process)" if workers == 1 else "(processes on one port, SO_REUSEPORT)"),
    )


def vllm_router_target(peers_python: Path, policy: str | None) -> Target:
    def start(backend: str, logs: Path) -> tuple[Group, str]:
        port, prom = free_port(), free_port()
        cmd = [str(peers_python.parent / "vllm-router"), "--host", HOST, "--port", str(port)]
        cmd += ["--worker-urls", backend, "--prometheus-host", HOST, "--prometheus-port", str(prom)]
        cmd += ["--log-level", "warning"]
        if policy:
            cmd += ["--policy", policy]
        name = "vllm-router" + (f"-{policy}" if policy else "")
        return Group.start(name, [cmd], logs / f"{name}.log", env=OFFLINE), f"http://{HOST}:{port}"

    if policy is None:
        return Target("vllm-router", start, "vllm-router 0.1.17, default policy (cache_aware)")
    return Target("vllm-router rr", start, f"vllm-router 0.1.17, --policy {policy}")


def sglang_router_target(peers_python: Path) -> Target:
    def start(backend: str, logs: Path) -> tuple[Group, str]:
        port, prom = free_port(), free_port()
        cmd = [str(peers_python), "-m", "sglang_router.launch_router", "--host", HOST, "--port", str(port)]
        cmd += ["--worker-urls", backend, "--prometheus-host", HOST, "--prometheus-port", str(prom)]
        cmd += ["--log-level", "warn"]
        return Group.start(
            "sglang-router", [cmd], logs / "sglang-router.log", env=OFFLINE
        ), f"http://{HOST}:{port}"

    return Target("sglang-router", start, "sglang-router 0.3.2, default policy (cache_aware)")


# -- memory ---------------------------------------------------------------------------------------
def rss_soak(
    *,
    wrk: str,
    lua: Path,
    backend_url: str,
    logs: Path,
    requests: int,
    warmup: int,
    stream_every: int,
    budget_s: float,
    console: Console,
    env: dict[str, str],
) -> dict[str, Any]:
    """A fresh one-process kvstack router under wrk -c 64 until ``requests`` reached it; RSS sampled."""
    group, url = kvstack_target(1, env).start(backend_url, logs)  # one process: its RSS
    out: dict[str, Any] = {"command": shlex.join(group.cmds[0]), "samples": []}
    wrk_proc: subprocess.Popen[bytes] | None = None
    try:
        ok, _, last = wait_serving(url, group, 20)
        if not ok:
            out["failure"] = f"router not serving: {last}"
            return out
        pid = group.procs[0].pid
        out["rss_before_traffic_mb"] = round((rss_bytes(pid) or 0) / 2**20, 1)
        env = {"WRK_MODE": "mixed", "WRK_THINK_MS": "0", "WRK_STREAM_EVERY": str(stream_every)}
        cmd = wrk_command(wrk, lua, url, MAX_CONNECTIONS, budget_s)
        out["wrk_command"] = " ".join(f"{k}={v}" for k, v in env.items()) + " " + shlex.join(cmd)
        base = backend_counts(backend_url).get("POST /v1/completions", 0)
        with (logs / "rss-wrk.log").open("wb") as log:
            wrk_proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}, cwd=str(lua.parent)
            )
        t0 = time.monotonic()
        next_report = 0
        while wrk_proc.poll() is None and time.monotonic() - t0 < budget_s + 5:
            time.sleep(0.5)
            done = backend_counts(backend_url).get("POST /v1/completions", 0) - base
            rss = rss_bytes(pid)
            if rss is None:
                out["failure"] = "router exited during the soak"
                break
            out["samples"].append(
                {"t_s": round(time.monotonic() - t0, 1), "requests": done, "rss_mb": round(rss / 2**20, 2)}
            )
            if done >= next_report:
                console.print(f"  rss soak: {done} requests, RSS {rss / 2**20:.1f} MB")
                next_report += 25_000
            if done >= requests:
                break
        if wrk_proc.poll() is None:
            wrk_proc.send_signal(signal.SIGINT)  # wrk prints its summary on SIGINT
            try:
                wrk_proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                wrk_proc.kill()
                wrk_proc.wait(timeout=5)
        out["elapsed_s"] = round(time.monotonic() - t0, 1)
        out["log_errors"] = _count_tracebacks(group.log_text())
    finally:
        if wrk_proc is not None and wrk_proc.poll() is None:
            wrk_proc.kill()
            wrk_proc.wait(timeout=5)
        group.stop()
    return summarize_rss(out, requests, warmup)


def summarize_rss(out: dict[str, Any], requests: int, warmup: int) -> dict[str, Any]:
    """Start (first sample at or after ``warmup`` requests), end, max; flat = all within +-10% of start."""
    samples = out["samples"]
    after = [s for s in samples if s["requests"] >= warmup]
    out["target_requests"] = requests
    out["requests_done"] = samples[-1]["requests"] if samples else 0
    if not after:
        out["flat"] = None
        return out
    start, end = after[0]["rss_mb"], after[-1]["rss_mb"]
    peak = max(s["rss_mb"] for s in after)
    low = min(s["rss_mb"] for s in after)
    out.update(
        start_mb=start,
        start_at_requests=after[0]["requests"],
        end_mb=end,
        max_mb=peak,
        min_mb=low,
        end_vs_start_pct=round(100 * (end - start) / start, 1),
        max_vs_start_pct=round(100 * (peak - start) / start, 1),
        flat=bool(peak <= 1.1 * start and low >= 0.9 * start),
    )
    return out


def _count_tracebacks(text: str) -> dict[str, int]:
    """'Error handling request' tracebacks in a kvstack log, by final exception line."""
    counts: dict[str, int] = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Traceback"):
            j = i + 1
            while j < len(lines) and (lines[j].startswith(" ") or not lines[j]):
                j += 1
            if j < len(lines):
                key = lines[j][:160]
                counts[key] = counts.get(key, 0) + 1
    return counts


# -- runs per target --------------------------------------------------------------------------------
def measure_target(
    args: argparse.Namespace,
    console: Console,
    out: dict[str, Any],
    wrk: str,
    lua: Path,
    logs: Path,
    name: str,
    target: Target | None,
    backend: Group,
    backend_url: str,
) -> None:
    info: dict[str, Any] = {
        "name": name,
        "note": "wrk straight to the backend" if target is None else target.note,
    }
    out["targets"].append(info)
    group: Group | None = None
    url = backend_url
    try:
        if target is not None:
            group, url = target.start(backend_url, logs)
            info["commands"] = [shlex.join(c) for c in group.cmds]
            ok, waited, last = wait_serving(url, group, 30)
            info["startup_s"] = round(waited, 1)
            if not ok:
                info["failure"] = f"not serving after {waited:.0f}s: {last}\n{group.log_text()[-1500:]}"
                console.print(f"[red]{name}: {info['failure']}[/]")
                return
        problem = check_responses(url)
        info["responses_check"] = problem or "ok"
        if problem:
            console.print(f"[red]{name}: response check failed: {problem}[/]")
        log = logs / f"wrk-{name.replace(' ', '-')}.log"
        plan = [
            ("plain", "low", LOW_CONNECTIONS, args.low_duration, args.rate),
            ("plain", "max", MAX_CONNECTIONS, args.max_duration, None),
            ("stream", "low", LOW_CONNECTIONS, args.low_duration, args.stream_rate),
            ("stream", "max", MAX_CONNECTIONS, args.max_duration, None),
        ]
        for kind, load, conns, duration, rate in plan:
            if group is not None:
                # A stream cut by the previous run's end may have opened kvstack's circuit (see docs).
                ok, waited, last = wait_serving(url, group, 15)
                if waited > 1:
                    info.setdefault("waits_before_runs_s", []).append(round(waited, 1))
                if not ok:
                    info.setdefault("failures", []).append(f"{kind}/{load}: not serving: {last}")
                    continue
            console.print(
                f"{name}: {kind} {f'{rate:g} req/s' if rate else 'max'} (-c {conns}, {duration:g} s) ..."
            )
            r = measure(
                wrk=wrk,
                lua=lua,
                target=name,
                url=url,
                group=group,
                backend=backend,
                backend_url=backend_url,
                kind=kind,
                load=load,
                connections=conns,
                duration_s=duration,
                rate=rate,
                warmup_s=args.warmup,
                log=log,
                processes=target.processes if target else (),
            )
            out["runs"].append(asdict(r))
            if r.failure or r.errors:
                console.print(f"[yellow]  {name} {kind}/{load}: {r.failure or r.errors}[/]")
        if group is not None:
            info["rss_mb_at_end"] = [round((rss_bytes(p) or 0) / 2**20, 1) for p in group.pids()]
            info["log_errors"] = _count_tracebacks(group.log_text())
    finally:
        if group is not None:
            group.stop()


def latency_rounds(
    args: argparse.Namespace,
    console: Console,
    wrk: str,
    lua: Path,
    logs: Path,
    targets: Sequence[Target | None],
    backend: Group,
    backend_url: str,
    time_left: Callable[[], float],
) -> dict[str, Any]:
    """Added latency at the low plain rate, interleaved: every target runs at once (idle but for its
    turn) and each round measures direct and every target one after the other, in a rotating order, so
    that the machine's noise of a given minute falls on all of them. Added = target - direct of the same
    round; the median over rounds is what the verdict reads."""
    running: list[tuple[str, Group | None, str]] = [("direct", None, backend_url)]
    result: dict[str, Any] = {"rounds": [], "duration_s": args.round_duration, "rate": args.rate}
    try:
        for target in targets:
            if target is None:
                continue
            started, url = target.start(backend_url, logs)
            ok, _, last = wait_serving(url, started, 30)
            if not ok:
                console.print(f"[yellow]latency rounds: {target.name} not serving ({last}); left out[/]")
                started.stop()
                continue
            running.append((target.name, started, url))
        log = logs / "wrk-rounds.log"
        for i in range(args.latency_rounds):
            if time_left() < 30 + len(running) * (args.round_duration + args.warmup + 2):
                result["stopped_after_rounds"] = i
                break
            order = running[i % len(running) :] + running[: i % len(running)]
            console.print(f"latency round {i + 1}/{args.latency_rounds}: {', '.join(n for n, _, _ in order)}")
            # The machine's own wake-up lag this round, while every target idles: the floor under any tail.
            this_round: dict[str, Any] = {"timer_wakeup": timer_wakeup_lag(WAKEUP_PROBE_S)}
            for name, group, url in order:
                r = measure(
                    wrk=wrk,
                    lua=lua,
                    target=name,
                    url=url,
                    group=group,
                    backend=backend,
                    backend_url=backend_url,
                    kind="plain",
                    load=f"round{i + 1}",
                    connections=LOW_CONNECTIONS,
                    duration_s=args.round_duration,
                    rate=args.rate,
                    warmup_s=args.warmup,
                    log=log,
                )
                this_round[name] = {
                    "p50_ms": r.p50_ms,
                    "p99_ms": r.p99_ms,
                    "rps": r.rps,
                    "machine_busy_pct": r.machine_busy_pct,
                    "failure": r.failure,
                    "errors": r.errors,
                }
            result["rounds"].append(this_round)
    finally:
        for _, group, _ in running:
            if group is not None:
                group.stop()
    summary: dict[str, Any] = {}
    for name, _, _ in running[1:]:
        added50, added99 = [], []
        for rnd in result["rounds"]:
            mine, base = rnd.get(name), rnd.get("direct")
            if mine and base and not mine["failure"] and not base["failure"]:
                added50.append(round(mine["p50_ms"] - base["p50_ms"], 3))
                added99.append(round(mine["p99_ms"] - base["p99_ms"], 3))
        summary[name] = {
            "added_p50_ms_by_round": added50,
            "added_p99_ms_by_round": added99,
            "added_p50_ms_median": statistics.median(added50) if added50 else None,
            "added_p99_ms_median": statistics.median(added99) if added99 else None,
        }
    wake = [rnd["timer_wakeup"]["p99_ms"] for rnd in result["rounds"]]
    result["timer_wakeup_p99_ms_by_round"] = wake
    result["timer_wakeup_p99_ms_median"] = statistics.median(wake) if wake else None
    result["summary"] = summary
    return result
