"""The router's per-request series: plain numbers that render what prometheus_client would, in one
process and summed over several workers."""

from __future__ import annotations

import contextlib
import logging
import random
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvstack.frontend.metrics import (
    ENGINE_SERIES,
    LATENCY_BUCKETS,
    LeanHotSeries,
    RouterMetrics,
    WorkerHotSeries,
)


def _drop_series(metric: Any, engine: str) -> None:
    for labels in list(metric._metrics):
        if dict(zip(metric._labelnames, labels, strict=True)).get("engine") == engine:
            metric.remove(*labels)


class PrometheusReference:
    """The same series as prometheus_client metrics: what the lean ones must render. Updates for an engine
    removed and not added again are ignored, as the router's are."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.forgotten: set[str] = set()
        self.engine_series: dict[str, Any] = {
            name: (Counter if kind == "counter" else Gauge)(name, doc, list(labels), registry=r)
            for name, (doc, labels, kind) in ENGINE_SERIES.items()
        }
        self.requests = Counter(
            "kvstack_router_requests",
            "Requests answered, by model, engine and HTTP status.",
            ["model", "engine", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "kvstack_router_time_to_first_byte_seconds",
            "Time from request arrival to the first response byte.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kvstack_router_request_duration_seconds",
            "Time from request arrival to the last response byte.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "kvstack_router_in_flight_requests",
            "Requests sent to an engine and not finished.",
            ["engine"],
            registry=r,
        )
        self.decisions = Counter(
            "kvstack_router_routing_decisions",
            "Routing decisions by scheduling profile and engine.",
            ["profile", "engine"],
            registry=r,
        )

    def request_done(self, model: str, engine: str, status: str) -> None:
        if engine not in self.forgotten:
            self.requests.labels(model, engine, status).inc()

    def observe_latency(self, model: str, first_byte: float, total: float) -> None:
        self.ttft.labels(model).observe(first_byte)
        self.e2e.labels(model).observe(total)

    def decision(self, profile: str, engine: str) -> None:
        if engine not in self.forgotten:
            self.decisions.labels(profile, engine).inc()

    def engine_in_flight(self, engine: str) -> Any:
        return (
            Gauge("unregistered", "", registry=None)
            if engine in self.forgotten
            else self.in_flight.labels(engine)
        )

    def count(self, family: str, labels: tuple[str, ...], n: float = 1.0) -> None:
        if labels[0] not in self.forgotten:
            self.engine_series[family].labels(*labels).inc(n)

    def set_gauge(self, family: str, labels: tuple[str, ...], value: float | None) -> None:
        if value is None:
            with contextlib.suppress(KeyError):
                self.engine_series[family].remove(*labels)
        elif labels[0] not in self.forgotten:
            self.engine_series[family].labels(*labels).set(value)

    def engine_added(self, engine: str) -> None:
        self.forgotten.discard(engine)

    def forget_engine(self, engine: str) -> None:
        self.forgotten.add(engine)
        with contextlib.suppress(KeyError):
            self.in_flight.remove(engine)
        for metric in (self.requests, self.decisions, *self.engine_series.values()):
            _drop_series(metric, engine)


def _lean() -> tuple[Any, CollectorRegistry]:
    registry = CollectorRegistry()
    return LeanHotSeries(registry), registry


def _prometheus() -> tuple[Any, CollectorRegistry]:
    registry = CollectorRegistry()
    return PrometheusReference(registry), registry


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


def _replay(series: Any, ops: list[tuple[Any, ...]]) -> None:
    for op, *args in ops:
        if op == "in_flight":
            series.engine_in_flight(args[0]).set(args[1])
        else:
            getattr(series, op)(*args)


def _engine_series_op(rng: random.Random, engine: str) -> tuple[Any, ...]:
    name = rng.choice(list(ENGINE_SERIES))
    _, labels, kind = ENGINE_SERIES[name]
    values = (engine, *(rng.choice(["a", "b"]) for _ in labels[1:]))
    if kind == "counter":
        return ("count", name, values, float(rng.randrange(1, 4)))
    return ("set_gauge", name, values, None if rng.random() < 0.2 else float(rng.randrange(3)))


def _random_ops(rng: random.Random, n: int) -> list[tuple[Any, ...]]:
    engines = [f"http://10.0.0.{i}:8000" for i in range(4)]
    models = ["llama", "qwen", "other"]
    # Latencies on, just under and just over every bucket bound, and far past the last one.
    edges = [b * f for b in LATENCY_BUCKETS for f in (1.0, 0.999999, 1.000001)]
    latencies = [0.0, 1e-6, 1e4, *edges]
    ops: list[tuple[Any, ...]] = []
    for _ in range(n):
        kind = rng.randrange(6)
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
        elif kind == 4:
            ops.append(_engine_series_op(rng, engine))
        else:
            roll = rng.random()
            if roll < 0.05:
                ops.append(("forget_engine", engine))
            elif roll < 0.15:
                ops.append(("engine_added", engine))
            else:
                ops.append(("request_done", model, engine, "200"))
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
    # A proxied attempt still running at the removal ends: it does not bring the series back.
    metrics.set_circuit("http://a", CircuitState.OPEN)
    metrics.upstream_error("http://a", "first_byte_timeout")
    metrics.request_done("m", "http://a", "504")
    metrics.on_scrape("http://a", False, 0.5, "timeout")
    assert "http://a" not in metrics.render().decode()
    metrics.engine_added("http://a")  # the same URL added again: shown again
    metrics.set_circuit("http://a", CircuitState.OPEN)
    assert shown() == 'kvstack_router_circuit_state{engine="http://a"} 2.0'


def _workers(tmp_path: Path, count: int) -> list[WorkerHotSeries]:
    return [WorkerHotSeries(tmp_path, i, count) for i in range(count)]


def test_workers_render_the_sum_of_what_each_counted(tmp_path: Path) -> None:
    """Three workers split a random workload; any of them renders what one process given all of it
    renders (in-flight gauges summed per engine)."""
    ops = _random_ops(random.Random(11), 3000)
    workers = _workers(tmp_path, 3)
    reference, reference_registry = _lean()
    rng = random.Random(12)
    for op in ops:
        if op[0] in ("forget_engine", "engine_added", "set_gauge"):
            # Removals and additions reach every worker; gauges (circuit states, connections) are
            # taken at their highest over the workers, so each worker is given the same value here.
            for w in workers:
                _replay(w, [op])
            _replay(reference, [op])
            continue
        worker = workers[rng.randrange(3)]
        if op[0] == "in_flight":
            # Each worker's own count for the engine; the reference holds their sum.
            worker.engine_in_flight(op[1]).set(op[2])
            # In one process the gauge is a plain value, which the InFlightGauge protocol only sets.
            gauges = [w.engine_in_flight(op[1]) for w in workers]
            total = sum(g.value for g in gauges)  # type: ignore[attr-defined]  # a plain value, see above
            reference.engine_in_flight(op[1]).set(total)
        else:
            _replay(worker, [op])
            _replay(reference, [op])
    for w in workers[1:]:
        w.flush()
    registry = CollectorRegistry()
    registry.register(workers[0])
    assert _families(registry) == _families(reference_registry)
    got, want = _samples(registry), _samples(reference_registry)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key


def test_a_worker_renders_without_siblings_that_never_wrote_or_wrote_garbage(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    workers = _workers(tmp_path, 3)
    workers[0].request_done("m", "http://a", "200")
    workers[1].request_done("m", "http://a", "200")
    workers[1].flush()
    (tmp_path / "hot-series-2.msgpack").write_bytes(b"not msgpack")
    registry = CollectorRegistry()
    registry.register(workers[0])
    with caplog.at_level(logging.WARNING):
        text = generate_latest(registry).decode()
    assert 'kvstack_router_requests_total{engine="http://a",model="m",status="200"} 2.0' in text
    assert "worker 2's snapshot" in caplog.text
    workers[1].request_done("m", "http://a", "200")  # not flushed yet: the render shows what was written
    assert 'status="200"} 2.0' in generate_latest(registry).decode()
    workers[1].flush()
    assert 'status="200"} 3.0' in generate_latest(registry).decode()


def test_router_metrics_of_a_worker_render_every_workers_requests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    first, second = RouterMetrics((tmp_path, 0, 2)), RouterMetrics((tmp_path, 1, 2))
    first.request_done("m", "http://a", "200")
    second.request_done("m", "http://a", "200")
    second.flush_hot()
    text = first.render().decode()
    assert 'kvstack_router_requests_total{engine="http://a",model="m",status="200"} 2.0' in text
