"""no-hit-lru-scorer: spread cold prompts over the engines least recently sent a request.

Formula: when no candidate holds any of the prompt's prefix (``PrefixView`` has no hit, or the prompt is
unknown), candidates are ranked by their last send time (``EngineState.recent_requests``; never = oldest):
score = (candidates sent to more recently) / (n - 1), so the least recently used scores 1, the most recent
0, and engines never sent to tie at the top (1 for a single candidate). When some candidate holds part
of the prompt, every candidate scores 0 and the prefix and load scorers decide.

Parameters: none. Cost: O(candidates log candidates).
When to use: next to a prefix scorer. Without it, a cold prompt scores equal everywhere on prefix and
the tie goes to whatever load looks lowest on a stale scrape; serial traffic with unrelated prompts (one
request at a time, so queues stay equal) would all land on one engine and its cache would churn while
the others sit empty. Spreading misses round the fleet fills every engine's cache.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import ClassVar

from kvstack.engines.state import EngineState
from kvstack.scheduling.interfaces import CycleState, SchedulingRequest, Scorer


def _last_sent(engine: EngineState) -> float:
    recent = engine.recent_requests
    return recent[-1] if recent else float("-inf")


class NoHitLRUScorer(Scorer):
    type_name: ClassVar[str] = "no-hit-lru-scorer"
    needs_prefix: ClassVar[bool] = True

    def score(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EngineState]
    ) -> dict[str, float]:
        view = request.prefix
        if view is not None and view.any_hit():
            return {}
        if len(candidates) == 1:
            return {candidates[0].url: 1.0}
        times = sorted(_last_sent(e) for e in candidates)
        top = len(times) - 1
        # Engines sent to after this one's last send: n - (those at or before it).
        return {e.url: (top - bisect_right(times, _last_sent(e)) + 1) / top for e in candidates}
