"""load-aware-scorer: an absolute queue score that halves the range so it never outweighs affinity.

Formula: score = 0.5 when q = 0, else 0.5 * (1 - min(q, limit) / limit); q is the waiting-request count
from the latest fresh scrape; 0 when unknown (stale or not exported). An idle engine scores 0.5, an engine
with ``limit`` or more waiting scores 0.

Parameters:
  limit (integer >= 1, default 128)  the queue length that scores 0

Cost: O(candidates).
When to use: next to an affinity scorer (session, prefix cache) to pull traffic away from an engine in
proportion to how far its queue has grown, without the all-or-nothing jumps of the relative queue-scorer
(one waiting request there swings the score from 1 to 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from kvstack.engines.state import EngineState
from kvstack.scheduling.interfaces import CycleState, SchedulingRequest, Scorer
from kvstack.scheduling.params import Param


class LoadAwareScorer(Scorer):
    type_name: ClassVar[str] = "load-aware-scorer"
    params: ClassVar[tuple[Param, ...]] = (
        Param("limit", "limit", int, 128, "an integer >= 1", lambda v: v >= 1),
    )

    def __init__(self, name: str | None = None, *, limit: int = 128) -> None:
        super().__init__(name)
        self.limit = limit

    def score(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EngineState]
    ) -> dict[str, float]:
        out: dict[str, float] = {}
        for engine in candidates:
            q = engine.queue_estimate()
            if q is None:
                out[engine.url] = 0.0
            elif q <= 0:
                out[engine.url] = 0.5
            else:
                out[engine.url] = 0.5 * (1.0 - min(q, self.limit) / self.limit)
        return out
