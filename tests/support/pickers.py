"""Endpoint pickers: in the test's event loop over simulated engines, or as ``kvstack epp`` processes."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstack.engines.state import Endpoint
from kvstack.epp.server import EppOptions, RunningEpp, start_epp
from kvstack.sim.cluster import RunningEngine
from support.ext_proc import ExtProcClient
from support.ports import free_port
from support.processes import kill_group, spawn, stop_group
from support.waiting import eventually


@dataclass
class PickerStack:
    engines: list[RunningEngine]
    epp: RunningEpp
    client: ExtProcClient

    def address(self, i: int) -> str:
        return self.engines[i].url.removeprefix("http://")

    def in_flight(self) -> dict[str, int]:
        counts = {}
        for i, engine in enumerate(self.engines):
            entry = self.epp.front.registry.get(engine.url)
            counts[self.address(i)] = 0 if entry is None else entry.state.in_flight
        return counts


async def wait_engines(epp: RunningEpp, count: int) -> None:
    """Until ``count`` engines have known models and fresh metrics."""

    def ready() -> bool:
        known = [e for e in epp.front.registry if e.state.endpoint.models and not e.state.metrics_stale]
        return len(known) >= count

    await eventually(ready, what=f"{count} engines known to the picker", timeout_s=10, interval_s=0.05)


@contextlib.asynccontextmanager
async def picking_over(engines: list[RunningEngine], **options: Any) -> AsyncIterator[PickerStack]:
    """A picker (free ports) over ``engines``; ``options`` are EppOptions fields."""
    opts = EppOptions(grpc_port=0, http_port=0, engines=[Endpoint(e.url) for e in engines], **options)
    epp = await start_epp(opts)
    client = ExtProcClient(epp.grpc_address)
    try:
        await wait_engines(epp, len(engines))
        yield PickerStack(engines, epp, client)
    finally:
        await client.close()
        await epp.stop()


@dataclass
class PickerProcess:
    """``kvstack epp`` in its own process group."""

    grpc_address: str
    http_url: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    args: list[str]

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        stop_group(self.proc)

    def kill(self) -> None:
        kill_group(self.proc)


def start_picker_process(
    workdir: Path,
    engine_urls: list[str],
    *extra: str,
    grpc_port: int | None = None,
    http_port: int | None = None,
    deadline_s: float = 30.0,
) -> PickerProcess:
    """Start ``kvstack epp`` over ``engine_urls`` (ports free unless given); return once it knows them all,
    with fresh metrics."""
    grpc_port = grpc_port or free_port()
    http_port = http_port or free_port()
    args = [
        sys.executable, "-m", "kvstack.cli", "epp", "--host", "127.0.0.1",
        "--grpc-port", str(grpc_port), "--http-port", str(http_port), "--log-level", "warning",
        *(a for url in engine_urls for a in ("--engine", url)), *extra,
    ]  # fmt: skip
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / f"epp-{grpc_port}.log"
    proc = spawn(args, log_path, cwd=workdir)
    picker = PickerProcess(f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}", proc, log_path, args)
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            with urllib.request.urlopen(f"{picker.http_url}/engines", timeout=2) as r:
                engines = json.load(r)["engines"]
            # Fresh metrics too: an engine never scraped counts as saturated, and traffic would avoid it.
            fresh = all(
                e["models"] and e["routable"] and e["metrics"] and not e["metrics"]["stale"] for e in engines
            )
            if len(engines) == len(engine_urls) and fresh:
                return picker
        except (OSError, ValueError, KeyError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = picker.log_tail()
            picker.stop()
            raise RuntimeError(f"kvstack epp did not come up: {tail}")
        time.sleep(0.1)


def picker_engines(picker: PickerProcess) -> dict[str, dict[str, Any]]:
    """The picker's /engines, by engine URL."""
    with urllib.request.urlopen(f"{picker.http_url}/engines", timeout=5) as r:
        return {e["url"]: e for e in json.load(r)["engines"]}
