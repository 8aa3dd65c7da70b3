"""Engine servers for tests: real vLLM (its own virtualenv) and ``kvstack sim``, as subprocesses.

Servers bind 127.0.0.1 on free ports, run in their own process group, and are stopped by that group's id
(never by name). Start-up waits on /health with a deadline and shows the server's log tail when it fails.
Tests that need the vLLM virtualenv call ``require_vllm()``: it skips without one, or fails when
KVSTACK_REQUIRE_VLLM=1 (as `make test` and CI set it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from support.ports import free_port
from support.processes import kill_group, spawn, stop_group

REPO = Path(__file__).resolve().parents[2]
# vLLM's CPU backend binds a server's compute threads to the cores it does not reserve for its scheduler: on a
# 2-core machine every engine to core 0. Engines started here take the usable cores in turn instead, so two
# engines of one test do not share one core while the other idles.
_VLLM_CORES = sorted(os.sched_getaffinity(0))
_vllm_started = 0


def vllm_python() -> Path:
    return Path(os.environ.get("KVSTACK_VLLM_PYTHON", REPO / ".venvs" / "vllm" / "bin" / "python"))


def vllm_missing_reason() -> str | None:
    """Why real vLLM cannot run here, or None when it can."""
    py = vllm_python()
    if not py.exists():
        return f"no vLLM virtualenv at {py} (run `make vllm`, or set KVSTACK_VLLM_PYTHON)"
    return None


def require_vllm() -> None:
    """Skip the test without the vLLM virtualenv (fail instead when KVSTACK_REQUIRE_VLLM=1)."""
    reason = vllm_missing_reason()
    if reason is None:
        return
    if os.environ.get("KVSTACK_REQUIRE_VLLM") == "1":
        pytest.fail(f"real vLLM is required here but {reason}")
    pytest.skip(reason)


@dataclass
class EngineProcess:
    """A running engine server and what a test needs to reach it."""

    kind: str
    url: str
    model: str
    events_endpoint: str
    replay_endpoint: str | None
    proc: subprocess.Popen[bytes]
    log_path: Path
    block_size: int
    extra: dict[str, object] = field(default_factory=dict)
    cmd: list[str] = field(default_factory=list)  # how it was started (``respawn`` runs it again)
    env: dict[str, str] | None = None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 30.0) -> None:
        stop_group(self.proc, timeout)

    def kill(self) -> None:
        """SIGKILL the server's process group (and reap it)."""
        kill_group(self.proc)

    def start_again(self) -> None:
        """Run the same command again on the same ports (a new process: empty cache, KV-event seq from 0).
        Returns at once; the caller waits for /health."""
        self.proc = spawn(self.cmd, self.log_path, env=self.env, cwd=self.log_path.parent)


def wait_healthy(proc: subprocess.Popen[bytes], url: str, log_path: Path, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"server exited with {proc.returncode} before becoming healthy:\n{tail}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    tail = log_path.read_text(errors="replace")[-4000:]
    raise RuntimeError(f"server at {url} not healthy after {deadline_s:.0f}s:\n{tail}")


def start_vllm(
    model_dir: Path,
    workdir: Path,
    *,
    served_name: str = "tiny",
    max_model_len: int = 2048,
    num_gpu_blocks: int | None = 64,
    replay: bool = True,
    extra_args: list[str] | None = None,
    deadline_s: float = 300.0,
    kv_transfer_config: dict[str, object] | None = None,
    env: dict[str, str] | None = None,
) -> EngineProcess:
    """Start real vLLM (CPU) serving ``model_dir`` with dummy weights and KV events on.

    ``kv_transfer_config`` becomes ``--kv-transfer-config`` (a KV connector); ``env`` is added to the
    server's environment (e.g. ``PYTHONPATH`` so that vLLM imports a connector from this checkout)."""
    port, ev_port = free_port(), free_port()
    replay_port = free_port() if replay else None
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{ev_port}"}
    if replay_port:
        events["replay_endpoint"] = f"tcp://*:{replay_port}"
    cmd = [
        str(vllm_python()),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        served_name,
        "--load-format",
        "dummy",
        "--dtype",
        "bfloat16",
        "--enforce-eager",
        "--max-model-len",
        str(max_model_len),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enable-prompt-tokens-details",
        "--enable-scale-out",
        "--kv-events-config",
        json.dumps(events),
    ]
    if num_gpu_blocks is not None:
        cmd += ["--num-gpu-blocks-override", str(num_gpu_blocks)]
    if kv_transfer_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    cmd += extra_args or []
    server_env = dict(os.environ)
    # Dev mode serves /reset_prefix_cache, which tests use to start from an empty prefix cache.
    server_env.update({"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1"})
    global _vllm_started
    if len(_VLLM_CORES) > 1:
        server_env["VLLM_CPU_OMP_THREADS_BIND"] = str(_VLLM_CORES[_vllm_started % len(_VLLM_CORES)])
    _vllm_started += 1
    server_env.update(env or {})
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / f"vllm-{port}.log"
    proc = spawn(cmd, log_path, env=server_env, cwd=log_path.parent)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log_path, deadline_s)
    except Exception:
        EngineProcess("vllm", url, served_name, "", None, proc, log_path, 128).stop()
        raise
    return EngineProcess(
        "vllm",
        url,
        served_name,
        f"tcp://127.0.0.1:{ev_port}",
        f"tcp://127.0.0.1:{replay_port}" if replay_port else None,
        proc,
        log_path,
        block_size=128,
        cmd=cmd,
        env=server_env,
    )


def start_sim(
    workdir: Path,
    *,
    model_dir: Path | None = None,
    served_name: str = "tiny",
    block_size: int = 128,
    num_gpu_blocks: int = 64,
    max_model_len: int = 2048,
    replay: bool = True,
    extra_args: list[str] | None = None,
    deadline_s: float = 60.0,
) -> EngineProcess:
    """Start ``kvstack sim`` (one engine) as a subprocess configured like the vLLM fixture."""
    port, ev_port = free_port(), free_port()
    replay_port = free_port() if replay else None
    cmd = [
        sys.executable,
        "-m",
        "kvstack.cli",
        "sim",
        "--served-model-name",
        served_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--block-size",
        str(block_size),
        "--num-gpu-blocks",
        str(num_gpu_blocks),
        "--max-model-len",
        str(max_model_len),
        "--enable-prompt-tokens-details",
        "--kv-events-port",
        str(ev_port),
        "--log-level",
        "warning",
    ]
    if model_dir is not None:
        cmd += ["--model", str(model_dir)]
    if replay_port:
        cmd += ["--kv-events-replay", "--kv-events-replay-port", str(replay_port)]
    cmd += extra_args or []
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / f"sim-{port}.log"
    proc = spawn(cmd, log_path, cwd=log_path.parent)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log_path, deadline_s)
    except Exception:
        EngineProcess("sim", url, served_name, "", None, proc, log_path, block_size).stop()
        raise
    return EngineProcess(
        "sim",
        url,
        served_name,
        f"tcp://127.0.0.1:{ev_port}",
        f"tcp://127.0.0.1:{replay_port}" if replay_port else None,
        proc,
        log_path,
        block_size=block_size,
        cmd=cmd,
    )


def fresh_prompt(tag: int, n: int) -> list[int]:
    """Token ids keyed by ``tag`` (distinct first block per tag), avoiding the special ids 0-2."""
    return [3 + (tag * 7919 + i * 31) % 2000 for i in range(n)]
