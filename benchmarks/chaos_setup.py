"""What the chaos benchmark starts: engines it can kill and restart on the same ports, the cache server and
Redis, and the routers under test.

- `Engine`: real vLLM (CPU, dummy weights, KV events on) or one ``kvstack sim`` process, each in its own
  process group; ``kill`` sends SIGKILL to the group, ``start`` runs the same command on the same ports.
- `Service`: a ``kvstack cache-server`` (memory tier, a Redis tier) or a ``redis-server``, likewise.
- `Router`: ``kvstack router`` (kv-aware routing, the default scrape interval), vllm-router and
  sglang-router from ``.venvs/peers`` (their default policy), or production-stack's router from a command
  line the user supplies (``{port}``, ``{backends}``, ``{models}`` filled in). ``serves`` is true once a
  streamed chat through the router works and, for kvstack, ``/engines`` has fresh metrics (and KV events)
  for every engine; for sglang-router, once its health gauge shows every worker healthy.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import shlex
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peers import PEER_VERSIONS, peer_router_command
from procs import HOST, KVSTACK, REPO, Group, engines_not_ready, free_port, get

VLLM_PYTHON = REPO / ".venvs" / "vllm" / "bin" / "python"
MODEL = "tiny"
VLLM_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
CHUNK = 256  # the cache server's and the sims' connector chunk


@dataclass
class Process:
    """One command in its own process group, restartable with the same command (same ports)."""

    name: str
    cmd: list[str]
    logs: Path
    env: dict[str, str] = field(default_factory=dict)
    group: Group | None = None

    def start(self) -> None:
        self.group = Group.start(self.name, [self.cmd], self.logs / f"{self.name}.log", env=self.env)

    def kill(self) -> None:
        """SIGKILL the whole group: no shutdown, no goodbye to any client."""
        if self.group is not None:
            for proc in self.group.procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)

    def stop(self) -> None:
        if self.group is not None:
            self.group.stop(timeout=15)

    def exited(self) -> str | None:
        return None if self.group is None else self.group.exited()

    def log_tail(self) -> str:
        return "" if self.group is None else self.group.log_text()[-2000:]


@dataclass
class Engine(Process):
    url: str = ""

    def healthy(self) -> bool:
        with contextlib.suppress(OSError, http.client.HTTPException):
            return get(self.url, "/health", timeout=1.0)[0] == 200
        return False

    def wait_healthy(self, budget_s: float) -> float:
        """Seconds until /health answers 200."""
        return wait_for(self.healthy, budget_s, f"{self.name} ({self.url}) healthy", self)

    def served(self) -> float:
        """Requests this engine finished or is running, from its /metrics (0 when it does not answer)."""
        try:
            status, body = get(self.url, "/metrics", timeout=1.0)
        except (OSError, http.client.HTTPException):
            return 0.0
        names = ("vllm:request_success_total", "vllm:num_requests_running")
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in body.decode(errors="replace").splitlines()
            if status == 200 and line.split("{")[0].split(" ")[0] in names
        )

    def set_faults(self, faults: dict[str, Any] | None) -> None:
        """``kvstack sim``'s ``/admin/faults``: ``faults`` set, or all cleared with None."""
        host, port = self.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=5)
        try:
            if faults is None:
                conn.request("DELETE", "/admin/faults")
            else:
                conn.request(
                    "POST", "/admin/faults", json.dumps(faults), {"Content-Type": "application/json"}
                )
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"{self.url}/admin/faults: HTTP {resp.status} {resp.read()[:200]!r}")
        finally:
            conn.close()


def vllm_engine(name: str, model_dir: Path, logs: Path, core: int) -> Engine:
    """Real vLLM on CPU serving the tiny model with dummy weights, KV events published (zmq, replay), its
    worker pinned to ``core`` (by default every CPU engine pins core 0: two engines, and a restarting one,
    would share it; unpinned, their OpenMP threads thrash on a busy machine)."""
    port, events, replay = free_port(), free_port(), free_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events}",
        "replay_endpoint": f"tcp://*:{replay}",
    }
    cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    cmd += ["--served-model-name", MODEL, "--host", HOST, "--port", str(port), "--load-format", "dummy"]
    cmd += ["--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "2048"]
    cmd += ["--num-gpu-blocks-override", "64", "--enable-prompt-tokens-details", "--enable-scale-out"]
    cmd += ["--kv-events-config", json.dumps(config)]
    env = {**VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": str(core % (os.cpu_count() or 1))}
    return Engine(name, cmd, logs, env, url=f"http://{HOST}:{port}")


def sim_engine(name: str, model_dir: Path, logs: Path, cache_server: str | None) -> Engine:
    """One ``kvstack sim`` engine (block size 16), KV events (replay), its connector on ``cache_server``."""
    port, events, replay = free_port(), free_port(), free_port()
    cmd = [str(KVSTACK), "sim", "--host", HOST, "--port", str(port), "--model", str(model_dir)]
    cmd += ["--served-model-name", MODEL, "--block-size", "16", "--num-gpu-blocks", "2000"]
    cmd += ["--kv-events-port", str(events), "--kv-events-replay", "--kv-events-replay-port", str(replay)]
    cmd += ["--enable-prompt-tokens-details", "--log-level", "warning"]
    if cache_server is not None:
        cmd += ["--kv-cache-server", cache_server, "--kv-cache-chunk-size", str(CHUNK)]
    return Engine(name, cmd, logs, url=f"http://{HOST}:{port}")


@dataclass
class Service(Process):
    port: int = 0

    def answers(self) -> bool:
        """The port accepts a connection (and, for Redis, PING gets PONG)."""
        with contextlib.suppress(OSError), socket.create_connection((HOST, self.port), timeout=0.5) as s:
            if "redis" not in self.name:
                return True
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
        return False


def redis_server(logs: Path) -> Service:
    port = free_port()
    data = logs / "redis"
    data.mkdir(parents=True, exist_ok=True)
    cmd = ["redis-server", "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no"]
    return Service("redis-server", [*cmd, "--dir", str(data), "--maxmemory", "256mb"], logs, port=port)


def cache_server(logs: Path, redis_port: int) -> Service:
    """``kvstack cache-server``: a 64 MiB memory tier over a Redis tier."""
    port = free_port()
    cmd = [str(KVSTACK), "cache-server", "--bind", f"tcp://{HOST}:{port}", "--memory-gb", "0.0625"]
    cmd += ["--redis-url", f"redis://{HOST}:{redis_port}/0", "--chunk-size", str(CHUNK)]
    return Service("cache-server", [*cmd, "--node", "chaos", "--log-level", "warning"], logs, port=port)


@dataclass
class Router:
    name: str
    kind: str  # kvstack | vllm-router | sglang-router | production-stack
    note: str
    command: Callable[[int, int, list[str]], list[str]]  # (port, metrics port, engine URLs) -> argv
    kv_events: bool = False  # consumes the engines' KV events


def kvstack_router(model_dir: Path) -> Router:
    def command(port: int, metrics_port: int, engines: list[str]) -> list[str]:
        cmd = [str(KVSTACK), "router", "--host", HOST, "--port", str(port), "--routing", "kv-aware"]
        for url in engines:
            cmd += ["--engine", url]
        return [*cmd, "--tokenizer", str(model_dir), "--log-level", "warning"]

    note = "kvstack router --routing kv-aware (KV events, scrape interval 1 s, defaults otherwise)"
    return Router("kvstack", "kvstack", note, command, kv_events=True)


def peer_router(kind: str, peers_python: Path) -> Router:
    def command(port: int, metrics_port: int, engines: list[str]) -> list[str]:
        return peer_router_command(kind, peers_python, HOST, port, metrics_port, engines)

    return Router(kind, kind, f"{kind} {PEER_VERSIONS[kind]} (PyPI), default policy and retries", command)


def production_stack_router(template: str) -> Router:
    """The user's command line starting production-stack's router; ``{port}``, ``{backends}`` (engine URLs,
    comma-separated) and ``{models}`` (the model name once per engine) are filled in."""

    def command(port: int, metrics_port: int, engines: list[str]) -> list[str]:
        models = ",".join([MODEL] * len(engines))
        return shlex.split(template.format(port=port, backends=",".join(engines), models=models))

    return Router("production-stack", "production-stack", f"production-stack router: {template}", command)


def router_not_ready(router: Router, url: str, metrics_port: int, engines: list[str]) -> str | None:
    """None once ``router`` at ``url`` routes to all ``engines``; else what it still lacks."""
    try:
        if router.kind == "kvstack":
            status, body = get(url, "/engines", timeout=2.0)
            states = json.loads(body)["engines"] if status == 200 else []
            if (why := engines_not_ready(states, len(engines), kv_events=router.kv_events)) is not None:
                return why
        if router.kind == "sglang-router":
            status, body = get(f"http://{HOST}:{metrics_port}", "/metrics", timeout=2.0)
            healthy = len(re.findall(rb"^smg_worker_health\{[^}]*\} 1\b", body, re.M)) if status == 200 else 0
            if healthy < len(engines):
                return f"{healthy}/{len(engines)} workers healthy"
        return None if chat_works(url) else "a streamed chat through it failed"
    except (OSError, http.client.HTTPException, ValueError, KeyError) as exc:
        return f"{type(exc).__name__}: {exc}"


def chat_works(url: str) -> bool:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "ready?"}],
        "max_tokens": 2,
        "stream": True,
    }
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status == 200 and b"[DONE]" in resp.read()
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def kv_event_batches(router_url: str, engine: str) -> int | None:
    """KV event batches kvstack's router applied from ``engine`` (its /engines), None when unknown."""
    with contextlib.suppress(OSError, http.client.HTTPException, ValueError, KeyError):
        status, body = get(router_url, "/engines", timeout=1.0)
        for state in json.loads(body)["engines"] if status == 200 else []:
            if state["url"] == engine and state.get("kv_events"):
                return int(state["kv_events"]["batches"])
    return None


def wait_for(check: Callable[[], bool], budget_s: float, what: str, proc: Process | None = None) -> float:
    """Seconds until ``check()`` holds; raises after ``budget_s`` or when ``proc`` exits."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < budget_s:
        if check():
            return time.monotonic() - t0
        if proc is not None and (gone := proc.exited()) is not None:
            raise RuntimeError(f"{what}: {gone}\n{proc.log_tail()}")
        time.sleep(0.1)
    raise RuntimeError(f"{what}: not after {budget_s:.0f}s" + (f"\n{proc.log_tail()}" if proc else ""))
