"""What a front end does when an engine goes down and comes back: its prefix entries (events and history)
dropped and counted when it is seen down, its open circuit probed at once when it answers again."""

from __future__ import annotations

from kvstack.engines.state import CircuitState, Endpoint, EngineState
from kvstack.frontend.circuit import CircuitBreaker, CircuitConfig
from kvstack.frontend.metrics import RouterMetrics
from kvstack.frontend.prefix import PrefixLocator
from kvstack.frontend.registry import EngineRegistry
from kvstack.frontend.rejoin import EngineRejoin
from kvstack.index.prefix_index import PrefixIndex
from support.kv_events import stored_batch
from support.metrics import sample_sum

URL = "http://10.0.0.5:8000"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_probe_now_turns_an_open_circuit_half_open_on_the_first_rung() -> None:
    clock = Clock()
    breaker = CircuitBreaker(CircuitConfig(failure_threshold=1, open_seconds=5, max_open_seconds=60), clock)
    breaker.record_failure()
    for _ in range(3):  # probes failing while the engine restarts: open 10, 20, 40 s
        clock.now += 100
        assert breaker.allow()
        breaker.record_failure()
    assert breaker.state is CircuitState.OPEN and not breaker.allow()
    breaker.probe_now()
    assert breaker.state is CircuitState.HALF_OPEN
    assert breaker.allow() and not breaker.allow()  # one probe at a time
    breaker.record_failure()  # the probe failed after all: back on the ladder's first rung
    clock.now += 9.9
    assert breaker.state is CircuitState.OPEN
    clock.now += 0.2
    assert breaker.state is CircuitState.HALF_OPEN


def test_probe_now_leaves_a_closed_circuit_closed() -> None:
    breaker = CircuitBreaker()
    breaker.probe_now()
    assert breaker.state is CircuitState.CLOSED and breaker.allow() and breaker.allow()


def test_an_engine_down_loses_its_entries_and_history_and_is_probed_when_back() -> None:
    metrics = RouterMetrics()
    registry = EngineRegistry(CircuitConfig(failure_threshold=1))
    other = "http://10.0.0.6:8000"
    for url in (URL, other):
        registry.upsert(Endpoint(url))
        metrics.engine_added(url)
    locator = PrefixLocator(PrefixIndex())
    locator.on_dropped = metrics.prefix_dropped
    for n in range(4):
        locator.apply(URL, stored_batch(n))
        locator.apply(other, stored_batch(10 + n))
    locator.history.record(URL, [11, 12], now=0.0)
    assert locator.index.location_entries(URL) == 4
    rejoin = EngineRejoin(registry, locator, metrics)
    entry = registry.get(URL)
    assert entry is not None
    entry.breaker.record_failure()
    assert entry.breaker.state is CircuitState.OPEN

    rejoin.engine_down(entry.state)
    assert locator.index.location_entries(URL) == 0
    assert URL not in locator.history.lookup([11, 12], now=0.0)
    assert locator.index.location_entries(other) == 4  # the other engine keeps its entries
    rejoin.engine_back(entry.state)
    assert entry.breaker.state is CircuitState.HALF_OPEN

    metrics.flush_hot()
    text = metrics.render().decode()
    assert sample_sum(text, "kvstack_prefix_entries_dropped_total", engine=URL, reason="engine_down") == 6
    assert sample_sum(text, "kvstack_engine_rejoins_total", engine=URL) == 1
    assert sample_sum(text, "kvstack_prefix_entries_dropped_total", engine=other) == 0


def test_a_removed_engine_coming_back_is_ignored() -> None:
    metrics = RouterMetrics()
    rejoin = EngineRejoin(EngineRegistry(), PrefixLocator(PrefixIndex()), metrics)
    rejoin.engine_back(EngineState(Endpoint(URL)))
    metrics.flush_hot()
    assert sample_sum(metrics.render().decode(), "kvstack_engine_rejoins_total") == 0
