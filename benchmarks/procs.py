"""Processes a benchmark starts and the plain HTTP it sends them; the repository's paths.

A `Group` is one or more processes, each started in its own session (its pid is its process group id),
logging to one file, and stopped by those group ids, never by name. ``get`` is a stdlib GET with a
timeout, for checks and reads while the load comes from wrk or ``kvstack.bench``. ``OFFLINE`` keeps any
Hugging Face client from the network.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import shlex
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from machine_info import process_cpu_seconds

REPO = Path(__file__).resolve().parents[1]
DEV_BIN = REPO / ".venvs" / "dev" / "bin"
KVSTACK = DEV_BIN / "kvstack"
# kvstack as `pip install .` builds it, request path compiled (`make compiled`); the dev install: sources.
COMPILED = REPO / ".cache" / "compiled"
HOST = "127.0.0.1"
# Peer routers get no model or tokenizer path; these keep any Hugging Face client offline all the same.
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def kvstack_build_env(build: str) -> dict[str, str]:
    """The environment that makes ``KVSTACK`` run ``build``: "compiled" (the shipped build) or "source"."""
    if build == "source":
        return {}
    if not (COMPILED / ".built").exists():
        raise SystemExit(f"{COMPILED} not found: run `make compiled` first (or pass --build source)")
    return {"PYTHONPATH": str(COMPILED)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def group_pids(pgid: int) -> list[int]:
    """Every live process in process group ``pgid``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2 :].split()[2]) == pgid:
            pids.append(int(entry.name))
    return pids


@dataclass
class Group:
    """Processes started in their own session (pid = process group id), logging to one file."""

    name: str
    cmds: list[list[str]]
    procs: list[subprocess.Popen[bytes]]
    log_path: Path

    @classmethod
    def start(
        cls, name: str, cmds: list[list[str]], log_path: Path, env: dict[str, str] | None = None
    ) -> Group:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        procs = []
        with log_path.open("ab") as log:
            for cmd in cmds:
                procs.append(
                    subprocess.Popen(
                        cmd,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        cwd=str(REPO),
                        env={**os.environ, **(env or {})},
                    )
                )
        return cls(name, cmds, procs, log_path)

    def pids(self) -> list[int]:
        """Every process of every group (backend_zero forks its extra processes into its group)."""
        return [pid for p in self.procs if p.poll() is None for pid in group_pids(p.pid)]

    def cpu_seconds(self) -> float:
        return sum(process_cpu_seconds(pid) for pid in self.pids())

    def cpu_seconds_each(self) -> list[float]:
        """CPU seconds of each started command (with what it forked into its group), in ``cmds`` order."""
        return [sum(process_cpu_seconds(pid) for pid in group_pids(p.pid)) for p in self.procs]

    def exited(self) -> str | None:
        for p in self.procs:
            if p.poll() is not None:
                return f"{shlex.join(p.args)} exited with {p.returncode}"  # type: ignore[arg-type]
        return None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=5)
            # backend_zero's forked processes are in the same group; make sure none outlives its parent.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)


def get(url: str, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """(status, body) of ``GET path`` on ``url`` (``http://host:port``)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def engines_not_ready(states: list[dict[str, Any]], n: int, *, kv_events: bool) -> str | None:
    """None when a kvstack router's ``/engines`` lists ``n`` engines, each with fresh metrics and (with
    ``kv_events``) routing on a connected KV event subscription; else what it still lacks."""
    if len(states) < n:
        return f"/engines lists {len(states)} engines"
    for s in states:
        if not s["metrics"] or s["metrics"]["stale"]:
            return f"{s['url']}: no fresh metrics yet"
        if kv_events:
            events = s.get("kv_events") or {}
            if s["routing_knowledge"] != "kv-events" or not events.get("connected"):
                return f"{s['url']}: knowledge {s['routing_knowledge']}, kv_events {events}"
    return None


_ENGINE_LINE = re.compile(r"engine (\d+): (http://\S+?)/v1\b")


def wait_engines(group: Group, n: int, budget_s: float = 30.0) -> list[str]:
    """The engine URLs the sim prints once all ``n`` serve."""
    deadline = time.monotonic() + budget_s
    while time.monotonic() < deadline:
        found = dict(_ENGINE_LINE.findall(group.log_text()))
        if len(found) >= n:
            return [found[str(i)] for i in range(n)]
        if (why := group.exited()) is not None:
            raise RuntimeError(f"sim: {why}\n{group.log_text()[-2000:]}")
        time.sleep(0.1)
    raise RuntimeError(f"sim: {n} engines not up after {budget_s:.0f}s\n{group.log_text()[-2000:]}")
