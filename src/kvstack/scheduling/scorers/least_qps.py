"""least-qps-scorer: prefer engines that were sent fewer requests recently.

Formula: qps = (sends in the last ``windowSeconds``) / windowSeconds, counted from
``EngineState.recent_requests`` (monotonic send times, appended in order by the router); then
score = (max_qps - qps) / (max_qps - min_qps) over the candidates, 1 for all when equal.

Parameters:
  windowSeconds (number in (0, 10], default 10)  length of the sliding window; the router keeps 10 s
                                                  of send times per engine, so a longer window would count
                                                  only 10 s

Cost: O(candidates * log(sends kept)): the send times are sorted, so the window start is a bisection.
Counts are capped at the send times the router keeps per engine (``RECENT_SENDS``).
When to use: to balance request rate rather than load when requests are alike and engines are equal
(benchmarks, uniform traffic); unlike queue or KV signals it needs no scrape, but it is blind to request
size and to engine speed.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import ClassVar

from kvstack.engines.state import RECENT_SENDS, EngineState
from kvstack.scheduling.interfaces import CycleState, SchedulingRequest, Scorer
from kvstack.scheduling.params import Param
from kvstack.scheduling.scorers.relative import lower_is_better


class LeastQPSScorer(Scorer):
    type_name: ClassVar[str] = "least-qps-scorer"
    params: ClassVar[tuple[Param, ...]] = (
        Param("windowSeconds", "window_seconds", float, 10.0, "a number in (0, 10]", lambda v: 0 < v <= 10),
    )

    def __init__(self, name: str | None = None, *, window_seconds: float = 10.0) -> None:
        super().__init__(name)
        self.window_seconds = window_seconds

    def qps(self, engine: EngineState, now: float) -> float:
        sent = engine.recent_requests
        count = min(len(sent) - bisect_right(sent, now - self.window_seconds), RECENT_SENDS)
        return count / self.window_seconds

    def score(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EngineState]
    ) -> dict[str, float]:
        now = state.now
        return lower_is_better(candidates, lambda e: self.qps(e, now))
