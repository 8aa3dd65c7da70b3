"""One phase of benchmarks/epp_replicas.py: fresh engines, two pickers, Envoy, one replayed chat workload.

``run_phase`` starts a ``kvstack sim`` process (engines publishing KV events), two ``kvstack epp`` processes
over those engines (the phase's ``--routing``; ``--fallbacks 0`` for Envoy's ORIGINAL_DST) and Envoy in
front of both, then replays the workload through Envoy. Before each request it asks BOTH replicas, at once
and as Envoy would, where the request would go (`epp_replicas_shadow`); then the real request goes through
Envoy, which hands it to one replica by round robin. On a disagreement it reads both replicas' ``/engines``
at once to see which signal they differed in. Meanwhile each replica's in-flight count (summed over
engines) and open streams are sampled from ``/engines``.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from epp_replicas_envoy import SERVED_HEADER, start_envoy
from epp_replicas_shadow import ShadowAsker, batches, engine_view, engines, why_differ
from procs import HOST, KVSTACK, REPO, Group, engines_not_ready, free_port, get, wait_engines

from kvstack.bench.workloads import Conversation, MultiRoundQA, Turn

MODEL = "sim-model"
CHAT = "/v1/chat/completions"
SRC_ENV = {"PYTHONPATH": str(REPO / "src")}  # the processes run this checkout's kvstack
SAMPLE_EVERY_S = 0.2


@dataclass(frozen=True)
class Settings:
    engines: int = 4
    block_size: int = 16
    num_gpu_blocks: int = 4000  # the working set fits: agreement, not eviction, is measured
    time_scale: float = 1.0
    scrape_interval: float = 1.0


@dataclass(frozen=True)
class Phase:
    name: str
    concurrency: int  # 1: each request after the previous answer, in the workload's order
    workload: MultiRoundQA
    routing: str = "auto"  # the pickers' --routing


def run_phase(phase: Phase, settings: Settings, logs: Path) -> dict[str, Any]:
    slug = re.sub(r"[^a-z0-9]+", "-", phase.name.lower()).strip("-")
    sim = Group.start("sim", [_sim_command(settings)], logs / f"sim-{slug}.log", env=SRC_ENV)
    groups = [sim]
    try:
        engine_urls = wait_engines(sim, settings.engines)
        grpc_ports, http_ports = [free_port() for _ in range(2)], [free_port() for _ in range(2)]
        picker_cmds = [
            _picker_command(engine_urls, g, h, phase.routing, settings)
            for g, h in zip(grpc_ports, http_ports, strict=True)
        ]
        pickers = Group.start("epp", picker_cmds, logs / f"epp-{slug}.log", env=SRC_ENV)
        groups.append(pickers)
        picker_urls = [f"http://{HOST}:{p}" for p in http_ports]
        _wait_pickers(pickers, picker_urls, settings.engines)
        listen, admin = free_port(), free_port()
        envoy_logs = logs / f"envoy-{slug}"
        envoy_logs.mkdir(parents=True, exist_ok=True)
        groups.append(start_envoy([f"{HOST}:{p}" for p in grpc_ports], listen, admin, envoy_logs))
        result = asyncio.run(
            _drive(
                phase,
                slug,
                f"http://{HOST}:{listen}",
                [f"{HOST}:{p}" for p in grpc_ports],
                picker_urls,
                engine_urls,
            )
        )
        result["cpu_seconds"] = {g.name: round(g.cpu_seconds(), 1) for g in groups}
        return result
    finally:
        for group in reversed(groups):
            group.stop()


def _sim_command(s: Settings) -> list[str]:
    return [
        str(KVSTACK), "sim", "--engines", str(s.engines), "--port", "0", "--kv-events-port", "0",
        "--served-model-name", MODEL, "--block-size", str(s.block_size),
        "--num-gpu-blocks", str(s.num_gpu_blocks), "--time-scale", f"{s.time_scale:g}",
        "--log-level", "warning",
    ]  # fmt: skip


def _picker_command(
    engine_urls: list[str], grpc_port: int, http_port: int, routing: str, s: Settings
) -> list[str]:
    cmd = [str(KVSTACK), "epp", "--host", HOST, "--grpc-port", str(grpc_port), "--http-port", str(http_port)]
    cmd += ["--routing", routing]
    for url in engine_urls:
        cmd += ["--engine", url]
    return [*cmd, "--fallbacks", "0", "--scrape-interval", f"{s.scrape_interval:g}", "--log-level", "warning"]


def _wait_pickers(group: Group, urls: list[str], n: int, budget_s: float = 60.0) -> None:
    deadline = time.monotonic() + budget_s
    why: str | None = "not asked yet"
    while time.monotonic() < deadline:
        if (gone := group.exited()) is not None:
            raise RuntimeError(f"epp: {gone}\n{group.log_text()[-2000:]}")
        try:
            why = None
            for url in urls:
                status, body = get(url, "/engines", timeout=2.0)
                why = why or (f"{url}: HTTP {status}" if status != 200 else None)
                why = why or engines_not_ready(json.loads(body)["engines"], n, kv_events=True)
        except OSError as exc:
            why = f"{type(exc).__name__}: {exc}"
        if why is None:
            return
        time.sleep(0.2)
    raise RuntimeError(f"pickers not ready after {budget_s:.0f}s: {why}\n{group.log_text()[-2000:]}")


async def _drive(
    phase: Phase,
    slug: str,
    envoy: str,
    picker_grpc: list[str],
    picker_urls: list[str],
    engine_urls: list[str],
) -> dict[str, Any]:
    askers = [ShadowAsker(a) for a in picker_grpc]
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        baselines = [batches(await engines(http, u)) for u in picker_urls]
        hits_before = await _prefix_counters(http, engine_urls)
        samples: list[dict[str, Any]] = []
        stop = asyncio.Event()
        sampler = asyncio.create_task(_sample(http, picker_urls, samples, stop))
        records: list[dict[str, Any]] = []
        conversations: dict[int, Conversation] = {}

        async def send(turn: Turn) -> None:
            conversation = conversations.setdefault(turn.session, Conversation(turn.system))
            conversation.ask(turn.text)
            body = {"model": MODEL, "messages": conversation.messages(), "max_tokens": turn.max_tokens}
            request_id = f"{slug}-{turn.index}"
            record: dict[str, Any] = {"index": turn.index, "session": turn.session, "round": turn.round}
            picks = await asyncio.gather(*(a.pick(CHAT, body, request_id) for a in askers))
            record["picks"] = picks
            if picks[0] != picks[1]:
                states = await asyncio.gather(*(engines(http, u) for u in picker_urls))
                views = [engine_view(s, b) for s, b in zip(states, baselines, strict=True)]
                record["cause"] = why_differ(*views)
                record["views"] = views
            t0 = time.perf_counter()
            async with http.post(f"{envoy}{CHAT}", json=body, headers={"x-request-id": request_id}) as r:
                record["status"] = r.status
                record["served"] = r.headers.get(SERVED_HEADER)
                reply = await r.json(content_type=None)
            record["latency_s"] = time.perf_counter() - t0
            answer = (
                reply.get("choices", [{}])[0].get("message", {}).get("content") if r.status == 200 else None
            )
            conversation.answer(answer or "")
            records.append(record)

        t_start = time.perf_counter()
        turns = list(phase.workload.turns())
        if phase.concurrency <= 1:
            for turn in turns:
                await send(turn)
        else:
            by_session: dict[int, list[Turn]] = {}
            for turn in turns:
                by_session.setdefault(turn.session, []).append(turn)
            queue: asyncio.Queue[list[Turn]] = asyncio.Queue()
            for session_turns in by_session.values():
                queue.put_nowait(session_turns)

            async def worker() -> None:
                while not queue.empty():
                    for turn in queue.get_nowait():
                        await send(turn)

            await asyncio.gather(*(worker() for _ in range(phase.concurrency)))
        elapsed = time.perf_counter() - t_start
        await asyncio.sleep(1.0)  # streams Envoy ends after the response settle
        stop.set()
        await sampler
        final = [await engines(http, u) for u in picker_urls]
        hits_after = await _prefix_counters(http, engine_urls)
    for asker in askers:
        await asker.close()
    return _summary(phase, records, samples, final, hits_before, hits_after, elapsed)


async def _sample(
    http: aiohttp.ClientSession, urls: list[str], samples: list[dict[str, Any]], stop: asyncio.Event
) -> None:
    t0 = time.perf_counter()
    while not stop.is_set():
        try:
            states = await asyncio.gather(*(engines(http, u) for u in urls))
        except (aiohttp.ClientError, TimeoutError):
            states = []
        if states:
            samples.append(
                {
                    "t": round(time.perf_counter() - t0, 2),
                    "in_flight": [sum(e["in_flight"] for e in s["engines"]) for s in states],
                    "streams": [s["streams"] for s in states],
                }
            )
        await asyncio.sleep(SAMPLE_EVERY_S)


async def _prefix_counters(http: aiohttp.ClientSession, engine_urls: list[str]) -> tuple[float, float]:
    """(prefix cache hit tokens, query tokens) summed over the engines."""
    hits = queries = 0.0
    for url in engine_urls:
        async with http.get(f"{url}/metrics") as r:
            text = await r.text()
        hits += _counter(text, "vllm:prefix_cache_hits")
        queries += _counter(text, "vllm:prefix_cache_queries")
    return hits, queries


def _counter(text: str, name: str) -> float:
    pattern = re.compile(rf"^{re.escape(name)}(?:_total)?(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", re.M)
    return sum(float(v) for v in pattern.findall(text))


def _wilson_lower(successes: int, n: int, z: float = 1.96) -> float | None:
    """The lower end of the Wilson score interval (95%) for a proportion."""
    if not n:
        return None
    p = successes / n
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - spread) / (1 + z * z / n)


def _summary(
    phase: Phase,
    records: list[dict[str, Any]],
    samples: list[dict[str, Any]],
    final: list[dict[str, Any]],
    hits_before: tuple[float, float],
    hits_after: tuple[float, float],
    elapsed: float,
) -> dict[str, Any]:
    n = len(records)
    agreed = sum(1 for r in records if r["picks"][0] == r["picks"][1])
    first_rounds = [r for r in records if r["round"] == 0]
    served_as_asked = sum(1 for r in records if r.get("served") in r["picks"])
    served = Counter(r.get("served") for r in records)
    in_flight = [s["in_flight"] for s in samples]
    latencies = sorted(r["latency_s"] for r in records)
    hits = hits_after[0] - hits_before[0]
    queries = hits_after[1] - hits_before[1]
    return {
        "phase": phase.name,
        "routing": phase.routing,
        "concurrency": phase.concurrency,
        "workload": phase.workload.describe(),
        "requests": n,
        "errors": sum(1 for r in records if r.get("status") != 200),
        "elapsed_s": round(elapsed, 1),
        "agreement": agreed / n if n else None,
        "agreement_lower_95": _wilson_lower(agreed, n),
        "disagreements": n - agreed,
        "agreement_first_rounds": (
            sum(1 for r in first_rounds if r["picks"][0] == r["picks"][1]) / len(first_rounds)
            if first_rounds
            else None
        ),
        "causes": dict(Counter(r["cause"] for r in records if "cause" in r)),
        "served_where_a_replica_said": served_as_asked / n if n else None,
        "engine_shares": {k or "none": v for k, v in sorted(served.items(), key=lambda kv: str(kv[0]))},
        "prefix_hit_rate": hits / queries if queries else None,
        "latency_p50_s": latencies[n // 2] if n else None,
        "latency_p99_s": latencies[min(n - 1, int(n * 0.99))] if n else None,
        "in_flight_peak": [max((s[i] for s in in_flight), default=0) for i in range(2)],
        "in_flight_mean": [
            round(sum(s[i] for s in in_flight) / len(in_flight), 2) if in_flight else None for i in range(2)
        ],
        "in_flight_gap_peak": max((abs(s[0] - s[1]) for s in in_flight), default=0),
        "in_flight_final": [sum(e["in_flight"] for e in s["engines"]) for s in final],
        "streams_final": [s["streams"] for s in final],
        "disagreement_detail": [
            {k: r[k] for k in ("index", "session", "round", "picks", "served", "cause", "views")}
            for r in records
            if "cause" in r
        ],
        "in_flight_samples": samples,
    }
