"""Prefix index lookup: block keys and ``PrefixIndex.lookup`` for long prompts against a big index.

Question (from the issue): is a lookup of a 32k-token prompt under 1 ms at p99 with 64 endpoints and 10
million indexed (location, block) entries, and how much memory does such an index take?

Each block size runs in its own child process (so its RSS is its own), which:

1. *builds* the index up to ``--entries`` (the index's ``max_entries`` too), shaped like a busy fleet:
   ``--locations`` engines plus ``--cache-nodes`` cache-tier nodes; 400 shared system-prompt chains of 8-64
   blocks, each on 4-32 engines; then conversations (a shared prefix + 8-256 blocks of their own) on one
   engine in GPU, 25% of them also in that engine's CPU tier (same engine hashes, as vLLM's offloading
   keeps them), 20% also on a cache node in DISK. Every store carries engine hashes, as KV events do.
   These keys are random 64-bit ints (hashing the tokens of millions of synthetic blocks would only slow the
   build; the index cannot tell);
2. stores the *lookup prompts*' real keys (``BlockKeyer``) last: 20 system prompts of 2-4k tokens on 16-64
   engines in GPU, and 100 documents of 8-24k tokens after them, each on 1-4 engines with 30-100% of their
   blocks in GPU (one also keeping more of them in CPU) and half of them on a cache node in DISK;
3. times ``--lookups`` lookups of ``--prompt-tokens``-token prompts: system prompt + document + a tail never
   indexed. Per lookup: ``keyer.keys(tokens)`` (a list of ints, as the tokenizer gives) and
   ``index.lookup(keys)``, separately and together, in wall time (``perf_counter_ns``) and in the thread's
   CPU time (``thread_time_ns``: on this shared machine, wall time also counts waits for a core). Also
   timed: keys from a pre-packed ``array('I')`` (the hashing alone) and a worst case, a prompt held in full
   by all engines; and the machine's busy share and the full GC collections during the lookups;
4. reports build time, RSS growth per entry (``/proc/self/status`` VmRSS before and after the build), the
   index's own estimate, and what a full ``gc.collect()`` costs before and after the build (the difference
   is the index's share: the process also holds the lookup prompts' token lists).

Lookups make blocks young and never store, so the index stays at its bound. The garbage collector stays on,
as in the router. Results: a table on stdout and ``bench-results/index_lookup.json``.

The current result, its command, machine and limits: ``docs/benchmarks/index-lookup.md``.

    .venvs/dev/bin/python benchmarks/index_lookup.py [--entries N] [--locations N] [--prompt-tokens N]
        [--block-size 128,16] [--lookups N]
"""

# mypy: disable-error-code="import-untyped"
from __future__ import annotations

import argparse
import gc
import json
import random
import subprocess
import sys
import time
from array import array
from pathlib import Path
from typing import Any

from machine_info import machine, machine_cpu_ticks
from procs import REPO
from rich.console import Console
from rich.table import Table

from kvstack.index import BlockKeyer, PrefixIndex, Tier

NAMESPACE = "bench-model|"
VOCAB = 150_000


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def full_gc_ms() -> list[float]:
    """Two full collections' durations: the first also untracks what it can, the second is steady state."""
    out = []
    for _ in range(2):
        t0 = time.perf_counter()
        gc.collect()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def percentiles(ns: list[int]) -> dict[str, float]:
    """p50/p99/max in microseconds."""
    s = sorted(ns)
    return {
        "p50_us": s[len(s) // 2] / 1e3,
        "p99_us": s[min(len(s) - 1, int(len(s) * 0.99))] / 1e3,
        "max_us": s[-1] / 1e3,
    }


class Fleet:
    """Location names, their engine hashes, and the random choices of the build."""

    def __init__(self, rng: random.Random, engines: int, cache_nodes: int) -> None:
        self.rng = rng
        self.engines = [f"http://10.0.{i // 200}.{i % 200 + 10}:8000" for i in range(engines)]
        self.cache_nodes = [f"cache://node-{i}" for i in range(cache_nodes)]
        self._salt = {loc: rng.getrandbits(64) for loc in self.engines + self.cache_nodes}

    def hashes(self, location: str, keys: list[int]) -> list[int]:
        """The location's own hash of each block: the same block always gets the same hash there (like an
        engine with a fixed hash seed), and another location's differs."""
        salt = self._salt[location]
        return [k ^ salt for k in keys]

    def keys(self, n: int) -> list[int]:
        bits = self.rng.getrandbits
        return [bits(64) for _ in range(n)]  # synthetic block keys: random 64-bit ints, like xxh3 output


def build_filler(index: PrefixIndex, fleet: Fleet, target: int) -> int:
    """Shared system chains, then conversations, until ``target`` entries. Returns the stores made."""
    rng = fleet.rng
    shared = [fleet.keys(rng.randint(8, 64)) for _ in range(400)]
    stores = 0
    for chain in shared:
        for loc in rng.sample(fleet.engines, rng.randint(4, min(32, len(fleet.engines)))):
            index.store(loc, chain, Tier.GPU, fleet.hashes(loc, chain))
            stores += 1
    while len(index) < target:
        keys = rng.choice(shared) + fleet.keys(rng.randint(8, 256))
        engine = rng.choice(fleet.engines)
        hashes = fleet.hashes(engine, keys)
        index.store(engine, keys, Tier.GPU, hashes)
        stores += 1
        if rng.random() < 0.25:  # offloaded to the engine's CPU tier (vLLM keeps the block hashes)
            index.store(engine, keys, Tier.CPU, hashes)
            stores += 1
        if fleet.cache_nodes and rng.random() < 0.2:
            node = rng.choice(fleet.cache_nodes)
            index.store(node, keys, Tier.DISK, fleet.hashes(node, keys))
            stores += 1
    return stores


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def store_prompts(
    index: PrefixIndex, fleet: Fleet, keyer: BlockKeyer, systems: list[list[int]], docs: list[list[int]]
) -> list[tuple[int, int]]:
    """Index the lookup prompts' real prefixes; returns the (system, document) pairs of the documents."""
    rng = fleet.rng
    n_engines = len(fleet.engines)
    for system in systems:
        keys = keyer.keys(system)
        for loc in rng.sample(fleet.engines, rng.randint(min(16, n_engines), n_engines)):
            index.store(loc, keys, Tier.GPU, fleet.hashes(loc, keys))
    pairs = []
    for d, doc in enumerate(docs):
        s = rng.randrange(len(systems))
        pairs.append((s, d))
        keys = keyer.keys(systems[s] + doc)
        for i, loc in enumerate(rng.sample(fleet.engines, rng.randint(1, min(4, n_engines)))):
            held = int(len(keys) * rng.uniform(0.3, 1.0))
            hashes = fleet.hashes(loc, keys)
            index.store(loc, keys[:held], Tier.GPU, hashes[:held])
            if i == 0:
                index.store(loc, keys, Tier.CPU, hashes)
        if fleet.cache_nodes and rng.random() < 0.5:
            node = rng.choice(fleet.cache_nodes)
            index.store(node, keys, Tier.DISK, fleet.hashes(node, keys))
    return pairs


def time_lookups(
    index: PrefixIndex, keyer: BlockKeyer, prompts: list[list[int]], lookups: int
) -> dict[str, Any]:
    """Wall and CPU time of keys and lookup per prompt, GC pauses, and the machine's busy share meanwhile."""
    wall: dict[str, list[int]] = {"keys": [], "lookup": [], "total": [], "keys_prepacked": []}
    cpu: dict[str, list[int]] = {"keys": [], "lookup": [], "total": []}
    matched_locations, deepest = [], []
    gc_pauses: list[int] = []
    gc_started = [0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_started[0] = time.perf_counter_ns()
        elif info["generation"] == 2:
            gc_pauses.append(time.perf_counter_ns() - gc_started[0])

    clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    gc.callbacks.append(on_gc)
    busy0, all0 = machine_cpu_ticks()
    try:
        for j in range(lookups):
            prompt = prompts[j % len(prompts)]
            c0, t0 = cpu_clock(), clock()
            keys = keyer.keys(prompt)
            c1, t1 = cpu_clock(), clock()
            found = index.lookup(keys)
            c2, t2 = cpu_clock(), clock()
            wall["keys"].append(t1 - t0)
            wall["lookup"].append(t2 - t1)
            wall["total"].append(t2 - t0)
            cpu["keys"].append(c1 - c0)
            cpu["lookup"].append(c2 - c1)
            cpu["total"].append(c2 - c0)
            matched_locations.append(len(found))
            deepest.append(max((m.blocks for m in found.values()), default=0))
            if j % 10 == 0:
                packed = array("I", prompt)
                t3 = clock()
                keyer.keys(packed)
                wall["keys_prepacked"].append(clock() - t3)
    finally:
        gc.callbacks.remove(on_gc)
    busy1, all1 = machine_cpu_ticks()
    return {
        "wall": {name: percentiles(ns) for name, ns in wall.items()},
        "cpu": {name: percentiles(ns) for name, ns in cpu.items()},
        "machine_busy_pct": round(100 * (busy1 - busy0) / max(1, all1 - all0), 1),
        "gc_full_collections": len(gc_pauses),
        "gc_full_max_ms": max(gc_pauses, default=0) / 1e6,
        "blocks_per_prompt": len(keyer.keys(prompts[0])),
        "locations_matched_mean": sum(matched_locations) / len(matched_locations),
        "deepest_match_mean_blocks": sum(deepest) / len(deepest),
    }


def run_child(args: argparse.Namespace) -> dict[str, Any]:
    """One block size: build, then time. Prints nothing but its JSON."""
    rng = random.Random(args.seed)
    keyer = BlockKeyer(NAMESPACE, args.block_size)
    fleet = Fleet(rng, args.locations, args.cache_nodes)
    systems = [tokens(rng, rng.randint(2048, 4096)) for _ in range(20)]
    docs = [tokens(rng, rng.randint(8192, 24576)) for _ in range(100)]
    tails = [tokens(rng, args.prompt_tokens) for _ in range(4)]
    gc_before_ms = full_gc_ms()
    rss0 = rss_bytes()
    index = PrefixIndex(max_entries=args.entries)
    t0 = time.perf_counter()
    # The filler leaves room for the prompts' entries, which come last (most recent), so none is evicted.
    filler_stores = build_filler(index, fleet, args.entries - args.entries // 200)
    pairs = store_prompts(index, fleet, keyer, systems, docs)
    build_s = time.perf_counter() - t0
    gc_after_ms = full_gc_ms()
    rss1 = rss_bytes()
    stats = index.stats()

    prompts = []
    for j, (s, d) in enumerate(pairs):
        head = systems[s] + docs[d]
        prompts.append((head + tails[j % len(tails)])[: args.prompt_tokens])
    mixed = time_lookups(index, keyer, prompts, args.lookups)

    full = tokens(rng, args.prompt_tokens)
    full_keys = keyer.keys(full)
    for loc in fleet.engines:
        index.store(loc, full_keys, Tier.GPU, fleet.hashes(loc, full_keys))
    worst = time_lookups(index, keyer, [full], max(200, args.lookups // 10))
    return {
        "block_size": args.block_size,
        "entries": stats.entries,
        "blocks": stats.blocks,
        "locations": stats.locations,
        "engine_hashes": stats.engine_hashes,
        "evicted_entries_during_build": stats.evicted_entries,
        "stores": filler_stores,
        "build_s": build_s,
        "build_us_per_entry": build_s * 1e6 / stats.entries,
        "rss_growth_bytes": rss1 - rss0,
        "rss_bytes_per_entry": (rss1 - rss0) / stats.entries,
        "approx_bytes_per_entry": stats.approx_bytes / stats.entries,
        "rss_total_bytes": rss1,
        "full_gc_ms_before_build": gc_before_ms,
        "full_gc_ms_after_build": gc_after_ms,
        "mixed": mixed,
        "all_engines_full": worst,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=10_000_000, help="(location, block) entries to index")
    parser.add_argument("--locations", type=int, default=64, help="engine endpoints")
    parser.add_argument("--cache-nodes", type=int, default=4, help="cache-tier locations besides the engines")
    parser.add_argument("--prompt-tokens", type=int, default=32_768)
    parser.add_argument("--block-size", default="128,16", help="comma-separated; one child process each")
    parser.add_argument("--lookups", type=int, default=2_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--results", type=Path, default=REPO / "bench-results" / "index_lookup.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        args.block_size = int(args.block_size)
        print(json.dumps(run_child(args)))
        return 0

    console = Console() if sys.stdout.isatty() else Console(width=200)
    facts = machine()
    console.print(
        f"machine: {facts['cpus']} cores, {facts['cpu_model']}, Python {facts['python']}, "
        f"load {' '.join(facts['loadavg_at_start'])}, {facts['busy_pct_before_start']}% busy before start"
    )
    command = " ".join(["benchmarks/index_lookup.py", *(argv if argv is not None else sys.argv[1:])])
    console.print(f"command: .venvs/dev/bin/python {command}")
    results = []
    for bs in (int(b) for b in args.block_size.split(",")):
        child = [
            sys.executable,
            __file__,
            "--child",
            f"--entries={args.entries}",
            f"--locations={args.locations}",
            f"--cache-nodes={args.cache_nodes}",
            f"--prompt-tokens={args.prompt_tokens}",
            f"--block-size={bs}",
            f"--lookups={args.lookups}",
            f"--seed={args.seed}",
        ]
        console.print(f"block size {bs}: building {args.entries:,} entries ...")
        done = subprocess.run(child, capture_output=True, text=True, timeout=1800, check=False)
        if done.returncode != 0:
            console.print(done.stderr)
            return 1
        results.append(json.loads(done.stdout))

    table = Table(title=f"Prefix index: {args.prompt_tokens}-token prompts; wall µs unless marked CPU")
    for col in ("block size", "scenario", "blocks", "locs matched", "keys p50 / p99", "keys pre-packed p50",
                "lookup p50 / p99 / max", "keys+lookup p50 / p99 / max", "CPU lookup p99",
                "CPU keys+lookup p99", "full GCs", "machine busy%"):  # fmt: skip
        table.add_column(col, justify="right")

    def p3(d: dict[str, float]) -> str:
        return f"{d['p50_us']:.0f} / {d['p99_us']:.0f} / {d['max_us']:.0f}"

    for r in results:
        for name in ("mixed", "all_engines_full"):
            m = r[name]
            wall, cpu = m["wall"], m["cpu"]
            table.add_row(
                str(r["block_size"]),
                name,
                str(m["blocks_per_prompt"]),
                f"{m['locations_matched_mean']:.1f}",
                f"{wall['keys']['p50_us']:.0f} / {wall['keys']['p99_us']:.0f}",
                f"{wall['keys_prepacked']['p50_us']:.0f}",
                p3(wall["lookup"]),
                p3(wall["total"]),
                f"{cpu['lookup']['p99_us']:.0f}",
                f"{cpu['total']['p99_us']:.0f}",
                f"{m['gc_full_collections']} ({m['gc_full_max_ms']:.0f} ms)",
                f"{m['machine_busy_pct']}",
            )
    console.print(table)
    build = Table(title="Build and memory")
    for col in ("block size", "entries", "blocks", "locations", "engine hashes", "build s", "µs/entry",
                "RSS growth GB", "RSS B/entry", "stats() B/entry",
                "gc.collect() ms before build (x2) / after (x2)"):  # fmt: skip
        build.add_column(col, justify="right")
    for r in results:
        build.add_row(
            str(r["block_size"]),
            f"{r['entries']:,}",
            f"{r['blocks']:,}",
            str(r["locations"]),
            f"{r['engine_hashes']:,}",
            f"{r['build_s']:.1f}",
            f"{r['build_us_per_entry']:.2f}",
            f"{r['rss_growth_bytes'] / 1e9:.2f}",
            f"{r['rss_bytes_per_entry']:.0f}",
            f"{r['approx_bytes_per_entry']:.0f}",
            " / ".join(f"{ms:.0f}" for ms in (*r["full_gc_ms_before_build"], *r["full_gc_ms_after_build"])),
        )
    console.print(build)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps({"machine": facts, "command": command, "results": results}, indent=2))
    console.print(f"JSON: {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
