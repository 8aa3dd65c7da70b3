"""The `kvstack router` command: argument errors (every numeric option checked, discovery sources that
cannot be combined), the hold flags, --workers processes sharing one port (default: one per usable core;
1: this process), and the scrape interval."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvstack import cli
from kvstack.router import workers
from kvstack.router.hold import HoldPolicy
from kvstack.router.server import RouterOptions
from support.engines import EngineProcess, start_sim
from support.ports import free_port
from support.processes import kill_group, spawn, stop_group


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
    bad_header = _cli("--engine", "http://127.0.0.1:9", "--session-header", "x user")
    assert bad_header.returncode == 2 and "'x user' is not an HTTP header name" in bad_header.stderr
    for flag in ("--scrape-interval", "--scrape-timeout"):
        bad_scrape = _cli("--engine", "http://127.0.0.1:9", flag, "0")
        assert bad_scrape.returncode == 2 and "must be positive" in bad_scrape.stderr


@pytest.fixture
def no_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    """A router the options let start is a test failure, not a server running until the test times out."""

    def refuse(opts: RouterOptions) -> None:
        raise AssertionError("the router started")

    monkeypatch.setattr("kvstack.router.server.serve_forever", refuse)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--max-queue", "-1", "must be >= 0, got -1"),
        ("--max-in-flight", "-2", "must be >= 0, got -2"),
        ("--queue-timeout", "-1", "must be positive"),
        ("--index-max-entries", "0", "must be >= 1, got 0"),
        ("--max-attempts", "0", "must be >= 1, got 0"),
        ("--hold-bytes", "-1", "must be >= 0, got -1"),
        ("--hold-seconds", "0", "must be positive"),
        ("--timeout-total", "-1", "must be positive"),
        ("--timeout-connect", "0", "must be positive"),
        ("--timeout-first-byte", "nan", "must be positive"),
        ("--timeout-idle", "inf", "must be positive and finite"),
        ("--max-body-mb", "-1", "must be positive"),
        ("--circuit-open-seconds", "-5", "must be positive"),
        ("--circuit-failures", "0", "must be >= 1, got 0"),
        ("--scrape-interval", "0", "must be positive"),
        ("--scrape-timeout", "-0.5", "must be positive"),
        ("--workers", "0", "must be >= 1, got 0"),
        ("--port", "70000", "must be from 0 to 65535"),
        ("--k8s-port", "0", "must be from 1 to 65535"),
        ("--max-queue", "many", "'many' is not an integer"),
        ("--timeout-total", "soon", "'soon' is not a number"),
    ],
)
def test_router_numeric_options_are_checked(
    option: str, value: str, message: str, capsys: pytest.CaptureFixture[str], no_serving: None
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["router", "--port", "0", "--engine", "http://127.0.0.1:9", option, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: {message}" in err and "Traceback" not in err


def test_hold_flags_set_how_a_streams_start_is_held(monkeypatch: pytest.MonkeyPatch) -> None:
    held: list[HoldPolicy] = []

    def capture(opts: RouterOptions) -> None:
        held.append(opts.app.hold)
        raise SystemExit(0)

    monkeypatch.setattr("kvstack.router.server.serve_forever", capture)
    base = ["router", "--port", "0", "--engine", "http://127.0.0.1:9", "--workers", "1"]
    for extra in ([], ["--no-hold-until-content", "--hold-bytes", "1024", "--hold-seconds", "2.5"]):
        with pytest.raises(SystemExit):
            cli.main(base + extra)
    assert held == [HoldPolicy(True, 64 * 1024, None), HoldPolicy(False, 1024, 2.5)]


def test_discovery_sources_that_cannot_be_combined_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_serving: None
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(
            ["router", "--port", "0", "--engines-file", str(tmp_path / "e.yaml"), "--k8s-namespace", "llm"]
        )
    assert info.value.code == 2
    assert "argument --k8s-namespace: not allowed with argument --engines-file" in capsys.readouterr().err
    for option, value in (("--k8s-selector", "app=vllm"), ("--k8s-port", "8000")):
        assert cli.main(["router", "--port", "0", "--engine", "http://127.0.0.1:9", option, value]) == 2
        assert "apply only with --k8s-namespace" in capsys.readouterr().err


def test_workers_default_to_the_usable_cores(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(workers, "_CGROUP_CPU_MAX", tmp_path / "no-cgroup")
    monkeypatch.setattr(workers.os, "sched_getaffinity", lambda pid: {0, 2, 5})
    parse = cli.build_parser().parse_args
    assert parse(["router", "--engine", "http://127.0.0.1:9"]).workers == 3
    assert parse(["router", "--engine", "http://127.0.0.1:9", "--workers", "auto"]).workers == 3
    assert parse(["router", "--engine", "http://127.0.0.1:9", "--workers", "1"]).workers == 1


def test_usable_cores_are_the_affinity_capped_by_the_cgroup_quota() -> None:
    assert workers.usable_cores(8, "max 100000\n") == 8
    assert workers.usable_cores(8, "200000 100000\n") == 2
    assert workers.usable_cores(8, "150000 100000") == 2  # 1.5 cores: both are used part of the time
    assert workers.usable_cores(8, "50000 100000") == 1
    assert workers.usable_cores(1, "400000 100000") == 1


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@pytest.mark.slow
def test_workers_share_the_port_and_stop_together(tmp_path: Path) -> None:
    sim: EngineProcess = start_sim(tmp_path / "sim", extra_args=["--time-scale", "50"])
    port = free_port()
    router = spawn(
        [sys.executable, "-m", "kvstack.cli", "router", "--port", str(port), "--engine", sim.url,
         "--workers", "2", "--log-level", "warning"],
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        # Each request is a new connection, which the kernel gives to either worker: wait until both have
        # said their engine is routable (a worker that has not yet read the engine's models answers 503).
        deadline = time.monotonic() + 30
        ready: set[int] = set()
        while ready != {0, 1}:
            try:
                with urllib.request.urlopen(f"{url}/engines", timeout=2) as r:
                    body = json.loads(r.read())
                if all(e["routable"] for e in body["engines"]):
                    ready.add(body["worker"]["index"])
            except OSError:
                pass
            assert time.monotonic() < deadline, f"workers {ready} of 2 ready"
            time.sleep(0.05)
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
            kill_group(router)
        sim.stop()


def _serves(url: str, requests: int) -> None:
    body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    for _ in range(requests):
        req = urllib.request.Request(
            f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200


def _until_serving(url: str, proc: subprocess.Popen[bytes], processes: int) -> None:
    """Until each of the router's ``processes`` workers has said its engines are routable (the kernel gives
    each new connection to either; one that has not read its engine's models yet answers 503)."""
    deadline = time.monotonic() + 30
    ready: set[int] = set()
    while len(ready) < processes:
        try:
            with urllib.request.urlopen(f"{url}/engines", timeout=2) as r:
                body = json.loads(r.read())
            if all(e["routable"] for e in body["engines"]):
                ready.add(body.get("worker", {"index": 0})["index"])
        except OSError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, f"workers {ready} of {processes} ready"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.skipif(workers.usable_cores() < 2, reason="needs 2 usable cores")
def test_a_default_router_runs_a_worker_per_core_and_workers_1_runs_one(tmp_path: Path) -> None:
    sim: EngineProcess = start_sim(tmp_path / "sim", extra_args=["--time-scale", "50"])
    try:
        for extra, processes in (([], workers.usable_cores()), (["--workers", "1"], 1)):
            port = free_port()
            log = tmp_path / f"router-{port}.log"
            router = spawn(
                [sys.executable, "-m", "kvstack.cli", "router", "--port", str(port), "--engine", sim.url,
                 "--log-level", "warning", *extra], log,
            )  # fmt: skip
            try:
                url = f"http://127.0.0.1:{port}"
                _until_serving(url, router, processes)
                # N workers: a supervisor and N children; one: this process serves, no children.
                assert len(_children(router.pid)) == (processes if processes > 1 else 0)
                with urllib.request.urlopen(f"{url}/engines", timeout=5) as r:
                    worker = json.loads(r.read()).get("worker")
                assert (worker or {"count": 1})["count"] == processes
                _serves(url, 10)
                # One banner per router, whatever its workers.
                assert log.read_text().count("kvstack router: http://") == 1
            finally:
                stop_group(router)
    finally:
        sim.stop()


@pytest.mark.slow
def test_workers_pick_one_free_port_for_port_0(tmp_path: Path) -> None:
    sim: EngineProcess = start_sim(tmp_path / "sim", extra_args=["--time-scale", "50"])
    log = tmp_path / "router.log"
    router = spawn(
        [sys.executable, "-m", "kvstack.cli", "router", "--port", "0", "--engine", sim.url, "--workers", "2",
         "--log-level", "warning"], log,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while "kvstack router: http://" not in log.read_text():
            assert router.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        url = log.read_text().split("kvstack router: ", 1)[1].split("/v1", 1)[0]
        seen: set[int] = set()
        while seen != {0, 1}:  # both workers answer on the one port the banner names
            with urllib.request.urlopen(f"{url}/engines", timeout=2) as r:
                seen.add(json.loads(r.read())["worker"]["index"])
            assert time.monotonic() < deadline, f"workers {seen} of 2 answered"
        _until_serving(url, router, 2)
        _serves(url, 4)
    finally:
        stop_group(router)
        sim.stop()


def _metric_ages(url: str, polls: int, every: float) -> list[float]:
    """The age of the engine's metric reading in /engines, polled ``polls`` times."""
    ages = []
    for _ in range(polls):
        with urllib.request.urlopen(f"{url}/engines", timeout=5) as r:
            (engine,) = json.loads(r.read())["engines"]
        if engine["metrics"] is not None:
            ages.append(engine["metrics"]["age_seconds"])
        time.sleep(every)
    return ages


@pytest.mark.slow
def test_scrape_interval_sets_how_fresh_engine_metrics_are(tmp_path: Path) -> None:
    sim: EngineProcess = start_sim(tmp_path / "sim", extra_args=["--time-scale", "50"])
    routers = {}
    try:
        for interval in ("0.1", "30"):
            port = free_port()
            routers[interval] = (port, spawn(
                [sys.executable, "-m", "kvstack.cli", "router", "--port", str(port), "--engine", sim.url,
                 "--scrape-interval", interval, "--scrape-timeout", "2", "--log-level", "warning",
                 "--workers", "1"],  # one process: each worker scrapes on its own clock
            ))  # fmt: skip
        for port, _ in routers.values():
            deadline = time.monotonic() + 30
            while True:
                try:
                    if _metric_ages(f"http://127.0.0.1:{port}", 1, 0):
                        break
                except OSError:  # not listening yet
                    pass
                assert time.monotonic() < deadline, "router never scraped its engine"
                time.sleep(0.2)
        # Every 0.1 s: the reading is always recent. Every 30 s: the first reading only grows older
        # (the default, 1 s, would have replaced it twice in the 2.5 s this waits).
        fast = _metric_ages(f"http://127.0.0.1:{routers['0.1'][0]}", 12, 0.1)
        time.sleep(1.3)
        slow = _metric_ages(f"http://127.0.0.1:{routers['30'][0]}", 12, 0.1)
        assert len(fast) == 12 and max(fast) < 0.8, fast
        assert len(slow) == 12 and slow == sorted(slow) and slow[-1] > 2.0, slow
    finally:
        for _, proc in routers.values():
            stop_group(proc)
        sim.stop()
