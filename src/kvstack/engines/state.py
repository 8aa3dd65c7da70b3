"""What the router knows about each engine: the shared state types read by scheduling and written by
discovery, the metrics scraper and the proxy. Plain data; no I/O.

Unknown is never zero: a load signal the engine did not export, or exported too long ago, is ``None``,
and scorers treat ``None`` as saturated rather than idle.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class EngineRole(enum.Enum):
    """Disaggregation role; ``BOTH`` serves whole requests."""

    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"


class CircuitState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


# Send times an engine's recent_requests keeps (at least) once it was sent more in its window.
RECENT_SENDS = 4096


@dataclass(frozen=True, slots=True)
class Endpoint:
    """An engine as discovery found it."""

    url: str  # base URL, e.g. "http://10.0.0.5:8000", no trailing slash
    engine_type: str = "vllm"  # catalog key: vllm, sglang, trtllm, triton
    role: EngineRole = EngineRole.BOTH
    models: frozenset[str] = frozenset()  # empty until /v1/models answered (or given by config)
    labels: tuple[tuple[str, str], ...] = ()  # discovery labels (pod labels, static config), sorted
    node: str | None = None  # host/node name, for cache-tier locality
    kv_events_endpoint: str | None = None  # ZMQ endpoint of its KV events, when known
    engine_version: str | None = None  # selects the metric catalog for that version; None = the newest


@dataclass(slots=True)
class LoadSignals:
    """Load readings from one scrape, already mapped through the engine's catalog. None = not exported."""

    queue: float | None = None  # requests waiting
    running: float | None = None  # requests running
    kv_usage: float | None = None  # 0..1
    prefix_cache_queries: float | None = None  # counter, tokens
    prefix_cache_hits: float | None = None  # counter, tokens
    block_size: int | None = None
    num_blocks: int | None = None


@dataclass(slots=True)
class MetricsReading:
    """The latest scrape of an engine's /metrics."""

    signals: LoadSignals
    scraped_at: float  # time.monotonic() of the scrape
    missing: frozenset[str] = frozenset()  # catalog names the engine did not export
    aliases_used: tuple[tuple[str, str], ...] = ()  # (expected name, legacy name found instead)

    def age(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self.scraped_at


@dataclass(slots=True)
class EngineState:
    """Everything the router tracks about one engine; scheduling reads it, never writes it."""

    endpoint: Endpoint
    metrics: MetricsReading | None = None
    metrics_stale: bool = True  # no scrape yet, or the last good one is older than the staleness limit
    healthy: bool = True  # last health check / scrape reached the engine
    draining: bool = False  # admin asked to stop sending new requests
    circuit: CircuitState = CircuitState.CLOSED
    in_flight: int = 0  # requests this router process has sent and not finished
    in_flight_peers: int = 0  # the same, summed over the other worker processes of the router
    in_flight_at_scrape: int = 0  # ``total_in_flight`` when the latest good scrape arrived
    # Monotonic send times, in order; the owner keeps at least the last RECENT_SENDS of them (and at most
    # RECENT_SENDS + RECENT_SENDS // 8: dropped in batches).
    recent_requests: list[float] = field(default_factory=list)
    knowledge: str = "none"  # where routing knowledge comes from: "kv-events", "approximate", "none"

    @property
    def url(self) -> str:
        return self.endpoint.url

    @property
    def total_in_flight(self) -> int:
        """Requests the whole router (every worker process) has sent to the engine and not finished."""
        return self.in_flight + self.in_flight_peers

    def signals(self) -> LoadSignals | None:
        """Fresh load signals, or None when unknown (no scrape, or stale)."""
        if self.metrics is None or self.metrics_stale:
            return None
        return self.metrics.signals

    def queue_estimate(self) -> float | None:
        """Waiting requests as last scraped plus those the router sent since, which the scrape cannot show.

        Without the correction every request of a burst would see the same scrape and pick the same engine.
        """
        signals = self.signals()
        if signals is None or signals.queue is None:
            return None
        return signals.queue + max(0, self.total_in_flight - self.in_flight_at_scrape)

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining and self.circuit is not CircuitState.OPEN
