"""The `kvstack router` command: argument errors, and --workers processes sharing one port."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from harness import EngineProcess, free_port, start_sim


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstack.cli", "router", *args], capture_output=True, text=True, timeout=60
    )


def test_bad_arguments_exit_2_with_the_reason() -> None:
    no_engines = _cli("--port", str(free_port()))
    assert no_engines.returncode == 2 and "--engine" in no_engines.stderr
    bad_preset = _cli("--engine", "http://127.0.0.1:9", "--routing", "fastest")
    assert bad_preset.returncode == 2 and "preset" in bad_preset.stderr
    bad_role = _cli("--engine", "http://127.0.0.1:9#role=decoder")
    assert bad_role.returncode == 2 and "decoder" in bad_role.stderr


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def test_workers_share_the_port_and_stop_together(tmp_path: Path) -> None:
    sim: EngineProcess = start_sim(tmp_path / "sim", extra_args=["--time-scale", "50"])
    port = free_port()
    router = subprocess.Popen(
        [sys.executable, "-m", "kvstack.cli", "router", "--port", str(port), "--engine", sim.url,
         "--workers", "2", "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "router never answered"
                time.sleep(0.2)
        workers = _children(router.pid)
        assert len(workers) == 2  # the parent supervises
        body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
        for _ in range(20):
            req = urllib.request.Request(
                f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=30) as r:
                assert r.status == 200
        router.send_signal(signal.SIGTERM)
        router.wait(timeout=20)
        time.sleep(0.5)
        for pid in workers:
            assert (
                not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
            )
    finally:
        if router.poll() is None:
            os.killpg(router.pid, signal.SIGKILL)
        sim.stop()
