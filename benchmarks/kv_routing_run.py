"""One router's run in the KV-aware routing experiment, on a fresh simulator, and what its requests show.

`Settings` are the simulated engines and the workload (`FULL`, `QUICK`); ``working_set`` sizes the workload
against the engines' KV capacity. ``run_target`` starts a fresh ``kvstack sim`` and the router, waits until
the router is ready, runs ``kvstack.bench`` and records CPU, the engines' and the router's counters and the
per-request view (``request_view``: cached share and TTFT by round, same engine as the round before).
"""

from __future__ import annotations

import asyncio
import random
import resource
import shlex
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kv_routing_routers import (
    MODEL,
    Launch,
    Target,
    engine_extras,
    envoy_stats,
    router_extras,
    wait_ready,
)
from machine_info import machine_cpu_ticks
from procs import KVSTACK, OFFLINE, Group, free_port, wait_engines
from rich.console import Console

from kvstack.bench import BenchConfig, BenchResult, MultiRoundQA, run_bench, write_report
from kvstack.bench.records import RequestRecord
from kvstack.bench.summary import percentile
from kvstack.bench.workloads import Conversation, words
from kvstack.engines.tokenizer import load_tokenizer


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


# -- per-request analysis -------------------------------------------------------------------------
def request_view(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Cached-token ratio and TTFT by round (round 0 carries the user's whole history, later rounds only a
    question on top of a context the engine that served the previous round holds); where the response
    names the engine that served (kvstack's router, Envoy) how often a later round went to the same engine
    as the round before, and how many users each engine got at round 0."""
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
        launch = Launch(engines, free_port(), free_port(), free_port(), free_port(), logs)
        cmds = target.commands(launch)
        info["command"] = " & ".join(shlex.join(cmd) for cmd in cmds)
        env = OFFLINE if target.kind in ("vllm-router", "sglang-router") else None
        router = Group.start(target.name, cmds, logs / f"{slug}.log", env=env)
        info["startup_s"] = round(wait_ready(target, launch, router, 60), 1)
        config = BenchConfig(
            url=launch.url,
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
        envoy_before = envoy_stats(launch) if target.kind == "envoy" else {}
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
        info["router"] = router_extras(target, launch, envoy_before)
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
