"""KV cache tier throughput and lookup latency, each a ratio to a ceiling this machine shows in the same run.

Targets:

- memory tier put and get >= 80% of a numpy memcpy's GB/s, chunks of 1-32 MiB;
- cache server over shared memory >= 50% of memcpy;
- lookup of a 128-chunk prompt (128 x 256 tokens): p99 < 1 ms;
- disk tier >= 70% of sequential ``dd`` on the same file system;
- Redis tier >= 70% of ``redis-benchmark`` GET/SET throughput at the same value size.

Ceilings:

- *memcpy*: ``np.copyto`` between preallocated, pre-touched uint8 arrays, one chunk at a time, over a working
  set (``--working-set-mib``, 256) well above the last-level cache, one thread. Each section runs its memcpy
  passes interleaved with the passes they are compared to (the machine is shared: a noisy moment hits both);
  the ceiling is the median pass.
- *dd* (``bs=4M``, ``--disk-mib`` per run, in the disk tier's directory): write with ``conv=fdatasync`` (the
  disk) and without (the page cache); read with ``iflag=direct`` (the device alone), buffered after dropping
  the file from the page cache with ``posix_fadvise(DONTNEED)`` (cold: the tier's own read path, readahead
  included) and buffered again (warm). The page cache is dropped per file, never machine-wide: writing
  ``/proc/sys/vm/drop_caches`` would also hit the other work on this machine. dd runs once beside each
  repetition of the tier's runs (``--disk-reps``, 3; before them in even repetitions, after them in odd
  ones), on the same bytes (``--disk-mib``) in the same directory, and each kind of I/O is judged by the
  median over repetitions of tier / dd within one repetition: both sides see the same minute of a machine
  whose disk and page-cache speeds move 2-5x within minutes. The tier writes distinct non-zero chunks, dd
  zeros: measured here, the content does not change dd's speed (zeros, random bytes and a constant byte
  copied from the page cache write alike).
- *redis-benchmark*: against a redis-server this script starts (127.0.0.1, free port, temp dir, no
  persistence): ``-t set,get -d <record bytes> -c C -P B -r 64``, i.e. the tier's stored value size (payload +
  64-byte record header), C connections each pipelining B commands, as the tier runs C concurrent
  ``put_many``/``get_many`` of B keys. Best of three runs, alternating with the tier's (best of three too):
  single runs of either moved by up to 2x between minutes on this VM.

Measured:

- `MemoryTier` in process: *put* into a full tier of equal-size chunks (each put evicts the LRU entry and
  reuses its mapping: the steady state) and *get + copy out* (the view ``get_sync`` returns, copied with
  ``np.copyto`` into the consumer's buffer: a consumer must move the bytes into its own KV cache, and one copy
  against one memcpy is the fair comparison) are judged; *put into fresh mappings* (first fill: mmap and page
  faults) and bare *get* (a read-only view, no copy: cost per call) are shown.
- `CacheServer` (a ``kvstack cache-server`` process, memory tier only) with `CacheClient` (sync) and
  `AsyncCacheClient` (``--async-concurrency`` requests in flight), over shared memory and over the socket
  (tcp 127.0.0.1); each request carries ``--request-mib`` of chunks. *put(bytes)* (the client copies each
  payload into its arena, the server copies it into its tier), *reserve + put* (``CacheClient.reserve``
  hands out arena regions, the producer writes into them, put sends their offsets: only the server's copy;
  the fill is not timed, since a producer writes its output somewhere anyway, here straight into shared
  memory, as the vLLM connector's save does), *get* (payloads delivered: views of the client's arena after
  the server's copy, or of the received frames) and *get + copy out*. Judged: reserve + put and get over
  shared memory (one copy each, the paths a producer and a consumer use); put(bytes) and get + copy (two
  copies by design) and the socket are shown.
- Lookup, from token ids to the answer: ``chunk_keys`` of a 32,768-token prompt given as a Python list (as
  vLLM hands a request's prompt to the connector) plus a ``CacheClient.lookup`` round trip to the running
  server (128 chunks, all held), judged; the same from packed uint32 ids (``array('I')``, hashed in place),
  each part alone, the async client's round trip, ``TieredStore.lookup`` in process, and the floor any ZMQ
  server has here: the round trip of a 4 KiB message to a ROUTER that only echoes it (sync, and
  zmq.asyncio on uvloop), are shown. Every measurement of an iteration runs back to back (the echo floors
  too), so all see the same moments of the machine; the server's CPU per lookup is read from /proc.
- `DiskTier` (2 I/O threads, ``put_many``/``get_many`` batches of 8 like the store's writer), each against the
  dd run of the same kind in the same repetition: put with fsync ``never`` vs dd's page-cache write, put
  with fsync ``data`` vs dd ``conv=fdatasync``, get cold (the tier's files dropped from the page cache
  first) vs dd's cold read, get warm vs dd's warm read. Shown: put ``never`` + ``sync -f`` vs dd
  ``conv=fdatasync``, cold get vs dd ``iflag=direct``.
- `RedisTier`: ``put_many`` (one pipeline of SETs) vs SET and ``get_many`` (one MGET) vs GET, keys/s.

The async parts (client, disk and Redis tiers) run on uvloop when it is installed, as ``kvstack
cache-server`` runs its tiers.

GB/s is 10^9 payload bytes per second. Bounded: 127.0.0.1 only, every subprocess and request has a timeout
and sections left are skipped past ``--deadline``; temp files, shared-memory arenas and processes (stopped by
PID) are cleaned up. Results: tables on stdout, ``.cache/bench/cache_tier/<UTC timestamp>.json``.

The current result, its command, machine and limits: ``docs/benchmarks/cache-tier.md``.

    .venvs/dev/bin/python benchmarks/cache_tier.py                # ~5 min
    .venvs/dev/bin/python benchmarks/cache_tier.py --quick        # ~30 s: smaller sets, fewer rounds
    .venvs/dev/bin/python benchmarks/cache_tier.py --only disk,redis --disk-mib 1024
"""

# kvstack ships no py.typed marker, so mypy run on this file alone would refuse its (typed) modules.
# mypy: disable-error-code="import-untyped"
from __future__ import annotations

import argparse
import contextlib
import glob
import inspect
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cache_tier_config import BenchError, Config, Deadline, MiB, quick_config, run_async
from cache_tier_disk import bench_disk
from cache_tier_lookup import bench_lookup
from cache_tier_memory import bench_memory
from cache_tier_redis import bench_redis
from cache_tier_report import Report, ceilings_table, markdown, results_table, verdicts
from cache_tier_server import bench_server, start_cache_server
from machine_info import machine
from procs import KVSTACK, REPO
from results import write_json
from rich.console import Console

OUT_DIR = REPO / ".cache" / "bench" / "cache_tier"
SECTIONS = ("memory", "server", "lookup", "disk", "redis")


# -- main ---------------------------------------------------------------------------------------------
def run(cfg: Config, sections: Sequence[str], work: Path, report: Report, console: Console) -> None:
    deadline = Deadline(cfg.deadline_s)

    def say(text: str) -> None:
        console.print(f"[dim]{time.strftime('%H:%M:%S')}[/] {text}")

    def section(name: str, body: Callable[[], Any]) -> None:
        if deadline.left() < 5:
            report.skipped.append(f"{name}: deadline")
            return
        t0 = time.monotonic()
        try:
            result = body()
            if inspect.iscoroutine(result):
                run_async(result)
        except BenchError as e:
            report.errors[name] = str(e)
            console.print(f"[red]{name}: {e}[/]")
        report.raw.setdefault("section_seconds", {})[name] = round(time.monotonic() - t0, 1)

    if "memory" in sections:
        section("memory", lambda: bench_memory(cfg, report, say, deadline))
    if "server" in sections or "lookup" in sections:
        # room for every chunk of the working set plus the lookup's prompts (4 KiB payloads)
        memory = cfg.working_set + 16 * MiB
        server, endpoint, unix_endpoint = start_cache_server(memory, work / "cache-server.log")
        say(f"cache server pid {server.proc.pid} on {endpoint} and {unix_endpoint}")
        try:
            if "server" in sections:
                section("server", lambda: bench_server(cfg, endpoint, server.proc.pid, report, say, deadline))
            if "lookup" in sections:
                section(
                    "lookup",
                    lambda: bench_lookup(cfg, endpoint, unix_endpoint, server.proc.pid, work, report, say),
                )
        finally:
            server.stop()
            report.raw["server_log_tail"] = (work / "cache-server.log").read_text(errors="replace")[-2000:]
    if "disk" in sections:
        section("disk", lambda: bench_disk(cfg, work / "disk", report, say, deadline))
    if "redis" in sections:
        section("redis", lambda: bench_redis(cfg, work, report, say, deadline))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="smaller working sets, fewer rounds (< 1 min)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument(
        "--disk-parent", type=Path, default=OUT_DIR, help="where the temp dir (disk tier, dd, redis) goes"
    )
    parser.add_argument("--results", type=Path, help="JSON path (default .cache/bench/cache_tier/<UTC>.json)")
    parser.add_argument("--working-set-mib", type=int, help="bytes per memcpy/memory/server pass (256)")
    parser.add_argument("--request-mib", type=int, help="chunk bytes per server request (32)")
    parser.add_argument("--async-concurrency", type=int, help="AsyncCacheClient requests in flight (2)")
    parser.add_argument("--disk-mib", type=int, help="bytes per dd and disk tier run (512)")
    parser.add_argument("--disk-reps", type=int, help="paired tier/dd repetitions per chunk size (3)")
    parser.add_argument("--deadline", type=float, help="seconds before remaining parts are skipped (480)")
    args = parser.parse_args(argv)
    sections = [s for s in args.only.split(",") if s]
    if unknown := set(sections) - set(SECTIONS):
        parser.error(f"unknown sections {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    cfg = quick_config() if args.quick else Config()
    for flag, attr, scale in (
        ("working_set_mib", "working_set", MiB),
        ("request_mib", "request_bytes", MiB),
        ("async_concurrency", "async_concurrency", 1),
        ("disk_mib", "disk_bytes", MiB),
        ("disk_reps", "disk_reps", 1),
        ("deadline", "deadline_s", 1),
    ):
        if (value := getattr(args, flag)) is not None:
            setattr(cfg, attr, value * scale)
    console = Console() if sys.stdout.isatty() else Console(width=200)
    command = shlex.join([sys.executable, *sys.argv])
    console.print(f"command: {command}")
    if not KVSTACK.exists():
        raise SystemExit(f"{KVSTACK} not found: run `make dev` first")
    for tool in ("dd", "sync", "redis-server", "redis-benchmark"):
        if shutil.which(tool) is None and (tool in ("dd", "sync") or "redis" in sections):
            raise SystemExit(f"{tool} not found (apt-get install redis-server brings redis-benchmark)")
    started = datetime.now(UTC)
    host, t0 = machine(), time.monotonic()
    console.print(
        f"machine: {host['cpus']} cores ({host['cpu_model']}), kernel {host['kernel']}, busy "
        f"{host['busy_pct_before_start']:.0f}% before the run (load {' '.join(host['loadavg_at_start'])}); "
        "client, server, redis and dd share these cores"
    )
    args.disk_parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="run-", dir=args.disk_parent))
    report = Report()
    stopped = None
    try:
        run(cfg, sections, work, report, console)
    except KeyboardInterrupt:
        stopped = "interrupted; results are partial"
    except Exception as exc:  # keep and report what was measured before the failure
        stopped = f"run failed: {type(exc).__name__}: {exc}"
        console.print_exception()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for path in glob.glob(f"/dev/shm/kvstack-arena-{os.getpid()}-*"):  # this process's arenas only
            with contextlib.suppress(OSError):
                os.unlink(path)

    verdict = verdicts(report, sections)
    console.print(ceilings_table(report.ceilings))
    console.print(results_table(report.rows))
    for target, v in verdict.items():
        colour = {"PASS": "green", "FAIL": "red"}.get(v["verdict"], "yellow")
        detail = f" ({len(v['failed'])} of {v['rows']} rows fail)" if v["failed"] else f" ({v['rows']} rows)"
        detail = detail if v["rows"] else ""
        console.print(f"target {target}: [{colour}]{v['verdict']}[/]{detail}: {v['target']}")
    for name, error in report.errors.items():
        console.print(f"[red]error in {name}: {error}[/]")
    if report.skipped:
        console.print(f"[yellow]skipped: {', '.join(report.skipped)}[/]")
    elapsed = round(time.monotonic() - t0, 1)
    results = args.results or OUT_DIR / f"{started.strftime('%Y%m%d-%H%M%S')}.json"
    out = {
        "command": command,
        "started_utc": started.isoformat(timespec="seconds"),
        "machine": host,
        "config": asdict(cfg),
        "sections": sections,
        "ceilings": [asdict(c) for c in report.ceilings],
        "rows": [{**asdict(r)} for r in report.rows],
        "verdict": verdict,
        "raw": report.raw,
        "errors": report.errors,
        "skipped": report.skipped,
        "stopped": stopped,
        "elapsed_s": elapsed,
        "markdown": markdown(report),
    }
    write_json(results, out, default=str)
    console.print(f"results: {results} ({elapsed} s)")
    return 1 if stopped or report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
