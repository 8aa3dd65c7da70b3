"""A connection to a publisher that drops and comes back: the subscriber survives the grace period ending
while a message is half read (libzmq would abort the process), and learns at once at reconnect whether the
publisher restarted or which batches it missed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import kvstack

SRC = Path(kvstack.__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parents[1]


def test_the_grace_period_ending_while_a_backlog_is_read_does_not_abort_the_process() -> None:
    """An engine dies with 200 batches unread and the subscriber reads them slowly (5 ms each): its 50 ms
    grace period ends between a poll, which prefetched a message's first frame, and the read of the rest.
    Disconnecting that socket then made libzmq abort (``!_more (src/fq.cpp:80)``); every run did."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)])}
    child = subprocess.run(
        [sys.executable, "-m", "support.kv_event_backlog", "200", "0.005", "0.05"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == 0, f"exit status {child.returncode}: {child.stderr[-3000:]}"
    assert json.loads(child.stdout)["resets"] == ["disconnected"]
