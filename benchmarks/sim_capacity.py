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

The current result, its command, machine and limits: ``docs/benchmarks/sim-capacity.md``.

    .venvs/dev/bin/python benchmarks/sim_capacity.py [--quick]
"""

# kvstack ships no py.typed marker, so mypy run on this file alone would refuse its (typed) modules.
# mypy: disable-error-code="import-untyped"
from __future__ import annotations

import argparse
import asyncio
import resource
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
from machine_info import machine
from procs import REPO
from results import write_json
from rich.console import Console
from rich.table import Table
from sim_capacity_process import (
    DECODE_BASE,
    DECODE_PER_SEQ,
    MODEL,
    PREFILL_PER_TOKEN,
    STEP_OVERHEAD,
    SimProcess,
)
from sim_capacity_streams import HOLD_RATIO, MAX_TOKENS, PROMPT_TOKENS, run_level

LEVELS = (50, 100, 200, 400, 800)
QUICK_LEVELS = (50, 200)
MULTI_ENGINES = 16
STREAMS_PER_ENGINE = 25


def port_of(endpoint: str | None) -> int | None:
    if not endpoint:
        return None
    tail = endpoint.rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else None


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
    write_json(args.results, report)
    console.print(f"results: {args.results} ({report['elapsed_s']} s)")
    return 1 if out["stopped"] else 0


if __name__ == "__main__":
    sys.exit(main())
