"""active-requests-scorer: prefer engines with fewer requests in flight from this router.

Formula: score = (max_a - a) / (max_a - min_a) over the candidates, a = ``EngineState.total_in_flight``
(requests the router, all its worker processes, sent and has not finished); 1 for all when equal. Always
known: the router counts it itself.

Parameters: none. Cost: O(candidates).
When to use: in every load-based profile. It is the only load signal that changes between two decisions:
scraped metrics are up to a scrape interval old, so a burst scored on them alone sees the same numbers
for every request. Because in_flight rises with each request sent, tied metric scores spread across
engines instead of piling onto one. It does not see other routers' traffic; the scraped signals do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from kvstack.engines.state import EngineState
from kvstack.scheduling.interfaces import CycleState, SchedulingRequest, Scorer
from kvstack.scheduling.scorers.relative import lower_is_better


def _in_flight(engine: EngineState) -> float:
    return engine.total_in_flight


class ActiveRequestsScorer(Scorer):
    type_name: ClassVar[str] = "active-requests-scorer"

    def score(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EngineState]
    ) -> dict[str, float]:
        return lower_is_better(candidates, _in_flight)
