"""KV-aware routing experiment: six routers, one seeded workload, fresh simulated engines for each.

Question (from the issue): with 4-8 engines whose KV capacity is smaller than the working set, how do
kvstack's routing policies compare with the Rust routers' ``cache_aware`` and with an oracle that knows
every engine's cache? Routers, each run alone against a FRESH ``kvstack sim --engines N`` process (empty
caches, counters from zero), on free 127.0.0.1 ports, each in its own process group (stopped by that id):

- ``kvstack kv-aware``: ``kvstack router --routing kv-aware`` (KV events from the sims' /kv_event_sources);
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
every engine, and kv-aware's shows ``routing_knowledge: kv-events`` and a connected subscriber for all.

Workload: ``MultiRoundQA`` (``kvstack.bench``), chat API, streaming, ``ignore_eos``, Poisson arrivals, the
same seed for every router. The number of users is odd on purpose: with U users a multiple of the
engine count, plain round-robin would send every round of a user to the same engine by accident.
Engine-side numbers (prefix-cache hit rate in tokens, finished requests per engine) come from the sims'
/metrics read before and after each run; the ``x-kvstack-engine`` header (kvstack only) and
``usage.prompt_tokens_details.cached_tokens`` (every router) give the per-request view.

Targets (for ``kvstack kv-aware``): hit rate >= 0.95 x the oracle's; TTFT p50 <= 0.5 x round-robin's;
hit rate >= 1.2 x and TTFT p90 below each Rust router's ``cache_aware``; max engine share <= 1.3 x mean.

Output: ``.cache/bench/kv_routing/<UTC timestamp>/``: ``results.json`` (everything), ``results.md`` (the
tables as markdown), per router a ``kvstack.bench`` report directory (requests.csv, summary.json, PNGs),
``compare/`` (``kvstack.bench.compare`` against round-robin), ``summary.png`` and ``logs/``.

    .venvs/dev/bin/python benchmarks/kv_routing.py            # ~7.5 min
    .venvs/dev/bin/python benchmarks/kv_routing.py --quick    # ~2 min smoke run
    .venvs/dev/bin/python benchmarks/kv_routing.py --kv-routing least-qps --routers kv-aware,oracle
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import math
import os
import random
import re
import resource
import shlex
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from machine_info import machine, machine_cpu_ticks
from rich.console import Console
from rich.table import Table
from router_overhead import _OFFLINE, DEV_BIN, KVSTACK, REPO, Group, ensure_peers, free_port, get

from kvstack.bench import BenchConfig, BenchResult, MultiRoundQA, compare, run_bench, write_report
from kvstack.bench.records import RequestRecord
from kvstack.bench.summary import percentile
from kvstack.bench.workloads import Conversation, words
from kvstack.engines.tokenizer import load_tokenizer

HOST = "127.0.0.1"
MODEL = "tiny"
ORACLE = Path(__file__).resolve().parent / "oracle_router.py"
OUT_ROOT = REPO / ".cache" / "bench" / "kv_routing"
ROUTERS = ("round-robin", "kv-aware", "prefix", "oracle", "vllm-router", "sglang-router")
BASELINE = "kvstack round-robin"
PEER_VERSIONS = {"vllm-router": "0.1.17", "sglang-router": "0.3.2"}
KV_AWARE = "kvstack kv-aware"

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


# -- settings -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    engines: int
    block_size: int
    num_gpu_blocks: int
    prefill_per_token: float
    max_num_seqs: int
    sim_seed: int
    users: int
    rounds: int
    system_prompt_len: int
    user_history_len: int
    question_len: int
    answer_len: int
    qps: float
    seed: int
    request_timeout: float

    def workload(self) -> MultiRoundQA:
        return MultiRoundQA(
            num_users=self.users,
            num_rounds=self.rounds,
            system_prompt_len=self.system_prompt_len,
            user_history_len=self.user_history_len,
            question_len=self.question_len,
            answer_len=self.answer_len,
            qps=self.qps,
            arrival="poisson",
            seed=self.seed,
        )

    def sim_command(self, model_dir: Path) -> list[str]:
        return [
            str(KVSTACK),
            "sim",
            "--engines",
            str(self.engines),
            "--port",
            "0",
            "--kv-events-port",
            "0",
            "--model",
            str(model_dir),
            "--served-model-name",
            MODEL,
            "--block-size",
            str(self.block_size),
            "--num-gpu-blocks",
            str(self.num_gpu_blocks),
            "--prefill-per-token",
            f"{self.prefill_per_token:g}",
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--enable-prompt-tokens-details",
            "--seed",
            str(self.sim_seed),
            "--log-level",
            "warning",
        ]


FULL = Settings(
    engines=4,
    block_size=16,
    num_gpu_blocks=900,
    prefill_per_token=0.0002,
    max_num_seqs=64,
    sim_seed=0,
    users=23,
    rounds=6,
    system_prompt_len=800,
    user_history_len=1600,
    question_len=20,
    answer_len=48,
    qps=2.0,
    seed=0,
    request_timeout=120.0,
)
QUICK = replace(FULL, users=9, rounds=4, num_gpu_blocks=450, qps=3.0)


def working_set(s: Settings, model_dir: Path) -> dict[str, Any]:
    """KV blocks the workload's conversations need at their last round (answers as random words), next to
    the capacity: shared system prompt once, each user's own context on top."""
    tok = load_tokenizer(str(model_dir))
    workload = s.workload()
    rng = random.Random(s.seed)

    def blocks(messages: list[dict[str, str]]) -> int:
        text = tok.render_chat(messages, add_generation_prompt=False)
        return len(tok.encode(text, add_special_tokens=False)) // s.block_size

    system = workload.system_prompt()
    shared = blocks([{"role": "system", "content": system}]) if system else 0
    conversations: dict[int, Conversation] = {}
    for turn in workload.turns():
        conv = conversations.setdefault(turn.session, Conversation(system=turn.system))
        conv.ask(turn.text)
        conv.answer(words(rng, s.answer_len))
    per_user = [blocks(c.messages()) for c in conversations.values()]
    total = shared + sum(n - shared for n in per_user)
    usable = s.num_gpu_blocks - 1  # block 0 is vLLM's null block
    return {
        "shared_system_prompt_blocks": shared,
        "blocks_per_user_at_last_round": round(sum(per_user) / len(per_user), 1),
        "working_set_blocks": total,
        "per_engine_blocks": usable,
        "aggregate_blocks": usable * s.engines,
        "per_engine_over_working_set": round(usable / total, 3),
        "aggregate_over_working_set": round(usable * s.engines / total, 3),
        "users_per_engine_that_fit": round((usable - shared) / (sum(per_user) / len(per_user) - shared), 1),
    }


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
        if len(states) < len(engines):
            return f"/engines lists {len(states)} engines"
        for s in states:
            if not s["metrics"] or s["metrics"]["stale"]:
                return f"{s['url']}: no fresh metrics yet"
            if target.needs_kv_events:
                events = s.get("kv_events") or {}
                if s["routing_knowledge"] != "kv-events" or not events.get("connected"):
                    return f"{s['url']}: knowledge {s['routing_knowledge']}, kv_events {events}"
    except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


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


# -- per-request analysis -------------------------------------------------------------------------
def request_view(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Cached-token ratio and TTFT by round (round 0 carries the user's whole history, later rounds only a
    question on top of a context the engine that served the previous round holds); for kvstack routers
    (x-kvstack-engine header) how often a later round went to the same engine as the round before, and
    how many users each engine got at round 0."""
    ok = [r for r in records if r.ok]
    out: dict[str, Any] = {}
    for label, rows in (("round0", [r for r in ok if r.round == 0]), ("later", [r for r in ok if r.round])):
        prompt = sum(r.prompt_tokens or 0 for r in rows if r.cached_tokens is not None)
        cached = sum(r.cached_tokens or 0 for r in rows if r.cached_tokens is not None)
        ttfts = [r.ttft for r in rows if r.ttft is not None]
        out[f"{label}_requests"] = len(rows)
        out[f"{label}_cached_ratio"] = cached / prompt if prompt else None
        out[f"{label}_ttft_p50_s"] = percentile(ttfts, 50)
        out[f"{label}_ttft_p90_s"] = percentile(ttfts, 90)
    by_key = {(r.session, r.round): r for r in records}
    same = later = 0
    for r in records:
        prev = by_key.get((r.session, r.round - 1))
        if r.round and r.engine and prev is not None and prev.engine:
            later += 1
            same += r.engine == prev.engine
    out["same_engine_as_previous_round"] = same / later if later else None
    firsts = Counter(r.engine for r in records if r.round == 0 and r.engine)
    out["users_per_engine"] = dict(sorted(firsts.items())) or None
    return out


# -- one router -----------------------------------------------------------------------------------
def run_target(
    target: Target, s: Settings, model_dir: Path, out_dir: Path, console: Console
) -> tuple[dict[str, Any], BenchResult | None]:
    logs = out_dir / "logs"
    slug = target.name.replace(" ", "-")
    info: dict[str, Any] = {"name": target.name, "kind": target.kind, "note": target.note}
    sim_cmd = s.sim_command(model_dir)
    sim = Group.start("sim", [sim_cmd], logs / f"sim-{slug}.log")
    router: Group | None = None
    result: BenchResult | None = None
    try:
        engines = wait_engines(sim, s.engines, 30)
        info["engines"] = engines
        port, metrics_port = free_port(), free_port()
        cmd = target.command(engines, port, metrics_port)
        info["command"] = shlex.join(cmd)
        env = _OFFLINE if target.kind in ("vllm-router", "sglang-router") else None
        router = Group.start(target.name, [cmd], logs / f"{slug}.log", env=env)
        url = f"http://{HOST}:{port}"
        info["startup_s"] = round(wait_ready(target, url, router, engines, metrics_port, 60), 1)
        config = BenchConfig(
            url=url,
            model=MODEL,
            workload=s.workload(),
            api="chat",
            max_concurrency=64,
            request_timeout=s.request_timeout,
            engine_metrics=tuple(engines),
            progress=console.is_terminal,
            label=target.name,
        )
        console.print(f"[bold]{target.name}[/]: {info['command']}")
        before = engine_extras(engines)
        cpu = (sim.cpu_seconds(), router.cpu_seconds(), _self_cpu())
        busy0, all0 = machine_cpu_ticks()
        t0 = time.monotonic()
        result = asyncio.run(run_bench(config))
        info["bench_wall_s"] = round(time.monotonic() - t0, 1)
        busy1, all1 = machine_cpu_ticks()
        info["machine_busy_pct"] = round(100 * (busy1 - busy0) / max(1, all1 - all0), 1)
        info["cpu_s"] = {
            "sim": round(sim.cpu_seconds() - cpu[0], 1),
            "router": round(router.cpu_seconds() - cpu[1], 1),
            "client": round(_self_cpu() - cpu[2], 1),
        }
        after = engine_extras(engines)
        info["engine_extras"] = [
            {
                "url": a["url"],
                "preemptions": None
                if a["preemptions"] is None or b["preemptions"] is None
                else a["preemptions"] - b["preemptions"],
            }
            for b, a in zip(before, after, strict=True)
        ]
        info["router"] = router_extras(target, url, metrics_port)
        info["requests"] = request_view(result.records)
        write_report(result, out_dir / slug)
    except Exception as exc:  # one router failing must not lose the others' results
        info["failure"] = f"{type(exc).__name__}: {exc}"
        console.print(f"[red]{target.name}: {info['failure']}[/]")
    finally:
        if router is not None:
            router.stop()
            info["router_log_tail"] = router.log_text()[-1500:]
        sim.stop()
    return info, result


def _self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# -- summary and targets --------------------------------------------------------------------------
def row_of(info: dict[str, Any], result: BenchResult | None) -> dict[str, Any]:
    row: dict[str, Any] = {"router": info["name"], "failure": info.get("failure")}
    if result is None:
        return row
    s = result.summary
    engine = s.get("engine") or {}
    shares = [e["load_share"] for e in engine.get("engines", [])]
    row.update(
        hit_rate=engine.get("prefix_hit_rate"),
        ttft_p50=s["ttft_s"]["p50"],
        ttft_p90=s["ttft_s"]["p90"],
        ttft_p99=s["ttft_s"]["p99"],
        itl_p50=s["itl_s"]["p50"],
        req_per_s=s["request_throughput"],
        out_tok_per_s=s["output_tokens_per_s"],
        ok=s["requests_ok"],
        sent=s["requests_sent"],
        errors=s["errors"],
        max_over_mean=engine.get("load_share_max_over_mean"),
        shares=shares,
        engine_hit_rates=[e["prefix_hit_rate"] for e in engine.get("engines", [])],
        preemptions=sum(e["preemptions"] or 0 for e in info.get("engine_extras", [])),
        machine_busy_pct=info.get("machine_busy_pct"),
        **{k: info["requests"][k] for k in ("later_cached_ratio", "same_engine_as_previous_round")},
    )
    return row


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def evaluate(rows: dict[str, dict[str, Any]], subject: str, oracle: str) -> list[dict[str, Any]]:
    """The issue's targets for ``subject`` (a kv-aware router) against the rows present."""
    kv = rows.get(subject, {})
    checks: list[dict[str, Any]] = []

    def check(name: str, value: float | None, ok: Callable[[float], bool], detail: str) -> None:
        checks.append(
            {"target": name, "value": value, "pass": None if value is None else ok(value), "detail": detail}
        )

    orc, rr = rows.get(oracle, {}), rows.get(BASELINE, {})
    check(
        "hit rate >= 0.95 x oracle's",
        _ratio(kv.get("hit_rate"), orc.get("hit_rate")),
        lambda v: v >= 0.95,
        f"{_pct(kv.get('hit_rate'))} vs {_pct(orc.get('hit_rate'))} ({oracle})",
    )
    check(
        "TTFT p50 <= 0.5 x round-robin's",
        _ratio(kv.get("ttft_p50"), rr.get("ttft_p50")),
        lambda v: v <= 0.5,
        f"{_ms(kv.get('ttft_p50'))} vs {_ms(rr.get('ttft_p50'))}",
    )
    for kind in PEER_VERSIONS:
        peer = next((n for n in rows if n.split(" [")[0] == kind), kind)
        p = rows.get(peer, {})
        check(
            f"hit rate >= 1.2 x {peer}'s",
            _ratio(kv.get("hit_rate"), p.get("hit_rate")),
            lambda v: v >= 1.2,
            f"{_pct(kv.get('hit_rate'))} vs {_pct(p.get('hit_rate'))}",
        )
        check(
            f"TTFT p90 below {peer}'s",
            _ratio(kv.get("ttft_p90"), p.get("ttft_p90")),
            lambda v: v < 1.0,
            f"{_ms(kv.get('ttft_p90'))} vs {_ms(p.get('ttft_p90'))}",
        )
    check(
        "max engine share <= 1.3 x mean",
        kv.get("max_over_mean"),
        lambda v: v <= 1.3,
        "shares " + ", ".join(_pct(x) for x in kv.get("shares") or []),
    )
    return checks


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:.0f}"


def _num(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


COLUMNS = (
    "router",
    "hit rate",
    "later rounds cached",
    "same engine as prev. round",
    "TTFT p50 ms",
    "TTFT p90 ms",
    "TTFT p99 ms",
    "ITL p50 ms",
    "req/s",
    "out tok/s",
    "ok/sent",
    "max/mean share",
    "engine shares",
    "engine hit rates",
    "preemptions",
)


def table_cells(row: dict[str, Any]) -> list[str]:
    if row.get("failure") and "hit_rate" not in row:
        return [row["router"], f"failed: {row['failure'][:60]}", *["-"] * (len(COLUMNS) - 2)]
    return [
        row["router"],
        _pct(row["hit_rate"]),
        _pct(row["later_cached_ratio"]),
        _pct(row["same_engine_as_previous_round"]),
        _ms(row["ttft_p50"]),
        _ms(row["ttft_p90"]),
        _ms(row["ttft_p99"]),
        _num(None if row["itl_p50"] is None else 1000 * row["itl_p50"], 1),
        _num(row["req_per_s"]),
        _num(row["out_tok_per_s"], 0),
        f"{row['ok']}/{row['sent']}" + (f" ({row['errors']} err)" if row["errors"] else ""),
        _num(row["max_over_mean"]),
        " ".join(f"{100 * x:.0f}" for x in row["shares"]),
        " ".join("-" if x is None else f"{100 * x:.0f}" for x in row["engine_hit_rates"]),
        str(row["preemptions"]),
    ]


def rich_table(rows: list[dict[str, Any]], title: str) -> Table:
    table = Table(title=title)
    for c in COLUMNS:
        table.add_column(c, justify="left" if c == "router" else "right")
    for row in rows:
        table.add_row(*table_cells(row))
    return table


def markdown(rows: list[dict[str, Any]], verdicts: dict[str, list[dict[str, Any]]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|---" + "|--:" * (len(COLUMNS) - 1) + "|"]
    lines += ["| " + " | ".join(table_cells(row)) + " |" for row in rows]
    for subject, checks in verdicts.items():
        lines += ["", f"Targets for `{subject}`:", ""]
        lines += [f"- {verdict_line(c)}" for c in checks]
    return "\n".join(lines) + "\n"


def verdict_line(c: dict[str, Any]) -> str:
    state = {True: "PASS", False: "FAIL", None: "n/a"}[c["pass"]]
    value = "-" if c["value"] is None else f"{c['value']:.2f}"
    return f"**{state}** {c['target']}: {value} ({c['detail']})"


def summary_png(path: Path, rows: list[dict[str, Any]]) -> Path | None:
    """Hit rate, TTFT p50/p90 and max/mean share per router, side by side."""
    rows = [r for r in rows if r.get("hit_rate") is not None]
    if not rows:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4), layout="constrained")
    FigureCanvasAgg(fig)
    names = [r["router"].replace(" [", "\n[") for r in rows]
    x = range(len(rows))
    ax = fig.add_subplot(1, 3, 1)
    ax.bar(x, [100 * r["hit_rate"] for r in rows])
    ax.set_title("engine prefix-cache hit rate (%)")
    ax.set_xticks(x, names, fontsize="x-small", rotation=30, ha="right")
    ax = fig.add_subplot(1, 3, 2)
    ax.bar([i - 0.2 for i in x], [1000 * (r["ttft_p50"] or 0) for r in rows], width=0.4, label="p50")
    ax.bar([i + 0.2 for i in x], [1000 * (r["ttft_p90"] or 0) for r in rows], width=0.4, label="p90")
    ax.set_yscale("log")
    ax.set_title("TTFT (ms, log scale)")
    ax.legend(fontsize="small")
    ax.set_xticks(x, names, fontsize="x-small", rotation=30, ha="right")
    ax = fig.add_subplot(1, 3, 3)
    ax.bar(x, [r["max_over_mean"] or 0 for r in rows])
    ax.axhline(1.3, color="red", linestyle="--", label="target 1.3")
    ax.set_title("max / mean engine share")
    ax.legend(fontsize="small")
    ax.set_xticks(x, names, fontsize="x-small", rotation=30, ha="right")
    fig.savefig(path, dpi=110)
    return path


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
                f"  {target.name}: hit rate {_pct(engine.get('prefix_hit_rate'))}"
                f", TTFT p50 {_ms(result.summary['ttft_s']['p50'])} ms, {result.summary['errors']} errors, "
                f"{info['bench_wall_s']} s, machine busy {info['machine_busy_pct']}%"
            )

    rows = [row_of(info, results.get(info["name"])) for info in infos]
    by_name = {r["router"]: r for r in rows}
    suffix = "" if args.kv_routing == "kv-aware" else f" [{args.kv_routing}]"
    subject = KV_AWARE + suffix
    verdicts = {subject: evaluate(by_name, subject, "oracle" + suffix)}
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
        "git": _git_state(),
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
    (out_dir / "results.json").write_text(json.dumps(report, indent=2, default=_jsonable) + "\n")
    (out_dir / "results.md").write_text(f"{title}\n\n```sh\n{command}\n```\n\n" + markdown(rows, verdicts))
    console.print(f"results: {out_dir}/results.json, results.md{', summary.png' if png else ''}")
    console.print(f"elapsed {report['elapsed_s']} s; command: {command}")
    return 0 if results else 1


def _git_state() -> dict[str, Any]:
    """The commit measured, and whether src/ had uncommitted changes (other work in progress)."""

    def git(*args: str) -> str:
        try:
            out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return out.stdout.strip()

    changed = git("status", "--porcelain", "--", "src")
    return {"commit": git("rev-parse", "HEAD"), "src_changed_files": changed.splitlines()}


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
