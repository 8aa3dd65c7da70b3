"""saturation-filter: drop saturated engines, unless every candidate is saturated (fails open).

Rule: an engine is saturated when ``queue > queueThreshold`` or ``kv_usage > kvUsageThreshold``, or when
it cannot be told: metrics stale or never scraped, or queue or KV usage not exported. Unknown load is
never treated as idle. When every candidate is saturated the input is returned unchanged: refusing
all traffic on stale metrics would turn a scrape hiccup into an outage, and the scorers still rank the
candidates.

Parameters:
  queueThreshold   (number >= 0, default 5)      waiting requests above which an engine is saturated
  kvUsageThreshold (number in [0, 1], default 0.8) KV-cache usage above which an engine is saturated

Cost: O(candidates).
When to use: in front of load scorers, to stop sending to engines that are visibly falling behind
(queueing or about to preempt) while others have room; with session affinity, to let sessions spill
off a saturated engine to the next one on the ring.
"""

from __future__ import annotations

from typing import ClassVar

from kvstack.engines.state import EngineState
from kvstack.scheduling.interfaces import CycleState, Filter, SchedulingRequest
from kvstack.scheduling.params import Param


class SaturationFilter(Filter):
    type_name: ClassVar[str] = "saturation-filter"
    params: ClassVar[tuple[Param, ...]] = (
        Param("queueThreshold", "queue_threshold", float, 5.0, "a number >= 0", lambda v: v >= 0),
        Param(
            "kvUsageThreshold", "kv_usage_threshold", float, 0.8, "a number in [0, 1]", lambda v: 0 <= v <= 1
        ),
    )

    def __init__(
        self, name: str | None = None, *, queue_threshold: float = 5.0, kv_usage_threshold: float = 0.8
    ) -> None:
        super().__init__(name)
        self.queue_threshold = queue_threshold
        self.kv_usage_threshold = kv_usage_threshold

    def saturated(self, engine: EngineState) -> bool:
        signals = engine.signals()
        queue = engine.queue_estimate()
        if signals is None or queue is None or signals.kv_usage is None:
            return True
        return queue > self.queue_threshold or signals.kv_usage > self.kv_usage_threshold

    def filter(
        self, request: SchedulingRequest, state: CycleState, candidates: list[EngineState]
    ) -> list[EngineState]:
        room = []
        for e in candidates:  # (a loop, not a comprehension: that is a function object made per request)
            if not self.saturated(e):
                room.append(e)
        return room or candidates
