"""Section ``qa``: multi-round QA through ``kvstack router --routing kv-aware`` in front of two fresh engines.

``qa_run`` starts the engines (small KV cache, below the working set) with or without the connector and a
cache server (whose chunk events the router also reads), waits until the router routes on KV events for
both (``wait_router``), runs ``kvstack.bench`` and sums up TTFT by round and where each engine's prompt
tokens came from (``qa_summary``).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from connector_ttft_engines import (
    SOURCES,
    VLLM_PYTHON,
    BenchError,
    Busy,
    Config,
    Processes,
    delta,
    kvstack_cache_server,
    kvstack_transfer,
    log_tail,
    read_metrics,
    start_engines,
    vllm_command,
    vllm_env,
)
from procs import HOST, KVSTACK, Group, engines_not_ready, free_port, get

from kvstack.bench import BenchConfig, BenchResult, MultiRoundQA, run_bench, write_report
from kvstack.bench.summary import percentile
from kvstack.devtools.tiny_model import TinyShape

QA_MODEL = "qa"
QA_SHAPE = TinyShape(
    num_hidden_layers=4, hidden_size=512, num_attention_heads=8, num_key_value_heads=2, intermediate_size=2048
)


# -- section: multi-round QA through the router -------------------------------------------------
def qa_workload(cfg: Config) -> MultiRoundQA:
    return MultiRoundQA(
        num_users=cfg.qa_users,
        num_rounds=cfg.qa_rounds,
        system_prompt_len=cfg.qa_system_words,
        user_history_len=cfg.qa_history_words,
        question_len=20,
        answer_len=cfg.qa_answer_tokens,
        qps=cfg.qa_qps,
        arrival="poisson",
        seed=0,
    )


def router_not_ready(url: str, n: int) -> str | None:
    try:
        status, body = get(url, "/engines", timeout=3.0)
        if status != 200:
            return f"/engines: HTTP {status}"
        states = json.loads(body)["engines"]
        return engines_not_ready(states, n, kv_events=True)
    except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"


def wait_router(url: str, n: int, router: Group, budget_s: float = 90.0) -> None:
    """Until the kvstack router at ``url`` routes on KV events for its ``n`` engines."""
    t0 = time.monotonic()
    why: str | None = "not asked"
    while time.monotonic() - t0 < budget_s and (why := router_not_ready(url, n)) is not None:
        if (gone := router.exited()) is not None:
            raise BenchError(f"router: {gone}\n{log_tail(router)}")
        time.sleep(0.5)
    if why is not None:
        raise BenchError(f"router not ready after {budget_s:.0f} s: {why}\n{log_tail(router)}")


def qa_summary(per_engine: list[dict[str, float]], result: BenchResult) -> dict[str, Any]:
    """A QA run from the client's records and each engine's counter deltas: TTFT percentiles (all, round 0,
    later rounds) and where prompt tokens came from (computed, local prefix cache, the tier), as shares."""
    tot = {k: sum(d.get(k, 0.0) for d in per_engine) for k in per_engine[0]}
    prompt = sum(tot.get(f"source_{s}", 0.0) for s in SOURCES)
    records = result.records
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    later = [r.ttft for r in ok if r.ttft is not None and r.round > 0]
    first = [r.ttft for r in ok if r.ttft is not None and r.round == 0]
    return {
        "requests": len(records),
        "ok": len(ok),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "round0_ttft_p50_s": percentile(first, 50),
        "later_ttft_p50_s": percentile(later, 50),
        "prompt_tokens": prompt,
        "local_hit_share": tot.get("source_local_cache_hit", 0.0) / prompt if prompt else None,
        "external_share": tot.get("source_external_kv_transfer", 0.0) / prompt if prompt else None,
        "computed_share": tot.get("source_local_compute", 0.0) / prompt if prompt else None,
        "preemptions": tot.get("preemptions"),
        "engine_shares": [
            d.get("prompt_tokens", 0.0) / tot["prompt_tokens"] if tot.get("prompt_tokens") else None
            for d in per_engine
        ],
        "bench_engine_view": result.summary.get("engine"),
        "elapsed_s": result.summary.get("elapsed_s"),
        "errors": result.summary.get("error_kinds"),
    }


def qa_run(
    label: str,
    tier: bool,
    procs: Processes,
    cfg: Config,
    model_dir: Path,
    out_dir: Path,
    say: Callable[[str], None],
) -> dict[str, Any]:
    info: dict[str, Any] = {"label": label, "tier": tier}
    node = "bench"
    transfer = None
    cache_events = None
    if tier:
        ev, replay = free_port(), free_port()
        _, endpoint, info["cache_server_command"] = kvstack_cache_server(
            procs, f"qa-{label}-cache-server", cfg, events=(ev, replay), node=node
        )
        transfer = kvstack_transfer(endpoint, f"{QA_MODEL}-{cfg.weights}")
        cache_events = f"tcp://{HOST}:{ev}#node={node},replay=tcp://{HOST}:{replay}"
    ports = [free_port(), free_port()]
    specs = [
        (
            f"qa-{label}-{name}",
            vllm_command(
                VLLM_PYTHON,
                model_dir,
                QA_MODEL,
                port,
                cfg,
                blocks=cfg.qa_blocks,
                kv_transfer=transfer,
                kv_events_port=free_port(),
            ),
            vllm_env(),
        )
        for name, port in zip("AB", ports, strict=True)
    ]
    t0 = time.monotonic()
    engines = start_engines(procs, specs, ports, cfg)
    info["engine_commands"] = [e.command for e in engines]
    info["startup_s"] = round(time.monotonic() - t0, 1)
    router_port = free_port()
    cmd = [str(KVSTACK), "router", "--host", HOST, "--port", str(router_port), "--routing", "kv-aware"]
    for e in engines:
        cmd += ["--engine", f"{e.url}#node={node}"]
    cmd += ["--tokenizer", str(model_dir), "--log-level", "warning"]
    if cache_events:
        cmd += ["--cache-events", cache_events]
    info["router_command"] = shlex.join(cmd)
    router = procs.start(f"qa-{label}-router", cmd)
    url = f"http://{HOST}:{router_port}"
    wait_router(url, len(engines), router)
    say(f"qa {label}: engines {[e.url for e in engines]} behind {url}")
    before = [read_metrics(e.url) for e in engines]
    config = BenchConfig(
        url=url,
        model=QA_MODEL,
        workload=qa_workload(cfg),
        api="chat",
        max_concurrency=16,
        request_timeout=cfg.request_timeout_s,
        engine_metrics=tuple(e.url for e in engines),
        label=label,
    )
    busy = Busy(lambda: procs.groups)
    result = asyncio.run(run_bench(config))
    info["machine"] = busy.result()
    time.sleep(0.5)
    after = [read_metrics(e.url) for e in engines]
    write_report(result, out_dir / f"qa-{label}")
    per_engine = [delta(b, a) for b, a in zip(before, after, strict=True)]
    info["engines"] = [{"url": e.url, **d} for e, d in zip(engines, per_engine, strict=True)]
    info["summary"] = qa_summary(per_engine, result)
    with contextlib.suppress(OSError, http.client.HTTPException):
        _, body = get(url, "/metrics", timeout=3.0)
        info["router_metrics"] = [
            line
            for line in body.decode(errors="replace").splitlines()
            if line.startswith(
                ("kvstack_router_routing_decisions", "kvstack_kv_event", "kvstack_prefix_index")
            )
        ]
    return info
