"""Sections ``tier`` and ``lmcache``: TTFT on engine B: cold, loaded from the tier, from B's own cache.

A `Stack` is two engines A and B sharing one KV cache tier (``kvstack cache-server`` with the kvstack
connector, or LMCache's multiprocess server with ``LMCacheMPConnector``). ``measure_stack`` warms both up,
then per prompt pair computes T_i on A, runs the cold C_i and T_i on B in alternating order, then C_i again;
``check`` holds each `Sample` to what B's counters must show, and answers must match. ``stack_summary``
takes medians, ratios to cold and the verdict (tier / cold <= ``TARGET_RATIO``).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from connector_ttft_engines import (
    BLOCK,
    CHUNK,
    LMCACHE_ENV,
    VLLM_PYTHON,
    Busy,
    Config,
    Engine,
    Processes,
    delta,
    kvstack_cache_server,
    kvstack_transfer,
    lmcache_server,
    log_tail,
    random_prompt,
    read_metrics,
    start_engines,
    stream_completion,
    vllm_command,
    vllm_env,
)
from procs import free_port
from results import ratio

PROMPT_MODEL = "ttft"
TARGET_RATIO = 0.3


# -- section: TTFT cold vs tier -------------------------------------------------------------------
@dataclass
class Sample:
    stack: str
    kind: str  # cold-A | cold | tier | own | warmup
    engine: str
    prompt: str
    ttft_s: float | None
    e2e_s: float
    server_ttft_s: float | None
    prompt_tokens: int | None
    token_ids: list[int]
    counters: dict[str, float]
    machine_busy_pct: float
    engine_cpu_pct: float
    """CPU the serving engine's processes used, in % of all cores (the rest of busy% is other work)."""
    error: str | None = None
    problems: list[str] = field(default_factory=list)


@dataclass
class Stack:
    """Two engines sharing one KV cache tier (kvstack's, or LMCache's)."""

    name: str
    a: Engine
    b: Engine
    server_command: str
    notes: list[str] = field(default_factory=list)


def request(
    stack: Stack, engine: Engine, kind: str, label: str, prompt: list[int], cfg: Config, model: str
) -> Sample:
    before = read_metrics(engine.url)
    busy = Busy(lambda: [engine.group])
    answer = stream_completion(engine.url, model, prompt, cfg.max_tokens, cfg.request_timeout_s)
    span = busy.result()
    time.sleep(0.3)  # counters are updated just after the last chunk
    d = delta(before, read_metrics(engine.url))
    server_ttft = d.get("ttft_sum") if d.get("ttft_count") == 1 else None
    return Sample(
        stack.name,
        kind,
        engine.name,
        label,
        answer.ttft_s,
        answer.e2e_s,
        server_ttft,
        answer.prompt_tokens,
        answer.token_ids,
        d,
        span["machine_busy_pct"],
        span["this_run_pct"],
        answer.error,
    )


def check(sample: Sample, n: int) -> None:
    """What B's (or A's) counters must show for this kind of request; problems are kept, never fatal."""
    if sample.error:
        sample.problems.append(f"request failed: {sample.error}")
        return
    if sample.prompt_tokens != n:
        sample.problems.append(f"prompt is {sample.prompt_tokens} tokens, not {n}")
    c = sample.counters
    ext, local = c.get("source_external_kv_transfer", 0), c.get("source_local_cache_hit", 0)
    if sample.kind in ("cold", "cold-A"):
        if ext or local:
            sample.problems.append(f"cold request had {ext:.0f} external and {local:.0f} local hit tokens")
    elif sample.kind == "tier":
        if ext < n - CHUNK:
            sample.problems.append(f"only {ext:.0f} of {n} tokens came from the tier")
        if c.get("external_hits", 0) != ext:
            sample.problems.append(
                f"external_prefix_cache_hits +{c.get('external_hits', 0):.0f} != {ext:.0f}"
            )
        if local:
            sample.problems.append(f"{local:.0f} tokens were local hits")
    elif sample.kind == "own":
        if local < n - CHUNK:
            sample.problems.append(f"only {local:.0f} of {n} tokens were local prefix-cache hits")
        # vLLM's own hit stops at the last full block before the last token; LMCache tops that block up
        # from its store (127 tokens here), kvstack loads whole blocks only (0).
        if ext >= BLOCK:
            sample.problems.append(f"{ext:.0f} tokens came from the tier")


def measure_stack(
    stack: Stack, cfg: Config, model: str, rng: random.Random, say: Callable[[str], None]
) -> list[Sample]:
    n = cfg.prompt_tokens
    samples: list[Sample] = []

    def run(engine: Engine, kind: str, label: str, prompt: list[int]) -> Sample:
        s = request(stack, engine, kind, label, prompt, cfg, model)
        if kind != "warmup":
            check(s, n)
        samples.append(s)
        ttft = "-" if s.ttft_s is None else f"{s.ttft_s:.2f} s"
        ext = s.counters.get("source_external_kv_transfer", 0)
        loc = s.counters.get("source_local_cache_hit", 0)
        problems = f" [red]{'; '.join(s.problems)}[/]" if s.problems else ""
        say(
            f"{stack.name} {engine.name} {kind:7} {label:5} TTFT {ttft} "
            f"(external {ext:.0f}, local {loc:.0f}){problems}"
        )
        return s

    # Warm-up: first requests pay one-off costs (allocations, the connector's shared-memory arena, the
    # first load); a 512-token prompt computed on A is loaded on B so that the load path is warm too.
    warm = random_prompt(rng, 512)
    for engine in (stack.a, stack.b):
        run(engine, "warmup", "w64", random_prompt(rng, 64))
    run(stack.a, "warmup", "w512", warm)
    run(stack.b, "warmup", "w512", warm)
    run(stack.b, "warmup", "w512c", random_prompt(rng, 512))
    for i in range(cfg.prompts):
        tier, cold = random_prompt(rng, n), random_prompt(rng, n)
        run(stack.a, "cold-A", f"T{i}", tier)
        order = [("cold", f"C{i}", cold), ("tier", f"T{i}", tier)]
        for kind, label, prompt in order if i % 2 == 0 else order[::-1]:
            run(stack.b, kind, label, prompt)
        run(stack.b, "own", f"C{i}", cold)
    # Answers: B's tier answer equals A's (cold) one; B's own-cache answer equals its cold one.
    by = {(s.kind, s.prompt): s for s in samples}
    for s in samples:
        ref = {"tier": ("cold-A", s.prompt), "own": ("cold", s.prompt)}.get(s.kind)
        if ref and ref in by and not s.error and s.token_ids != by[ref].token_ids:
            s.problems.append(f"answer {s.token_ids} != {ref[0]} {by[ref].token_ids}")
    return samples


def stack_summary(samples: list[Sample]) -> dict[str, Any]:
    out: dict[str, Any] = {"kinds": {}}
    for kind in ("cold", "tier", "own", "cold-A"):
        rows = [s for s in samples if s.kind == kind]
        ttfts = [s.ttft_s for s in rows if s.ttft_s is not None and not s.error]
        server = [s.server_ttft_s for s in rows if s.server_ttft_s is not None]
        out["kinds"][kind] = {
            "n": len(rows),
            "ttft_median_s": statistics.median(ttfts) if ttfts else None,
            "ttft_min_s": min(ttfts) if ttfts else None,
            "ttft_max_s": max(ttfts) if ttfts else None,
            "ttft_s": ttfts,
            "server_ttft_median_s": statistics.median(server) if server else None,
            "computed_tokens_median": _median([s.counters.get("source_local_compute") for s in rows]),
            "external_tokens_median": _median([s.counters.get("source_external_kv_transfer") for s in rows]),
            "local_hit_tokens_median": _median([s.counters.get("source_local_cache_hit") for s in rows]),
            "verified": sum(1 for s in rows if not s.problems),
            "machine_busy_pct_median": _median([s.machine_busy_pct for s in rows]),
            "engine_cpu_pct_median": _median([s.engine_cpu_pct for s in rows]),
        }
    k = out["kinds"]
    out["ratio_tier_over_cold"] = ratio(k["tier"]["ttft_median_s"], k["cold"]["ttft_median_s"])
    out["ratio_own_over_cold"] = ratio(k["own"]["ttft_median_s"], k["cold"]["ttft_median_s"])
    out["ratio_tier_over_cold_server"] = ratio(
        k["tier"]["server_ttft_median_s"], k["cold"]["server_ttft_median_s"]
    )
    answers = {tuple(s.token_ids) for s in samples if s.kind in ("cold", "cold-A") and s.token_ids}
    out["distinct_answers_among_cold_prompts"] = f"{len(answers)} of {k['cold']['n'] + k['cold-A']['n']}"
    out["problems"] = [f"{s.kind} {s.prompt}: {p}" for s in samples for p in s.problems]
    tier_over_cold = out["ratio_tier_over_cold"]
    out["verdict"] = (
        "no result" if tier_over_cold is None else ("PASS" if tier_over_cold <= TARGET_RATIO else "FAIL")
    )
    return out


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def kvstack_stack(procs: Processes, cfg: Config, model_dir: Path) -> Stack:
    _, endpoint, server_cmd = kvstack_cache_server(procs, "kvstack-cache-server", cfg)
    transfer = kvstack_transfer(endpoint, f"{PROMPT_MODEL}-{cfg.weights}")
    ports = [free_port(), free_port()]
    specs = [
        (
            f"kvstack-{name}",
            vllm_command(
                VLLM_PYTHON, model_dir, PROMPT_MODEL, port, cfg, blocks=cfg.ttft_blocks, kv_transfer=transfer
            ),
            vllm_env(),
        )
        for name, port in zip("AB", ports, strict=True)
    ]
    a, b = start_engines(procs, specs, ports, cfg)
    a.name, b.name = "A", "B"
    return Stack("kvstack", a, b, server_cmd)


def lmcache_stack(procs: Processes, cfg: Config, model_dir: Path, python: Path) -> Stack:
    transfer, server_cmd = lmcache_server(procs, "lmcache-server", cfg, python)
    ports = [free_port(), free_port()]
    specs = [
        (
            f"lmcache-{name}",
            vllm_command(
                python, model_dir, PROMPT_MODEL, p, cfg, blocks=cfg.ttft_blocks, kv_transfer=transfer
            ),
            vllm_env(LMCACHE_ENV),
        )
        for name, p in zip("AB", ports, strict=True)
    ]
    a, b = start_engines(procs, specs, ports, cfg)
    a.name, b.name = "A", "B"
    notes = [
        "LMCache's in-process LMCacheConnectorV1 cannot run on vLLM's CPU backend: lmcache 0.5.6's "
        "CreateGPUConnector knows cuda, xpu, musa and hpu only ('No supported cpu connector found', the "
        "engine then runs in 'degraded mode (recompute)'), and vLLM's bundled adapter (use_native) "
        "hard-codes torch.device('cuda'). Its multiprocess mode (lmcache server + LMCacheMPConnector) has "
        "a CPU path (engine-driven transfers through the server); that is what runs here.",
    ]
    return Stack("lmcache", a, b, server_cmd, notes)


def run_stack(
    name: str,
    build: Callable[[Processes], Stack],
    procs: Processes,
    cfg: Config,
    seed: int,
    report: dict[str, Any],
    say: Callable[[str], None],
) -> None:
    t0 = time.monotonic()
    stack = build(procs)
    startup = time.monotonic() - t0
    say(f"{name}: engines A {stack.a.url}, B {stack.b.url} up after {startup:.0f} s")
    busy = Busy(lambda: procs.groups)
    try:
        samples = measure_stack(stack, cfg, PROMPT_MODEL, random.Random(seed), say)
    finally:
        span = busy.result()
        logs = {g.name: log_tail(g, 4000) for g in procs.groups}
        procs.stop_all()
    summary = stack_summary(samples)
    report[name] = {
        "server_command": stack.server_command,
        "engine_commands": {"A": stack.a.command, "B": stack.b.command},
        "startup_s": round(startup, 1),
        "machine": span,
        "notes": stack.notes,
        "summary": summary,
        "samples": [asdict(s) for s in samples],
        "log_tails": logs,
    }
