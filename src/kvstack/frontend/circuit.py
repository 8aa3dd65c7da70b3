"""Per-engine circuit breaker.

CLOSED: requests flow; ``failure_threshold`` consecutive failures (connect errors, timeouts, 5xx the
proxy retries on) open the circuit. OPEN: the engine is not routable for ``open_seconds``. Then
HALF_OPEN: exactly one probe request is let through; its success closes the circuit, its failure
opens it again for twice as long (`kvstack.backoff`, from the current open time; up to
``max_open_seconds``). Client errors (4xx) never count: a bad request says nothing about the
engine. ``force_open`` takes a sibling worker's open time as its own place on that ladder. ``probe_now``
(the engine answers again after it was down: a restart) turns an open circuit half-open at once, back on
the ladder's first rung.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kvstack.backoff import Backoff
from kvstack.engines.state import CircuitState


@dataclass(frozen=True, slots=True)
class CircuitConfig:
    failure_threshold: int = 5
    open_seconds: float = 5.0
    max_open_seconds: float = 60.0


class CircuitBreaker:
    """The breaker of one engine; the proxy reports outcomes, scheduling reads ``state``."""

    def __init__(
        self, config: CircuitConfig | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config or CircuitConfig()
        self._clock = clock
        self._state = CircuitState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._open_for = self.config.open_seconds
        self._probe_in_flight = False
        self.on_open: Callable[[float], None] | None = None  # told the open time when this breaker trips

    @property
    def state(self) -> CircuitState:
        """Current state; an open circuit whose time is up reads as half-open."""
        if self._state is CircuitState.OPEN and self._clock() - self._opened_at >= self._open_for:
            self._state = CircuitState.HALF_OPEN
            self._probe_in_flight = False
        return self._state

    def allow(self) -> bool:
        """May a request be sent now? In half-open state only one probe at a time."""
        state = self.state
        if state is CircuitState.CLOSED:
            return True
        if state is CircuitState.HALF_OPEN and not self._probe_in_flight:
            self._probe_in_flight = True
            return True
        return False

    def record_success(self) -> None:
        self._failures = 0
        self._probe_in_flight = False
        if self._state is not CircuitState.CLOSED:
            self._state = CircuitState.CLOSED

    def record_failure(self) -> None:
        self._failures += 1
        if self.state is CircuitState.HALF_OPEN:
            # The next rung of the ladder from the current open time (a sibling's, after force_open).
            cap = self.config.max_open_seconds
            self._open(Backoff(min(self._open_for, cap), cap).delay(1))
        elif self._state is CircuitState.CLOSED and self._failures >= self.config.failure_threshold:
            self._open(self.config.open_seconds)

    def settle(self, ok: bool | None) -> None:
        """A request's outcome: True success, False failure, None neither (a client error, a client gone)."""
        if ok is True:
            self.record_success()
        elif ok is False:
            self.record_failure()
        else:
            self.release_probe()

    def release_probe(self) -> None:
        """A probe ended without an outcome (for example the client went away): let another through."""
        self._probe_in_flight = False

    def probe_now(self) -> None:
        """The engine answers again after it was down: let one probe through now instead of at the end of
        the open time (which may have grown while it restarted)."""
        if self._state is not CircuitState.CLOSED:
            self._state = CircuitState.HALF_OPEN
            self._probe_in_flight = False
            self._open_for = self.config.open_seconds

    def force_open(self, seconds: float) -> None:
        """Open because another router process's breaker for this engine opened (no hook call)."""
        if self._state is not CircuitState.OPEN:
            self._open(seconds, notify=False)

    def _open(self, seconds: float, *, notify: bool = True) -> None:
        self._state = CircuitState.OPEN
        self._opened_at = self._clock()
        self._open_for = seconds
        self._probe_in_flight = False
        if notify and self.on_open is not None:
            self.on_open(seconds)
