"""approximate-prefix-scorer: prefer engines the router recently sent this prompt's prefix to.

Formula: score = a / P, with P the prompt tokens and a the longest prefix of the prompt (in the router's
history block size) that the router sent to the engine within the history's TTL (``PrefixView.approximate``).
The history is the router's own and bounded per engine (LRU with a TTL): it cannot see evictions inside
the engine, so it guesses; /engines shows such engines with routing knowledge "approximate". Each
engine's ``a`` is left in CycleState (``CACHED_PROMPT_TOKENS``) for pd-profile-handler.

Parameters: none. Cost: O(candidates); the history lookup is done once per request before scheduling.
When to use: engines that publish no KV events (preset ``prefix``); with events, precise-prefix-scorer
knows instead of guessing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from kvstack.engines.state import EngineState
from kvstack.scheduling.interfaces import CycleState, SchedulingRequest, Scorer, record_cached


class ApproximatePrefixScorer(Scorer):
    type_name: ClassVar[str] = "approximate-prefix-scorer"
    needs_prefix: ClassVar[bool] = True

    def score(
        self, request: SchedulingRequest, state: CycleState, candidates: Sequence[EngineState]
    ) -> dict[str, float]:
        view = request.prefix
        if view is None or view.prompt_tokens <= 0:
            return {}
        sent = view.approximate
        cached = {e.url: sent.get(e.url, 0) for e in candidates}
        record_cached(state, cached)
        return {url: tokens / view.prompt_tokens for url, tokens in cached.items()}
