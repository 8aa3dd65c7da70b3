"""weighted-random-picker: choose at random in proportion to the total scores.

Rule: the target is candidate i with probability score_i / sum(scores); fallbacks follow in the same
weighted order (sampling without replacement, by the Efraimidis-Spirakis keys u ** (1 / score_i) sorted
highest first, u uniform in (0, 1)). Candidates scoring 0 come last in random order; when every score is
0 the order is uniform.

Parameters: none. Cost: O(candidates * log candidates).
When to use: to follow the scores while still sending some traffic to lower-scored engines, which keeps
their metrics and caches warm and avoids herding when scores are stale.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from kvstack.engines.state import EngineState
from kvstack.scheduling.interfaces import CycleState, SchedulingRequest, ScoredEngine
from kvstack.scheduling.pickers.randomized import RandomizedPicker


class WeightedRandomPicker(RandomizedPicker):
    type_name: ClassVar[str] = "weighted-random-picker"

    def pick(
        self, request: SchedulingRequest, state: CycleState, scored: Sequence[ScoredEngine]
    ) -> list[EngineState]:
        rng = self.rng
        keyed = []
        for s in scored:
            # Zero scores get keys in [-1, 0): below every positive key, in random order among themselves.
            u = 1.0 - rng.random()  # (0, 1]: avoids 0 ** x
            keyed.append((u ** (1.0 / s.score) if s.score > 0 else -u, s.engine))
        keyed.sort(key=lambda k: k[0], reverse=True)
        return [engine for _, engine in keyed]
