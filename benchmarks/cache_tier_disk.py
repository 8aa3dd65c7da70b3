"""The disk tier against ``dd`` on the same file system, in paired repetitions.

Each repetition runs the tier (fsync ``never``, then ``data``) and a set of dd runs back to back, in
alternating order; each kind of I/O (page-cache write, fdatasync write, cold read, warm read) is judged by
the median over repetitions of tier / dd. Files are dropped from the page cache one by one
(``posix_fadvise(DONTNEED)``), never machine-wide.
"""

# kvstack ships no py.typed marker, so mypy run on this file alone would refuse its (typed) modules.
# mypy: disable-error-code="import-untyped"
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cache_tier_config import BenchError, Config, Deadline, MiB, chunks_of, gbps, median, new_keys, size_label
from cache_tier_report import Ceiling, Report, ratio_row

from kvstack.cache.tiers.disk import DiskTier, FsyncPolicy
from kvstack.cache.tiers.record import HEADER_BYTES

DD_BS = 4 * MiB
DISK_BATCH = 8  # the store's default write_batch


# -- disk tier ------------------------------------------------------------------------------------------
_DD_LINE = re.compile(r"^(\d+) bytes .* copied, ([0-9.e+-]+) s", re.M)


def dd(*args: str) -> float:
    """GB/s of one dd run, from its own byte count and seconds."""
    done = subprocess.run(
        ["dd", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "LC_ALL": "C"},
    )
    found = _DD_LINE.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise BenchError(f"dd {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()[-300:]}")
    return gbps(int(found.group(1)), float(found.group(2)))


def sync_fs(path: Path) -> float:
    """Seconds to write back every dirty page of ``path``'s file system (``sync -f``: syncfs(2))."""
    t0 = time.perf_counter()
    subprocess.run(["sync", "-f", str(path)], check=True, timeout=300)
    return time.perf_counter() - t0


def drop_cached(root: Path) -> int:
    """Drop every file under ``root`` from the page cache (clean pages only: sync first); returns bytes."""
    dropped = 0
    paths = [root] if root.is_file() else [Path(d) / f for d, _, files in os.walk(root) for f in files]
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            dropped += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return dropped


def describe_fs(path: Path) -> str:
    """``path (fs type on device)``; creates ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    df = subprocess.run(
        ["df", "--output=fstype,source", str(path)], capture_output=True, text=True, timeout=10
    )
    words = df.stdout.split()
    return f"{path} ({words[-2]} on {words[-1]})" if len(words) >= 4 else str(path)


def dd_ceilings(directory: Path, nbytes: int) -> dict[str, float | None]:
    path = directory / "dd.bin"
    count = str(max(1, nbytes // DD_BS))
    out: dict[str, float | None] = {}
    try:
        sync_fs(directory)
        out["write_fdatasync"] = dd("if=/dev/zero", f"of={path}", "bs=4M", f"count={count}", "conv=fdatasync")
        path.unlink()
        sync_fs(directory)
        out["write_page_cache"] = dd("if=/dev/zero", f"of={path}", "bs=4M", f"count={count}")
        sync_fs(directory)
        drop_cached(path)
        try:
            out["read_direct"] = dd(f"if={path}", "of=/dev/null", "bs=4M", "iflag=direct")
        except BenchError:
            out["read_direct"] = None  # O_DIRECT unsupported on this file system
        drop_cached(path)
        out["read_cold"] = dd(f"if={path}", "of=/dev/null", "bs=4M")
        out["read_warm"] = dd(f"if={path}", "of=/dev/null", "bs=4M")
    finally:
        path.unlink(missing_ok=True)
    return out


async def disk_run(root: Path, size: int, nbytes: int, fsync: FsyncPolicy) -> dict[str, float]:
    n = max(1, nbytes // size)
    keys = new_keys(n)
    src = [a.data for a in chunks_of(size, n)]
    batches = [(lo, min(n, lo + DISK_BATCH)) for lo in range(0, n, DISK_BATCH)]
    tier = DiskTier(root, n * (size + HEADER_BYTES) + MiB, fsync=fsync, name=f"bench-{fsync}")
    await tier.start()
    out: dict[str, float] = {}
    try:
        sync_fs(root)
        t0 = time.perf_counter()
        for lo, hi in batches:
            if await tier.put_many(list(zip(keys[lo:hi], src[lo:hi], strict=True))) != hi - lo:
                raise BenchError(f"disk tier ({fsync}) dropped writes: {tier.stats()}")
        out["put"] = gbps(n * size, time.perf_counter() - t0)
        out["put_then_sync"] = gbps(n * size, time.perf_counter() - t0 + sync_fs(root))
        if fsync == "never":
            drop_cached(root)
            for name in ("get_cold", "get_warm"):
                t0 = time.perf_counter()
                for lo, hi in batches:
                    got = await tier.get_many(keys[lo:hi])
                    if any(g is None for g in got):
                        raise BenchError(f"disk tier missed chunks it holds: {tier.stats()}")
                    del got
                out[name] = gbps(n * size, time.perf_counter() - t0)
    finally:
        await tier.close()
        shutil.rmtree(root, ignore_errors=True)
    return out


# Each judged (and shown) disk measurement: what the tier does, the dd run it is compared with, judged.
DISK_PAIRS = (
    ("put, fsync never (page cache)", "never", "put", "write_page_cache", True),
    ("put, fsync data (disk)", "data", "put", "write_fdatasync", True),
    ("get cold (disk: files dropped first)", "never", "get_cold", "read_cold", True),
    ("get warm (page cache)", "never", "get_warm", "read_warm", True),
    ("put, fsync never, + sync -f (disk)", "never", "put_then_sync", "write_fdatasync", False),
    ("get cold vs dd iflag=direct", "never", "get_cold", "read_direct", False),
)
POLICIES: tuple[FsyncPolicy, ...] = ("never", "data")
DD_HOWS = {
    "write_fdatasync": "dd if=/dev/zero bs=4M conv=fdatasync",
    "write_page_cache": "dd if=/dev/zero bs=4M (no sync: page cache)",
    "read_direct": "dd bs=4M iflag=direct",
    "read_cold": "dd bs=4M after posix_fadvise(DONTNEED)",
    "read_warm": "dd bs=4M, file in the page cache",
}


async def bench_disk(
    cfg: Config, work: Path, report: Report, say: Callable[[str], None], deadline: Deadline
) -> None:
    """Paired runs: each repetition runs the tier (fsync never, then data) and a dd set back to back, in
    alternating order, and each kind of I/O is judged by the median over repetitions of tier / dd within a
    repetition: both sides see the same minute of this machine, whose disk and page-cache speeds move a lot
    within one."""
    where = describe_fs(work)
    say(f"disk: tier and dd in {where}, {cfg.disk_reps} paired repetitions per chunk size")
    dd_runs: list[dict[str, float | None]] = []
    runs: dict[int, list[dict[str, Any]]] = {}
    for mib in cfg.disk_sizes_mib:
        if deadline.left() < 25:
            report.skipped.append(f"disk {mib} MiB: deadline")
            continue
        runs[mib] = []
        for rep in range(cfg.disk_reps):
            pair: dict[str, Any] = {}
            if rep % 2:
                pair["dd"] = dd_ceilings(work, cfg.disk_bytes)
            for policy in POLICIES:
                root = work / f"tier-{policy}-{mib}"
                pair[policy] = await disk_run(root, mib * MiB, cfg.disk_bytes, policy)
            if not rep % 2:
                pair["dd"] = dd_ceilings(work, cfg.disk_bytes)
            dd_runs.append(pair["dd"])
            runs[mib].append(pair)
        say(f"disk {mib} MiB: {runs[mib]}")
    for name, how in DD_HOWS.items():
        samples = [v for run in dd_runs if (v := run[name]) is not None]
        if samples:
            report.ceilings.append(
                Ceiling(
                    f"dd {name}",
                    size_label(cfg.disk_bytes),
                    median(samples),
                    "GB/s",
                    f"{how}; median of {len(samples)} runs, one beside each repetition of each chunk size",
                    samples,
                )
            )
    report.raw["disk"] = {"where": where, "paired_runs": runs}
    for mib, pairs in runs.items():
        for what, run_of, kind, dd_kind, judged in DISK_PAIRS:
            ratios = [
                (pair[run_of][kind] / ceiling, pair[run_of][kind], ceiling)
                for pair in pairs
                if (ceiling := pair["dd"][dd_kind])
            ]
            if not ratios:
                continue
            _, value, ceiling = sorted(ratios)[(len(ratios) - 1) // 2]  # the median pair (lower middle)
            row = ratio_row(
                "disk",
                what,
                f"{mib} MiB",
                value,
                "GB/s",
                f"dd {dd_kind}",
                ceiling,
                0.7 if judged else None,
                {
                    "bytes": cfg.disk_bytes,
                    "pairs": [{"tier": v, "dd": c, "ratio": r} for r, v, c in ratios],
                },
            )
            report.rows.append(row)
