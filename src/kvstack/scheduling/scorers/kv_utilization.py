"""kv-cache-utilization-scorer: prefer engines with free KV-cache blocks.

Formula: score = 1 - kv_usage (usage in [0, 1] from the latest fresh scrape, clamped); 0 when unknown
(stale or not exported), the same as a full cache.

Parameters: none. Cost: O(candidates).
When to use: with long prompts or long generations, where a nearly full KV cache means the next admitted
request preempts a running one; it is absolute, unlike queue-scorer, so it also keeps ranking engines
whose queues are all empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from kvstack.engines.state import EngineState
from kvstack.scheduling.interfaces import CycleState, SchedulingRequest, Scorer


class KVCacheUtilizationScorer(Scorer):
    type_name: ClassVar[str] = "kv-cache-utilization-scorer"

    def score(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EngineState]
    ) -> dict[str, float]:
        out: dict[str, float] = {}
        for engine in candidates:
            signals = engine.signals()
            usage = None if signals is None else signals.kv_usage
            out[engine.url] = 0.0 if usage is None else 1.0 - min(1.0, max(0.0, usage))
        return out
