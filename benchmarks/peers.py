"""The peer routers and the load generator the router benchmarks need, installed when missing.

``ensure_peers``: the ``.venvs/peers`` virtualenv holding ``PEER_PACKAGES`` (vllm-router and sglang-router,
pinned; their pins stay out of kvstack's environment), created with pip. ``peer_router_command``: the
command line starting one of them in front of given engines. ``ensure_wrk``: Debian's wrk,
installed with apt-get when running as root. With ``allow_install`` false both fail with the command to run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from procs import REPO
from rich.console import Console

PEERS = REPO / ".venvs" / "peers"
PEER_PACKAGES = ("vllm-router==0.1.17", "sglang-router==0.3.2")
PEER_VERSIONS = {name: version for name, version in (p.split("==") for p in PEER_PACKAGES)}


def ensure_wrk(console: Console, allow_install: bool) -> str:
    found = shutil.which("wrk")
    if found:
        return found
    if not allow_install or os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SystemExit("wrk not found: install it with `apt-get update && apt-get install -y wrk` (Debian)")
    console.print(
        "[yellow]wrk not found: installing Debian's wrk (apt-get update && apt-get install -y wrk)[/]"
    )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, timeout=300)
    subprocess.run(["apt-get", "install", "-y", "-qq", "wrk"], check=True, env=env, timeout=300)
    found = shutil.which("wrk")
    if not found:
        raise SystemExit("apt-get installed wrk but it is not on PATH")
    return found


def ensure_peers(console: Console, allow_install: bool) -> Path:
    """The virtualenv holding the peer routers (their pins stay out of kvstack's environment)."""
    python = PEERS / "bin" / "python"
    if python.exists() and _peer_versions_ok(python):
        return python
    if not allow_install:
        raise SystemExit(f"{PEERS} lacks {' '.join(PEER_PACKAGES)}; run without --no-install")
    console.print(f"[yellow]installing {' '.join(PEER_PACKAGES)} into {PEERS} (pip, about a minute)[/]")
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(PEERS)], check=True, timeout=120)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *PEER_PACKAGES], check=True, timeout=600)
    if not _peer_versions_ok(python):
        raise SystemExit(f"{PEERS}: pip finished but {' '.join(PEER_PACKAGES)} are not importable")
    return python


def peer_router_command(
    kind: str, peers_python: Path, host: str, port: int, metrics_port: int, engines: list[str]
) -> list[str]:
    """``vllm-router`` or ``sglang-router`` from ``.venvs/peers`` on ``host:port`` routing to ``engines``, its
    Prometheus page on ``metrics_port``, warnings only (add ``--policy`` and the like after it)."""
    if kind == "vllm-router":
        cmd, level = [str(peers_python.parent / "vllm-router")], "warning"
    elif kind == "sglang-router":
        cmd, level = [str(peers_python), "-m", "sglang_router.launch_router"], "warn"
    else:
        raise ValueError(f"unknown peer router {kind!r}; known: {', '.join(PEER_VERSIONS)}")
    cmd += ["--host", host, "--port", str(port), "--worker-urls", *engines]
    return [*cmd, "--prometheus-host", host, "--prometheus-port", str(metrics_port), "--log-level", level]


def _peer_versions_ok(python: Path) -> bool:
    probe = "import importlib.metadata as m;print(m.version('vllm-router'), m.version('sglang-router'))"
    try:
        out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    wanted = " ".join(PEER_VERSIONS.values())
    return out.returncode == 0 and out.stdout.strip() == wanted
