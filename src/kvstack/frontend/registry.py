"""A front end's table of engines: ``EngineState`` plus the circuit breaker of each, keyed by URL.

Discovery adds and removes entries; admin endpoints drain them; the proxy updates in-flight counts and
breaker outcomes; scheduling reads ``states()``. A removed engine's in-flight requests finish normally.

A drain belongs to the engine URL, not to the entry: whatever comes back at a drained URL after discovery
removed it (a Kubernetes pod flapping NotReady/Ready, a file edit, a new pod given the same IP) is still
drained, and says so in the log. An undrain (``POST /admin/engines/undrain``, accepted while the URL is
absent too) or an admin removal (``DELETE /admin/engines``) ends a drain.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from kvstack.engines.state import RECENT_SENDS, Endpoint, EngineState
from kvstack.frontend.circuit import CircuitBreaker, CircuitConfig

log = logging.getLogger(__name__)

# Send times kept per engine for least-QPS scoring; older ones are dropped, in batches of at least
# RECENT_SLACK once there are more than RECENT_SENDS (a cut moves the list: not on every request).
RECENT_WINDOW_S = 10.0
RECENT_SLACK = RECENT_SENDS // 8


class InFlightTable(Protocol):
    """In-flight counts shared between processes of one front end (the router's worker table)."""

    def slot(self, url: str) -> int: ...

    def set_local(self, slot: int, value: int) -> None: ...

    def others(self, slot: int) -> int: ...


@dataclass
class EngineEntry:
    state: EngineState
    breaker: CircuitBreaker
    added_at: float = field(default_factory=time.monotonic)
    slot: int = 0  # column in the workers' shared in-flight table


class EngineRegistry:
    def __init__(
        self,
        circuit: CircuitConfig | None = None,
        *,
        shared_in_flight: InFlightTable | None = None,
        on_circuit_open: Callable[[str, float], None] | None = None,
    ) -> None:
        """``shared_in_flight``: the worker group's table (several router processes); ``on_circuit_open``
        is told (URL, seconds) when a breaker of this process opens."""
        self._entries: dict[str, EngineEntry] = {}
        self.shared_in_flight = shared_in_flight
        self.on_circuit_open = on_circuit_open
        self._circuit = circuit or CircuitConfig()
        self.default_knowledge = "none"  # EngineState.knowledge of a new engine
        self._drained: set[str] = set()  # URLs an admin drained, present or not
        # Derived per request on the hot path; recomputed only when an engine or its models change.
        self._models: frozenset[str] | None = None
        self._all_known: bool | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, url: object) -> bool:
        return url in self._entries

    def __iter__(self) -> Iterator[EngineEntry]:
        return iter(list(self._entries.values()))

    def get(self, url: str) -> EngineEntry | None:
        return self._entries.get(url)

    def states(self) -> list[EngineState]:
        """Current states with circuit state refreshed (an open breaker turns half-open on its own)."""
        out = []
        shared = self.shared_in_flight
        for entry in self._entries.values():
            state = entry.state
            state.circuit = entry.breaker.state
            if shared is not None:
                state.in_flight_peers = shared.others(entry.slot)
            out.append(state)
        return out

    def publish_in_flight(self, entry: EngineEntry) -> None:
        """Tell the other worker processes this process's in-flight count for the engine."""
        if self.shared_in_flight is not None:
            self.shared_in_flight.set_local(entry.slot, entry.state.in_flight)

    def upsert(self, endpoint: Endpoint) -> EngineEntry:
        """Add an engine, or update what discovery says about it, keeping its runtime state."""
        entry = self._entries.get(endpoint.url)
        if entry is None:
            url = endpoint.url
            breaker = CircuitBreaker(self._circuit)
            if self.on_circuit_open is not None:
                hook = self.on_circuit_open
                breaker.on_open = lambda seconds: hook(url, seconds)
            state = EngineState(endpoint, knowledge=self.default_knowledge, draining=url in self._drained)
            if state.draining:
                log.info("engine %s is back and still drained (POST /admin/engines/undrain to use it)", url)
            entry = EngineEntry(state, breaker)
            if self.shared_in_flight is not None:
                entry.slot = self.shared_in_flight.slot(url)
            self._entries[url] = entry
        else:
            entry.state.endpoint = endpoint
        self._models = self._all_known = None
        return entry

    def remove(self, url: str) -> EngineEntry | None:
        self._models = self._all_known = None
        entry = self._entries.pop(url, None)
        if entry is not None and self.shared_in_flight is not None:
            self.shared_in_flight.set_local(entry.slot, 0)
        return entry

    def set_draining(self, url: str, draining: bool) -> bool:
        """Drain or undrain the engine at ``url``; False when there is none (and no drain to end)."""
        entry = self._entries.get(url)
        if entry is None:
            if draining or url not in self._drained:
                return False
            self._drained.discard(url)
            return True
        entry.state.draining = draining
        if draining:
            self._drained.add(url)
        else:
            self._drained.discard(url)
        return True

    def models(self) -> frozenset[str]:
        """Every model some engine serves."""
        if self._models is None:
            self._models = frozenset(m for e in self._entries.values() for m in e.state.endpoint.models)
        return self._models

    def all_models_known(self) -> bool:
        """True when every engine has told its models (so an unknown model name is a 404)."""
        if self._all_known is None:
            self._all_known = all(e.state.endpoint.models for e in self._entries.values())
        return self._all_known

    @staticmethod
    def note_sent(state: EngineState, now: float) -> None:
        """Record a send time, keeping the last window's (at least the last RECENT_SENDS of them)."""
        recent = state.recent_requests
        recent.append(now)
        if len(recent) > RECENT_SENDS + RECENT_SLACK or now - recent[0] > RECENT_WINDOW_S + 1.0:
            # Times are appended in order, so the expired ones are a prefix.
            cut = max(bisect.bisect_right(recent, now - RECENT_WINDOW_S), len(recent) - RECENT_SENDS)
            del recent[:cut]
