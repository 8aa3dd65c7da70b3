"""The `kvstack envoy-config` command: flags into the bootstrap, YAML or JSON to stdout or a file, exit 2 on a
bad value."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvstack import cli


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = cli.main(["envoy-config", *args])
    out, err = capsys.readouterr()
    return status, out, err


def ext_proc(config: dict[str, Any]) -> dict[str, Any]:
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (found,) = [
        f["typed_config"] for f in manager["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"
    ]
    return dict(found)


def test_flags_reach_the_bootstrap(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(
        capsys,
        *("--picker", "10.0.0.7:9002", "--picker", "10.0.0.8:9002", "--engine", "10.0.1.1:8000"),
        *("--port", "10000", "--admin-port", "10001", "--fail-open", "--message-timeout", "0.5"),
        *("--body-mode", "full-duplex-streamed"),
    )
    assert status == 0
    config = yaml.safe_load(out)
    assert config["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] == 10000
    assert config["admin"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 10001}
    (picker, engines) = config["static_resources"]["clusters"]
    assert len(picker["load_assignment"]["endpoints"][0]["lb_endpoints"]) == 2
    assert "load_balancing_policy" in engines
    proc = ext_proc(config)
    assert proc["failure_mode_allow"] is True
    assert proc["message_timeout"] == "0.5s"
    assert proc["processing_mode"]["request_body_mode"] == "FULL_DUPLEX_STREAMED"


def test_json_to_a_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = tmp_path / "envoy.json"
    status, out, _ = run(capsys, "--picker", "10.0.0.7:9002", "--format", "json", "--output", str(target))
    assert (status, out) == (0, "")
    assert json.loads(target.read_text())["static_resources"]["clusters"][1]["type"] == "ORIGINAL_DST"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--picker", "10.0.0.7"], "expected HOST:PORT"),
        (["--picker", "10.0.0.7:9002", "--engine", "vllm:http"], "expected HOST:PORT"),
        (["--picker", "10.0.0.7:9002", "--port", "9901"], "different ports"),
        (["--picker", "10.0.0.7:9002", "--message-timeout", "0"], "message_timeout_s 0"),
        (["--picker", "10.0.0.7:9002", "--retries", "-1"], "retries -1"),
        (["--picker", "10.0.0.7:9002", "--output", "/nonexistent/dir/envoy.yaml"], "cannot write"),
    ],
)
def test_bad_values_exit_2_with_the_reason(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    status, out, err = run(capsys, *args)
    assert (status, out) == (2, "")
    assert err.startswith("kvstack envoy-config: ") and message in err


@pytest.mark.parametrize(
    ("args", "message"),
    [([], "--picker"), (["--picker", "10.0.0.7:9002", "--body-mode", "chunked"], "--body-mode")],
)
def test_argument_errors_exit_2(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exited:
        run(capsys, *args)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
