"""The routers of the KV-aware routing experiment: their commands, when each is ready, what it says after.

A `Target` turns a `Launch` (the engines' URLs, its ports, a directory for its files) into one command per
process group: ``kvstack router`` with a routing preset or YAML, the oracle (``oracle_router.py``),
vllm-router / sglang-router from ``.venvs/peers`` with ``--policy cache_aware``, or real Envoy in front of
``kvstack epp`` (its bootstrap from `kvstack.epp.envoy_config`, the engines listed). ``wait_ready`` waits
until the router lists the model and, for kvstack's router and picker, has fresh metrics (and KV events
when its policy needs them) for every engine, and Envoy's admin says ready. ``engine_extras`` and
``router_extras`` read the counters the bench library does not.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peers import PEER_VERSIONS, peer_router_command
from procs import DEV_BIN, HOST, KVSTACK, Group, engines_not_ready, get

from kvstack.epp.envoy_config import EnvoyOptions, bootstrap, render

MODEL = "tiny"
ORACLE = Path(__file__).resolve().parent / "oracle_router.py"


# -- targets (routers) ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Launch:
    """Where a target's processes listen, what they route to, where they may write."""

    engines: list[str]
    port: int  # the OpenAI port the load goes to
    metrics_port: int  # the Rust routers' Prometheus; the picker's HTTP (/engines, /metrics, /ready)
    admin_port: int  # Envoy's admin
    grpc_port: int  # the picker's ext_proc
    workdir: Path  # files a target writes (Envoy's bootstrap)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"


@dataclass
class Target:
    name: str
    kind: str  # kvstack | oracle | envoy | vllm-router | sglang-router
    note: str
    commands: Callable[[Launch], list[list[str]]]  # one argv per process group
    needs_kv_events: bool = False

    def state_url(self, launch: Launch) -> str | None:
        """Where kvstack's /engines and kvstack_ metrics are: the router itself, or Envoy's picker."""
        if self.kind in ("kvstack", "oracle"):
            return launch.url
        return f"http://{HOST}:{launch.metrics_port}" if self.kind == "envoy" else None


def kvstack_target(name: str, routing: str, model_dir: Path, *, kv_events: bool, note: str) -> Target:
    def commands(launch: Launch) -> list[list[str]]:
        cmd = [str(KVSTACK), "router", "--host", HOST, "--port", str(launch.port)]
        for url in launch.engines:
            cmd += ["--engine", url]
        cmd += ["--routing", routing, "--tokenizer", str(model_dir), "--log-level", "warning"]
        return [cmd + ([] if kv_events else ["--no-kv-events"])]

    return Target(name, "kvstack", note, commands, needs_kv_events=kv_events)


def envoy_target(name: str, routing: str, model_dir: Path) -> Target:
    """Real Envoy (one worker thread) asking ``kvstack epp --routing ROUTING`` (KV events from the engines),
    on the bootstrap `kvstack up --front-end envoy` uses: the engines listed, so Envoy's retries walk the
    picker's fallbacks; the served address comes back as ``x-gateway-destination-endpoint-served``."""

    def commands(launch: Launch) -> list[list[str]]:
        picker = [str(KVSTACK), "epp", "--host", HOST, "--grpc-port", str(launch.grpc_port)]
        picker += ["--http-port", str(launch.metrics_port)]
        for url in launch.engines:
            picker += ["--engine", url]
        picker += ["--routing", routing, "--tokenizer", str(model_dir), "--log-level", "warning"]
        options = EnvoyOptions(
            pickers=(f"{HOST}:{launch.grpc_port}",),
            engines=tuple(url.removeprefix("http://") for url in launch.engines),
            listen_host=HOST,
            listen_port=launch.port,
            admin_host=HOST,
            admin_port=launch.admin_port,
        )
        config = launch.workdir / f"envoy-{launch.port}.yaml"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(render(bootstrap(options)))
        envoy = [str(DEV_BIN / "envoy"), "-c", str(config), "--disable-hot-restart", "--concurrency", "1"]
        return [picker, [*envoy, "--log-level", "warning"]]

    note = f"Envoy {_envoy_version()} + kvstack epp --routing {routing} (KV events)"
    return Target(name, "envoy", note, commands, needs_kv_events=True)


def oracle_target(name: str, routing: str, model_dir: Path) -> Target:
    def commands(launch: Launch) -> list[list[str]]:
        cmd = [str(DEV_BIN / "python"), str(ORACLE), "--host", HOST, "--port", str(launch.port)]
        for url in launch.engines:
            cmd += ["--engine", url]
        return [[*cmd, "--tokenizer", str(model_dir), "--routing", routing]]

    note = f"kvstack router, {routing} load policy, prefix knowledge from POST /admin/prefix_match"
    return Target(name, "oracle", note, commands)


def peer_target(kind: str, peers_python: Path, extra: list[str]) -> Target:
    """vllm-router or sglang-router, policy cache_aware (their default), plus ``extra`` arguments (for
    sensitivity runs, e.g. ``--cache-threshold 0.5``; the name then shows them)."""

    def commands(launch: Launch) -> list[list[str]]:
        cmd = peer_router_command(kind, peers_python, HOST, launch.port, launch.metrics_port, launch.engines)
        return [[*cmd, "--policy", "cache_aware", *extra]]

    version = PEER_VERSIONS[kind]
    name = kind + (f" [{' '.join(extra)}]" if extra else "")
    return Target(name, kind, f"{kind} {version}, --policy cache_aware (default) {' '.join(extra)}", commands)


def _envoy_version() -> str:
    """Envoy's version, as ``envoy --version`` prints it (e.g. 1.40.0)."""
    try:
        out = subprocess.run(
            [str(DEV_BIN / "envoy"), "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except OSError:
        return "(not found)"
    found = re.search(r"/(\d+\.\d+\.\d+)/", out)
    return found.group(1) if found else "(unknown version)"


# -- waiting for things ---------------------------------------------------------------------------
def _json(url: str, path: str, timeout: float = 2.0) -> Any:
    status, body = get(url, path, timeout=timeout)
    if status != 200:
        raise ValueError(f"GET {path}: HTTP {status}")
    return json.loads(body)


def not_ready(target: Target, launch: Launch) -> str | None:
    """None when ``target`` is ready to route to all of ``launch``'s engines; else what it still lacks."""
    n = len(launch.engines)
    try:
        if target.kind == "envoy":
            admin = f"http://{HOST}:{launch.admin_port}"
            status, body = get(admin, "/ready")
            if status != 200:
                return f"Envoy admin /ready: HTTP {status} {body[:40]!r}"
            # The picker cluster's health check: until it passes, Envoy answers 503 "no healthy upstream".
            status, body = get(admin, "/clusters")
            if f"picker::{HOST}:{launch.grpc_port}::health_flags::healthy".encode() not in body:
                return "Envoy's health check has not found the picker serving yet"
        if (state_url := target.state_url(launch)) is not None:
            states = _json(state_url, "/engines")["engines"]
            if (why := engines_not_ready(states, n, kv_events=target.needs_kv_events)) is not None:
                return why
        # Through the front end (for Envoy: headers-only through the picker).
        models = [m.get("id") for m in _json(launch.url, "/v1/models").get("data", [])]
        if target.kind == "sglang-router":
            # It lists the model as "unknown" (no model_path from the sim); its gauge tells worker health.
            status, body = get(f"http://{HOST}:{launch.metrics_port}", "/metrics")
            healthy = len(re.findall(rb"^smg_worker_health\{[^}]*\} 1\b", body, re.M)) if status == 200 else 0
            return None if healthy >= n else f"{healthy}/{n} workers healthy"
        return None if MODEL in models else f"/v1/models lists {models}"
    except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"


def wait_ready(target: Target, launch: Launch, group: Group, budget_s: float) -> float:
    t0 = time.monotonic()
    why: str | None = "not asked yet"
    while time.monotonic() - t0 < budget_s:
        if (gone := group.exited()) is not None:
            raise RuntimeError(f"{target.name}: {gone}\n{group.log_text()[-2000:]}")
        why = not_ready(target, launch)
        if why is None:
            return time.monotonic() - t0
        time.sleep(0.2)
    raise RuntimeError(f"{target.name}: not ready after {budget_s:.0f}s: {why}\n{group.log_text()[-2000:]}")


# -- reading state after a run --------------------------------------------------------------------
def _metric_lines(url: str, pattern: str) -> list[str]:
    """Sample lines of a Prometheus text page whose name matches ``pattern`` (no comments, no buckets)."""
    try:
        status, body = get(url, "/metrics", timeout=3.0)
    except (OSError, http.client.HTTPException):
        return []
    if status != 200:
        return []
    rx = re.compile(pattern)
    return [
        line
        for line in body.decode(errors="replace").splitlines()
        if line and not line.startswith("#") and "_bucket" not in line and rx.search(line.split("{")[0])
    ]


def _sum_metric(lines: list[str], name: str) -> float | None:
    values = [float(line.rsplit(" ", 1)[1]) for line in lines if line.split("{")[0].split(" ")[0] == name]
    return sum(values) if values else None


def engine_extras(engines: list[str]) -> list[dict[str, Any]]:
    """Per engine, counters the bench library does not read: preemptions (KV pressure)."""
    out = []
    for url in engines:
        lines = _metric_lines(url, r"^vllm:(num_preemptions|prompt_tokens|generation_tokens)_total$")
        out.append(
            {
                "url": url,
                "preemptions": _sum_metric(lines, "vllm:num_preemptions_total"),
                "prompt_tokens": _sum_metric(lines, "vllm:prompt_tokens_total"),
            }
        )
    return out


def router_extras(target: Target, launch: Launch, envoy_before: dict[str, int]) -> dict[str, Any]:
    """What the router itself says after the run: kvstack's /engines and event counters (the router's, or
    the picker's behind Envoy, with Envoy's retry and ext_proc counters since ``envoy_before``), the peers'
    routing counters (vllm-router's render calls and prefix decisions, sglang-router's selections)."""
    if (state_url := target.state_url(launch)) is not None:
        out: dict[str, Any] = {
            "metrics": _metric_lines(
                state_url,
                r"^kvstack_(kv_event|prefix_index|router_routing_decisions|router_retries|router_up)",
            )
        }
        with contextlib.suppress(OSError, http.client.HTTPException, ValueError):
            out["engines"] = _json(state_url, "/engines")["engines"]
        if target.kind == "envoy":
            out["envoy_stats"] = {k: v - envoy_before.get(k, 0) for k, v in envoy_stats(launch).items()}
        return out
    pattern = {
        "vllm-router": r"^vllm_router_(kv_routing_inputs|prefix_routing_decisions|policy_decisions|"
        r"processed_requests|requests)_total$",
        "sglang-router": r"^smg_(worker_selection|router_requests|router_upstream_responses|http_responses)",
    }[target.kind]
    return {"metrics": _metric_lines(f"http://{HOST}:{launch.metrics_port}", pattern)}


_ENVOY_STATS = (
    r"^(cluster\.engines\.upstream_rq_(total|retry|retry_success|[2-5]xx|timeout)"
    r"|cluster\.engines\.upstream_cx_connect_fail|http\.openai\.ext_proc\..*)$"
)


def envoy_stats(launch: Launch) -> dict[str, int]:
    """Envoy's counters that tell whether requests went where the picker said: requests and retries to
    the engines, connect failures, and the ext_proc filter's streams, errors and message timeouts."""
    try:
        status, body = get(f"http://{HOST}:{launch.admin_port}", "/stats?format=json", timeout=3.0)
    except (OSError, http.client.HTTPException):
        return {}
    if status != 200:
        return {}
    rx = re.compile(_ENVOY_STATS)
    return {
        e["name"]: e["value"]
        for e in json.loads(body)["stats"]
        if "name" in e and isinstance(e.get("value"), int) and rx.match(e["name"])
    }
