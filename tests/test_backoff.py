"""The one backoff rule: growth, cap, jitter bounds, reset, bad policies refused."""

from __future__ import annotations

import random

import pytest

from kvstack.backoff import Backoff


def test_delays_double_up_to_the_cap_without_jitter() -> None:
    seq = Backoff(0.05, 0.5).sequence()
    assert [seq.next() for _ in range(6)] == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.5, 0.5])
    seq.reset()
    assert seq.next() == pytest.approx(0.05)


def test_jitter_stays_within_its_bounds_and_varies() -> None:
    policy = Backoff(1.0, 8.0, jitter=(0.5, 1.0))
    rng = random.Random(7)
    draws = [policy.delay(2, rng) for _ in range(200)]
    assert all(2.0 <= d <= 4.0 for d in draws)
    assert len(set(draws)) > 100
    full = Backoff(0.02, 1.0, jitter=(0.0, 1.0))
    assert all(0.0 <= full.delay(10, rng) <= 1.0 for _ in range(200))


def test_huge_attempt_numbers_do_not_overflow() -> None:
    assert Backoff(0.5, 30.0).delay(10_000) == 30.0
    assert Backoff(0.5, 30.0).delay(-3) == 0.5


@pytest.mark.parametrize(
    ("initial", "cap", "jitter"), [(0.0, 1.0, (1.0, 1.0)), (2.0, 1.0, (1.0, 1.0)), (0.1, 1.0, (1.0, 0.5))]
)
def test_bad_policies_are_refused(initial: float, cap: float, jitter: tuple[float, float]) -> None:
    with pytest.raises(ValueError, match="backoff"):
        Backoff(initial, cap, jitter=jitter)
