"""queue-scorer: prefer engines with fewer waiting requests.

Formula: score = (max_q - q) / (max_q - min_q) over the candidates, where q is the engine's waiting-request
count from its latest fresh scrape plus the requests the router sent it since that scrape
(``EngineState.queue_estimate``); 1 for all when every known q is equal; 0 when q is unknown (stale or
not exported), so an engine the router cannot see is ranked with the most loaded.

Parameters: none. Cost: O(candidates).
When to use: the main load signal; a queue means requests are already waiting for a batch slot. It is
relative: the least queued candidate scores 1 however long its queue is (pair it with saturation-filter
or load-aware-scorer for an absolute limit).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from kvstack.engines.state import EngineState
from kvstack.scheduling.interfaces import CycleState, SchedulingRequest, Scorer
from kvstack.scheduling.scorers.relative import lower_is_better


def _queue(engine: EngineState) -> float | None:
    return engine.queue_estimate()


class QueueScorer(Scorer):
    type_name: ClassVar[str] = "queue-scorer"

    def score(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EngineState]
    ) -> dict[str, float]:
        return lower_is_better(candidates, _queue)
