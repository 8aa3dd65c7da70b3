"""running-requests-scorer: prefer engines with fewer running requests.

Formula: score = (max_r - r) / (max_r - min_r) over the candidates, where r is the engine's running-request
count from its latest fresh scrape; 1 for all when every known r is equal; 0 when r is unknown (stale or
not exported).

Parameters: none. Cost: O(candidates).
When to use: when batch size drives latency (inter-token latency grows with the running batch) and queues
are usually empty, so queue-scorer cannot tell engines apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from kvstack.engines.state import EngineState
from kvstack.scheduling.interfaces import CycleState, SchedulingRequest, Scorer
from kvstack.scheduling.scorers.relative import lower_is_better


def _running(engine: EngineState) -> float | None:
    signals = engine.signals()
    return None if signals is None else signals.running


class RunningRequestsScorer(Scorer):
    type_name: ClassVar[str] = "running-requests-scorer"

    def score(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EngineState]
    ) -> dict[str, float]:
        return lower_is_better(candidates, _running)
