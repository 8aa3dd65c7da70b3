"""wrk against one target: the load script, the request bodies, one measured run and the checks around it.

``LUA_SCRIPT`` makes wrk send plain, streamed or mixed completions, with a think time for a set rate.
``measure`` warms up (calibrating the think time to the rate), waits until the target serves again, then
records one `Run`: wrk's latency summary, the CPU of the target (and of each of its processes, when named),
the backend, wrk and the whole machine, and the backend's upstream calls per client request
(``backend_zero_requests_total``).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import resource
import shlex
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from machine_info import machine_cpu_ticks
from procs import Group, get

CHUNKS = 64
PLAIN_BODY = b'{"model":"zero","prompt":"Say something short about routers.","max_tokens":64}'
STREAM_BODY = PLAIN_BODY[:-1] + b',"stream":true}'
LOW_CONNECTIONS = 4
MAX_CONNECTIONS = 64
WRK_TIMEOUT = "5s"


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
    cpu_s_by_process: dict[str, float] = field(default_factory=dict)  # targets of several processes
    cpu_us_per_req_by_process: dict[str, float] = field(default_factory=dict)
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
    processes: Sequence[str] = (),
) -> Run:
    """Warm up (and calibrate the think time for ``rate``), then one measured wrk run; with ``processes``
    (names of ``group``'s commands) the target's CPU also per process."""
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
    each0 = group.cpu_seconds_each() if group and processes else []
    back0, wrk0 = backend.cpu_seconds(), children_cpu_seconds()
    busy0, all0 = machine_cpu_ticks()
    summary, run.command, text = run_wrk(
        wrk, lua, url, mode=kind, connections=connections, duration_s=duration_s, think_ms=think, log=log
    )
    busy1, all1 = machine_cpu_ticks()
    run.target_cpu_s = round((group.cpu_seconds() - cpu0) if group else 0.0, 2)
    if group and processes:
        each1 = group.cpu_seconds_each()
        run.cpu_s_by_process = {n: round(b - a, 3) for n, a, b in zip(processes, each0, each1, strict=True)}
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
        run.cpu_us_per_req_by_process = {
            n: round(1e6 * s / run.requests, 1) for n, s in run.cpu_s_by_process.items()
        }
        for key, n in counts1.items():
            delta = n - counts0.get(key, 0)
            if delta and key.startswith("POST"):
                run.upstream_per_req[key] = round(delta / run.requests, 3)
    return run
