"""``kvstack metrics check``: exit codes, the text and JSON reports, catalog selection and --live.

The tests under "the real catalogs" read ``kvstack.board.catalogs``'s data (vLLM per version, kvstack's
exporters, a simulator's /metrics page); the others stand test catalogs in for it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstack import cli
from kvstack.board import catalogs
from kvstack.cli.front_end import UsageError
from kvstack.cli.metrics import fetch_metrics
from support.board_catalogs import EPP, ROUTER, VLLM_NEW, VLLM_OLD
from support.engines import EngineProcess, start_sim
from support.ports import free_port

FIXTURES = Path(__file__).parent / "fixtures"


def _engine_catalog(spec: str) -> catalogs.Catalog:
    known = {"vllm": VLLM_NEW, "vllm==0.32": VLLM_NEW, "vllm==0.8": VLLM_OLD}
    if spec not in known:
        raise ValueError(f"unknown engine {spec!r}; known: {', '.join(known)}")
    return known[spec]


@pytest.fixture
def test_catalogs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(catalogs, "engine_catalog", _engine_catalog)
    monkeypatch.setattr(catalogs, "kvstack_catalogs", lambda: (ROUTER, EPP))


def check(*args: str) -> int:
    return cli.main(["metrics", "check", *args])


def _promql(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "q.promql"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.usefixtures("test_catalogs")
def test_exit_0_clean_1_with_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert check(str(FIXTURES / "clean")) == 0
    assert (
        capsys.readouterr().out.strip() == "0 error(s), 0 warning(s) in 3 file(s), 18 expression(s) checked"
    )
    assert check(str(FIXTURES / "names.promql")) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[:4] == [
        str(FIXTURES / "names.promql"),
        "  error retired-metric line 1: vllm:gpu_cache_usage_perc was renamed to vllm:kv_cache_usage_perc "
        "(vllm 0.32: deprecated in 0.9.2, removed in 0.11; source: vllm/v1/metrics/loggers.py)",
        "      expr: vllm:gpu_cache_usage_perc",
        "      fix: use vllm:kv_cache_usage_perc",
    ]
    assert out.splitlines()[-1] == "5 error(s), 0 warning(s) in 1 file(s), 5 expression(s) checked"


@pytest.mark.usefixtures("test_catalogs")
def test_warnings_alone_exit_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert check(_promql(tmp_path, "rate(vllm:kv_cache_usage_perc[5m])")) == 0
    assert "warning rate-of-gauge line 1" in capsys.readouterr().out


@pytest.mark.usefixtures("test_catalogs")
def test_json_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert check(str(FIXTURES / "suffix.promql"), "--format", "json") == 1
    report = json.loads(capsys.readouterr().out)
    assert report["summary"] == {"errors": 6, "warnings": 2, "files": 1, "expressions": 8}
    assert report["findings"][0] == {
        "severity": "error",
        "code": "suffix",
        "file": str(FIXTURES / "suffix.promql"),
        "where": "line 1",
        "expression": "rate(vllm:prompt_tokens[5m])",
        "message": "vllm:prompt_tokens is a counter, exported as vllm:prompt_tokens_total, "
        "vllm:prompt_tokens_created",
        "fix": "use vllm:prompt_tokens_total",
    }


@pytest.mark.usefixtures("test_catalogs")
def test_engine_versions_and_no_kvstack(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old_name = _promql(tmp_path, "vllm:gpu_cache_usage_perc")
    assert check(old_name, "--engine", "vllm==0.8") == 0
    assert check(old_name, "--engine", "vllm==0.8", "--engine", "vllm==0.32") == 0  # a warning
    assert "works on vllm 0.8, not on vllm 0.32" in capsys.readouterr().out
    router = _promql(tmp_path, 'kvstack_router_requests_total{job="kvstack-router"}')
    assert check(router) == 0
    assert check(router, "--no-kvstack") == 1


@pytest.mark.usefixtures("test_catalogs")
def test_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert check(str(tmp_path / "missing.json")) == 2
    assert "missing.json: no such file or directory" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("x")
    assert check(str(tmp_path / "notes.txt")) == 2
    assert "not a dashboard" in capsys.readouterr().err
    assert check(str(FIXTURES / "clean"), "--engine", "vllm==0.1") == 2
    assert "--engine vllm==0.1: unknown engine 'vllm==0.1'" in capsys.readouterr().err
    unreachable = f"http://127.0.0.1:{free_port()}"
    assert check(str(FIXTURES / "clean"), "--live", unreachable, "--live-timeout", "2") == 2
    assert f"--live {unreachable}/metrics: cannot read it" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        check(str(FIXTURES / "clean"), "--format", "xml")
    assert exited.value.code == 2


def test_usage_error_as_a_subprocess(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvstack.cli", "metrics", "check", str(tmp_path / "missing.promql")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "no such file" in done.stderr and done.stdout == ""


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    engine = start_sim(tmp_path_factory.mktemp("sim"), replay=False)
    yield engine
    engine.stop()


def test_fetch_metrics_of_a_running_engine(sim: EngineProcess) -> None:
    assert "vllm:num_requests_running" in fetch_metrics(sim.url, 5.0)
    assert "vllm:num_requests_running" in fetch_metrics(sim.url + "/metrics", 5.0)
    with pytest.raises(UsageError, match="not an http"):
        fetch_metrics("ftp://x/metrics", 5.0)


# The real catalogs (kvstack.board.catalogs's data).


def test_real_catalogs_default_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    clean = _promql(tmp_path, "vllm:kv_cache_usage_perc", "sum(rate(vllm:prompt_tokens_total[5m]))")
    assert check(clean) == 0
    capsys.readouterr()
    assert (
        check(_promql(tmp_path, "vllm:gpu_cache_usage_perc"), "--engine", "vllm==0.32", "--format", "json")
        == 1
    )
    (finding,) = json.loads(capsys.readouterr().out)["findings"]
    assert finding["code"] == "retired-metric" and finding["fix"] == "use vllm:kv_cache_usage_perc"
    assert check(clean, "--engine", "nosuch") == 2


def test_real_catalogs_json_as_a_subprocess(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstack.cli",
            "metrics",
            "check",
            _promql(tmp_path, "vllm:num_requests_runing"),
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    assert [f["code"] for f in report["findings"]] == ["unknown-metric"]
    assert report["findings"][0]["fix"] == "did you mean vllm:num_requests_running?"
    assert report["summary"] == {"errors": 1, "warnings": 0, "files": 1, "expressions": 1}


def test_live_engine(sim: EngineProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    known = _promql(tmp_path, "vllm:num_requests_running", "vllm:kv_cache_usage_perc")
    assert check(known, "--live", sim.url, "--no-kvstack") == 0
    capsys.readouterr()
    assert (
        check(_promql(tmp_path, "vllm:not_a_metric"), "--live", sim.url, "--no-kvstack", "--format", "json")
        == 1
    )
    (finding,) = json.loads(capsys.readouterr().out)["findings"]
    assert finding["code"] == "unknown-metric" and f"live {sim.url}" in finding["message"]
