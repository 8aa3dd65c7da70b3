"""Several router processes on one port (``--workers N``, SO_REUSEPORT) and the state they share.

Each worker runs the whole router; the kernel spreads client connections over them. Kept consistent:
- Admin changes reach one worker, which applies them and forwards them to every sibling over their control
  sockets (Unix sockets in the group's private 0700 directory, aiohttp on both ends), answering when all
  have applied them. A sibling still starting is waited for (``Backoff(0.05, 0.5)``) up to ``timeout``.
- A breaker that opens opens the siblings' breakers for the same time; half-open probes stay per worker.
- In-flight requests per engine: ``SharedInFlight``, an mmap'd table of workers x slots int32 counters
  (each worker writes only its own row, reads the sum of the others).
- Metrics: prometheus_client's multiprocess mode in the group directory; the per-request series are plain
  numbers in each worker, written there on request (``flush-hot-series``) before /metrics sums them.
- Admission limits are divided between the workers (rounded up); every worker subscribes to the KV events
  itself (same index), the routing history is per worker.
The supervisor creates the directory, starts the workers, stops them all when stopped or when one dies,
and deletes the directory. ``usable_cores`` is how many workers ``--workers auto`` (the default) runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import mmap
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import xxhash
from aiohttp import web

from kvstack.backoff import Backoff
from kvstack.openai import errors
from kvstack.openai.http import json_response

log = logging.getLogger(__name__)

__all__ = ["SharedInFlight", "WorkerGroup", "WorkerGroupConfig", "usable_cores"]

ENV_DIR = "KVSTACK_WORKER_DIR"
ENV_INDEX = "KVSTACK_WORKER_INDEX"
ENV_COUNT = "KVSTACK_WORKER_COUNT"
METRICS_SUBDIR = "metrics"
_SLOTS = 65_536
_CELL = struct.Struct("=i")
_SIBLING_STARTING = Backoff(0.05, 0.5)  # waits for a sibling whose control socket is not there yet
_CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def usable_cores(affinity: int | None = None, cpu_max: str | None = None) -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota (a container's
    CPU limit, ``cpu.max`` = "quota period" or "max period") rounded up; at least 1."""
    cores = len(os.sched_getaffinity(0)) if affinity is None else affinity
    if cpu_max is None:
        try:
            cpu_max = _CGROUP_CPU_MAX.read_text()
        except OSError:
            cpu_max = "max"
    quota, _, period = cpu_max.partition(" ")
    if quota.strip() not in ("", "max") and period.strip():
        cores = min(cores, math.ceil(int(quota) / int(period)))
    return max(1, cores)


@dataclass(frozen=True, slots=True)
class WorkerGroupConfig:
    directory: Path
    index: int
    count: int

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> WorkerGroupConfig | None:
        """The group this process belongs to, as the supervisor described it in the environment."""
        directory = env.get(ENV_DIR)
        if not directory:
            return None
        return cls(Path(directory), int(env[ENV_INDEX]), int(env[ENV_COUNT]))

    def socket_path(self, index: int) -> Path:
        return self.directory / f"worker-{index}.sock"

    @property
    def table_path(self) -> Path:
        return self.directory / "in-flight.table"

    def limit(self, total: int) -> int:
        """This worker's share of a router-wide limit (0 = unlimited stays 0)."""
        return 0 if total == 0 else -(-total // self.count)


def prepare_group_directory(directory: Path, count: int) -> None:
    """Create what the workers share: the metrics directory and the zeroed in-flight table."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    (directory / METRICS_SUBDIR).mkdir(mode=0o700, exist_ok=True)
    with open(directory / "in-flight.table", "wb") as f:
        f.truncate(count * _SLOTS * _CELL.size)


class SharedInFlight:
    """Per-engine in-flight counts of every worker: row = worker, column = hash(engine URL) % slots.

    Two engine URLs that hash to one slot would share a counter (about 3% odds for 64 engines); their
    in-flight numbers then read a little high, which only makes scoring slightly more cautious.
    """

    def __init__(self, path: Path, count: int, index: int) -> None:
        self.count = count
        self.index = index
        self._file = open(path, "r+b")  # noqa: SIM115 - held open for the mmap's lifetime, closed in close()
        self._map = mmap.mmap(self._file.fileno(), count * _SLOTS * _CELL.size)
        self._row = index * _SLOTS

    @staticmethod
    def slot(url: str) -> int:
        return xxhash.xxh64_intdigest(url.encode()) % _SLOTS

    def set_local(self, slot: int, value: int) -> None:
        _CELL.pack_into(self._map, (self._row + slot) * _CELL.size, value)

    def others(self, slot: int) -> int:
        total = 0
        for worker in range(self.count):
            if worker != self.index:
                total += _CELL.unpack_from(self._map, (worker * _SLOTS + slot) * _CELL.size)[0]
        return max(0, total)

    def close(self) -> None:
        self._map.close()
        self._file.close()


# An internal command: (op, body) -> applied locally. Raising OpenAIError reports the failure.
Command = Callable[[str, dict[str, Any]], None]


class WorkerGroup:
    """This worker's link to its siblings: its control socket, broadcasts to theirs, the shared table."""

    def __init__(self, config: WorkerGroupConfig, timeout: float = 5.0) -> None:
        self.config = config
        self.timeout = timeout
        self.in_flight = SharedInFlight(config.table_path, config.count, config.index)
        self._handlers: dict[str, Command] = {}
        self._runner: web.AppRunner | None = None
        self._sessions: dict[int, aiohttp.ClientSession] = {}

    @property
    def index(self) -> int:
        return self.config.index

    @property
    def count(self) -> int:
        return self.config.count

    def on(self, op: str, handler: Command) -> None:
        """Handle ``op`` when a sibling broadcasts it."""
        self._handlers[op] = handler

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/internal/{op}", self._receive)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        path = self.config.socket_path(self.index)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        await web.UnixSite(self._runner, str(path)).start()
        os.chmod(path, 0o600)

    async def stop(self) -> None:
        for session in self._sessions.values():
            await session.close()
        self._sessions.clear()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self.in_flight.close()

    async def _receive(self, request: web.Request) -> web.Response:
        op = request.match_info["op"]
        handler = self._handlers.get(op)
        if handler is None:
            raise errors.bad_request(f"unknown internal operation {op!r}")
        body = msgspec.json.decode(await request.read())
        handler(op, body)
        return json_response({"applied": op, "worker": self.index})

    async def broadcast(self, op: str, body: dict[str, Any]) -> int:
        """Send ``op`` to every sibling; returns how many applied it (failures are logged)."""
        siblings = [i for i in range(self.count) if i != self.index]
        results = await asyncio.gather(*(self._send(i, op, body) for i in siblings))
        return sum(results)

    async def _send(self, worker: int, op: str, body: dict[str, Any]) -> bool:
        session = self._sessions.get(worker)
        if session is None:
            connector = aiohttp.UnixConnector(path=str(self.config.socket_path(worker)))
            session = self._sessions[worker] = aiohttp.ClientSession(connector=connector)
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        waits = _SIBLING_STARTING.sequence()
        deadline = asyncio.get_running_loop().time() + self.timeout
        while True:
            try:
                async with session.post(f"http://worker/internal/{op}", json=body, timeout=timeout) as resp:
                    if resp.status == 200:
                        return True
                    log.warning("worker %d refused %s: %s", worker, op, await resp.text())
                    return False
            except aiohttp.ClientConnectorError as exc:
                # A sibling still starting has no socket yet: wait for it rather than leave it behind.
                delay = waits.next()
                if asyncio.get_running_loop().time() + delay > deadline:
                    log.warning("worker %d did not take %s: %r", worker, op, exc)
                    return False
                await asyncio.sleep(delay)
            except (aiohttp.ClientError, TimeoutError) as exc:
                log.warning("worker %d did not take %s: %r", worker, op, exc)
                return False
