"""A cache_tier run's settings and the pieces every section measures with.

`Config` (and ``quick_config`` for ``--quick``) sets the working sets, rounds and sizes; `BenchError` is a
measurement that could not be made as intended. Helpers: distinct pre-touched chunk buffers and random
keys, GB/s, medians and nearest-rank percentiles, a `Deadline`, ``run_async`` (uvloop when installed), and
``async_passes`` (batches with N calls in flight). A `Child` is a process started in its own session whose
first stdout lines can be read (a server's endpoints), stopped by its PID.
"""

# kvstack ships no py.typed marker, so mypy run on this file alone would refuse its (typed) modules.
# mypy: disable-error-code="import-untyped"
from __future__ import annotations

import asyncio
import os
import select
import signal
import statistics
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from procs import REPO

from kvstack.cache.keys import ChunkKey

MiB = 1 << 20


class BenchError(Exception):
    """A measurement that could not be made as intended (a miss, a dropped write, a tool that failed)."""


@dataclass
class Config:
    sizes_mib: tuple[int, ...] = (1, 4, 16, 32)
    working_set: int = 256 * MiB
    memory_rounds: int = 9
    server_rounds: int = 4
    request_bytes: int = 32 * MiB
    async_concurrency: int = 2
    lookup_iterations: int = 2000
    lookup_prompts: int = 16
    disk_bytes: int = 512 * MiB
    disk_sizes_mib: tuple[int, ...] = (1, 4, 16, 32)
    disk_reps: int = 3
    redis_cases: tuple[tuple[int, int], ...] = ((64 * 1024, 16), (1 * MiB, 4))  # (payload bytes, batch)
    redis_concurrency: tuple[int, ...] = (1, 4)
    redis_bytes: int = 512 * MiB  # per measurement (each of SET, GET; tier and redis-benchmark)
    deadline_s: float = 480.0


def quick_config() -> Config:
    return Config(
        working_set=128 * MiB,
        memory_rounds=3,
        server_rounds=1,
        lookup_iterations=500,
        lookup_prompts=8,
        disk_bytes=128 * MiB,
        disk_sizes_mib=(1, 16),
        disk_reps=1,
        redis_concurrency=(1,),
        redis_bytes=128 * MiB,
        deadline_s=75.0,
    )


# -- small helpers --------------------------------------------------------------------------------------
def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def pct(values_ns: Sequence[int], q: float) -> float:
    """The q-th percentile of ``values_ns`` in µs (nearest rank)."""
    ordered = sorted(values_ns)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))] / 1e3


def new_keys(n: int) -> list[ChunkKey]:
    return [ChunkKey(os.urandom(32)) for _ in range(n)]


def chunks_of(size: int, n: int) -> list[np.ndarray]:
    """``n`` distinct, pre-touched chunks of ``size`` bytes (the content does not change any cost here)."""
    return [np.full(size, 1 + i % 251, dtype=np.uint8) for i in range(n)]


def size_label(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // 1024} KiB"


def run_async(coro: Any) -> None:
    """Run ``coro`` as the cache server runs its tiers: on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


@dataclass
class Child:
    """A process started in its own session, stopped by its PID."""

    name: str
    proc: subprocess.Popen[bytes]

    @classmethod
    def start(cls, name: str, cmd: list[str], log_path: Path, *, stdout_pipe: bool = False) -> Child:
        log = log_path.open("ab")
        try:
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE if stdout_pipe else log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=str(REPO),
            )
        finally:
            log.close()
        return cls(name, proc)

    def read_line(self, timeout_s: float) -> str:
        """The next stdout line (needs ``stdout_pipe``); raises BenchError on timeout or exit."""
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            raise BenchError(f"{self.name} printed nothing within {timeout_s}s")
        line = self.proc.stdout.readline().decode(errors="replace")
        if not line:
            raise BenchError(f"{self.name} exited with {self.proc.wait(timeout=5)} before it was ready")
        return line.strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


async def async_passes(concurrency: int, batches: Sequence[tuple[int, int]], one: Any) -> float:
    """Time ``one(lo, hi)`` over every batch, ``concurrency`` at a time."""
    it = iter(batches)

    async def worker() -> None:
        for lo, hi in it:  # shared: each batch is taken by one worker
            await one(lo, hi)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - t0
