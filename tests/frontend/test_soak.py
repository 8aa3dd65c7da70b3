"""A one-minute soak through both front ends (kvstack router; real Envoy asking kvstack epp) over simulated
engines with injected faults, restarts and a cache server: every request accounted for, nothing leaked.

The test runs benchmarks/soak.py itself, so this and the 30-minute soak share every line of setup, load,
sampling and verdict; it only passes bounds for a short run: an engine restart every 20 s, a sample every
second, 24 MiB of RSS slack (a minute is mostly warm-up: the tokenization cache, the routing history and the
prefix index still fill) and 8 fds or sockets of slack (connections to a restarted engine come and go).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from support.envoy import envoy_binary, require_envoy
from support.processes import spawn, stop_group

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def test_short_soak_accounts_for_every_request_and_leaks_nothing(tmp_path: Path) -> None:
    require_envoy()
    cmd = [
        *(sys.executable, str(REPO / "benchmarks" / "soak.py"), "--minutes", "1"),
        *("--restart-every", "20", "--sample-every", "1", "--rss-slack-mib", "24", "--count-slack", "8"),
        *("--out", str(tmp_path), "--logs", str(tmp_path / "work")),
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
        "KVSTACK_ENVOY": str(envoy_binary()),
    }
    soak = spawn(cmd, tmp_path / "soak.log", env=env, cwd=REPO)
    try:
        soak.wait(timeout=360)
    finally:
        stop_group(soak, 30)
    output = (tmp_path / "soak.log").read_text(errors="replace")
    assert (tmp_path / "soak.json").exists(), output[-4000:]
    result = json.loads((tmp_path / "soak.json").read_text())

    assert len(result["restarts_s"]) >= 2, "the soak restarted fewer than 2 engines"
    for front, f in result["fronts"].items():
        outcomes = f["client"]["outcomes"]
        assert f["client"]["sent"] >= 100, (front, f["client"])
        assert outcomes["cancelled"] > 0 and outcomes["ok"] > 0, (front, outcomes)
        assert f["accounting"]["problems"] == [], (front, f["client"], f["counters"])
    for process, leak in result["leaks"].items():
        assert leak["ok"], (process, leak)
    assert soak.returncode == 0, output[-4000:]
