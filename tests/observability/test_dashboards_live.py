"""kvstack's dashboards and rules on real Prometheus: it scrapes real vLLM (with KVStackConnector on a cache
server), simulated engines, a kvstack router over them with KV events, Envoy's endpoint picker over the
same engines, a P/D stack (``kvstack up``) and the cache server, under the fixed job labels. After a short
workload through the openai client every templating query and every panel query of every dashboard
returns data through Prometheus's HTTP API, for each front end (``$frontend``); every rule evaluates.

The workload provokes what the panels show: repeated prompts (prefix hits), streaming, a tiny admission
limit (429), injected engine errors (retries, 5xx, an open circuit), an engine that never answers (scrape
errors), one with pre-rename metric names (missing names), P/D prefills and fallbacks, cache tier reads
after a reset prefix cache, and a malformed cache request (protocol error). `NOT_PROVOKED` lists the panels
left without data, with the reason.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq

import openai
from kvstack.epp.envoy_config import EnvoyOptions, bootstrap
from support.cache import start_cache_server
from support.engines import REPO, EngineProcess, require_vllm, start_sim, start_vllm, wait_healthy
from support.envoy import start_envoy
from support.pickers import start_picker_process
from support.ports import free_port, free_ports
from support.processes import spawn, stop_group
from support.prometheus import (
    PrometheusProcess,
    dashboard_queries,
    require_prometheus,
    scrape_config,
    start_prometheus,
)
from support.waiting import wait_until

pytestmark = [pytest.mark.prometheus, pytest.mark.vllm, pytest.mark.slow]

DASHBOARDS = REPO / "deploy" / "observability" / "dashboards"
RULES = REPO / "deploy" / "observability" / "rules"
WINDOW = "2m"  # what $__rate_interval stands for: the whole workload is inside it
MODEL = "tiny"  # every engine's served name
CHUNK = 256  # the cache server's and the connector's tokens per chunk
SHARED = " ".join(f"section {i} of the shared system prompt reads {i * 7 % 13}" for i in range(60))

FRONTENDS = ("kvstack-router", "kvstack-epp")
# (front-end job, dashboard file, panel title) -> why the workload leaves it without data.
NOT_PROVOKED = {
    (job, "kvstack-kv-routing.json", title): why
    for job in FRONTENDS
    for title, why in (
        ("Sequence gaps", "no KV event batch is lost on loopback"),
        ("Replays", "replays follow gaps, and there are none"),
        ("Index resets and decode errors", "no engine restarts, drops its stream or sends a bad batch"),
    )
} | {
    ("kvstack-epp", "kvstack-router.json", "Retries"): "the picker does not proxy: Envoy retries",
    ("kvstack-epp", "kvstack-router.json", "Upstream errors"): "the picker does not proxy: Envoy sees them",
    ("kvstack-epp", "kvstack-router.json", "5xx ratio"): "the injected engine errors go through the router",
    ("kvstack-epp", "kvstack-engines.json", "Scrape errors"): "the picker's engines all answer",
}
# The P/D stack has no Envoy in front: kvstack-pd is checked for the router only.
NO_PD = "kvstack-epp"


@dataclass
class Fleet:
    """What the workload talks to, and the Prometheus that scrapes it all."""

    prometheus: PrometheusProcess
    router: str  # over vLLM and the two sims (and an engine that never answers)
    pd_router: str  # kvstack up's, over a prefill and a decode sim
    envoy: str  # Envoy with kvstack's endpoint picker, over vLLM and the two sims
    vllm: EngineProcess
    sims: list[EngineProcess]
    cache_endpoint: str


def _host(url: str) -> str:
    return url.removeprefix("http://")


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _post(url: str, body: dict[str, Any]) -> None:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as r:
        assert r.status == 200


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)


def _complete(
    url: str,
    prompt: str,
    *,
    stream: bool = False,
    max_tokens: int = 4,
    client: openai.OpenAI | None = None,
    start: threading.Barrier | None = None,
) -> int:
    """One completion (after ``start`` lets it go); the HTTP status (an error status is an answer here,
    not a failure)."""
    own = client is None
    client = client or _client(url)
    if start is not None:
        start.wait()
    try:
        if stream:
            for _ in client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True
            ):
                pass
        else:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens)
    except openai.APIStatusError as e:
        return e.status_code
    finally:
        if own:
            client.close()
    return 200


def _start_router(workdir: Path, engines: list[str], *options: str) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    cmd = [sys.executable, "-m", "kvstack.cli", "router", "--port", str(port), "--log-level", "warning"]
    for engine in engines:
        cmd += ["--engine", engine]
    log_path = workdir / f"router-{port}.log"
    proc = spawn([*cmd, *options], log_path, cwd=workdir)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, log_path, 60)
    return url, proc


def _workload(fleet: Fleet, round_: int) -> None:
    router, pd, vllm, sims = fleet.router, fleet.pd_router, fleet.vllm, fleet.sims
    # Repeated prompts with a shared prefix, half of them streamed: prefix hits, KV events, latencies.
    for i in range(12):
        assert _complete(router, f"{SHARED} question {i % 3}", stream=i % 2 == 0) == 200
    # The same through Envoy and the endpoint picker, and a burst past its admission limit.
    for i in range(6):
        assert _complete(fleet.envoy, f"{SHARED} question {i % 3}", stream=i % 2 == 0) == 200
    _burst(fleet.envoy)
    # The cache tier: vLLM stores the prompt's chunks; after its prefix cache is reset it loads them back.
    assert _complete(vllm.url, f"{SHARED} for the cache tier") == 200
    _post(f"{vllm.url}/reset_prefix_cache", {})
    assert _complete(vllm.url, f"{SHARED} for the cache tier") == 200
    assert 429 in _burst(router)
    # Both simulated engines refuse every request (503): retries on the others, open circuits.
    for sim in sims:
        _post(f"{sim.url}/admin/faults", {"error_rate": 1.0, "error_codes": [503]})
    statuses = [_complete(router, f"during faults {i}") for i in range(10)]
    for sim in sims:
        _post(f"{sim.url}/admin/faults", {"error_rate": 0.0})
    # P/D: long prompts the decode engine has not seen are prefilled on the prefill engine; a failing
    # prefill engine makes fallbacks, and a failing decode engine (the only one) 5xx answers.
    prefill, decode = _up_engines(pd)
    for i in range(3):
        assert _complete(pd, f"pd round {round_} prompt {i}: {SHARED}") == 200
    _post(f"{prefill}/admin/faults", {"error_rate": 1.0, "error_codes": [500]})
    assert _complete(pd, f"pd round {round_} fallback: {SHARED}") == 200
    _post(f"{prefill}/admin/faults", {"error_rate": 0.0})
    _post(f"{decode}/admin/faults", {"error_rate": 1.0, "error_codes": [500]})
    statuses += [_complete(pd, f"pd failing {i}") for i in range(2)]
    _post(f"{decode}/admin/faults", {"error_rate": 0.0})
    assert any(s >= 500 for s in statuses), statuses
    # A malformed cache request: one protocol error.
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(fleet.cache_endpoint)
        sock.send_multipart([b"", b"not a request"])
        assert sock.poll(5000), "the cache server did not answer a malformed request"


def _burst(url: str) -> list[int]:
    """12 requests sent at once (past --max-in-flight 2 with no queue); their statuses."""
    clients = [_client(url) for _ in range(12)]
    start = threading.Barrier(len(clients))
    with ThreadPoolExecutor(len(clients)) as pool:
        burst = [
            pool.submit(_complete, url, f"burst {i}", max_tokens=32, client=c, start=start)
            for i, c in enumerate(clients)
        ]
        statuses = [f.result() for f in burst]
    for c in clients:
        c.close()
    return statuses


def _up_engines(router: str) -> tuple[str, str]:
    """The prefill engine and the decode engine of ``kvstack up``'s router (the decode one as started,
    not its sidecar)."""
    roles = {e["role"]: e["url"] for e in _get(f"{router}/engines")["engines"]}
    port = int(router.rsplit(":", 1)[1])
    assert roles["prefill"] == f"http://127.0.0.1:{port + 1}", roles
    return roles["prefill"], f"http://127.0.0.1:{port + 2}"


@pytest.fixture(scope="module")
def fleet(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    require_prometheus()
    require_vllm()
    workdir = tmp_path_factory.mktemp("dashboards-live")
    with ExitStack() as stack:
        http_port = free_port()
        cache = start_cache_server(
            workdir, "--memory-gb", "0.25", "--chunk-size", str(CHUNK), "--http-port", str(http_port),
            "--disk-dir", str(workdir / "disk"), "--disk-gb", "0.25", events=True,
        )  # fmt: skip
        stack.callback(cache.stop)
        wait_healthy(cache.proc, f"http://127.0.0.1:{http_port}", cache.log_path, 30)
        connector: dict[str, object] = {
            "kv_connector": "KVStackConnector",
            "kv_connector_module_path": "kvstack.connector.vllm_v1",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"server": cache.endpoint, "model_id": MODEL, "chunk_size": CHUNK},
        }
        path = os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])
        vllm = start_vllm(
            tiny_model_dir, workdir / "vllm", kv_transfer_config=connector, env={"PYTHONPATH": path}
        )
        stack.callback(vllm.stop)
        sims = [
            start_sim(workdir / "sim", model_dir=tiny_model_dir, extra_args=["--time-scale", "20"]),
            start_sim(workdir / "sim", model_dir=tiny_model_dir, extra_args=["--legacy-metric-names"]),
        ]
        for sim in sims:
            stack.callback(sim.stop)
        never_answers = f"http://127.0.0.1:{free_port()}"
        router, proc = _start_router(
            workdir, [vllm.url, *(s.url for s in sims), never_answers],
            "--tokenizer", str(tiny_model_dir), "--max-in-flight", "2", "--max-queue", "0",
            "--max-attempts", "3", "--circuit-failures", "2",
        )  # fmt: skip
        stack.callback(stop_group, proc)
        ports = free_ports(3)
        up_cmd = [
            sys.executable, "-m", "kvstack.cli", "up", "--prefill-engines", "1", "--decode-engines", "1",
            "--port", str(ports.start), "--time-scale", "20", "--served-model-name", MODEL,
            "--no-cache-server",
        ]  # fmt: skip
        up = spawn(up_cmd, workdir / "up.log", cwd=workdir)
        stack.callback(stop_group, up)
        pd_router = f"http://127.0.0.1:{ports.start}"
        wait_healthy(up, pd_router, workdir / "up.log", 60)
        pd_engines = [f"127.0.0.1:{ports.start + 1}", f"127.0.0.1:{ports.start + 2}"]
        engines = [vllm.url, *(s.url for s in sims)]
        picker = start_picker_process(
            workdir / "epp", engines, "--tokenizer", str(tiny_model_dir), "--max-in-flight", "2",
            "--max-queue", "0", deadline_s=60,
        )  # fmt: skip
        stack.callback(picker.stop)
        envoy_port = free_port()
        options = EnvoyOptions(
            pickers=(picker.grpc_address,),
            engines=tuple(_host(e) for e in engines),
            listen_host="127.0.0.1",
            listen_port=envoy_port,
            admin_port=free_port(),
            message_timeout_s=5.0,
            response_usage=True,
        )
        stack.callback(start_envoy(bootstrap(options.validate()), workdir / "epp").stop)
        envoy = f"http://127.0.0.1:{envoy_port}"
        jobs = {
            "vllm": [_host(vllm.url), *(_host(s.url) for s in sims), *pd_engines],
            "kvstack-router": [_host(router), _host(pd_router)],
            "kvstack-epp": [_host(picker.http_url)],
            "kvstack-cache-server": [f"127.0.0.1:{http_port}"],
        }
        rules = [RULES / "kvstack-recording.yaml", RULES / "kvstack-alerts.yaml"]
        prometheus = start_prometheus(scrape_config(jobs, rule_files=rules), workdir / "prometheus")
        stack.callback(prometheus.stop)

        def engines_known() -> bool:
            engines = _get(f"{router}/engines")["engines"]
            known = [e for e in engines if e["models"] and e["metrics"] and not e["metrics"]["stale"]]
            return sum(e["routing_knowledge"] == "kv-events" for e in known) == 3

        wait_until(engines_known, what="three engines known, with KV events", timeout_s=60, interval_s=0.5)
        fleet = Fleet(prometheus, router, pd_router, envoy, vllm, sims, cache.endpoint)
        # Twice: counters appear at their first increment, and Prometheus computes no rate from a series'
        # first sample; the second round increments series it has already seen.
        _workload(fleet, 1)
        time.sleep(3)
        _workload(fleet, 2)
        # Every target scraped after the workload (scrapes every second).
        wait_until(
            lambda: all(prometheus.targets_up().values()), what="targets up", timeout_s=30, interval_s=0.5
        )
        time.sleep(3)
        yield fleet


def _substitute(expr: str, values: dict[str, str]) -> str:
    def value(match: re.Match[str]) -> str:
        name = match[1] or match[2]
        if name == "__rate_interval":
            return WINDOW
        assert name in values, f"{expr}: variable ${name} is not defined before its use"
        return values[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, expr)


def _has_data(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(r["value"][1])) for r in result)


def _cases() -> list[tuple[str, str]]:
    """(dashboard file, front-end job): every dashboard, and those with a $frontend for each front end."""
    cases = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        variables = json.loads(path.read_text())["templating"]["list"]
        jobs = FRONTENDS if any(v["name"] == "frontend" for v in variables) else FRONTENDS[:1]
        cases += [(path.name, job) for job in jobs if (path.name, job) != ("kvstack-pd.json", NO_PD)]
    return cases


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("name", "frontend"), _cases())
def test_every_query_of_the_dashboard_returns_data(fleet: Fleet, name: str, frontend: str) -> None:
    values = {"frontend": frontend}
    empty: dict[str, str] = {}
    for query in dashboard_queries(DASHBOARDS / name):
        expr = _substitute(query.expr, values)
        result = fleet.prometheus.query(expr)
        if query.variable is not None:
            if query.variable in values:
                continue
            found = sorted({r["metric"][query.label] for r in result if query.label in r["metric"]})
            assert found, f"{query.where}: no {query.label} values in {expr}"
            values[query.variable] = "|".join(found)
        elif not _has_data(result):
            empty[query.where] = expr
    allowed = {title for (job, board, title) in NOT_PROVOKED if (job, board) == (frontend, name)}
    titles = {q.where for q in dashboard_queries(DASHBOARDS / name)}
    assert {t for t in allowed if not any(f'panel "{t}"' in w for w in titles)} == set(), "stale NOT_PROVOKED"
    unexpected = {w: e for w, e in empty.items() if not any(f'panel "{t}"' in w for t in allowed)}
    assert unexpected == {}, "panels without data"


def test_every_rule_evaluates_and_every_recorded_series_has_data(fleet: Fleet) -> None:
    rules = [r for g in fleet.prometheus.api("/api/v1/rules")["groups"] for r in g["rules"]]
    assert [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []
    recorded = [r["name"] for r in rules if r["type"] == "recording"]
    assert recorded
    assert [name for name in recorded if not _has_data(fleet.prometheus.query(name))] == []


def test_alerts_see_what_the_stack_provoked(fleet: Fleet) -> None:
    """Pending (their ``for`` is minutes long): a sim with pre-rename names (missing names, and no
    vllm:kv_cache_usage_perc), and an engine that never answers the router's scrapes."""
    expected = {"KVStackEngineMetricMissing", "KVStackEngineCoreMetricAbsent", "KVStackEngineMetricsStale"}

    def active() -> set[str]:
        return {a["labels"]["alertname"] for a in fleet.prometheus.api("/api/v1/alerts")["alerts"]}

    wait_until(lambda: expected <= active(), what=f"{sorted(expected)} active", timeout_s=30, interval_s=0.5)
