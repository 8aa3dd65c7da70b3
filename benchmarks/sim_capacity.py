"""How many concurrent streams one ``kvstack sim`` process serves at the modelled inter-token latency.

Starts ``kvstack sim`` on free 127.0.0.1 ports (its own process group, stopped by its group id), then:

1. one engine, K concurrent streaming ``/v1/completions`` for K in 50, 100, 200, 400, 800 (50, 200 with
   ``--quick``): a ~64-token prompt, ``max_tokens`` 128, ``ignore_eos``, ``stream_options.include_usage``,
   all K started together;
2. ``--engines 16`` in one process, 25 streams per engine (400 in all), checking that every engine has its
   own ``/metrics`` (``vllm:num_requests_running`` seen per engine during the run) and its own
   ``/kv_event_sources``.

Per level it reports completed/failed streams, TTFT, the inter-chunk gap (ITL) p50/p99 seen by the client
against the modelled ITL at that batch size (``step_overhead + decode_base + decode_per_seq * batch``),
tokens/s, and the CPU% of the simulator (``/proc/<pid>/stat`` utime+stime), of this client and of the whole
machine (``/proc/stat``): the client shares the cores with the simulator, and other work skews latencies. A
level *holds* when every stream completes and ITL p50 <= 1.25 x modelled; the largest K that holds is the
stream capacity of one simulator process.

Bounded: every request has a timeout, the run stops itself before ``--deadline`` seconds (default 270),
and all traffic goes to 127.0.0.1. Results: a table on stdout and ``bench-results/sim_capacity.json``.

    .venvs/dev/bin/python benchmarks/sim_capacity.py [--quick]
"""

# kvstack ships no py.typed marker, so mypy run on this file alone would refuse its (typed) modules.
# mypy: disable-error-code="import-untyped"
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from machine_info import machine, machine_cpu_ticks
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from kvstack.openai.sse import DONE_PAYLOAD, SSEParser

REPO = Path(__file__).resolve().parents[1]
KVSTACK = REPO / ".venvs" / "dev" / "bin" / "kvstack"
HOST = "127.0.0.1"

LEVELS = (50, 100, 200, 400, 800)
QUICK_LEVELS = (50, 200)
MULTI_ENGINES = 16
STREAMS_PER_ENGINE = 25
PROMPT_TOKENS = 64
MAX_TOKENS = 128
HOLD_RATIO = 1.25
# The simulator's default latency model, in seconds at --time-scale 1.
STEP_OVERHEAD = 0.001
PREFILL_PER_TOKEN = 0.00005
DECODE_BASE = 0.008
DECODE_PER_SEQ = 0.0001
MAX_NUM_BATCHED_TOKENS = 8192
MODEL = "kvstack-sim"
# Every engine on its own free port (0), read back from the start-up banner; the latency model is the
# simulator's default, passed explicitly so the modelled ITL below stays in step with it.
SIM_FLAGS = {
    "--host": HOST,
    "--port": "0",
    "--kv-events-port": "0",
    "--served-model-name": MODEL,
    "--block-size": "16",
    "--num-gpu-blocks": "100000",
    "--max-num-seqs": "1024",
    "--max-num-batched-tokens": str(MAX_NUM_BATCHED_TOKENS),
    "--step-overhead": str(STEP_OVERHEAD),
    "--prefill-per-token": str(PREFILL_PER_TOKEN),
    "--decode-base": str(DECODE_BASE),
    "--decode-per-seq": str(DECODE_PER_SEQ),
    "--log-level": "warning",
}
METRICS_POLL_S = 1.0
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- pure pieces --------------------------------------------------------------------------------------
def modelled_itl(batch: int) -> float:
    """Seconds between tokens of one sequence in a pure-decode batch of ``batch`` sequences."""
    return STEP_OVERHEAD + DECODE_BASE + DECODE_PER_SEQ * batch


def modelled_duration(batch: int) -> float:
    """Seconds the latency model needs to prefill and decode ``batch`` requests started together."""
    prefill_tokens = batch * PROMPT_TOKENS
    prefill_steps = -(-prefill_tokens // MAX_NUM_BATCHED_TOKENS)
    prefill = prefill_steps * STEP_OVERHEAD + prefill_tokens * PREFILL_PER_TOKEN
    return prefill + MAX_TOKENS * modelled_itl(batch)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0-100), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def prompt_ids(level: str, stream_index: int) -> list[int]:
    """A 64-token prompt (byte ids 3-258) unique to this level and stream.

    Unique across levels too: the simulator keeps earlier levels' prompts in its prefix cache, and a hit
    would shorten prefill and TTFT.
    """
    rng = random.Random(f"{level}/{stream_index}")
    return [rng.randrange(3, 259) for _ in range(PROMPT_TOKENS)]


_ENGINE_LINE = re.compile(r"engine (\d+): (http://\S+)/v1\s+metrics \S+(?:\s+kv events (\S+))?")


def parse_banner(text: str) -> list[tuple[int, str, str | None]]:
    """(index, base url, KV events endpoint) of each engine ``kvstack sim`` printed at start-up."""
    return [(int(m[1]), m[2], m[3]) for m in _ENGINE_LINE.finditer(text)]


def port_of(endpoint: str | None) -> int | None:
    if not endpoint:
        return None
    tail = endpoint.rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else None


def metric_value(text: str, name: str) -> float | None:
    """The first sample of ``name`` in a Prometheus text page (gauges carry no suffix)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    return None


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc/<pid>/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    # The command name may contain spaces; the fields after it are fixed.
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


# -- wire types (only the fields the benchmark reads; msgspec skips the rest) ---------------------------
class _Choice(msgspec.Struct):
    index: int = 0
    text: str = ""
    finish_reason: str | None = None


class _Usage(msgspec.Struct):
    completion_tokens: int = 0


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: dict[str, Any] | None = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


# -- the simulator process --------------------------------------------------------------------------
@dataclass
class Engine:
    index: int
    url: str
    events_endpoint: str | None


@dataclass
class SimProcess:
    """A running ``kvstack sim`` in its own process group."""

    cmd: list[str]
    proc: subprocess.Popen[bytes]
    log_path: Path
    engines: list[Engine] = field(default_factory=list)

    @classmethod
    def start(cls, engines: int, log_path: Path, deadline_s: float = 60.0) -> SimProcess:
        if not KVSTACK.exists():
            raise SystemExit(f"{KVSTACK} not found: run `make dev` first")
        cmd = [str(KVSTACK), "sim", "--engines", str(engines)]
        cmd += [part for flag, value in SIM_FLAGS.items() for part in (flag, value)]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=str(REPO)
            )
        sim = cls(cmd, proc, log_path)
        try:
            sim._wait_ready(engines, deadline_s)
        except BaseException:
            sim.stop()
            raise
        return sim

    def _wait_ready(self, expected: int, deadline_s: float) -> None:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvstack sim exited with {self.proc.returncode}:\n{self.log_tail()}")
            found = parse_banner(self.log_path.read_text(errors="replace"))
            if len(found) >= expected:
                self.engines = [Engine(i, url, ev) for i, url, ev in found[:expected]]
                if all(_healthy(e.url) for e in self.engines):
                    return
            time.sleep(0.2)
        raise RuntimeError(f"kvstack sim not healthy after {deadline_s:.0f}s:\n{self.log_tail()}")

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(self.proc.pid)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc.poll() is not None:
            return
        pgid = self.proc.pid  # start_new_session=True: the pid is the process group id
        try:
            os.killpg(pgid, signal.SIGTERM)
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(timeout=5)
        except ProcessLookupError:
            pass


def _healthy(url: str) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


# -- one stream --------------------------------------------------------------------------------------
@dataclass
class StreamResult:
    ok: bool = False
    error: str | None = None
    chunks: int = 0
    completion_tokens: int = 0
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    end: float = 0.0

    @property
    def tpot(self) -> float | None:
        """Mean seconds per token after the first: immune to several chunks arriving in one read."""
        if self.chunks < 2 or not self.gaps:
            return None
        return sum(self.gaps) / len(self.gaps)


async def run_stream(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt: list[int],
    gate: asyncio.Event,
    client_timeout: aiohttp.ClientTimeout,
) -> StreamResult:
    """One streaming completion; chunk times are taken when their bytes are read."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res = StreamResult()
    await gate.wait()
    t0 = time.perf_counter()
    last: float | None = None
    done = False
    try:
        async with session.post(f"{url}/v1/completions", json=body, timeout=client_timeout) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            parser = SSEParser()
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                for payload in parser.feed(data):
                    if payload == DONE_PAYLOAD:
                        done = True
                        continue
                    chunk = _decode_chunk(payload)
                    if chunk.error is not None:
                        res.error = f"in-stream error: {chunk.error}"
                    if chunk.usage is not None:
                        res.completion_tokens = chunk.usage.completion_tokens
                    if not chunk.choices:
                        continue  # the usage chunk is not a token
                    res.chunks += 1
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.gaps.append(now - last)
                    last = now
    except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    res.end = time.perf_counter()
    if res.error is None and not done:
        res.error = "stream ended without [DONE]"
    if res.error is None and res.chunks != MAX_TOKENS:
        res.error = f"{res.chunks} token chunks, expected {MAX_TOKENS}"
    res.ok = res.error is None
    return res


# -- one level ---------------------------------------------------------------------------------------
@dataclass
class LevelResult:
    scenario: str
    engines: int
    streams: int
    batch_per_engine: int
    completed: int
    failed: int
    errors: list[str]
    wall_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    tpot_mean_ms: float | None
    modelled_itl_ms: float
    itl_p50_ratio: float | None
    tpot_ratio: float | None
    tokens_per_s: float
    sim_cpu_pct: float
    client_cpu_pct: float
    # Busy share of all cores during the level (100 = every core busy), other processes included.
    machine_busy_pct: float
    max_running_per_engine: list[int]
    holds: bool


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 2)


async def _poll_running(
    session: aiohttp.ClientSession, urls: list[str], seen: list[int], stop: asyncio.Event
) -> None:
    """Largest ``vllm:num_requests_running`` each engine's own /metrics showed while the level ran."""
    timeout = aiohttp.ClientTimeout(total=5)

    async def one(i: int, url: str) -> None:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.get(f"{url}/metrics", timeout=timeout) as r:
                value = metric_value(await r.text(), "vllm:num_requests_running")
                if value is not None:
                    seen[i] = max(seen[i], int(value))

    while not stop.is_set():
        await asyncio.gather(*(one(i, u) for i, u in enumerate(urls)))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), METRICS_POLL_S)


async def _wait_idle(session: aiohttp.ClientSession, urls: list[str], budget_s: float) -> None:
    """Wait until no engine has running or waiting requests (aborted streams of a failed level drain)."""
    deadline = time.monotonic() + budget_s
    timeout = aiohttp.ClientTimeout(total=5)
    while time.monotonic() < deadline:
        busy = 0.0
        for url in urls:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(f"{url}/metrics", timeout=timeout) as r:
                    text = await r.text()
                    busy += metric_value(text, "vllm:num_requests_running") or 0.0
                    busy += metric_value(text, "vllm:num_requests_waiting") or 0.0
        if busy == 0:
            return
        await asyncio.sleep(0.5)


async def run_level(
    session: aiohttp.ClientSession,
    sim: SimProcess,
    model: str,
    scenario: str,
    per_engine: int,
    time_left: float,
) -> LevelResult:
    """``per_engine`` streams on every engine of ``sim``, all released at once."""
    urls = [e.url for e in sim.engines]
    total = per_engine * len(urls)
    # Generous, yet bounded by what is left of the run's deadline.
    limit = min(max(20.0, 3.0 * modelled_duration(per_engine) + 5.0), time_left)
    timeout = aiohttp.ClientTimeout(total=limit, sock_connect=10, sock_read=min(30.0, limit))
    gate = asyncio.Event()
    tasks = [
        asyncio.create_task(
            run_stream(
                session, urls[i % len(urls)], model, prompt_ids(f"{scenario}/{total}", i), gate, timeout
            ),
            name=f"stream-{i}",
        )
        for i in range(total)
    ]
    seen = [0] * len(urls)
    stop_poll = asyncio.Event()
    await asyncio.sleep(0)  # let every stream reach the gate
    sim_cpu0, client_cpu0, t0 = sim.cpu_seconds(), time.process_time(), time.perf_counter()
    busy0, all0 = machine_cpu_ticks()
    gate.set()
    poller = asyncio.create_task(_poll_running(session, urls, seen, stop_poll))
    results = await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    sim_cpu, client_cpu = sim.cpu_seconds() - sim_cpu0, time.process_time() - client_cpu0
    busy1, all1 = machine_cpu_ticks()
    stop_poll.set()
    await poller

    ok = [r for r in results if r.ok]
    gaps = [g for r in ok for g in r.gaps]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [t for r in ok if (t := r.tpot) is not None]
    tokens = sum(r.chunks for r in results)
    errors = sorted({r.error for r in results if r.error})
    modelled = modelled_itl(per_engine)
    p50 = percentile(gaps, 50)
    tpot = statistics.fmean(tpots) if tpots else None
    ratio = None if p50 is None else p50 / modelled
    holds = len(ok) == total and ratio is not None and ratio <= HOLD_RATIO
    await _wait_idle(session, urls, budget_s=min(15.0, max(0.0, time_left - limit)))
    return LevelResult(
        scenario=scenario,
        engines=len(urls),
        streams=total,
        batch_per_engine=per_engine,
        completed=len(ok),
        failed=total - len(ok),
        errors=errors[:5],
        wall_s=round(wall, 2),
        ttft_p50_ms=_ms(percentile(ttfts, 50)),
        ttft_p99_ms=_ms(percentile(ttfts, 99)),
        itl_p50_ms=_ms(p50),
        itl_p99_ms=_ms(percentile(gaps, 99)),
        tpot_mean_ms=_ms(tpot),
        modelled_itl_ms=round(modelled * 1000, 2),
        itl_p50_ratio=None if ratio is None else round(ratio, 3),
        tpot_ratio=None if tpot is None else round(tpot / modelled, 3),
        tokens_per_s=round(tokens / wall, 1) if wall > 0 else 0.0,
        sim_cpu_pct=round(100 * sim_cpu / wall, 1) if wall > 0 else 0.0,
        client_cpu_pct=round(100 * client_cpu / wall, 1) if wall > 0 else 0.0,
        machine_busy_pct=round(100 * (busy1 - busy0) / (all1 - all0), 1) if all1 > all0 else 0.0,
        max_running_per_engine=seen,
        holds=holds,
    )


# -- multi-engine checks -----------------------------------------------------------------------------
@dataclass
class EventSource:
    """What one engine's /kv_event_sources answered."""

    engine: int
    url: str
    status: int
    endpoints: list[str]
    matches_banner: bool


async def kv_event_sources(session: aiohttp.ClientSession, sim: SimProcess) -> dict[str, Any]:
    """Each engine's /kv_event_sources: present, and naming the engine's own ZMQ port."""
    timeout = aiohttp.ClientTimeout(total=5)
    sources: list[EventSource] = []
    for e in sim.engines:
        status, endpoints = 0, []
        try:
            async with session.get(f"{e.url}/kv_event_sources", timeout=timeout) as r:
                status = r.status
                body = await r.json()
            endpoints = [str(cfg.get("endpoint")) for cfg in body.values() if isinstance(cfg, dict)]
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
            pass  # recorded as no endpoints: the check below fails visibly
        ports = [port_of(ep) for ep in endpoints]
        sources.append(EventSource(e.index, e.url, status, endpoints, port_of(e.events_endpoint) in ports))
    all_ports = [port_of(ep) for src in sources for ep in src.endpoints]
    return {
        "per_engine": [asdict(src) for src in sources],
        "all_present": all(src.status == 200 and src.endpoints for src in sources),
        "distinct_ports": len(set(all_ports)) == len(all_ports) == len(sim.engines),
        "all_match_banner": all(src.matches_banner for src in sources),
    }


# -- the run -----------------------------------------------------------------------------------------
async def run(args: argparse.Namespace, console: Console, out: dict[str, Any]) -> None:
    """Fill ``out`` level by level, so a run stopped by its deadline still reports what it measured."""
    started = time.monotonic()

    def time_left() -> float:
        return args.deadline - (time.monotonic() - started) - 15.0  # keep room to stop the sim

    levels = QUICK_LEVELS if args.quick else LEVELS
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        sim = await asyncio.to_thread(SimProcess.start, 1, args.results.parent / "sim_capacity-single.log")
        out["sim_commands"].append(shlex.join(sim.cmd))
        try:
            for k in levels:
                if time_left() < 20:
                    console.print(f"[yellow]skipping K={k}: run deadline near[/]")
                    break
                console.print(f"single engine: {k} streams ...")
                level = await run_level(session, sim, MODEL, "1 engine", k, time_left())
                out["single"].append(asdict(level))
        finally:
            sim.stop()

        if args.skip_multi or time_left() < 30:
            return
        sim = await asyncio.to_thread(
            SimProcess.start, MULTI_ENGINES, args.results.parent / "sim_capacity-multi.log"
        )
        out["sim_commands"].append(shlex.join(sim.cmd))
        try:
            sources = await kv_event_sources(session, sim)
            console.print(f"{MULTI_ENGINES} engines: {STREAMS_PER_ENGINE} streams each ...")
            level = await run_level(
                session, sim, MODEL, f"{MULTI_ENGINES} engines", STREAMS_PER_ENGINE, time_left()
            )
            out["multi"] = {
                "level": asdict(level),
                "kv_event_sources": sources,
                "metrics_per_engine": {
                    "num_requests_running_max": level.max_running_per_engine,
                    "every_engine_reported_running": all(n > 0 for n in level.max_running_per_engine),
                },
            }
        finally:
            sim.stop()


async def run_bounded(args: argparse.Namespace, console: Console, out: dict[str, Any]) -> None:
    """`run` under a hard deadline: every level is bounded already, this catches anything that is not."""
    try:
        async with asyncio.timeout(args.deadline):
            await run(args, console, out)
    except TimeoutError:
        out["stopped"] = f"run deadline of {args.deadline:.0f}s reached; results are partial"
        console.print(f"[red]{out['stopped']}[/]")
    except Exception as exc:  # keep and report what was measured before the failure
        out["stopped"] = f"run failed: {type(exc).__name__}: {exc}"
        console.print_exception()


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def results_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(
        title="kvstack sim stream capacity (streaming /v1/completions, 64-token prompt, 128 tokens)"
    )
    for name in (
        "scenario",
        "streams",
        "ok/failed",
        "TTFT p50 ms",
        "ITL p50 ms",
        "ITL p99 ms",
        "modelled ITL ms",
        "p50/modelled",
        "TPOT/modelled",
        "tokens/s",
        "sim CPU%",
        "client CPU%",
        "machine busy%",
        "holds",
    ):
        table.add_column(name, justify="left" if name == "scenario" else "right")
    for r in rows:
        table.add_row(
            r["scenario"],
            str(r["streams"]),
            f"{r['completed']}/{r['failed']}",
            _fmt(r["ttft_p50_ms"]),
            _fmt(r["itl_p50_ms"]),
            _fmt(r["itl_p99_ms"]),
            _fmt(r["modelled_itl_ms"]),
            _fmt(r["itl_p50_ratio"], 2),
            _fmt(r["tpot_ratio"], 2),
            _fmt(r["tokens_per_s"], 0),
            _fmt(r["sim_cpu_pct"], 0),
            _fmt(r["client_cpu_pct"], 0),
            _fmt(r["machine_busy_pct"], 0),
            "yes" if r["holds"] else "no",
        )
    return table


def _raise_fd_limit() -> None:
    # K streams hold K sockets in this process and in the simulator (which inherits the limit).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help=f"only K in {QUICK_LEVELS}")
    parser.add_argument("--skip-multi", action="store_true", help="skip the 16-engine run")
    parser.add_argument("--deadline", type=float, default=270.0, help="seconds the whole run may take")
    parser.add_argument("--results", type=Path, default=REPO / "bench-results" / "sim_capacity.json")
    args = parser.parse_args(argv)
    # Wide enough for the table when stdout is a file or a pipe.
    console = Console() if sys.stdout.isatty() else Console(width=200)
    command = shlex.join([sys.executable, *sys.argv])
    console.print(f"command: {command}")
    _raise_fd_limit()
    args.results.parent.mkdir(parents=True, exist_ok=True)
    host, t0 = machine(), time.monotonic()
    if host["busy_pct_before_start"] > 20:
        console.print(
            f"[yellow]the machine was {host['busy_pct_before_start']:.0f}% busy before the run "
            "(other processes): latencies will be skewed; see the machine busy% column[/]"
        )
    out: dict[str, Any] = {"single": [], "multi": None, "sim_commands": [], "stopped": None}
    try:
        import uvloop

        uvloop.run(run_bounded(args, console, out))
    except ImportError:
        asyncio.run(run_bounded(args, console, out))

    single = out["single"]
    held = [r["streams"] for r in single if r["holds"]]
    capacity = max(held) if held else 0
    rows = [*single, *([out["multi"]["level"]] if out["multi"] else [])]
    console.print(results_table(rows))
    for r in rows:
        for err in r["errors"]:
            console.print(f"  {r['scenario']} K={r['streams']}: {err}")
    if out["multi"]:
        m = out["multi"]
        src = m["kv_event_sources"]
        console.print(
            f"{MULTI_ENGINES} engines: max num_requests_running per engine "
            f"{m['metrics_per_engine']['num_requests_running_max']}; /kv_event_sources present on all: "
            f"{src['all_present']}, distinct ports: {src['distinct_ports']}, match banner: "
            f"{src['all_match_banner']}"
        )
    console.print(
        f"stream capacity of one simulator process: {capacity} "
        f"(largest K with all streams complete and ITL p50 <= {HOLD_RATIO} x modelled)"
    )
    report = {
        "command": command,
        "sim_commands": out["sim_commands"],
        "machine": host,
        "workload": {
            "prompt_tokens": PROMPT_TOKENS,
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "hold_ratio": HOLD_RATIO,
            "latency_model": {
                "step_overhead": STEP_OVERHEAD,
                "prefill_per_token": PREFILL_PER_TOKEN,
                "decode_base": DECODE_BASE,
                "decode_per_seq": DECODE_PER_SEQ,
            },
        },
        "single_engine": single,
        "multi_engine": out["multi"],
        "capacity_streams": capacity,
        "stopped": out["stopped"],
        "elapsed_s": round(time.monotonic() - t0, 1),
    }
    args.results.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"results: {args.results} ({report['elapsed_s']} s)")
    return 1 if out["stopped"] else 0


if __name__ == "__main__":
    sys.exit(main())
