"""Exponential backoff: the one retry-delay rule every kvstack component uses.

`Backoff` is the policy: the delay before retry ``n`` (from 0) is ``min(max_s, initial_s * 2**n)``, times a
factor drawn uniformly from ``jitter`` (``(1.0, 1.0)``: none; ``(0.0, 1.0)``: full jitter; ``(0.5, 1.0)``:
at least half). Jitter keeps many routers or clients from retrying in lockstep after a shared outage.
`BackoffSequence` walks a policy: ``next()`` returns the next delay, ``reset()`` starts again after a success.
Imports nothing of kvstack.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# 2**30 times any sensible initial delay is past every cap; larger exponents only risk float overflow.
_MAX_EXPONENT = 30


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delay before retry n: ``uniform(*jitter) * min(max_s, initial_s * 2**n)``."""

    initial_s: float
    max_s: float
    jitter: tuple[float, float] = (1.0, 1.0)

    def __post_init__(self) -> None:
        lo, hi = self.jitter
        if not (0.0 < self.initial_s <= self.max_s):
            raise ValueError(f"backoff needs 0 < initial_s <= max_s, got {self.initial_s} and {self.max_s}")
        if not (0.0 <= lo <= hi):
            raise ValueError(f"backoff jitter needs 0 <= low <= high, got {self.jitter}")

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """The delay before retry ``attempt`` (0 for the first retry)."""
        base = min(self.max_s, self.initial_s * 2 ** min(max(attempt, 0), _MAX_EXPONENT))
        lo, hi = self.jitter
        if lo == hi == 1.0:
            return base
        return base * (rng or random).uniform(lo, hi)

    def sequence(self, rng: random.Random | None = None) -> BackoffSequence:
        """A fresh walk of this policy."""
        return BackoffSequence(self, rng)


class BackoffSequence:
    """Successive delays of one `Backoff`: ``next()`` after each failure, ``reset()`` after a success."""

    __slots__ = ("attempt", "policy", "rng")

    def __init__(self, policy: Backoff, rng: random.Random | None = None) -> None:
        self.policy = policy
        self.rng = rng
        self.attempt = 0

    def next(self) -> float:
        """The delay to wait now; the one after it is longer, up to the policy's cap."""
        delay = self.policy.delay(self.attempt, self.rng)
        self.attempt += 1
        return delay

    def reset(self) -> None:
        """Start again from the initial delay."""
        self.attempt = 0
