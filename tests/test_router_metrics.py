"""The router's per-request series: the lean single-process ones render what prometheus_client would."""

from __future__ import annotations

import random
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvstack.router.metrics import (
    LATENCY_BUCKETS,
    HotSeries,
    LeanHotSeries,
    PrometheusHotSeries,
    RouterMetrics,
)


def _lean() -> tuple[HotSeries, CollectorRegistry]:
    registry = CollectorRegistry()
    return LeanHotSeries(registry), registry


def _prometheus() -> tuple[HotSeries, CollectorRegistry]:
    registry = CollectorRegistry()
    return PrometheusHotSeries(registry, lambda metric, *values: metric.labels(*values)), registry


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample by (name, sorted labels); ``_created`` samples only say that they exist."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            created = sample.name.endswith("_created")
            out[sample.name, tuple(sorted(sample.labels.items()))] = 0.0 if created else sample.value
    return out


def _families(registry: CollectorRegistry) -> dict[str, tuple[str, str]]:
    return {
        f.name: (f.type, f.documentation)
        for f in text_string_to_metric_families(generate_latest(registry).decode())
    }


def _replay(series: HotSeries, ops: list[tuple[Any, ...]]) -> None:
    for op, *args in ops:
        if op == "in_flight":
            series.engine_in_flight(args[0]).set(args[1])
        else:
            getattr(series, op)(*args)


def _random_ops(rng: random.Random, n: int) -> list[tuple[Any, ...]]:
    engines = [f"http://10.0.0.{i}:8000" for i in range(4)]
    models = ["llama", "qwen", "other"]
    # Latencies on, just under and just over every bucket bound, and far past the last one.
    edges = [b * f for b in LATENCY_BUCKETS for f in (1.0, 0.999999, 1.000001)]
    latencies = [0.0, 1e-6, 1e4, *edges]
    ops: list[tuple[Any, ...]] = []
    for _ in range(n):
        kind = rng.randrange(5)
        engine, model = rng.choice(engines), rng.choice(models)
        if kind == 0:
            ops.append(("request_done", model, engine, rng.choice(["200", "429", "502", "499"])))
        elif kind == 1:
            first = rng.choice(latencies) if rng.random() < 0.5 else rng.expovariate(5.0)
            ops.append(("observe_latency", model, first, first + rng.choice(latencies)))
        elif kind == 2:
            ops.append(("decision", rng.choice(["default", "prefill", "decode"]), engine))
        elif kind == 3:
            ops.append(("in_flight", engine, rng.randrange(0, 50)))
        else:
            ops.append(
                ("forget_engine", engine) if rng.random() < 0.05 else ("request_done", model, engine, "200")
            )
    return ops


@pytest.mark.parametrize("seed", range(5))
def test_lean_series_render_what_prometheus_client_renders(seed: int) -> None:
    ops = _random_ops(random.Random(seed), 3000)
    lean, lean_registry = _lean()
    reference, reference_registry = _prometheus()
    _replay(lean, ops)
    _replay(reference, ops)
    assert _families(lean_registry) == _families(reference_registry)
    got, want = _samples(lean_registry), _samples(reference_registry)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key


def test_a_value_on_a_bucket_bound_counts_in_that_bucket() -> None:
    lean, registry = _lean()
    lean.observe_latency("m", 0.005, 0.25)
    samples = _samples(registry)

    def bucket(name: str, le: str) -> float:
        return samples[f"kvstack_router_{name}_bucket", (("le", le), ("model", "m"))]

    assert bucket("time_to_first_byte_seconds", "0.005") == 1
    assert bucket("request_duration_seconds", "0.1") == 0
    assert bucket("request_duration_seconds", "0.25") == 1
    assert bucket("request_duration_seconds", "+Inf") == 1


@pytest.mark.parametrize("make", [_lean, _prometheus], ids=["lean", "prometheus_client"])
def test_a_removed_engine_leaves_no_series(make: Any) -> None:
    series, registry = make()
    for engine in ("http://a", "http://b"):
        series.request_done("m", engine, "200")
        series.decision("default", engine)
        series.engine_in_flight(engine).set(3)
    series.forget_engine("http://a")
    text = generate_latest(registry).decode()
    assert "http://a" not in text
    assert text.count("http://b") == 5  # requests and decisions (each with _created), in flight


def test_router_metrics_use_the_lean_series_in_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    metrics = RouterMetrics()
    assert isinstance(metrics.hot, LeanHotSeries)
    metrics.request_done("m", "http://a", "200")
    metrics.engine_in_flight("http://a").set(2)
    text = metrics.render().decode()
    assert 'kvstack_router_requests_total{engine="http://a",model="m",status="200"} 1.0' in text
    assert 'kvstack_router_in_flight_requests{engine="http://a"} 2.0' in text
    metrics.forget_engine("http://a")
    assert "http://a" not in metrics.render().decode()


def test_circuit_gauge_follows_changes_and_a_removed_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstack.engines.state import CircuitState

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    metrics = RouterMetrics()

    def shown() -> str:
        lines = metrics.render().decode().splitlines()
        return next(line for line in lines if line.startswith("kvstack_router_circuit"))

    for state, value in [
        (CircuitState.CLOSED, "0.0"),
        (CircuitState.CLOSED, "0.0"),
        (CircuitState.OPEN, "2.0"),
        (CircuitState.HALF_OPEN, "1.0"),
        (CircuitState.HALF_OPEN, "1.0"),
        (CircuitState.CLOSED, "0.0"),
        (CircuitState.OPEN, "2.0"),
    ]:
        metrics.set_circuit("http://a", state)
        assert shown() == f'kvstack_router_circuit_state{{engine="http://a"}} {value}'
    metrics.forget_engine("http://a")
    assert "http://a" not in metrics.render().decode()
    metrics.set_circuit("http://a", CircuitState.OPEN)  # the same URL added again: shown again
    assert shown() == 'kvstack_router_circuit_state{engine="http://a"} 2.0'
