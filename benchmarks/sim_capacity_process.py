"""The ``kvstack sim`` process under test, started with the latency model the expected ITL is computed from.

`SimProcess` starts ``kvstack sim --engines N`` in its own process group (stopped by that id) with
``SIM_FLAGS`` (free ports, the default latency model passed explicitly), reads every engine's URL and KV
events endpoint from its start-up banner and waits until each answers ``/health``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from machine_info import process_cpu_seconds
from procs import HOST, KVSTACK, REPO

# The simulator's default latency model, in seconds at --time-scale 1.
STEP_OVERHEAD = 0.001
PREFILL_PER_TOKEN = 0.00005
DECODE_BASE = 0.008
DECODE_PER_SEQ = 0.0001
MAX_NUM_BATCHED_TOKENS = 8192
MODEL = "kvstack-sim"
# Every engine on its own free port (0), read back from the start-up banner; the latency model is the
# simulator's default, passed explicitly so that sim_capacity_streams.modelled_itl stays in step with it.
SIM_FLAGS = {
    "--host": HOST,
    "--port": "0",
    "--kv-events-port": "0",
    "--served-model-name": MODEL,
    "--block-size": "16",
    "--num-gpu-blocks": "100000",
    "--max-num-seqs": "1024",
    "--max-num-batched-tokens": str(MAX_NUM_BATCHED_TOKENS),
    "--step-overhead": str(STEP_OVERHEAD),
    "--prefill-per-token": str(PREFILL_PER_TOKEN),
    "--decode-base": str(DECODE_BASE),
    "--decode-per-seq": str(DECODE_PER_SEQ),
    "--log-level": "warning",
}


_ENGINE_LINE = re.compile(r"engine (\d+): (http://\S+)/v1\s+metrics \S+(?:\s+kv events (\S+))?")


def parse_banner(text: str) -> list[tuple[int, str, str | None]]:
    """(index, base url, KV events endpoint) of each engine ``kvstack sim`` printed at start-up."""
    return [(int(m[1]), m[2], m[3]) for m in _ENGINE_LINE.finditer(text)]


# -- the simulator process --------------------------------------------------------------------------
@dataclass
class Engine:
    index: int
    url: str
    events_endpoint: str | None


@dataclass
class SimProcess:
    """A running ``kvstack sim`` in its own process group."""

    cmd: list[str]
    proc: subprocess.Popen[bytes]
    log_path: Path
    engines: list[Engine] = field(default_factory=list)

    @classmethod
    def start(cls, engines: int, log_path: Path, deadline_s: float = 60.0) -> SimProcess:
        if not KVSTACK.exists():
            raise SystemExit(f"{KVSTACK} not found: run `make dev` first")
        cmd = [str(KVSTACK), "sim", "--engines", str(engines)]
        cmd += [part for flag, value in SIM_FLAGS.items() for part in (flag, value)]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=str(REPO)
            )
        sim = cls(cmd, proc, log_path)
        try:
            sim._wait_ready(engines, deadline_s)
        except BaseException:
            sim.stop()
            raise
        return sim

    def _wait_ready(self, expected: int, deadline_s: float) -> None:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvstack sim exited with {self.proc.returncode}:\n{self.log_tail()}")
            found = parse_banner(self.log_path.read_text(errors="replace"))
            if len(found) >= expected:
                self.engines = [Engine(i, url, ev) for i, url, ev in found[:expected]]
                if all(_healthy(e.url) for e in self.engines):
                    return
            time.sleep(0.2)
        raise RuntimeError(f"kvstack sim not healthy after {deadline_s:.0f}s:\n{self.log_tail()}")

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(self.proc.pid)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc.poll() is not None:
            return
        pgid = self.proc.pid  # start_new_session=True: the pid is the process group id
        try:
            os.killpg(pgid, signal.SIGTERM)
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(timeout=5)
        except ProcessLookupError:
            pass


def _healthy(url: str) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False
