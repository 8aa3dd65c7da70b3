"""What ``epp_transport.py`` runs and measures: the targets, one measured wrk run, and the capability probes.

A `Target` is one way a request reaches the zero-delay backend: Envoy + a trivial picker over one transport
(``grpcio``, ``lean``, ``http``; the picker answers the buffered body, or the headers when Envoy sends no
body), Envoy alone (wrk sets the destination header itself: Envoy's own cost), or ``kvstack router
--routing round-robin`` (the reference: kvstack's whole proxy). ``start`` runs its processes, each in its own
process group; ``measure`` runs wrk against it once and reads the CPU of the picker (or router) and of Envoy
from /proc, Envoy's ext_proc counters and the backend's request counts around the run. ``probe`` checks what
a transport supports with real Envoy: the dynamic metadata (the ORIGINAL_DST cluster routes by ``envoy.lb``
while the picker's header points nowhere) and a buffered body (Envoy refuses http_service with one).
"""

from __future__ import annotations

import contextlib
import http.client
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import epp_transport_envoy as envoy
from machine_info import machine_cpu_ticks
from procs import DEV_BIN, HOST, KVSTACK, REPO, Group, free_port, get
from router_overhead_wrk import PLAIN_BODY, backend_counts, children_cpu_seconds, post, run_wrk

PICKERS = Path(__file__).resolve().parent / "epp_transport_pickers.py"
WORKTREE = {"PYTHONPATH": str(REPO / "src")}  # the kvstack measured is this checkout's
NOWHERE = "127.0.0.1:1"  # the header's address in the metadata probe: a connection there is refused


@dataclass(frozen=True)
class Target:
    name: str
    transport: (
        str | None
    )  # grpcio | lean | http (a picker behind Envoy), "none" (Envoy alone), None (kvstack)
    route_on: str = "body"  # the ProcessingRequest the picker answers with the destination
    note: str = ""

    @property
    def body_mode(self) -> str:
        return "BUFFERED" if self.route_on == "body" else "NONE"


TARGETS = {
    t.name: t
    for t in (
        Target("grpcio", "grpcio", "body", "Envoy + grpcio aio picker, request body BUFFERED"),
        Target("lean", "lean", "body", "Envoy + kvstack.http.grpc_server picker, request body BUFFERED"),
        Target("http", "http", "headers", "Envoy http_service + kvstack HTTP/1.1 picker, headers only"),
        Target("lean headers", "lean", "headers", "Envoy + lean picker, headers only (as http_service)"),
        Target("envoy alone", "none", "headers", "Envoy, no ext_proc: wrk sends the destination header"),
        Target("kvstack", None, "body", "kvstack router --routing round-robin (the whole proxy)"),
    )
}


@dataclass
class Running:
    target: Target
    url: str
    picker: Group | None  # the picker, or kvstack's router
    envoy: Group | None
    admin: str | None = None

    def groups(self) -> list[Group]:
        return [g for g in (self.picker, self.envoy) if g is not None]

    def stop(self) -> None:
        for g in self.groups():
            g.stop()


def _slug(name: str) -> str:
    return name.replace(" ", "-")


def start_picker(
    target: Target, destination: str, logs: Path, header: str | None = None
) -> tuple[Group, int]:
    port = free_port()
    cmd = [str(DEV_BIN / "python"), str(PICKERS), "--transport", str(target.transport), "--port", str(port)]
    cmd += ["--destination", destination, "--route-on", target.route_on]
    if header:
        cmd += ["--header-destination", header]
    name = f"picker-{_slug(target.name)}" + ("-probe" if header else "")
    return Group.start(name, [cmd], logs / f"{name}.log", env=WORKTREE), port


def start(target: Target, destination: str, logs: Path) -> Running:
    """The target's processes against the backend at ``destination`` (host:port)."""
    if target.transport is None:
        port = free_port()
        cmd = [str(KVSTACK), "router", "--port", str(port), "--engine", f"http://{destination}"]
        cmd += ["--routing", "round-robin", "--log-level", "warning"]
        router = Group.start("kvstack", [cmd], logs / "kvstack.log", env=WORKTREE)
        return Running(target, f"http://{HOST}:{port}", router, None)
    picker, picker_port = (None, 0) if target.transport == "none" else start_picker(target, destination, logs)
    listen, admin = free_port(), free_port()
    config = envoy.bootstrap(listen, picker_port, target.transport, admin, request_body_mode=target.body_mode)
    proxy = envoy.start(f"envoy-{_slug(target.name)}", config, logs)
    return Running(target, f"http://{HOST}:{listen}", picker, proxy, f"http://{HOST}:{admin}")


def wait_serving(running: Running, budget_s: float, headers: dict[str, str]) -> str | None:
    """None once the target answered 10 completions in a row with 200; else the last answer."""
    deadline, good, last = time.monotonic() + budget_s, 0, "no answer"
    while time.monotonic() < deadline:
        for g in running.groups():
            if (why := g.exited()) is not None:
                return f"{why}\n{g.log_text()[-1500:]}"
        status, body = _post(running.url, headers)
        last = f"{status} {body[:200]!r}"
        good = good + 1 if status == 200 and b'"choices"' in body else 0
        if good >= 10:
            return None
        if status != 200:
            time.sleep(0.2)
    return last


def _post(url: str, headers: dict[str, str]) -> tuple[int, bytes]:
    if not headers:
        with contextlib.suppress(OSError, http.client.HTTPException):
            return post(url, PLAIN_BODY, timeout=3.0)
        return 0, b""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=3.0)
    try:
        conn.request("POST", "/v1/completions", PLAIN_BODY, {"Content-Type": "application/json", **headers})
        resp = conn.getresponse()
        return resp.status, resp.read()
    except (OSError, http.client.HTTPException):
        return 0, b""
    finally:
        conn.close()


_STAT = re.compile(r"^http\.ingress\.ext_proc\.(\w+): (\d+)$", re.M)


def ext_proc_stats(admin: str | None) -> dict[str, int]:
    if admin is None:
        return {}
    try:
        _, body = get(admin, "/stats?filter=ext_proc")
    except (OSError, http.client.HTTPException):
        return {}
    return {k: int(v) for k, v in _STAT.findall(body.decode())}


# -- one measured run --------------------------------------------------------------------------------
@dataclass
class Run:
    target: str
    round: int
    connections: int
    duration_s: float
    requests: int = 0
    ok_rps: float = 0.0
    p50_ms: float | None = None
    p99_ms: float | None = None
    errors: dict[str, int] = field(default_factory=dict)
    picker_cpu_us_per_req: float | None = None  # the picker, or kvstack's router
    envoy_cpu_us_per_req: float | None = None
    backend_cpu_us_per_req: float | None = None
    wrk_cpu_us_per_req: float | None = None
    machine_busy_pct: float = 0.0
    upstream_per_req: float | None = None  # backend completions per wrk request
    ext_proc_msgs_per_req: float | None = None  # ProcessingResponses Envoy received per request
    ext_proc_failures: dict[str, int] = field(default_factory=dict)
    command: str = ""
    failure: str | None = None


def measure(
    *,
    wrk: str,
    lua: Path,
    running: Running,
    backend: Group,
    backend_url: str,
    round_no: int,
    connections: int,
    duration_s: float,
    warmup_s: float,
    log: Path,
) -> Run:
    """A warm-up, then one wrk run at ``connections`` with every process's CPU read around it."""
    run = Run(running.target.name, round_no, connections, duration_s)
    warm, _, text = run_wrk(
        wrk, lua, running.url, mode="plain", connections=connections, duration_s=warmup_s, log=log
    )
    if warm is None:
        run.failure = f"warm-up failed: {text[-300:]}"
        return run
    picker, proxy = running.picker, running.envoy
    stats0, counts0 = ext_proc_stats(running.admin), backend_counts(backend_url)
    cpu0 = [g.cpu_seconds() if g else 0.0 for g in (picker, proxy, backend)]
    wrk0, (busy0, all0) = children_cpu_seconds(), machine_cpu_ticks()
    summary, run.command, text = run_wrk(
        wrk, lua, running.url, mode="plain", connections=connections, duration_s=duration_s, log=log
    )
    busy1, all1 = machine_cpu_ticks()
    cpu = [(g.cpu_seconds() if g else 0.0) - c0 for g, c0 in zip((picker, proxy, backend), cpu0, strict=True)]
    wrk_cpu = children_cpu_seconds() - wrk0
    stats1, counts1 = ext_proc_stats(running.admin), backend_counts(backend_url)
    run.machine_busy_pct = round(100 * (busy1 - busy0) / max(1, all1 - all0), 1)
    if summary is None:
        run.failure = f"no wrk summary: {text[-300:]}"
        return run
    n = run.requests = summary["requests"]
    seconds = summary["duration_us"] / 1e6
    run.ok_rps = round((n - summary["errors"]["status"]) / seconds, 1)
    run.p50_ms, run.p99_ms = summary["latency_us"]["p50"] / 1000, summary["latency_us"]["p99"] / 1000
    run.errors = {k: v for k, v in summary["errors"].items() if v}
    if not n:
        run.failure = "no requests completed"
        return run

    def per_request(seconds: float) -> float:
        return round(1e6 * seconds / n, 1)

    run.picker_cpu_us_per_req = per_request(cpu[0]) if picker else None
    run.envoy_cpu_us_per_req = per_request(cpu[1]) if proxy else None
    run.backend_cpu_us_per_req = per_request(cpu[2])
    run.wrk_cpu_us_per_req = per_request(wrk_cpu)
    done = counts1.get("POST /v1/completions", 0) - counts0.get("POST /v1/completions", 0)
    run.upstream_per_req = round(done / n, 3)
    if stats1:
        run.ext_proc_msgs_per_req = round(
            (stats1["stream_msgs_received"] - stats0["stream_msgs_received"]) / n, 3
        )
        for key in (
            "streams_failed",
            "message_timeouts",
            "failure_mode_allowed",
            "http_not_ok_resp_received",
        ):
            if delta := stats1.get(key, 0) - stats0.get(key, 0):
                run.ext_proc_failures[key] = delta
    return run


# -- what each transport supports ------------------------------------------------------------------------
def probe(target: Target, destination: str, logs: Path) -> dict[str, Any]:
    """With real Envoy: does the picker's dynamic metadata route (``envoy.lb``)? Is a buffered body
    accepted? (Header mutation routes every measured request already.)"""
    out: dict[str, Any] = {"transport": target.transport, "route_on": target.route_on}
    picker, port = start_picker(target, destination, logs, header=NOWHERE)
    listen, admin = free_port(), free_port()
    config = envoy.bootstrap(
        listen, port, str(target.transport), admin, request_body_mode=target.body_mode, route_by="metadata"
    )
    proxy = envoy.start(f"envoy-{_slug(target.name)}-probe", config, logs)
    running = Running(target, f"http://{HOST}:{listen}", picker, proxy, f"http://{HOST}:{admin}")
    try:
        problem = wait_serving(running, 15, {})
        out["dynamic_metadata_routes"] = problem is None
        if problem:
            out["dynamic_metadata_answer"] = problem[:300]
    finally:
        running.stop()
    if target.transport == "http":
        config = envoy.bootstrap(free_port(), port, "http", free_port(), allow_refused=True)
        refused = envoy.start("envoy-http-buffered-probe", config, logs)
        deadline = time.monotonic() + 10
        while refused.exited() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        exited = refused.exited()
        refused.stop()
        refusal = re.search(r"error `([^`]*)`", refused.log_text())
        out["buffered_body_accepted"] = exited is None
        out["buffered_body_refusal"] = refusal.group(1) if refusal else refused.log_text()[-300:]
    return out
