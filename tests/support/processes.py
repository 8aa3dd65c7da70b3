"""Subprocesses for tests: each starts in a session of its own, so its pid is its process group's id, and
it is stopped by that group (never by name), taking anything it started along."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path


def spawn(
    cmd: Sequence[str],
    log_path: Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in a new session; stdout and stderr go to ``log_path`` (appended) or nowhere."""
    log = log_path.open("ab") if log_path is not None else subprocess.DEVNULL
    try:
        return subprocess.Popen(
            list(cmd),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
        )
    finally:
        if not isinstance(log, int):
            log.close()


def stop_group(proc: subprocess.Popen[bytes], timeout_s: float = 20.0) -> int:
    """SIGTERM to ``proc``'s process group, SIGKILL to it after ``timeout_s``; ``proc``'s exit status."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(proc)
        except ProcessLookupError:
            pass
    return proc.wait(timeout=10)


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL to ``proc``'s process group (kill -9 of the server and what it started), then reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def group_alive(proc: subprocess.Popen[bytes]) -> bool:
    """Whether anything in ``proc``'s process group still runs (``proc`` itself may have exited)."""
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_for_banner(
    log_path: Path, proc: subprocess.Popen[bytes], marker: str = "OpenAI base URL", budget_s: float = 60.0
) -> str:
    """The log of ``proc`` once it contains ``marker`` (a command's ready banner); fails if it exits first."""
    deadline = time.monotonic() + budget_s
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace") if log_path.exists() else ""
        if marker in text:
            return text
        assert proc.poll() is None, text
        time.sleep(0.1)
    raise AssertionError(f"no {marker!r} in the log: {log_path.read_text(errors='replace')}")
