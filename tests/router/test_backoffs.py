"""The router's retry delays, all from kvstack.backoff: circuit re-opens, proxy and /v1/models retries."""

from __future__ import annotations

import itertools
import random

from kvstack.engines.state import CircuitState
from kvstack.frontend.circuit import CircuitBreaker, CircuitConfig
from kvstack.frontend.fleet import _models_retry
from kvstack.router.proxy import RetryPolicy


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def breaker(open_seconds: float, max_open_seconds: float) -> tuple[CircuitBreaker, Clock, list[float]]:
    clock = Clock()
    b = CircuitBreaker(CircuitConfig(2, open_seconds, max_open_seconds), clock)
    opened: list[float] = []
    b.on_open = opened.append
    return b, clock, opened


def fail_probes(b: CircuitBreaker, clock: Clock, opened: list[float], probes: int) -> None:
    """Let ``probes`` half-open probes through, each as soon as the circuit allows, and fail them."""
    for _ in range(probes):
        clock.now += opened[-1] - 0.01
        assert b.state is CircuitState.OPEN and not b.allow()
        clock.now += 0.01
        assert b.allow() and not b.allow()  # one probe at a time
        b.record_failure()


def test_failed_probes_double_the_open_time_up_to_the_cap_and_a_success_starts_over() -> None:
    b, clock, opened = breaker(5.0, 60.0)
    b.record_failure()
    b.record_failure()
    fail_probes(b, clock, opened, 5)
    assert opened == [5.0, 10.0, 20.0, 40.0, 60.0, 60.0]
    clock.now += 60.0
    assert b.allow()
    b.record_success()
    assert b.state is CircuitState.CLOSED
    b.record_failure()
    b.record_failure()
    fail_probes(b, clock, opened, 1)
    assert opened[6:] == [5.0, 10.0]


def test_a_first_open_above_the_cap_is_kept_and_reopens_are_at_the_cap() -> None:
    b, clock, opened = breaker(100.0, 60.0)
    b.record_failure()
    b.record_failure()
    fail_probes(b, clock, opened, 2)
    assert opened == [100.0, 60.0, 60.0]


def test_a_breaker_opened_by_a_sibling_goes_on_from_the_siblings_open_time() -> None:
    b, clock, opened = breaker(5.0, 60.0)
    b.force_open(20.0)
    assert opened == []  # a sibling's open is not told to the siblings again
    opened.append(20.0)
    fail_probes(b, clock, opened, 2)
    assert opened == [20.0, 40.0, 60.0]
    above, clock, opened = breaker(100.0, 60.0)
    above.force_open(100.0)
    opened.append(100.0)
    fail_probes(above, clock, opened, 1)
    assert opened == [100.0, 60.0]


def test_proxy_retries_wait_a_full_jitter_delay() -> None:
    policy = RetryPolicy(backoff_base=0.02, backoff_max=1.0)
    ours, reference = random.Random(7), random.Random(7)
    for attempt in range(10):
        expected = reference.uniform(0, min(1.0, 0.02 * 2**attempt))
        assert policy.backoff.delay(attempt, ours) == expected


def test_models_are_asked_again_quickly_until_an_engine_answers() -> None:
    first = _models_retry(0.2)
    assert [first.next() for _ in range(7)] == [0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0]
    # After an answer (every 30 s), an engine that lost its models is asked again every 5 s.
    after = _models_retry(30.0)
    assert list(itertools.islice(iter(after.next, None), 3)) == [5.0, 5.0, 5.0]
