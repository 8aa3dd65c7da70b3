"""What prefix routing costs the router per request: prompt → token ids (local render + encode, cached,
remote through an engine's /tokenize) and token ids → prefix view (block keys + index lookup).

Run: ``.venvs/dev/bin/python benchmarks/tokenize_cost.py`` (makes the tiny model under .cache/ if missing,
starts one simulated engine in-process for the remote path). Prints a table of p50/p99 per prompt size and
path, and the longest event-loop stall seen while long prompts are tokenized (offloaded to the worker
thread above ``inline_chars``).

The current result, its command, machine and limits: ``docs/benchmarks/tokenize-cost.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import machine
from procs import REPO

from kvstack.devtools.tiny_model import make_tiny_model
from kvstack.engines.prompt_tokens import ChatPrompt, PromptTokenizer
from kvstack.engines.state import Endpoint, EngineState
from kvstack.engines.tokenizer import load_tokenizer
from kvstack.frontend.prefix import PrefixLocator
from kvstack.http.client import UpstreamPool
from kvstack.index.prefix_index import Tier
from kvstack.sim.cluster import SimOptions, start_engine, stop_engine
from kvstack.sim.engine import EngineConfig
from kvstack.sim.textgen import OutputSampler

PATHS = {
    "local": "local render+encode",
    "cached": "render cache hit",
    "remote": "engine /tokenize",
    "lookup": "keys + index lookup (8 engines, block 16)",
}
MODEL = "tiny"
WORDS = [
    "the",
    "router",
    "keeps",
    "every",
    "engine",
    "busy",
    "while",
    "sending",
    "each",
    "prompt",
    "where",
    "its",
    "prefix",
    "already",
    "lives",
]


def chat_of(n_words: int, salt: int) -> ChatPrompt:
    text = " ".join(WORDS[(i * 7 + salt) % len(WORDS)] for i in range(n_words))
    return ChatPrompt([{"role": "system", "content": f"session {salt}"}, {"role": "user", "content": text}])


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


async def loop_stall_probe(stop: asyncio.Event, stalls: list[float]) -> None:
    """Longest gap between 1 ms sleeps: how long the event loop was blocked."""
    last = time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(0.001)
        now = time.perf_counter()
        stalls.append(now - last - 0.001)
        last = now


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="200,2000,8000,24000", help="user message sizes in words")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    console = Console()
    model_dir = make_tiny_model(REPO / ".cache" / "tiny-model")
    tokenizer = load_tokenizer(str(model_dir))
    sim = SimOptions(
        engine=EngineConfig(model_name=MODEL, max_model_len=200_000),
        served_model_names=[MODEL],
        model_root=str(model_dir),
        port=0,
        kv_events=False,
    )
    engine = await start_engine(sim, tokenizer, OutputSampler(tokenizer), 0)
    table = Table(title="prompt → token ids → prefix view, per request (ms)")
    for col in ("words", "tokens", "path", "p50", "p99"):
        table.add_column(col, justify="right" if col != "path" else "left")
    stall_rows: list[tuple[int, float]] = []
    client = UpstreamPool()
    try:
        for n_words in (int(s) for s in args.sizes.split(",")):
            local = PromptTokenizer({MODEL: tokenizer, f"{MODEL}-probe": tokenizer})
            remote = PromptTokenizer(client=client, engines_for=lambda _m: [engine.url])
            timings: dict[str, list[float]] = {"local": [], "cached": [], "remote": [], "lookup": []}
            locator = PrefixLocator()
            states = [EngineState(Endpoint(f"http://e{i}", models=frozenset({MODEL}))) for i in range(8)]
            tokens: tuple[int, ...] = ()
            # The local path alone, under the stall probe (the in-process sim's own inline tokenizing
            # would show up in it otherwise).
            stop, stalls = asyncio.Event(), []
            probe = asyncio.create_task(loop_stall_probe(stop, stalls))
            for i in range(args.repeats):
                await local.token_ids(f"{MODEL}-probe", chat_of(n_words, i))
                await asyncio.sleep(0.002)  # let the probe run between requests, as a server would
            stop.set()
            await probe
            stall_rows.append((n_words, max(stalls) if stalls else 0.0))
            for i in range(args.repeats):
                prompt = chat_of(n_words, i)
                t0 = time.perf_counter()
                ids = await local.token_ids(MODEL, prompt)
                t1 = time.perf_counter()
                await local.token_ids(MODEL, prompt)
                t2 = time.perf_counter()
                remote_ids = await remote.token_ids(MODEL, prompt)
                t3 = time.perf_counter()
                assert ids is not None and ids == remote_ids, "local and engine tokenization differ"
                if i == 0:
                    # Index the first prompt on half the engines so lookups find real prefixes.
                    for s in states[:4]:
                        keys = locator.keyer("", 16).keys(ids)
                        locator.index.store(s.url, keys, Tier.GPU)
                        locator._block_sizes[s.url] = 16
                t4 = time.perf_counter()
                locator.lookup(ids, states)
                t5 = time.perf_counter()
                tokens = ids
                timings["local"].append(t1 - t0)
                timings["cached"].append(t2 - t1)
                timings["remote"].append(t3 - t2)
                timings["lookup"].append(t5 - t4)
            for path, values in timings.items():
                table.add_row(
                    str(n_words),
                    str(len(tokens)),
                    PATHS[path],
                    f"{statistics.median(values) * 1e3:.3f}",
                    f"{pct(values, 99) * 1e3:.3f}",
                )  # fmt: skip
            local.close()
    finally:
        await client.close()
        await stop_engine(engine)
    console.print(f"machine: {machine()}")
    console.print(table)
    for n_words, stall in stall_rows:
        console.print(
            f"{n_words} words: longest event-loop stall while tokenizing locally {stall * 1e3:.1f} ms"
        )


if __name__ == "__main__":
    asyncio.run(main())
