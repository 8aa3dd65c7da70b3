"""The routers of the KV-aware routing experiment: their commands, when each is ready, what it says after.

A `Target` turns the engines' URLs and its ports into a command line: ``kvstack router`` with a routing
preset or YAML, the oracle (``oracle_router.py``), or vllm-router / sglang-router from ``.venvs/peers``
with ``--policy cache_aware``. ``wait_ready`` waits until the router lists the model and, for kvstack
routers, has fresh metrics (and KV events when its policy needs them) for every engine. ``engine_extras``
and ``router_extras`` read the counters the bench library does not.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peers import PEER_VERSIONS
from procs import DEV_BIN, HOST, KVSTACK, Group, engines_not_ready, get

MODEL = "tiny"
ORACLE = Path(__file__).resolve().parent / "oracle_router.py"


# -- targets (routers) ----------------------------------------------------------------------------
@dataclass
class Target:
    name: str
    kind: str  # kvstack | oracle | vllm-router | sglang-router
    note: str
    command: Callable[[list[str], int, int], list[str]]  # (engine urls, port, metrics port) -> argv
    needs_kv_events: bool = False


def kvstack_target(name: str, routing: str, model_dir: Path, *, kv_events: bool, note: str) -> Target:
    def command(engines: list[str], port: int, _metrics_port: int) -> list[str]:
        cmd = [str(KVSTACK), "router", "--host", HOST, "--port", str(port)]
        for url in engines:
            cmd += ["--engine", url]
        cmd += ["--routing", routing, "--tokenizer", str(model_dir), "--log-level", "warning"]
        return cmd + ([] if kv_events else ["--no-kv-events"])

    return Target(name, "kvstack", note, command, needs_kv_events=kv_events)


def oracle_target(name: str, routing: str, model_dir: Path) -> Target:
    def command(engines: list[str], port: int, _metrics_port: int) -> list[str]:
        cmd = [str(DEV_BIN / "python"), str(ORACLE), "--host", HOST, "--port", str(port)]
        for url in engines:
            cmd += ["--engine", url]
        return [*cmd, "--tokenizer", str(model_dir), "--routing", routing]

    note = f"kvstack router, {routing} load policy, prefix knowledge from POST /admin/prefix_match"
    return Target(name, "oracle", note, command)


def peer_target(kind: str, peers_python: Path, extra: list[str]) -> Target:
    """vllm-router or sglang-router, policy cache_aware (their default), plus ``extra`` arguments (for
    sensitivity runs, e.g. ``--cache-threshold 0.5``; the name then shows them)."""

    def command(engines: list[str], port: int, metrics_port: int) -> list[str]:
        if kind == "vllm-router":
            cmd, level = [str(peers_python.parent / "vllm-router")], "warning"
        else:
            cmd, level = [str(peers_python), "-m", "sglang_router.launch_router"], "warn"
        cmd += ["--host", HOST, "--port", str(port), "--worker-urls", *engines]
        cmd += ["--prometheus-host", HOST, "--prometheus-port", str(metrics_port)]
        return [*cmd, "--policy", "cache_aware", "--log-level", level, *extra]

    version = PEER_VERSIONS[kind]
    name = kind + (f" [{' '.join(extra)}]" if extra else "")
    return Target(name, kind, f"{kind} {version}, --policy cache_aware (default) {' '.join(extra)}", command)


# -- waiting for things ---------------------------------------------------------------------------
_ENGINE_LINE = re.compile(r"engine (\d+): (http://\S+?)/v1\b")


def wait_engines(group: Group, n: int, budget_s: float) -> list[str]:
    """The engine URLs the sim prints once all ``n`` serve."""
    deadline = time.monotonic() + budget_s
    while time.monotonic() < deadline:
        found = dict(_ENGINE_LINE.findall(group.log_text()))
        if len(found) >= n:
            return [found[str(i)] for i in range(n)]
        if (why := group.exited()) is not None:
            raise RuntimeError(f"sim: {why}\n{group.log_text()[-2000:]}")
        time.sleep(0.1)
    raise RuntimeError(f"sim: {n} engines not up after {budget_s:.0f}s\n{group.log_text()[-2000:]}")


def _json(url: str, path: str, timeout: float = 2.0) -> Any:
    status, body = get(url, path, timeout=timeout)
    if status != 200:
        raise ValueError(f"GET {path}: HTTP {status}")
    return json.loads(body)


def not_ready(target: Target, url: str, engines: list[str], metrics_port: int) -> str | None:
    """None when ``target`` at ``url`` is ready to route to all ``engines``; else what it still lacks."""
    try:
        models = [m.get("id") for m in _json(url, "/v1/models").get("data", [])]
        if target.kind == "sglang-router":
            # It lists the model as "unknown" (no model_path from the sim); its gauge tells worker health.
            status, body = get(f"http://{HOST}:{metrics_port}", "/metrics")
            healthy = len(re.findall(rb"^smg_worker_health\{[^}]*\} 1\b", body, re.M)) if status == 200 else 0
            return None if healthy >= len(engines) else f"{healthy}/{len(engines)} workers healthy"
        if MODEL not in models:
            return f"/v1/models lists {models}"
        if target.kind not in ("kvstack", "oracle"):
            return None
        states = _json(url, "/engines")["engines"]
        return engines_not_ready(states, len(engines), kv_events=target.needs_kv_events)
    except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"


def wait_ready(
    target: Target, url: str, group: Group, engines: list[str], metrics_port: int, budget_s: float
) -> float:
    t0 = time.monotonic()
    why: str | None = "not asked yet"
    while time.monotonic() - t0 < budget_s:
        if (gone := group.exited()) is not None:
            raise RuntimeError(f"{target.name}: {gone}\n{group.log_text()[-2000:]}")
        why = not_ready(target, url, engines, metrics_port)
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


def router_extras(target: Target, url: str, metrics_port: int) -> dict[str, Any]:
    """What the router itself says after the run: kvstack's /engines and event counters, the peers'
    routing counters (vllm-router's render calls and prefix decisions, sglang-router's selections)."""
    if target.kind in ("kvstack", "oracle"):
        out: dict[str, Any] = {
            "metrics": _metric_lines(
                url, r"^kvstack_(kv_event|prefix_index|router_routing_decisions|router_retries|router_up)"
            )
        }
        with contextlib.suppress(OSError, http.client.HTTPException, ValueError):
            out["engines"] = _json(url, "/engines")["engines"]
        return out
    pattern = {
        "vllm-router": r"^vllm_router_(kv_routing_inputs|prefix_routing_decisions|policy_decisions|"
        r"processed_requests|requests)_total$",
        "sglang-router": r"^smg_(worker_selection|router_requests|router_upstream_responses|http_responses)",
    }[target.kind]
    return {"metrics": _metric_lines(f"http://{HOST}:{metrics_port}", pattern)}
