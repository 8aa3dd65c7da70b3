"""One setup of the P/D benchmark: fresh simulated engines, ``kvstack router``, the workload through it.

`Settings` hold the engines' latency model and the offered load (`FULL`, `QUICK`), in modelled seconds: the
sims run ``time_scale`` times faster than modelled, so the load goes out at ``rate * time_scale`` requests
per wall second. A `Setup` names the engines' roles and the routing preset. ``run_setup`` starts one
``kvstack sim`` process per engine (each its own process group), the router (``--engine URL#role=...``,
KV events on), waits until the router has fresh metrics and a KV event subscription for every engine, runs
``kvstack.bench`` and reads what the client does not see: the router's ``kvstack_pd_*`` counters, and each
engine's own inter-token histogram and prompt-token counters (modelled time, no client noise).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import resource
import shlex
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from machine_info import machine_cpu_ticks
from pd_workload import LongAndShort
from procs import HOST, KVSTACK, Group, engines_not_ready, free_port, get, wait_engines
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from kvstack.bench import BenchConfig, BenchResult, run_bench, write_report

MODEL = "tiny"
# A decode step this long or longer had a prefill chunk in it (a pure decode step is ~0.02 s modelled); a
# bucket bound of the engines' inter-token histogram (vLLM's buckets).
SLOW_GAP_S = 0.1


@dataclass(frozen=True)
class Settings:
    """Latency model (modelled seconds) and offered load of every setup in a run."""

    time_scale: float
    prefill_per_token: float
    decode_base: float
    decode_per_seq: float
    step_overhead: float
    max_num_batched_tokens: int
    max_model_len: int
    rate: float  # requests per modelled second, the base load level
    duration: float  # modelled seconds of arrivals at the base level
    long_share: float
    long_prompt_len: tuple[int, int]
    long_answer_len: int
    short_prompt_len: tuple[int, int]
    short_answer_len: int
    seed: int
    request_timeout: float  # wall seconds

    def workload(self, load: float = 1.0) -> LongAndShort:
        """The workload at ``load`` times the base rate, over the same modelled duration."""
        return LongAndShort(
            requests=max(1, round(self.rate * load * self.duration)),
            qps=self.rate * load * self.time_scale,
            long_share=self.long_share,
            long_prompt_len=self.long_prompt_len,
            long_answer_len=self.long_answer_len,
            short_prompt_len=self.short_prompt_len,
            short_answer_len=self.short_answer_len,
            arrival="poisson",
            seed=self.seed,
        )

    def sim_command(self, model_dir: Path) -> list[str]:
        return [
            str(KVSTACK),
            "sim",
            "--port",
            "0",
            "--kv-events-port",
            "0",
            "--model",
            str(model_dir),
            "--served-model-name",
            MODEL,
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-batched-tokens",
            str(self.max_num_batched_tokens),
            "--time-scale",
            f"{self.time_scale:g}",
            "--prefill-per-token",
            f"{self.prefill_per_token:g}",
            "--decode-base",
            f"{self.decode_base:g}",
            "--decode-per-seq",
            f"{self.decode_per_seq:g}",
            "--step-overhead",
            f"{self.step_overhead:g}",
            "--enable-prompt-tokens-details",
            "--log-level",
            "warning",
        ]

    def offered(self, load: float = 1.0) -> dict[str, float]:
        """The base load's demand in modelled seconds of engine work per second (mean prompt and answer
        lengths): prefill seconds, and long/short requests per second."""
        rate = self.rate * load
        long_tokens = sum(self.long_prompt_len) / 2
        return {
            "requests_per_s": rate,
            "long_per_s": rate * self.long_share,
            "short_per_s": rate * (1 - self.long_share),
            "long_prefill_s_per_s": rate * self.long_share * long_tokens * self.prefill_per_token,
            "output_tokens_per_s": rate
            * (self.long_share * self.long_answer_len + (1 - self.long_share) * self.short_answer_len),
        }


FULL = Settings(
    time_scale=2.0,
    prefill_per_token=0.0001,
    decode_base=0.02,
    decode_per_seq=0.0002,
    step_overhead=0.001,
    max_num_batched_tokens=2048,
    max_model_len=8192,
    rate=5.0,
    duration=120.0,
    long_share=0.3,
    long_prompt_len=(3000, 5000),
    long_answer_len=256,
    short_prompt_len=(40, 160),
    short_answer_len=64,
    seed=0,
    request_timeout=120.0,
)
QUICK = replace(FULL, duration=40.0)


@dataclass(frozen=True)
class Setup:
    """Engines by role, the routing preset, and the load level (a multiple of the base rate)."""

    name: str
    roles: tuple[str, ...]  # one per engine: both, prefill or decode
    routing: str
    load: float = 1.0

    @property
    def disaggregated(self) -> bool:
        return "prefill" in self.roles

    @property
    def label(self) -> str:
        return self.name if self.load == 1.0 else f"{self.name} @{self.load:g}x"

    def router_command(self, engines: list[str], port: int, model_dir: Path) -> list[str]:
        cmd = [str(KVSTACK), "router", "--host", HOST, "--port", str(port)]
        for url, role in zip(engines, self.roles, strict=True):
            cmd += ["--engine", url if role == "both" else f"{url}#role={role}"]
        return [*cmd, "--routing", self.routing, "--tokenizer", str(model_dir), "--log-level", "warning"]


def run_setup(
    setup: Setup, s: Settings, model_dir: Path, out_dir: Path, console: Console
) -> tuple[dict[str, Any], BenchResult | None]:
    """Run the workload through ``setup`` on fresh engines; (what the run showed, the bench result)."""
    slug = re.sub(r"[^A-Za-z0-9.+]+", "-", setup.label)
    logs = out_dir / "logs" / slug
    info: dict[str, Any] = {"name": setup.label, "setup": setup.__dict__, "load": setup.load}
    sims = [Group.start(f"sim-{i}", [s.sim_command(model_dir)], logs / f"sim-{i}.log") for i in range(4)]
    router: Group | None = None
    result: BenchResult | None = None
    try:
        engines = [wait_engines(g, 1, 30)[0] for g in sims]
        info["engines"] = dict(zip(engines, setup.roles, strict=True))
        port = free_port()
        cmd = setup.router_command(engines, port, model_dir)
        info["router_command"] = shlex.join(cmd)
        router = Group.start("router", [cmd], logs / "router.log")
        url = f"http://{HOST}:{port}"
        info["startup_s"] = round(_wait_ready(url, len(engines), router, 60), 1)
        config = BenchConfig(
            url=url,
            model=MODEL,
            workload=s.workload(setup.load),
            api="chat",
            max_concurrency=256,
            request_timeout=s.request_timeout,
            engine_metrics=tuple(engines),
            progress=console.is_terminal,
            label=setup.label,
        )
        console.print(f"[bold]{setup.label}[/]: {info['router_command']}")
        engines_before = {e: engine_counters(e) for e in engines}
        cpu = (sum(g.cpu_seconds() for g in sims), router.cpu_seconds(), _self_cpu())
        busy0, all0 = machine_cpu_ticks()
        t0 = time.monotonic()
        result = asyncio.run(run_bench(config))
        info["bench_wall_s"] = round(time.monotonic() - t0, 1)
        busy1, all1 = machine_cpu_ticks()
        info["machine_busy_pct"] = round(100 * (busy1 - busy0) / max(1, all1 - all0), 1)
        info["cpu_s"] = {
            "sims": round(sum(g.cpu_seconds() for g in sims) - cpu[0], 1),
            "router": round(router.cpu_seconds() - cpu[1], 1),
            "client": round(_self_cpu() - cpu[2], 1),
        }
        info["engine_counters"] = {
            e: _delta(engines_before[e], engine_counters(e)) | {"role": role}
            for e, role in zip(engines, setup.roles, strict=True)
        }
        info["router_pd"] = router_pd(url)
        write_report(result, out_dir / slug)
    except Exception as exc:  # one setup failing must not lose the others' results
        info["failure"] = f"{type(exc).__name__}: {exc}"
        console.print(f"[red]{setup.label}: {info['failure']}[/]")
    finally:
        if router is not None:
            router.stop()
            info["router_log_tail"] = router.log_text()[-1500:]
        for g in sims:
            g.stop()
    return info, result


# -- readiness and counters -----------------------------------------------------------------------
def _wait_ready(url: str, n: int, router: Group, budget_s: float) -> float:
    """Seconds until the router lists the model and has fresh metrics and KV events for all ``n`` engines."""
    t0 = time.monotonic()
    why: str | None = "not asked yet"
    while time.monotonic() - t0 < budget_s:
        if (gone := router.exited()) is not None:
            raise RuntimeError(f"router: {gone}\n{router.log_text()[-2000:]}")
        try:
            status, body = get(url, "/engines")
            why = f"/engines: HTTP {status}"
            if status == 200:
                why = engines_not_ready(json.loads(body)["engines"], n, kv_events=True)
            if why is None:
                status, body = get(url, "/v1/models")
                models = [m.get("id") for m in json.loads(body).get("data", [])] if status == 200 else []
                why = None if MODEL in models else f"/v1/models lists {models}"
            if why is None:
                return time.monotonic() - t0
        except (OSError, http.client.HTTPException, ValueError, KeyError) as exc:
            why = f"{type(exc).__name__}: {exc}"
        time.sleep(0.2)
    raise RuntimeError(f"router not ready after {budget_s:.0f}s: {why}\n{router.log_text()[-2000:]}")


def _samples(url: str, prefixes: tuple[str, ...]) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of the /metrics samples whose family name starts with one of ``prefixes``."""
    try:
        status, body = get(url, "/metrics", timeout=5.0)
    except (OSError, http.client.HTTPException):
        return []
    if status != 200:
        return []
    text = body.decode(errors="replace")
    return [
        (sample.name, dict(sample.labels), sample.value)
        for family in text_string_to_metric_families(text)
        if family.name.startswith(prefixes)
        for sample in family.samples
    ]


def engine_counters(url: str) -> dict[str, Any]:
    """An engine's inter-token histogram (modelled seconds: count, cumulative count per bucket bound),
    finished requests and prompt tokens (computed, and pulled from a prefill engine)."""
    out: dict[str, Any] = {"itl_count": 0.0, "itl_buckets": {}, "requests": 0.0}
    out |= {"prompt_computed": 0.0, "prompt_pulled": 0.0}
    for name, labels, value in _samples(
        url, ("vllm:inter_token_latency", "vllm:request_success", "vllm:prompt")
    ):
        if name == "vllm:inter_token_latency_seconds_count":
            out["itl_count"] += value
        elif name == "vllm:inter_token_latency_seconds_bucket":
            le = float(labels["le"])
            out["itl_buckets"][le] = out["itl_buckets"].get(le, 0.0) + value
        elif name == "vllm:request_success_total":
            out["requests"] += value
        elif name == "vllm:prompt_tokens_by_source_total" and labels.get("source") == "local_compute":
            out["prompt_computed"] += value
        elif name == "vllm:prompt_tokens_by_source_total" and labels.get("source") == "external_kv_transfer":
            out["prompt_pulled"] += value
    return out


def _delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in after.items():
        if isinstance(value, dict):
            out[key] = {k: v - before[key].get(k, 0.0) for k, v in value.items()}
        else:
            out[key] = value - before.get(key, 0.0)
    return out


def router_pd(url: str) -> dict[str, Any]:
    """The router's P/D counters: prefills by outcome, fallbacks by reason, prefill time and tokens."""
    prefills: dict[str, float] = {}
    fallbacks: dict[str, float] = {}
    out: dict[str, Any] = {"prefills": prefills, "fallbacks": fallbacks}
    for name, labels, value in _samples(url, ("kvstack_pd_",)):
        if name == "kvstack_pd_prefills_total":
            prefills[labels["outcome"]] = prefills.get(labels["outcome"], 0.0) + value
        elif name == "kvstack_pd_fallbacks_total":
            fallbacks[labels["reason"]] = value
        elif name == "kvstack_pd_prefill_seconds_sum":
            out["prefill_seconds_sum"] = value
        elif name == "kvstack_pd_prefill_seconds_count":
            out["prefill_seconds_count"] = value
        elif name == "kvstack_pd_transferred_prompt_tokens_total":
            out["transferred_prompt_tokens"] = out.get("transferred_prompt_tokens", 0.0) + value
    return out


def _self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
