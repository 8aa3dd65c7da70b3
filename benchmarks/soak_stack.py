"""The soak's processes on 127.0.0.1: a KV cache server, simulated engines (one process each, faults injected,
the cache server as their connector), ``kvstack router`` over them, and ``kvstack epp`` with real Envoy in
front over the same engines.

An engine restart is SIGKILL of its process group, then the same command on the same ports. A fault burst
adds one profile (`BURSTS`) to an engine's standing faults over POST /admin/faults and later restores them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from procs import DEV_BIN, HOST, KVSTACK, Group, engines_not_ready, free_port, get
from soak_load import MODEL

# Standing faults of every engine, as flags (a restarted engine gets them again) and as /admin/faults JSON.
BASE_FAULTS: dict[str, Any] = {
    "error_rate": 0.02,
    "error_codes": [429, 500, 503],
    "drop_rate": 0.02,
    "drop_after_chunks": 2,
    "hang_rate": 0.003,
    "first_token_delay": 0.0,
}
BURSTS: dict[str, dict[str, Any]] = {
    "503s": {"error_rate": 0.3, "error_codes": [503]},
    "slow-first-token": {"first_token_delay": 1.5},
    "drops": {"drop_rate": 0.25},
    "hangs": {"hang_rate": 0.05},
}
ENVOY = Path(os.environ.get("KVSTACK_ENVOY", DEV_BIN / "envoy"))
CHUNK = 64  # tokens per cache-server chunk (a multiple of the sims' block size, 16)


def _fault_flags() -> list[str]:
    f = BASE_FAULTS
    return [
        f"--error-rate={f['error_rate']}",
        f"--error-codes={','.join(map(str, f['error_codes']))}",
        f"--drop-rate={f['drop_rate']}",
        f"--drop-after-chunks={f['drop_after_chunks']}",
        f"--hang-rate={f['hang_rate']}",
    ]


def wait_http(url: str, path: str, budget_s: float, group: Group) -> None:
    deadline = time.monotonic() + budget_s
    while time.monotonic() < deadline:
        try:
            if get(url, path, timeout=2.0)[0] == 200:
                return
        except OSError:
            pass
        if (why := group.exited()) is not None:
            raise RuntimeError(f"{group.name}: {why}\n{group.log_text()[-2000:]}")
        time.sleep(0.2)
    raise RuntimeError(f"{group.name}: {url}{path} not 200 after {budget_s:.0f}s\n{group.log_text()[-2000:]}")


@dataclass
class Engine:
    """One simulated engine process on fixed ports."""

    index: int
    port: int
    events_port: int
    cmd: list[str]
    log: Path
    group: Group | None = None
    restarts: list[float] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> None:
        self.group = Group.start(f"engine{self.index}", [self.cmd], self.log)
        wait_http(self.url, "/health", 30.0, self.group)

    def kill(self) -> None:
        """SIGKILL, as a crash: no graceful shutdown."""
        assert self.group is not None
        for p in self.group.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)


@dataclass
class Stack:
    cache: Group
    engines: list[Engine]
    router: Group
    router_url: str
    epp: Group
    epp_url: str
    envoy: Group
    envoy_url: str
    envoy_admin: str

    def watched(self) -> dict[str, int]:
        """The processes whose resources the soak samples: name -> process group (the router's supervisor
        and its workers are one group; each other name is one process)."""
        return {
            "router": self.router.procs[0].pid,
            "epp": self.epp.procs[0].pid,
            "envoy": self.envoy.procs[0].pid,
            "cache-server": self.cache.procs[0].pid,
        }

    def stop(self) -> None:
        for g in (self.envoy, self.epp, self.router):
            g.stop()
        for e in self.engines:
            if e.group is not None:
                e.group.stop()
        self.cache.stop()


def start_stack(workdir: Path, n_engines: int, time_scale: float) -> Stack:
    """Everything up and ready: both front ends list every engine with fresh metrics."""
    logs = workdir / "logs"
    cache_port, cache_http = free_port(), free_port()
    cache = Group.start(
        "cache-server",
        [
            [
                *(
                    str(KVSTACK),
                    "cache-server",
                    "--bind",
                    f"tcp://{HOST}:{cache_port}",
                    "--memory-gb",
                    "0.25",
                ),
                *("--chunk-size", str(CHUNK), "--http-port", str(cache_http), "--http-host", HOST),
            ]
        ],
        logs / "cache-server.log",
    )
    started: list[Group] = [cache]
    engines: list[Engine] = []
    try:
        wait_http(f"http://{HOST}:{cache_http}", "/health", 30.0, cache)
        for i in range(n_engines):
            port, ev = free_port(), free_port()
            cmd = [str(KVSTACK), "sim", "--host", HOST, "--port", str(port), "--kv-events-port", str(ev)]
            cmd += ["--served-model-name", MODEL, "--time-scale", str(time_scale), "--seed", str(i)]
            cmd += ["--kv-cache-server", f"tcp://{HOST}:{cache_port}", "--kv-cache-chunk-size", str(CHUNK)]
            cmd += [*_fault_flags(), "--log-level", "warning"]
            engines.append(Engine(i, port, ev, cmd, logs / f"engine{i}.log"))
        for e in engines:
            e.start()
        engine_args = [a for e in engines for a in ("--engine", e.url)]
        common = ["--scrape-interval", "1", "--log-level", "warning", *engine_args]
        router_port = free_port()
        router = Group.start(
            "router",
            [
                [
                    *(str(KVSTACK), "router", "--host", HOST, "--port", str(router_port), *common),
                    *("--timeout-first-byte", "5", "--timeout-idle", "5", "--max-attempts", "3"),
                ]
            ],
            logs / "router.log",
        )
        started.append(router)
        grpc_port, epp_http = free_port(), free_port()
        epp = Group.start(
            "epp",
            [
                [
                    *(str(KVSTACK), "epp", "--host", HOST, "--grpc-port", str(grpc_port)),
                    *("--http-port", str(epp_http), "--fallbacks", "2", *common),
                ]
            ],
            logs / "epp.log",
        )
        started.append(epp)
        envoy_port, admin_port = free_port(), free_port()
        config = workdir / "envoy.yaml"
        envoy_cfg = [str(KVSTACK), "envoy-config", "--picker", f"{HOST}:{grpc_port}", "--host", HOST]
        envoy_cfg += ["--port", str(envoy_port), "--admin-host", HOST, "--admin-port", str(admin_port)]
        envoy_cfg += ["--retries", "2", "--idle-timeout", "10", "-o", str(config)]
        envoy_cfg += [a for e in engines for a in ("--engine", f"{HOST}:{e.port}")]
        Group.start("envoy-config", [envoy_cfg], logs / "envoy-config.log").procs[0].wait(timeout=60)
        envoy = Group.start(
            "envoy",
            [
                [
                    *(str(ENVOY), "-c", str(config), "--concurrency", "1"),
                    *("--disable-hot-restart", "--log-level", "info"),
                ]
            ],
            logs / "envoy.log",
        )
        started.append(envoy)
        stack = Stack(
            cache,
            engines,
            router,
            f"http://{HOST}:{router_port}",
            epp,
            f"http://{HOST}:{epp_http}",
            envoy,
            f"http://{HOST}:{envoy_port}",
            f"http://{HOST}:{admin_port}",
        )
        wait_http(stack.envoy_admin, "/ready", 30.0, envoy)
        _wait_picker_healthy(envoy, stack.envoy_admin)
        for group, url in ((router, stack.router_url), (epp, stack.epp_url)):
            _wait_engines(group, url, n_engines)
        return stack
    except BaseException:
        for g in reversed(started):
            g.stop()
        for e in engines:
            if e.group is not None:
                e.group.stop()
        raise


def _wait_picker_healthy(envoy: Group, admin: str, budget_s: float = 30.0) -> None:
    """Envoy is LIVE before its first gRPC health check of the picker passes; until then it answers 503
    (no healthy upstream) without asking the picker."""
    deadline = time.monotonic() + budget_s
    stat = "cluster.picker.membership_healthy"
    while time.monotonic() < deadline:
        body = get(admin, f"/stats?filter=^{stat}$")[1].decode()
        values = [line.split(": ", 1)[1] for line in body.splitlines() if line.startswith(f"{stat}: ")]
        if values and int(values[0]) > 0:
            return
        time.sleep(0.2)
    raise RuntimeError(f"envoy: no healthy picker after {budget_s:.0f}s\n{envoy.log_text()[-2000:]}")


def _wait_engines(group: Group, url: str, n: int, budget_s: float = 30.0) -> None:
    deadline = time.monotonic() + budget_s
    why: str | None = "not asked yet"
    while time.monotonic() < deadline:
        try:
            status, body = get(url, "/engines")
            if status == 200:
                why = engines_not_ready(json.loads(body)["engines"], n, kv_events=False)
                if why is None:
                    return
        except OSError as e:
            why = str(e)
        if (exited := group.exited()) is not None:
            raise RuntimeError(f"{group.name}: {exited}\n{group.log_text()[-2000:]}")
        time.sleep(0.2)
    raise RuntimeError(f"{group.name} at {url}: {why}\n{group.log_text()[-2000:]}")
