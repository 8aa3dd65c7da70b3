"""What every benchmark result carries besides its numbers: the commit measured, ratios, the JSON file.

``git_state``: the commit and any uncommitted changes under src/ (other work in progress would be measured
too). ``ratio``: a / b, None when either is unknown or b is 0. ``write_json``: the result, indented, one
trailing newline, its directory created.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from procs import REPO


def git_state() -> dict[str, Any]:
    """The commit measured, and whether src/ had uncommitted changes (other work in progress)."""

    def git(*args: str) -> str:
        try:
            out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return out.stdout.strip()

    changed = git("status", "--porcelain", "--", "src")
    return {"commit": git("rev-parse", "HEAD"), "src_changed_files": changed.splitlines()}


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def write_json(path: Path, result: Any, default: Callable[[Any], Any] | None = None) -> None:
    """``result`` as indented JSON; ``default`` turns what json cannot encode into what it can."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=default) + "\n")
