"""The memory tier in process against a numpy memcpy of the same chunks, passes interleaved.

Per chunk size: puts into fresh mappings (first fill), puts into a full tier (each evicts the LRU entry and
reuses its mapping), bare gets (a read-only view) and gets copied out into a consumer's buffer, each round
followed by a memcpy pass over the same chunks: the ceiling is the median pass.
"""

# kvstack ships no py.typed marker, so mypy run on this file alone would refuse its (typed) modules.
# mypy: disable-error-code="import-untyped"
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from cache_tier_config import BenchError, Config, Deadline, MiB, chunks_of, gbps, median, new_keys
from cache_tier_report import Ceiling, Report, Row, ratio_row

from kvstack.cache.tiers.memory import MemoryTier


# -- memory tier ----------------------------------------------------------------------------------------
def bench_memory(cfg: Config, report: Report, say: Callable[[str], None], deadline: Deadline) -> None:
    for mib in cfg.sizes_mib:
        if deadline.left() < 5:
            report.skipped.append(f"memory {mib} MiB: deadline")
            continue
        size = mib * MiB
        n = max(2, cfg.working_set // size)
        src, dst = chunks_of(size, n), chunks_of(size, n)
        tier = MemoryTier(n * size, name="bench")  # page-multiple chunks: exactly n entries fit
        a, b = new_keys(n), new_keys(n)
        passes: dict[str, list[float]] = {k: [] for k in ("memcpy", "put_fresh", "put_full", "get_copy")}
        get_us: list[float] = []
        get_reps = max(1, 1000 // n)  # bare gets are cheap: enough calls for a steady per-call figure
        for r in range(cfg.memory_rounds + 1):  # round 0 warms up
            tier.clear_sync()
            t0 = time.perf_counter()
            fresh = sum(tier.put_sync(a[i], src[i].data) for i in range(n))
            t1 = time.perf_counter()
            full = sum(tier.put_sync(b[i], src[i].data) for i in range(n))  # each evicts an `a` entry
            t2 = time.perf_counter()
            for _ in range(get_reps):
                for key in b:
                    tier.get_sync(key)
            t3 = time.perf_counter()
            for i, key in enumerate(b):
                view = tier.get_sync(key)
                assert view is not None
                np.copyto(dst[i], np.frombuffer(view, dtype=np.uint8))
            t4 = time.perf_counter()
            del view  # a live view pins its mapping: the next round's puts would evict around it
            for i in range(n):
                np.copyto(dst[i], src[i])
            t5 = time.perf_counter()
            if fresh != n or full != n or tier.held_bytes:
                raise BenchError(
                    f"memory tier kept {fresh}, {full} of {n} {mib} MiB puts, {tier.held_bytes} bytes held"
                )
            if r:
                passes["put_fresh"].append(gbps(n * size, t1 - t0))
                passes["put_full"].append(gbps(n * size, t2 - t1))
                get_us.append((t3 - t2) / (n * get_reps) * 1e6)
                passes["get_copy"].append(gbps(n * size, t4 - t3))
                passes["memcpy"].append(gbps(n * size, t5 - t4))
        stats = tier.stats()
        tier.clear_sync()
        del src, dst
        label = f"{mib} MiB"
        memcpy = median(passes["memcpy"])
        report.ceilings.append(
            Ceiling(
                "memcpy (memory section)",
                label,
                memcpy,
                "GB/s",
                f"np.copyto, {n} chunks, median of {cfg.memory_rounds} "
                f"({min(passes['memcpy']):.2f}-{max(passes['memcpy']):.2f})",
                passes["memcpy"],
            )
        )
        common = {"chunks": n, "rounds": cfg.memory_rounds, "evictions": stats.evictions}
        for name, what, judged in (
            ("put_full", "put, full tier (evict LRU + reuse its mapping)", True),
            ("get_copy", "get + copy out (view -> consumer buffer)", True),
            ("put_fresh", "put, fresh mapping (first fill)", False),
        ):
            report.rows.append(
                ratio_row(
                    "memory",
                    what,
                    label,
                    median(passes[name]),
                    "GB/s",
                    "memcpy",
                    memcpy,
                    0.8 if judged else None,
                    {**common, "samples": passes[name], "memcpy_samples": passes["memcpy"]},
                )
            )
        get_call = median(get_us)
        report.rows.append(
            Row(
                "memory",
                "get (read-only view, no copy)",
                label,
                f"{get_call:.2f} µs/call",
                data={"us_per_call": get_call, "samples_us": get_us, **common},
            )
        )
        say(
            f"memory {label}: memcpy {memcpy:.2f}, put full {median(passes['put_full']):.2f}, get+copy "
            f"{median(passes['get_copy']):.2f}, put fresh {median(passes['put_fresh']):.2f} GB/s"
        )
