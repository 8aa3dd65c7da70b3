"""What reading one engine's /metrics costs the router's event loop, per engine and scrape.

The router scrapes every engine every second (``--scrape-interval``) and reads the page through the engine's
metric catalog (`kvstack.engines.metrics_reader.read_signals`); the read runs on the event loop, so with N
engines it takes N times this per second from the requests. Compared, on the same pages in one process:

- ``kvstack``: `read_signals` as the router runs it (only the catalog's lines are parsed, by kvstack's own
  sample-line reader);
- ``prometheus_client, wanted lines``: the same selection, each line through prometheus_client's parser (what
  kvstack did before);
- ``prometheus_client, whole page``: the whole page through ``text_string_to_metric_families``, the way vLLM
  production-stack's router reads engine metrics.

Then the fetch itself: CPU of this process per GET of ``benchmarks/backend_zero.py``'s /metrics (a separate
process), through an aiohttp session (how the router fetched until 2026-12-03) and through the router's lean
HTTP client (`kvstack.http.client.UpstreamPool.get`, what the scraper uses now), interleaved in rounds.

Pages: a simulated vLLM engine's /metrics after some requests (vLLM 0.32 names and histograms), and the same
page with 8 data-parallel ranks (every series repeated with ``engine="0".."7"``).

Run: ``.venvs/dev/bin/python benchmarks/scrape_cost.py`` (about 30 s; starts one simulated engine in-process;
JSON in ``bench-results/scrape_cost.json``).

The current result, its command, machine and limits: ``docs/benchmarks/scrape-cost.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import machine
from procs import REPO

from kvstack.devtools.tiny_model import make_tiny_model
from kvstack.engines.catalog import catalog_for
from kvstack.engines.metrics_reader import read_signals, sample_names
from kvstack.engines.tokenizer import load_tokenizer
from kvstack.http.client import UpstreamPool
from kvstack.sim.cluster import SimOptions, start_engine, stop_engine
from kvstack.sim.engine import EngineConfig
from kvstack.sim.textgen import OutputSampler

MODEL = "tiny"
VLLM = catalog_for("vllm")
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


async def sim_page(requests: int) -> str:
    """/metrics of an in-process simulated engine after ``requests`` completions."""
    model_dir = make_tiny_model(REPO / ".cache" / "tiny-model")
    tokenizer = load_tokenizer(str(model_dir))
    sim = SimOptions(
        engine=EngineConfig(model_name=MODEL, time_scale=50.0),
        served_model_names=[MODEL],
        model_root=str(model_dir),
        port=0,
        kv_events=False,
    )
    engine = await start_engine(sim, tokenizer, OutputSampler(tokenizer), 0)
    try:
        async with aiohttp.ClientSession() as http:
            for i in range(requests):
                body = {"model": MODEL, "prompt": f"request {i} " * 20, "max_tokens": 8}
                async with http.post(f"{engine.url}/v1/completions", json=body) as resp:
                    resp.raise_for_status()
                    await resp.read()
            async with http.get(f"{engine.url}/metrics") as resp:
                return await resp.text()
    finally:
        await stop_engine(engine)


def with_ranks(page: str, ranks: int) -> str:
    """The page as a data-parallel engine of ``ranks`` ranks would export it: every sample once per rank."""
    out = []
    for line in page.split("\n"):
        if not line or line.startswith("#"):
            out.append(line)
            continue
        name = _NAME.match(line)
        assert name is not None, line
        rest = line[name.end() :]
        for rank in range(ranks):
            if 'engine="' in rest:  # vLLM labels its series with the rank already
                out.append(name.group() + re.sub(r'engine="[^"]*"', f'engine="{rank}"', rest, count=1))
            elif rest.startswith("{"):
                out.append(f'{name.group()}{{engine="{rank}",{rest[1:]}')
            else:
                out.append(f'{name.group()}{{engine="{rank}"}}{rest}')
    return "\n".join(out)


def old_wanted_lines(page: str) -> int:
    """kvstack's previous reader: the catalog's lines, each through prometheus_client's parser."""
    wanted = sample_names(VLLM)
    samples = 0
    for raw in page.split("\n"):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _NAME.match(line)
        if m is not None and m.group() in wanted:
            for family in text_string_to_metric_families(line + "\n"):
                samples += len(family.samples)
    return samples


def whole_page(page: str) -> int:
    return sum(len(f.samples) for f in text_string_to_metric_families(page))


def timed(fn: Callable[[str], object], page: str, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(page)
        out.append((time.perf_counter() - t0) * 1e6)
    return out


async def fetch_costs(url: str, rounds: int, per_round: int) -> dict[str, float]:
    """µs of this process's CPU per /metrics fetch of ``url``, aiohttp session against the lean client."""
    pool = UpstreamPool(max_idle_per_origin=1)
    cpu = {"aiohttp session": 0.0, "kvstack lean client": 0.0}
    try:
        async with aiohttp.ClientSession() as http:

            async def with_aiohttp() -> bytes:
                async with http.get(f"{url}/metrics", headers={"Accept": "text/plain"}) as resp:
                    resp.raise_for_status()
                    return await resp.read()

            async def with_lean() -> bytes:
                reply = await pool.get(
                    url, "/metrics", headers=[("Accept", "text/plain")], within=2.0, max_bytes=1 << 24
                )
                assert reply.status == 200
                return reply.body

            fetchers = {"aiohttp session": with_aiohttp, "kvstack lean client": with_lean}
            for fetch in fetchers.values():  # connections open, both bodies look alike
                assert (await fetch()).startswith(b"#")
            for _ in range(rounds):
                for name, fetch in fetchers.items():
                    c0 = time.process_time()
                    for _ in range(per_round):
                        await fetch()
                    cpu[name] += time.process_time() - c0
    finally:
        await pool.close()
    return {name: seconds / (rounds * per_round) * 1e6 for name, seconds in cpu.items()}


def backend_metrics_fetches(rounds: int, per_round: int) -> dict[str, float]:
    backend = subprocess.Popen(
        [sys.executable, str(REPO / "benchmarks" / "backend_zero.py"), "--port", "0", "--procs", "1"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert backend.stdout is not None
        m = re.search(r"(http://\S+)", backend.stdout.readline())
        if m is None:
            raise RuntimeError("backend_zero did not print its URL")
        return asyncio.run(fetch_costs(m.group(1), rounds, per_round))
    finally:
        os.killpg(backend.pid, signal.SIGTERM)
        backend.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20, help="completions before the page is taken")
    parser.add_argument("--repeats", type=int, default=200, help="reads per page and reader (interleaved)")
    parser.add_argument("--fetch-rounds", type=int, default=20, help="rounds of 20 fetches per client")
    args = parser.parse_args()
    console = Console() if sys.stdout.isatty() else Console(width=200)
    console.print(machine())
    base = asyncio.run(sim_page(args.requests))
    pages = {"sim engine": base, "sim engine, 8 DP ranks": with_ranks(base, 8)}
    readers: dict[str, Callable[[str], object]] = {
        "kvstack read_signals": lambda p: read_signals(p, VLLM),
        "prometheus_client, wanted lines (kvstack before)": old_wanted_lines,
        "prometheus_client, whole page (production-stack)": whole_page,
    }
    table = Table(title="one read of an engine's /metrics, µs of the event loop")
    for col in ("page", "lines", "reader", "p50 µs", "p99 µs", "÷ kvstack p50"):
        table.add_column(col, justify="left" if col in ("page", "reader") else "right")
    results: list[dict[str, object]] = []
    for page_name, page in pages.items():
        times: dict[str, list[float]] = {name: [] for name in readers}
        for _ in range(args.repeats // 10):  # interleaved in rounds, so drift hits every reader alike
            for name, fn in readers.items():
                times[name] += timed(fn, page, 10)
        ours = statistics.median(times["kvstack read_signals"])
        for name, samples in times.items():
            p50 = statistics.median(samples)
            p99 = statistics.quantiles(samples, n=100)[98]
            table.add_row(
                page_name, f"{page.count(chr(10)):,}", name, f"{p50:,.0f}", f"{p99:,.0f}", f"{p50 / ours:.1f}"
            )
            results.append(
                {"page": page_name, "lines": page.count("\n"), "reader": name, "p50_us": p50, "p99_us": p99}
            )
    console.print(table)
    fetches = backend_metrics_fetches(args.fetch_rounds, 20)
    fetch_table = Table(
        title="one GET of /metrics (backend_zero.py, another process), µs of this process's CPU"
    )
    for col in ("client", "CPU µs per fetch", "÷ lean client"):
        fetch_table.add_column(col, justify="left" if col == "client" else "right")
    for name, us in fetches.items():
        fetch_table.add_row(name, f"{us:,.0f}", f"{us / fetches['kvstack lean client']:.1f}")
    console.print(fetch_table)
    out = REPO / "bench-results" / "scrape_cost.json"
    out.parent.mkdir(exist_ok=True)
    command = " ".join([".venvs/dev/bin/python", "benchmarks/scrape_cost.py", *sys.argv[1:]])
    out.write_text(
        json.dumps(
            {"command": command, "machine": machine(), "results": results, "fetch_cpu_us": fetches}, indent=2
        )
    )
    console.print(f"results: {out}")


if __name__ == "__main__":
    main()
