"""Facts about the machine a benchmark runs on, shared by the scripts in benchmarks/.

These machines are shared and noisy: every result records the cores, the CPU and how busy the machine was just
before the run, so a reader can tell a slow run from a slow program.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import time
from pathlib import Path
from typing import Any


def machine_cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all cores from /proc/stat: the whole machine, other processes included."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


def machine() -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "loadavg_at_start": Path("/proc/loadavg").read_text().split()[:3],
        "busy_pct_before_start": round(idle_check(), 1),
    }


def idle_check(seconds: float = 1.0) -> float:
    """Busy share of all cores over ``seconds`` before the run: other work on the machine skews results."""
    busy0, all0 = machine_cpu_ticks()
    time.sleep(seconds)
    busy1, all1 = machine_cpu_ticks()
    return 100 * (busy1 - busy0) / max(1, all1 - all0)


def timer_wakeup_lag(seconds: float = 2.0, period_s: float = 0.001) -> dict[str, float]:
    """How late an otherwise idle event loop (uvloop when installed) wakes from a ``period_s`` sleep, in ms
    (p50, p99, max over ``seconds``), run in this process. It is the machine's own wake-up latency: on a VM
    whose host is busy an idle vCPU can take milliseconds to run again, and every process a request passes
    through pays one such wake-up, so a latency tail that a program adds cannot be read below this floor."""
    try:
        import uvloop

        new_loop: Any = uvloop.new_event_loop
    except ImportError:
        new_loop = asyncio.new_event_loop

    async def probe() -> list[float]:
        lags: list[float] = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            await asyncio.sleep(period_s)
            lags.append(time.perf_counter() - t0 - period_s)
        return sorted(lags)

    loop = new_loop()
    try:
        lags = loop.run_until_complete(probe())
    finally:
        loop.close()

    def pct(q: float) -> float:
        return round(1000 * lags[min(len(lags) - 1, int(len(lags) * q))], 3)

    return {"p50_ms": pct(0.5), "p99_ms": pct(0.99), "max_ms": round(1000 * lags[-1], 3), "n": len(lags)}


CLK_TCK = os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc/<pid>/stat; 0 when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK
