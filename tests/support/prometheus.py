"""Debian's Prometheus for tests: promtool on rule files, a Prometheus scraping given targets, and its HTTP
query API; and a dashboard's queries as kvstack's checker reads them, to run them on Prometheus.

``require_prometheus()`` / ``require_promtool()`` return the binary, or skip the test without it (fail
instead when KVSTACK_REQUIRE_PROMETHEUS=1, as `make test` sets it). ``start_prometheus(config, workdir)``
runs one on a free 127.0.0.1 port with its TSDB in ``workdir``; it is stopped by its process group.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvstack.board import documents
from support.ports import free_port
from support.processes import spawn, stop_group


def _require(name: str, variable: str) -> Path:
    binary = Path(os.environ.get(variable, f"/usr/bin/{name}"))
    if binary.exists():
        return binary
    reason = f"no {name} at {binary} (`apt-get install prometheus`, or set {variable})"
    if os.environ.get("KVSTACK_REQUIRE_PROMETHEUS") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


def require_prometheus() -> Path:
    """The prometheus binary; skips the test without one (fails when KVSTACK_REQUIRE_PROMETHEUS=1)."""
    return _require("prometheus", "KVSTACK_PROMETHEUS")


def require_promtool() -> Path:
    """The promtool binary; skips the test without one (fails when KVSTACK_REQUIRE_PROMETHEUS=1)."""
    return _require("promtool", "KVSTACK_PROMTOOL")


def promtool(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(require_promtool()), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=cwd,
    )


def scrape_config(
    jobs: dict[str, list[str]], interval_s: float = 1.0, rule_files: Sequence[Path] = ()
) -> dict[str, Any]:
    """A Prometheus config scraping each job's ``host:port`` targets every ``interval_s`` and evaluating
    ``rule_files`` as often."""
    every = f"{interval_s:g}s"
    return {
        "global": {"scrape_interval": every, "evaluation_interval": every, "scrape_timeout": every},
        "rule_files": [str(path) for path in rule_files],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": targets}]} for job, targets in jobs.items()
        ],
    }


@dataclass
class PrometheusProcess:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def query(self, expr: str, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        """The result of an instant query (``/api/v1/query``); a PromQL error raises with its message."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{expr}: {e.read().decode(errors='replace')}") from e
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def api(self, path: str) -> Any:
        """The ``data`` of a GET on the HTTP API (``/api/v1/...``)."""
        with urllib.request.urlopen(f"{self.url}{path}", timeout=10) as r:
            return json.loads(r.read())["data"]

    def targets_up(self) -> dict[str, bool]:
        """Active targets' scrape URLs and whether their last scrape succeeded."""
        targets = self.api("/api/v1/targets?state=active")["activeTargets"]
        return {t["scrapeUrl"]: t["health"] == "up" for t in targets}

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> int:
        return stop_group(self.proc, 15.0)


def start_prometheus(config: dict[str, Any], workdir: Path, deadline_s: float = 30.0) -> PrometheusProcess:
    """Prometheus on ``config`` at a free 127.0.0.1 port, its TSDB under ``workdir``; returns once ready."""
    binary = require_prometheus()
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    log_path = workdir / "prometheus.log"
    cmd = [
        str(binary),
        f"--config.file={config_path}",
        f"--web.listen-address=127.0.0.1:{port}",
        f"--storage.tsdb.path={workdir / 'tsdb'}",
        "--web.enable-lifecycle",
    ]
    prometheus = PrometheusProcess(f"http://127.0.0.1:{port}", spawn(cmd, log_path, cwd=workdir), log_path)
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if prometheus.proc.poll() is not None:
            code = prometheus.proc.returncode
            raise RuntimeError(f"prometheus exited with {code}:\n{prometheus.log_tail()}")
        try:
            with urllib.request.urlopen(f"{prometheus.url}/-/ready", timeout=1) as r:
                if r.status == 200:
                    return prometheus
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    prometheus.stop()
    raise RuntimeError(f"prometheus not ready after {deadline_s:g} s:\n{prometheus.log_tail()}")


@dataclass(frozen=True)
class DashboardQuery:
    """One PromQL expression of a dashboard: where it is, the text, and for a ``label_values(selector,
    label)`` variable its name and label (``expr`` is then the selector)."""

    where: str
    expr: str
    variable: str | None = None
    label: str | None = None


def dashboard_queries(path: Path) -> list[DashboardQuery]:
    """Every PromQL expression of a Grafana dashboard as ``kvstack metrics check`` reads it (its reader,
    ``kvstack.board.documents``): the templating variables first, in order, so that later queries can use
    their values, then the panels' targets (rows' nested panels too)."""
    found = []
    for expression in documents.read([path]).expressions:
        variable = re.fullmatch(r'variable "(\w+)"', expression.where)
        assert expression.text, f"{expression.where}: label_values without a selector cannot be queried"
        label = expression.labels[0] if expression.labels else None
        found.append(DashboardQuery(expression.where, expression.text, variable and variable[1], label))
    return sorted(found, key=lambda q: q.variable is None)
