"""The vLLM 0.32 name table against real vLLM 0.32 after one request, both ways: every family on its
/metrics page is in the table with the same kind and labels the table lists (none hidden), and every
family the table says vLLM always registers is on the page."""

from __future__ import annotations

import json
import urllib.request

import pytest

from kvstack.board.catalogs import live_catalog
from kvstack.engines.names import names_for
from support.catalogs import disagreements
from support.engines import EngineProcess


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return str(r.read().decode())


@pytest.mark.vllm
def test_vllm_0_32_page_is_its_table(vllm_engine: EngineProcess) -> None:
    body = {"model": vllm_engine.model, "prompt": "The quick brown fox", "max_tokens": 4, "ignore_eos": True}
    request = urllib.request.Request(
        f"{vllm_engine.url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as r:
        assert r.status == 200
    version = _get(f"{vllm_engine.url}/version")
    assert json.loads(version)["version"].startswith("0.32"), version
    page = _get(f"{vllm_engine.url}/metrics")
    table = names_for("vllm", "0.32.0").metrics
    assert disagreements(page, table) == []
    live = live_catalog(page, "vllm").metrics
    assert live["vllm:request_success"].labels == {"model_name", "engine", "finished_reason"}
    assert {"block_size", "num_gpu_blocks"} <= live["vllm:cache_config_info"].labels
