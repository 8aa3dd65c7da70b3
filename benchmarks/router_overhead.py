"""Router overhead against a zero-delay backend: kvstack router, vllm-router and sglang-router side by side.

One run, one backend (``benchmarks/backend_zero.py``: answers at once, ``--backend-procs`` processes on one
port), and every target in turn on free 127.0.0.1 ports, each in its own process group (stopped by that
group's id):

- ``direct``: wrk straight to the backend (the floor every router adds to);
- ``kvstack``: ``kvstack router --engine <backend>`` (default routing preset), one process;
- ``kvstack xW``: ``kvstack router --workers W`` (W processes sharing the port through SO_REUSEPORT);
- ``vllm-router``: ``vllm-router==0.1.17``, default policy (``cache_aware``: it asks the engine's
  ``/v1/completions/render`` for token ids before every request, as it would ask vLLM);
- ``vllm-router rr``: the same with ``--policy round_robin`` (no render call: its bare proxy cost);
- ``sglang-router``: ``sglang-router==0.3.2`` (``python -m sglang_router.launch_router``), default policy.

The peers are Rust routers installed in ``.venvs/peers`` (created here when missing) and given no model or
tokenizer path: nothing is downloaded. wrk comes from Debian (installed here with apt-get when missing).

Per target and response kind (``plain`` JSON, ``stream`` = 64 SSE chunks + ``[DONE]``, each its own
socket write on the backend):

1. *low load*: wrk ``-c 4`` with a Lua ``delay()`` think time calibrated so that the offered rate is
   ``--rate`` (500 req/s, plain) or ``--stream-rate`` (100 req/s, stream); latency percentiles from wrk's
   histogram; *added* latency = target percentile - direct percentile;
2. *throughput*: wrk ``-c 64``, no think time, requests/s.

Then *interleaved latency rounds* (``--latency-rounds``, 5): every target runs at once, and each round
measures the low plain load on direct and on every target one after the other (``--round-duration`` s
each, the order rotating), so a noisy minute on this shared machine falls on all of them alike. The added
p99 the verdict reads is the median over rounds of (target p99 - direct p99 of the same round).
Each round starts with 3 s of an idle event loop's 1 ms timer (``machine_info.timer_wakeup_lag``): its
p99 lag is the machine's own wake-up floor in that minute, shown under the rounds.

Each run also records the CPU seconds of the target's processes, the backend's, wrk's and the machine's
busy share (``/proc``): load generator, routers and backend share the machine's cores, so the CPU cost per
request is the comparison that contention distorts least. The backend counts the requests it answered by
path, so upstream calls per client request are checked, not assumed.

Last, *memory*: a fresh one-process ``kvstack router`` serves ``--rss-requests`` (200k) requests (wrk
``-c 64``, every ``--rss-stream-every``-th request streamed) while its RSS is sampled from
``/proc/<pid>/status``; flat means every sample after warm-up within +-10% of the first.

Bounded: all traffic on 127.0.0.1, every wrk run has ``-d`` and a subprocess timeout, every HTTP check a
timeout, and the run skips what is left once ``--deadline`` (900 s) is near. Results: a table on stdout and
``bench-results/router_overhead.json``; logs and the Lua script in ``bench-results/router_overhead/``.

    .venvs/dev/bin/python benchmarks/router_overhead.py [--quick] [--skip-peers] [--workers 2]
"""

# kvstack ships no py.typed marker, so mypy run on this file alone would refuse its (typed) modules.
# mypy: disable-error-code="import-untyped"
from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
import resource
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from machine_info import machine, machine_cpu_ticks, process_cpu_seconds, timer_wakeup_lag
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
DEV_BIN = REPO / ".venvs" / "dev" / "bin"
KVSTACK = DEV_BIN / "kvstack"
PEERS = REPO / ".venvs" / "peers"
PEER_PACKAGES = ("vllm-router==0.1.17", "sglang-router==0.3.2")
BACKEND = Path(__file__).resolve().parent / "backend_zero.py"
HOST = "127.0.0.1"
MODEL = "zero"
CHUNKS = 64
PLAIN_BODY = b'{"model":"zero","prompt":"Say something short about routers.","max_tokens":64}'
STREAM_BODY = PLAIN_BODY[:-1] + b',"stream":true}'
LOW_CONNECTIONS = 4
MAX_CONNECTIONS = 64
WRK_TIMEOUT = "5s"
WAKEUP_PROBE_S = 3.0  # per interleaved round: machine_info.timer_wakeup_lag

# wrk's main and thread Lua states both read the environment, so whether delay() and request() exist
# is decided identically in all of them (wrk checks for delay() in the main state).
LUA_SCRIPT = r"""-- POST load for benchmarks/router_overhead.py. Settings from the environment:
--   WRK_MODE          plain | stream | mixed (every WRK_STREAM_EVERY-th request streamed)
--   WRK_THINK_MS      mean pause before each request on a connection (0 = back to back), uniform in
--                     [0.5, 1.5] x the mean, rounded at random to whole ms (wrk's timer unit) so that
--                     the mean is kept
local mode = os.getenv("WRK_MODE") or "plain"
local think = tonumber(os.getenv("WRK_THINK_MS") or "0")
local every = tonumber(os.getenv("WRK_STREAM_EVERY") or "2")
local plain_body = '__PLAIN__'
local stream_body = '__STREAM__'

wrk.method = "POST"
wrk.path = "/v1/completions"
wrk.headers["Content-Type"] = "application/json"
wrk.body = (mode == "stream") and stream_body or plain_body

if mode == "mixed" then
  local plain_req, stream_req, n = nil, nil, 0
  function request()
    if plain_req == nil then
      plain_req = wrk.format(nil, nil, nil, plain_body)
      stream_req = wrk.format(nil, nil, nil, stream_body)
    end
    n = n + 1
    if n % every == 0 then return stream_req end
    return plain_req
  end
end

if think > 0 then
  function delay()
    return math.floor(think * (0.5 + math.random()) + math.random())
  end
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"requests":%d,"duration_us":%d,"bytes":%d,"errors":{"connect":%d,"read":%d,"write":%d,' ..
    '"status":%d,"timeout":%d},"latency_us":{"min":%d,"mean":%.1f,"stdev":%.1f,"max":%d,"p50":%d,' ..
    '"p90":%d,"p99":%d,"p999":%d}}\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
    latency.min, latency.mean, latency.stdev, latency.max, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency:percentile(99.9)))
end
"""


# -- /proc ----------------------------------------------------------------------------------------


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


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def children_cpu_seconds() -> float:
    """CPU of this process's waited-for children (wrk runs): the delta around one run is wrk's."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


# -- processes ------------------------------------------------------------------------------------
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


# -- HTTP checks (stdlib: this process makes no load, wrk does) ----------------------------------------
def post(url: str, body: bytes, timeout: float = 5.0) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def get(url: str, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def check_responses(url: str) -> str | None:
    """None when a plain and a streamed completion come back whole through ``url``; else what is wrong."""
    try:
        status, body = post(url, PLAIN_BODY)
        if status != 200 or not json.loads(body).get("choices"):
            return f"plain completion: status {status}, body {body[:200]!r}"
        status, body = post(url, STREAM_BODY)
        events = [line[6:] for line in body.split(b"\n") if line.startswith(b"data: ")]
        tokens = [e for e in events if e != b"[DONE]" and json.loads(e).get("choices")]
        if status != 200 or len(tokens) != CHUNKS or events[-1:] != [b"[DONE]"]:
            return f"stream: status {status}, {len(tokens)} token events, last {events[-1:]!r}"
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def wait_serving(url: str, group: Group, budget_s: float, in_a_row: int = 20) -> tuple[bool, float, str]:
    """Wait until ``url`` answers ``in_a_row`` plain completions with 200, each on a new connection (so that
    every process of a SO_REUSEPORT group is likely asked); (ok, seconds waited, last answer)."""
    t0 = time.monotonic()
    last, good = "no answer", 0
    while time.monotonic() - t0 < budget_s:
        if (why := group.exited()) is not None:
            return False, time.monotonic() - t0, why
        status = 0
        with contextlib.suppress(OSError, http.client.HTTPException):
            status, body = post(url, PLAIN_BODY, timeout=2.0)
            last = "200" if status == 200 else f"{status} {body[:160].decode(errors='replace')}"
        good = good + 1 if status == 200 else 0
        if good >= in_a_row:
            return True, time.monotonic() - t0, last
        if status != 200:
            time.sleep(0.2)
    return False, time.monotonic() - t0, last


_COUNT_LINE = re.compile(r'backend_zero_requests_total\{method="([^"]+)",path="([^"]+)"\} (\d+)')


def backend_counts(url: str) -> dict[str, int]:
    """Requests the backend answered so far, by "METHOD path"."""
    try:
        _, body = get(url, "/metrics")
    except (OSError, http.client.HTTPException):
        return {}
    return {f"{m} {p}": int(n) for m, p, n in _COUNT_LINE.findall(body.decode())}


# -- setup ----------------------------------------------------------------------------------------
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


def _peer_versions_ok(python: Path) -> bool:
    probe = "import importlib.metadata as m;print(m.version('vllm-router'), m.version('sglang-router'))"
    try:
        out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    wanted = " ".join(p.split("==")[1] for p in PEER_PACKAGES)
    return out.returncode == 0 and out.stdout.strip() == wanted


# -- targets --------------------------------------------------------------------------------------
@dataclass
class Target:
    name: str
    start: Callable[[str, Path], tuple[Group, str]]  # (backend url, log dir) -> (processes, base url)
    note: str


def kvstack_target(workers: int) -> Target:
    def start(backend: str, logs: Path) -> tuple[Group, str]:
        port = free_port()
        args = ["router", "--port", str(port), "--engine", backend, "--log-level", "warning"]
        cmds = [[str(KVSTACK), *args, "--workers", str(workers)]]
        name = "kvstack" if workers == 1 else f"kvstack-x{workers}"
        return Group.start(name, cmds, logs / f"{name}.log"), f"http://{HOST}:{port}"

    if workers == 1:
        return Target("kvstack", start, "kvstack router, default routing preset, 1 process")
    return Target(
        f"kvstack x{workers}",
        start,
        f"kvstack router, default routing preset, {workers} processes on one port (SO_REUSEPORT)",
    )


def vllm_router_target(peers_python: Path, policy: str | None) -> Target:
    def start(backend: str, logs: Path) -> tuple[Group, str]:
        port, prom = free_port(), free_port()
        cmd = [str(peers_python.parent / "vllm-router"), "--host", HOST, "--port", str(port)]
        cmd += ["--worker-urls", backend, "--prometheus-host", HOST, "--prometheus-port", str(prom)]
        cmd += ["--log-level", "warning"]
        if policy:
            cmd += ["--policy", policy]
        name = "vllm-router" + (f"-{policy}" if policy else "")
        return Group.start(name, [cmd], logs / f"{name}.log", env=_OFFLINE), f"http://{HOST}:{port}"

    if policy is None:
        return Target("vllm-router", start, "vllm-router 0.1.17, default policy (cache_aware)")
    return Target("vllm-router rr", start, f"vllm-router 0.1.17, --policy {policy}")


def sglang_router_target(peers_python: Path) -> Target:
    def start(backend: str, logs: Path) -> tuple[Group, str]:
        port, prom = free_port(), free_port()
        cmd = [str(peers_python), "-m", "sglang_router.launch_router", "--host", HOST, "--port", str(port)]
        cmd += ["--worker-urls", backend, "--prometheus-host", HOST, "--prometheus-port", str(prom)]
        cmd += ["--log-level", "warn"]
        return Group.start(
            "sglang-router", [cmd], logs / "sglang-router.log", env=_OFFLINE
        ), f"http://{HOST}:{port}"

    return Target("sglang-router", start, "sglang-router 0.3.2, default policy (cache_aware)")


# The peers get no model or tokenizer path; these keep any Hugging Face client offline all the same.
_OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


# -- one wrk run ----------------------------------------------------------------------------------
@dataclass
class Run:
    target: str
    kind: str  # plain | stream
    load: str  # low | max
    connections: int
    think_ms: float
    duration_s: float
    wait_after_warmup_s: float = 0.0
    requests: int = 0
    rps: float = 0.0  # every response, non-2xx included
    ok_rps: float = 0.0  # 2xx responses only: the throughput compared
    p50_ms: float | None = None
    p90_ms: float | None = None
    p99_ms: float | None = None
    p999_ms: float | None = None
    max_ms: float | None = None
    errors: dict[str, int] = field(default_factory=dict)
    target_cpu_s: float = 0.0
    backend_cpu_s: float = 0.0
    wrk_cpu_s: float = 0.0
    machine_busy_pct: float = 0.0
    target_cpu_us_per_req: float | None = None
    upstream_per_req: dict[str, float] = field(default_factory=dict)
    command: str = ""
    failure: str | None = None


def wrk_command(wrk: str, lua: Path, url: str, connections: int, duration_s: float) -> list[str]:
    timing = [f"-c{connections}", f"-d{duration_s:g}s", "--timeout", WRK_TIMEOUT]
    return [wrk, "-t1", *timing, "--latency", "-s", str(lua), url]


def run_wrk(
    wrk: str,
    lua: Path,
    url: str,
    *,
    mode: str,
    connections: int,
    duration_s: float,
    think_ms: float = 0.0,
    stream_every: int = 2,
    log: Path | None = None,
) -> tuple[dict[str, Any] | None, str, str]:
    """One wrk run; (its WRK_JSON summary or None, the command line with its environment, output)."""
    env = {"WRK_MODE": mode, "WRK_THINK_MS": f"{think_ms:.3f}", "WRK_STREAM_EVERY": str(stream_every)}
    cmd = wrk_command(wrk, lua, url, connections, duration_s)
    shown = " ".join(f"{k}={v}" for k, v in env.items()) + " " + shlex.join(cmd)
    try:
        out = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=duration_s + 20,
            env={**os.environ, **env},
            cwd=str(lua.parent),
        )
        text = out.stdout + out.stderr
    except subprocess.TimeoutExpired as exc:
        text = f"wrk did not finish: {exc}"
    if log is not None:
        with log.open("a") as f:
            f.write(f"$ {shown}\n{text}\n")
    for line in text.splitlines():
        if line.startswith("WRK_JSON "):
            return json.loads(line[len("WRK_JSON ") :]), shown, text
    return None, shown, text


def measure(
    *,
    wrk: str,
    lua: Path,
    target: str,
    url: str,
    group: Group | None,
    backend: Group,
    backend_url: str,
    kind: str,
    load: str,
    connections: int,
    duration_s: float,
    rate: float | None,
    warmup_s: float,
    log: Path,
) -> Run:
    """Warm up (and calibrate the think time for ``rate``), then one measured wrk run."""
    think = 1000.0 * connections / rate if rate else 0.0
    warm, _, _ = run_wrk(
        wrk, lua, url, mode=kind, connections=connections, duration_s=warmup_s, think_ms=think, log=log
    )
    if rate and warm and warm["requests"]:
        # Each connection waits think + latency between sends: take the warm-up's mean latency off.
        think = max(0.5, 1000.0 * connections / rate - warm["latency_us"]["mean"] / 1000.0)
    run = Run(target, kind, load, connections, round(think, 2), duration_s)
    if group is not None:
        # The warm-up's end cut streams; kvstack may have opened its circuit over it (see the docs).
        ok, run.wait_after_warmup_s, last = wait_serving(url, group, 15)
        run.wait_after_warmup_s = round(run.wait_after_warmup_s, 1)
        if not ok:
            run.failure = f"not serving after the warm-up: {last}"
            return run
    counts0 = backend_counts(backend_url)
    cpu0 = group.cpu_seconds() if group else 0.0
    back0, wrk0 = backend.cpu_seconds(), children_cpu_seconds()
    busy0, all0 = machine_cpu_ticks()
    summary, run.command, text = run_wrk(
        wrk, lua, url, mode=kind, connections=connections, duration_s=duration_s, think_ms=think, log=log
    )
    busy1, all1 = machine_cpu_ticks()
    run.target_cpu_s = round((group.cpu_seconds() - cpu0) if group else 0.0, 2)
    run.backend_cpu_s = round(backend.cpu_seconds() - back0, 2)
    run.wrk_cpu_s = round(children_cpu_seconds() - wrk0, 2)
    run.machine_busy_pct = round(100 * (busy1 - busy0) / max(1, all1 - all0), 1)
    counts1 = backend_counts(backend_url)
    if summary is None:
        run.failure = f"no wrk summary: {text[-300:]}"
        return run
    run.requests = summary["requests"]
    seconds = summary["duration_us"] / 1e6
    run.rps = round(summary["requests"] / seconds, 1)
    run.ok_rps = round((summary["requests"] - summary["errors"]["status"]) / seconds, 1)
    lat = summary["latency_us"]
    run.p50_ms, run.p90_ms, run.p99_ms = lat["p50"] / 1000, lat["p90"] / 1000, lat["p99"] / 1000
    run.p999_ms, run.max_ms = lat["p999"] / 1000, lat["max"] / 1000
    run.errors = {k: v for k, v in summary["errors"].items() if v}
    if run.requests:
        if group is not None:
            run.target_cpu_us_per_req = round(1e6 * run.target_cpu_s / run.requests, 1)
        for key, n in counts1.items():
            delta = n - counts0.get(key, 0)
            if delta and key.startswith("POST"):
                run.upstream_per_req[key] = round(delta / run.requests, 3)
    return run


# -- memory ---------------------------------------------------------------------------------------
def rss_soak(
    *,
    wrk: str,
    lua: Path,
    backend_url: str,
    logs: Path,
    requests: int,
    warmup: int,
    stream_every: int,
    budget_s: float,
    console: Console,
) -> dict[str, Any]:
    """A fresh one-process kvstack router under wrk -c 64 until ``requests`` reached it; RSS sampled."""
    group, url = kvstack_target(1).start(backend_url, logs)
    out: dict[str, Any] = {"command": shlex.join(group.cmds[0]), "samples": []}
    wrk_proc: subprocess.Popen[bytes] | None = None
    try:
        ok, _, last = wait_serving(url, group, 20)
        if not ok:
            out["failure"] = f"router not serving: {last}"
            return out
        pid = group.procs[0].pid
        out["rss_before_traffic_mb"] = round((rss_bytes(pid) or 0) / 2**20, 1)
        env = {"WRK_MODE": "mixed", "WRK_THINK_MS": "0", "WRK_STREAM_EVERY": str(stream_every)}
        cmd = wrk_command(wrk, lua, url, MAX_CONNECTIONS, budget_s)
        out["wrk_command"] = " ".join(f"{k}={v}" for k, v in env.items()) + " " + shlex.join(cmd)
        base = backend_counts(backend_url).get("POST /v1/completions", 0)
        with (logs / "rss-wrk.log").open("wb") as log:
            wrk_proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}, cwd=str(lua.parent)
            )
        t0 = time.monotonic()
        next_report = 0
        while wrk_proc.poll() is None and time.monotonic() - t0 < budget_s + 5:
            time.sleep(0.5)
            done = backend_counts(backend_url).get("POST /v1/completions", 0) - base
            rss = rss_bytes(pid)
            if rss is None:
                out["failure"] = "router exited during the soak"
                break
            out["samples"].append(
                {"t_s": round(time.monotonic() - t0, 1), "requests": done, "rss_mb": round(rss / 2**20, 2)}
            )
            if done >= next_report:
                console.print(f"  rss soak: {done} requests, RSS {rss / 2**20:.1f} MB")
                next_report += 25_000
            if done >= requests:
                break
        if wrk_proc.poll() is None:
            wrk_proc.send_signal(signal.SIGINT)  # wrk prints its summary on SIGINT
            try:
                wrk_proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                wrk_proc.kill()
                wrk_proc.wait(timeout=5)
        out["elapsed_s"] = round(time.monotonic() - t0, 1)
        out["log_errors"] = _count_tracebacks(group.log_text())
    finally:
        if wrk_proc is not None and wrk_proc.poll() is None:
            wrk_proc.kill()
            wrk_proc.wait(timeout=5)
        group.stop()
    return summarize_rss(out, requests, warmup)


def summarize_rss(out: dict[str, Any], requests: int, warmup: int) -> dict[str, Any]:
    """Start (first sample at or after ``warmup`` requests), end, max; flat = all within +-10% of start."""
    samples = out["samples"]
    after = [s for s in samples if s["requests"] >= warmup]
    out["target_requests"] = requests
    out["requests_done"] = samples[-1]["requests"] if samples else 0
    if not after:
        out["flat"] = None
        return out
    start, end = after[0]["rss_mb"], after[-1]["rss_mb"]
    peak = max(s["rss_mb"] for s in after)
    low = min(s["rss_mb"] for s in after)
    out.update(
        start_mb=start,
        start_at_requests=after[0]["requests"],
        end_mb=end,
        max_mb=peak,
        min_mb=low,
        end_vs_start_pct=round(100 * (end - start) / start, 1),
        max_vs_start_pct=round(100 * (peak - start) / start, 1),
        flat=bool(peak <= 1.1 * start and low >= 0.9 * start),
    )
    return out


def _count_tracebacks(text: str) -> dict[str, int]:
    """'Error handling request' tracebacks in a kvstack log, by final exception line."""
    counts: dict[str, int] = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Traceback"):
            j = i + 1
            while j < len(lines) and (lines[j].startswith(" ") or not lines[j]):
                j += 1
            if j < len(lines):
                key = lines[j][:160]
                counts[key] = counts.get(key, 0) + 1
    return counts


# -- the run --------------------------------------------------------------------------------------
def run(args: argparse.Namespace, console: Console, out: dict[str, Any]) -> None:
    started = time.monotonic()

    def time_left() -> float:
        return float(args.deadline) - (time.monotonic() - started)

    wrk = ensure_wrk(console, not args.no_install)
    out["wrk"] = (
        subprocess.run([wrk, "--version"], capture_output=True, text=True).stdout.split("\n")[0].strip()
    )
    logs = args.results.parent / "router_overhead"
    logs.mkdir(parents=True, exist_ok=True)
    for old in logs.glob("*.log"):
        old.unlink()
    lua = logs / "load.lua"
    lua.write_text(
        LUA_SCRIPT.replace("__PLAIN__", PLAIN_BODY.decode()).replace("__STREAM__", STREAM_BODY.decode())
    )
    out["lua_script"] = str(lua)

    targets: list[Target | None] = [None, kvstack_target(1)]
    if args.workers > 1:
        targets.append(kvstack_target(args.workers))
    if not args.skip_peers:
        peers_python = ensure_peers(console, not args.no_install)
        targets += [
            vllm_router_target(peers_python, None),
            vllm_router_target(peers_python, "round_robin"),
            sglang_router_target(peers_python),
        ]

    backend_cmd = [str(DEV_BIN / "python"), str(BACKEND), "--port", "0", "--procs", str(args.backend_procs)]
    backend_cmd += ["--chunks", str(CHUNKS)]
    backend = Group.start("backend", [backend_cmd], logs / "backend.log")
    out["backend_command"] = shlex.join(backend_cmd)
    try:
        backend_url = _wait_banner(backend, r"backend_zero: (http://\S+)", 15)
        for target in targets:
            name = "direct" if target is None else target.name
            if time_left() < 60:
                console.print(f"[yellow]skipping {name}: run deadline near[/]")
                out["skipped"].append(name)
                continue
            measure_target(args, console, out, wrk, lua, logs, name, target, backend, backend_url)
        if args.latency_rounds and time_left() > 90:
            out["rounds"] = latency_rounds(
                args, console, wrk, lua, logs, targets, backend, backend_url, time_left
            )
        elif args.latency_rounds:
            out["skipped"].append("latency rounds")
        if args.rss_requests and time_left() > 40:
            console.print(f"memory: kvstack router, up to {args.rss_requests} requests ...")
            out["rss"] = rss_soak(
                wrk=wrk,
                lua=lua,
                backend_url=backend_url,
                logs=logs,
                requests=args.rss_requests,
                warmup=args.rss_warmup,
                stream_every=args.rss_stream_every,
                budget_s=min(args.rss_budget, time_left() - 25),
                console=console,
            )
        elif args.rss_requests:
            out["skipped"].append("rss")
    finally:
        backend.stop()


def measure_target(
    args: argparse.Namespace,
    console: Console,
    out: dict[str, Any],
    wrk: str,
    lua: Path,
    logs: Path,
    name: str,
    target: Target | None,
    backend: Group,
    backend_url: str,
) -> None:
    info: dict[str, Any] = {
        "name": name,
        "note": "wrk straight to the backend" if target is None else target.note,
    }
    out["targets"].append(info)
    group: Group | None = None
    url = backend_url
    try:
        if target is not None:
            group, url = target.start(backend_url, logs)
            info["commands"] = [shlex.join(c) for c in group.cmds]
            ok, waited, last = wait_serving(url, group, 30)
            info["startup_s"] = round(waited, 1)
            if not ok:
                info["failure"] = f"not serving after {waited:.0f}s: {last}\n{group.log_text()[-1500:]}"
                console.print(f"[red]{name}: {info['failure']}[/]")
                return
        problem = check_responses(url)
        info["responses_check"] = problem or "ok"
        if problem:
            console.print(f"[red]{name}: response check failed: {problem}[/]")
        log = logs / f"wrk-{name.replace(' ', '-')}.log"
        plan = [
            ("plain", "low", LOW_CONNECTIONS, args.low_duration, args.rate),
            ("plain", "max", MAX_CONNECTIONS, args.max_duration, None),
            ("stream", "low", LOW_CONNECTIONS, args.low_duration, args.stream_rate),
            ("stream", "max", MAX_CONNECTIONS, args.max_duration, None),
        ]
        for kind, load, conns, duration, rate in plan:
            if group is not None:
                # A stream cut by the previous run's end may have opened kvstack's circuit (see docs).
                ok, waited, last = wait_serving(url, group, 15)
                if waited > 1:
                    info.setdefault("waits_before_runs_s", []).append(round(waited, 1))
                if not ok:
                    info.setdefault("failures", []).append(f"{kind}/{load}: not serving: {last}")
                    continue
            console.print(
                f"{name}: {kind} {f'{rate:g} req/s' if rate else 'max'} (-c {conns}, {duration:g} s) ..."
            )
            r = measure(
                wrk=wrk,
                lua=lua,
                target=name,
                url=url,
                group=group,
                backend=backend,
                backend_url=backend_url,
                kind=kind,
                load=load,
                connections=conns,
                duration_s=duration,
                rate=rate,
                warmup_s=args.warmup,
                log=log,
            )
            out["runs"].append(asdict(r))
            if r.failure or r.errors:
                console.print(f"[yellow]  {name} {kind}/{load}: {r.failure or r.errors}[/]")
        if group is not None:
            info["rss_mb_at_end"] = [round((rss_bytes(p) or 0) / 2**20, 1) for p in group.pids()]
            info["log_errors"] = _count_tracebacks(group.log_text())
    finally:
        if group is not None:
            group.stop()


def latency_rounds(
    args: argparse.Namespace,
    console: Console,
    wrk: str,
    lua: Path,
    logs: Path,
    targets: Sequence[Target | None],
    backend: Group,
    backend_url: str,
    time_left: Callable[[], float],
) -> dict[str, Any]:
    """Added latency at the low plain rate, interleaved: every target runs at once (idle but for its
    turn) and each round measures direct and every target one after the other, in a rotating order, so
    that the machine's noise of a given minute falls on all of them. Added = target - direct of the same
    round; the median over rounds is what the verdict reads."""
    running: list[tuple[str, Group | None, str]] = [("direct", None, backend_url)]
    result: dict[str, Any] = {"rounds": [], "duration_s": args.round_duration, "rate": args.rate}
    try:
        for target in targets:
            if target is None:
                continue
            group, url = target.start(backend_url, logs)
            ok, _, last = wait_serving(url, group, 30)
            if not ok:
                console.print(f"[yellow]latency rounds: {target.name} not serving ({last}); left out[/]")
                group.stop()
                continue
            running.append((target.name, group, url))
        log = logs / "wrk-rounds.log"
        for i in range(args.latency_rounds):
            if time_left() < 30 + len(running) * (args.round_duration + args.warmup + 2):
                result["stopped_after_rounds"] = i
                break
            order = running[i % len(running) :] + running[: i % len(running)]
            console.print(f"latency round {i + 1}/{args.latency_rounds}: {', '.join(n for n, _, _ in order)}")
            # The machine's own wake-up lag this round, while every target idles: the floor under any tail.
            this_round: dict[str, Any] = {"timer_wakeup": timer_wakeup_lag(WAKEUP_PROBE_S)}
            for name, group, url in order:
                r = measure(
                    wrk=wrk,
                    lua=lua,
                    target=name,
                    url=url,
                    group=group,
                    backend=backend,
                    backend_url=backend_url,
                    kind="plain",
                    load=f"round{i + 1}",
                    connections=LOW_CONNECTIONS,
                    duration_s=args.round_duration,
                    rate=args.rate,
                    warmup_s=args.warmup,
                    log=log,
                )
                this_round[name] = {
                    "p50_ms": r.p50_ms,
                    "p99_ms": r.p99_ms,
                    "rps": r.rps,
                    "machine_busy_pct": r.machine_busy_pct,
                    "failure": r.failure,
                    "errors": r.errors,
                }
            result["rounds"].append(this_round)
    finally:
        for _, group, _ in running:
            if group is not None:
                group.stop()
    summary: dict[str, Any] = {}
    for name, _, _ in running[1:]:
        added50, added99 = [], []
        for rnd in result["rounds"]:
            mine, base = rnd.get(name), rnd.get("direct")
            if mine and base and not mine["failure"] and not base["failure"]:
                added50.append(round(mine["p50_ms"] - base["p50_ms"], 3))
                added99.append(round(mine["p99_ms"] - base["p99_ms"], 3))
        summary[name] = {
            "added_p50_ms_by_round": added50,
            "added_p99_ms_by_round": added99,
            "added_p50_ms_median": statistics.median(added50) if added50 else None,
            "added_p99_ms_median": statistics.median(added99) if added99 else None,
        }
    wake = [rnd["timer_wakeup"]["p99_ms"] for rnd in result["rounds"]]
    result["timer_wakeup_p99_ms_by_round"] = wake
    result["timer_wakeup_p99_ms_median"] = statistics.median(wake) if wake else None
    result["summary"] = summary
    return result


def rounds_table(rounds: dict[str, Any]) -> Table:
    table = Table(
        title=f"Interleaved latency rounds at {rounds['rate']:g} req/s (added = target - direct, same round)"
    )
    for col in ("target", "added p50 ms by round", "added p99 ms by round", "median +p50", "median +p99"):
        table.add_column(col, justify="left" if col == "target" else "right")
    for name, s in rounds["summary"].items():
        table.add_row(
            name,
            " ".join(f"{x:.2f}" for x in s["added_p50_ms_by_round"]),
            " ".join(f"{x:.2f}" for x in s["added_p99_ms_by_round"]),
            _fmt(s["added_p50_ms_median"]),
            _fmt(s["added_p99_ms_median"]),
        )
    wake = rounds.get("timer_wakeup_p99_ms_by_round") or []
    if wake:  # results from before the probe existed have none
        table.add_row(
            "machine: idle loop's 1 ms timer, p99 lag",
            "",
            " ".join(f"{x:.2f}" for x in wake),
            "",
            _fmt(rounds["timer_wakeup_p99_ms_median"]),
        )
    return table


def _wait_banner(group: Group, pattern: str, budget_s: float) -> str:
    deadline = time.monotonic() + budget_s
    while time.monotonic() < deadline:
        m = re.search(pattern, group.log_text())
        if m:
            return m.group(1)
        if (why := group.exited()) is not None:
            raise RuntimeError(f"{group.name}: {why}\n{group.log_text()[-2000:]}")
        time.sleep(0.1)
    raise RuntimeError(f"{group.name}: no start-up banner after {budget_s:.0f}s\n{group.log_text()[-2000:]}")


# -- reporting ------------------------------------------------------------------------------------
def _find(runs: list[dict[str, Any]], target: str, kind: str, load: str) -> dict[str, Any] | None:
    for r in runs:
        if r["target"] == target and r["kind"] == kind and r["load"] == load and not r["failure"]:
            return r
    return None


def summarize(runs: list[dict[str, Any]], targets: Sequence[str]) -> list[dict[str, Any]]:
    """One row per target: added latency at low load vs direct, throughput at -c 64 and ratios."""
    rows = []
    for t in targets:
        row: dict[str, Any] = {"target": t}
        for kind in ("plain", "stream"):
            low, base = _find(runs, t, kind, "low"), _find(runs, "direct", kind, "low")
            top = _find(runs, t, kind, "max")
            if low:
                row[f"{kind}_low_rps"] = low["rps"]
                row[f"{kind}_low_p50_ms"] = low["p50_ms"]
                row[f"{kind}_low_p99_ms"] = low["p99_ms"]
                row[f"{kind}_low_errors"] = sum(low["errors"].values())
                row[f"{kind}_low_cpu_us_per_req"] = low["target_cpu_us_per_req"]
            if low and base:
                row[f"{kind}_added_p50_ms"] = round(low["p50_ms"] - base["p50_ms"], 3)
                row[f"{kind}_added_p99_ms"] = round(low["p99_ms"] - base["p99_ms"], 3)
            if top:
                row[f"{kind}_max_rps"] = top["ok_rps"]
                row[f"{kind}_max_errors"] = sum(top["errors"].values())
                row[f"{kind}_cpu_us_per_req"] = top["target_cpu_us_per_req"]
                row[f"{kind}_upstream_per_req"] = top["upstream_per_req"]
                row[f"{kind}_machine_busy_pct"] = top["machine_busy_pct"]
        rows.append(row)
    for row in rows:
        for peer in ("vllm-router", "vllm-router rr", "sglang-router", "direct"):
            ref = next((r for r in rows if r["target"] == peer), None)
            if ref is None or ref is row:
                continue
            for kind in ("plain", "stream"):
                a, b = row.get(f"{kind}_max_rps"), ref.get(f"{kind}_max_rps")
                if a and b:
                    row[f"{kind}_rps_vs_{peer}"] = round(a / b, 2)
    return rows


def targets_verdict(
    rows: list[dict[str, Any]], rate: float, rounds: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The issue's targets for every kvstack row: throughput >= 0.5 x vllm-router's, added p99 <= 2 ms
    (the median of the interleaved rounds when they ran, else the single low-load run)."""
    verdict: dict[str, Any] = {}
    for row in rows:
        if not row["target"].startswith("kvstack"):
            continue
        v: dict[str, Any] = {}
        for kind in ("plain", "stream"):
            ratio = row.get(f"{kind}_rps_vs_vllm-router")
            v[f"{kind}_throughput_vs_vllm_router"] = ratio
            v[f"{kind}_throughput_target_met"] = None if ratio is None else ratio >= 0.5
        added = row.get("plain_added_p99_ms")
        interleaved = (rounds or {}).get("summary", {}).get(row["target"], {}).get("added_p99_ms_median")
        if interleaved is not None:
            v["added_p99_single_run_ms"] = added
            added = interleaved
            v["added_p99_from"] = "median of interleaved rounds"
        v[f"added_p99_ms_at_{rate:g}_rps"] = added
        v["added_p99_target_met"] = None if added is None else added <= 2.0
        verdict[row["target"]] = v
    return verdict


def _fmt(x: Any, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def results_table(rows: list[dict[str, Any]], rate: float, stream_rate: float) -> Table:
    table = Table(title="Router overhead against a zero-delay backend (wrk; added = target - direct)")
    cols = [
        "target",
        f"plain +p50 ms @{rate:g}/s",
        f"plain +p99 ms @{rate:g}/s",
        "plain req/s c64",
        "/vllm-router",
        "/sglang-router",
        "CPU us/req",
        f"stream +p50 ms @{stream_rate:g}/s",
        f"stream +p99 ms @{stream_rate:g}/s",
        "stream req/s c64",
        "/vllm-router",
        "/sglang-router",
        "CPU us/req",
        "upstream POSTs/req",
    ]
    for c in cols:
        table.add_column(c, justify="left" if c == "target" else "right")
    for r in rows:
        ups = r.get("plain_upstream_per_req") or {}
        table.add_row(
            r["target"],
            _fmt(r.get("plain_added_p50_ms")),
            _fmt(r.get("plain_added_p99_ms")),
            _rps_cell(r, "plain"),
            _fmt(r.get("plain_rps_vs_vllm-router")),
            _fmt(r.get("plain_rps_vs_sglang-router")),
            _fmt(r.get("plain_cpu_us_per_req"), 0),
            _fmt(r.get("stream_added_p50_ms")),
            _fmt(r.get("stream_added_p99_ms")),
            _rps_cell(r, "stream"),
            _fmt(r.get("stream_rps_vs_vllm-router")),
            _fmt(r.get("stream_rps_vs_sglang-router")),
            _fmt(r.get("stream_cpu_us_per_req"), 0),
            _upstream(ups),
        )
    return table


def _rps_cell(row: dict[str, Any], kind: str) -> str:
    errors = row.get(f"{kind}_max_errors")
    return _fmt(row.get(f"{kind}_max_rps"), 0) + (f" ({errors} err)" if errors else "")


def _upstream(per_req: dict[str, float]) -> str:
    """Upstream POSTs per client request, by the last path segment: ``completions 1, render 1``."""
    return ", ".join(f"{key.rsplit('/', 1)[-1]} {n:g}" for key, n in per_req.items()) or "-"


def runs_table(runs: list[dict[str, Any]]) -> Table:
    table = Table(title="Every measured run")
    for c in (
        "target",
        "kind",
        "load",
        "-c",
        "think ms",
        "2xx req/s",
        "p50 ms",
        "p90 ms",
        "p99 ms",
        "p99.9 ms",
        "errors",
        "target CPU s",
        "backend CPU s",
        "wrk CPU s",
        "machine busy%",
    ):
        table.add_column(c, justify="left" if c in ("target", "kind", "load") else "right")
    for r in runs:
        table.add_row(
            r["target"],
            r["kind"],
            r["load"],
            str(r["connections"]),
            _fmt(r["think_ms"], 1),
            _fmt(r["ok_rps"], 0),
            _fmt(r["p50_ms"], 3),
            _fmt(r["p90_ms"], 3),
            _fmt(r["p99_ms"], 3),
            _fmt(r["p999_ms"], 3),
            r["failure"] or (" ".join(f"{k}={v}" for k, v in r["errors"].items()) or "0"),
            _fmt(r["target_cpu_s"], 1),
            _fmt(r["backend_cpu_s"], 1),
            _fmt(r["wrk_cpu_s"], 1),
            _fmt(r["machine_busy_pct"], 0),
        )
    return table


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="short runs and a 20k-request memory soak")
    parser.add_argument("--skip-peers", action="store_true", help="only direct and kvstack")
    parser.add_argument(
        "--no-install", action="store_true", help="fail instead of installing wrk or the peers"
    )
    parser.add_argument(
        "--workers", type=int, default=2, help="processes of the 'kvstack xW' target (1 = none)"
    )
    parser.add_argument("--backend-procs", type=int, default=2, help="backend_zero processes (SO_REUSEPORT)")
    parser.add_argument("--rate", type=float, default=500.0, help="offered req/s of the low-load plain runs")
    parser.add_argument("--stream-rate", type=float, default=100.0, help="offered req/s of low-load streams")
    parser.add_argument("--low-duration", type=float, default=10.0, help="seconds of each low-load run")
    parser.add_argument("--max-duration", type=float, default=8.0, help="seconds of each -c 64 run")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of warm-up before each run")
    parser.add_argument(
        "--latency-rounds", type=int, default=5, help="interleaved low-load rounds of every target (0 = none)"
    )
    parser.add_argument("--round-duration", type=float, default=6.0, help="seconds of each round's run")
    parser.add_argument("--rss-requests", type=int, default=200_000, help="memory soak length (0 = skip)")
    parser.add_argument("--rss-warmup", type=int, default=10_000, help="requests before the RSS baseline")
    parser.add_argument("--rss-stream-every", type=int, default=8, help="every Nth soak request streams")
    parser.add_argument("--rss-budget", type=float, default=240.0, help="seconds the memory soak may take")
    parser.add_argument("--deadline", type=float, default=900.0, help="seconds the whole run may take")
    parser.add_argument("--results", type=Path, default=REPO / "bench-results" / "router_overhead.json")
    args = parser.parse_args(argv)
    args.results = args.results.resolve()
    if args.quick:
        args.low_duration, args.max_duration, args.warmup = 4.0, 3.0, 1.0
        args.rss_requests, args.rss_warmup, args.rss_budget = 20_000, 2_000, 60.0
        args.latency_rounds, args.round_duration = min(args.latency_rounds, 2), 4.0
    console = Console() if sys.stdout.isatty() else Console(width=220)
    command = shlex.join([sys.executable, *sys.argv])
    console.print(f"command: {command}")
    if not KVSTACK.exists():
        raise SystemExit(f"{KVSTACK} not found: run `make dev` first")
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    args.results.parent.mkdir(parents=True, exist_ok=True)
    host, t0 = machine(), time.monotonic()
    console.print(
        f"machine: {host['cpus']} cores ({host['cpu_model']}), busy {host['busy_pct_before_start']:.0f}% "
        "before the run; wrk, the routers and the backend share these cores"
    )
    if host["busy_pct_before_start"] > 20:
        console.print(
            f"[yellow]the machine was {host['busy_pct_before_start']:.0f}% busy before the run (other "
            "processes): latencies and throughput will be skewed; see the machine busy% column[/]"
        )
    out: dict[str, Any] = {
        "targets": [],
        "runs": [],
        "skipped": [],
        "rss": None,
        "rounds": None,
        "stopped": None,
    }
    try:
        run(args, console, out)
    except KeyboardInterrupt:
        out["stopped"] = "interrupted; results are partial"
    except Exception as exc:  # keep and report what was measured before the failure
        out["stopped"] = f"run failed: {type(exc).__name__}: {exc}"
        console.print_exception()

    names = [t["name"] for t in out["targets"]]
    rows = summarize(out["runs"], names)
    verdict = targets_verdict(rows, args.rate, out["rounds"])
    console.print(runs_table(out["runs"]))
    console.print(results_table(rows, args.rate, args.stream_rate))
    if out["rounds"]:
        console.print(rounds_table(out["rounds"]))
    for t in out["targets"]:
        if t.get("failure") or t.get("failures") or t.get("responses_check", "ok") != "ok":
            console.print(
                f"[red]{t['name']}: {t.get('failure') or t.get('failures') or t['responses_check']}[/]"
            )
        if t.get("waits_before_runs_s"):
            console.print(
                f"{t['name']}: waited {t['waits_before_runs_s']} s before runs for it to serve again"
            )
    for name, v in verdict.items():
        console.print(f"targets, {name}: {v}")
    rss = out["rss"]
    if rss and rss.get("flat") is not None:
        console.print(
            f"memory, kvstack router: {rss['requests_done']} requests; RSS {rss['start_mb']} MB at "
            f"{rss['start_at_requests']} requests, {rss['end_mb']} MB at the end, max {rss['max_mb']} MB "
            f"({rss['max_vs_start_pct']:+.1f}%): {'flat' if rss['flat'] else 'NOT flat'} (+-10%)"
        )
    elif rss:
        console.print(f"[red]memory soak: {rss.get('failure', 'no samples')}[/]")
    report = {
        "command": command,
        "machine": host,
        "setup": {
            "backend": out.get("backend_command"),
            "wrk": out.get("wrk"),
            "lua_script": out.get("lua_script"),
            "plain_body": PLAIN_BODY.decode(),
            "stream_body": STREAM_BODY.decode(),
            "chunks_per_stream": CHUNKS,
            "low_load": {
                "connections": LOW_CONNECTIONS,
                "plain_rate": args.rate,
                "stream_rate": args.stream_rate,
            },
            "max_load": {"connections": MAX_CONNECTIONS},
            "durations_s": {"low": args.low_duration, "max": args.max_duration, "warmup": args.warmup},
        },
        "targets": out["targets"],
        "summary": rows,
        "verdict": verdict,
        "runs": out["runs"],
        "rss": rss,
        "latency_rounds": out["rounds"],
        "skipped": out["skipped"],
        "stopped": out["stopped"],
        "elapsed_s": round(time.monotonic() - t0, 1),
    }
    args.results.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"results: {args.results} ({report['elapsed_s']} s)")
    return 1 if out["stopped"] else 0


if __name__ == "__main__":
    sys.exit(main())
