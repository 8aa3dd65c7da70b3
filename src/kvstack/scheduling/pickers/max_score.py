"""max-score-picker: the highest total score wins; ties are broken at random.

Rule: shuffle the candidates, then stable-sort them by total score, highest first. The shuffle makes every
tied candidate equally likely to come first, so equal scores (all metrics stale, or identical engines)
spread traffic instead of always choosing the first engine in the list. The full order is returned, so
retries go to the next best.

Parameters: none. Cost: O(candidates * log candidates) for the ordering.
When to use: the default picker, after scorers that express preference.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import ClassVar

from kvstack.engines.state import EngineState
from kvstack.scheduling.interfaces import CycleState, SchedulingRequest, ScoredEngine
from kvstack.scheduling.pickers.randomized import RandomizedPicker


def order_by_score(scored: Sequence[ScoredEngine], rng: random.Random) -> list[EngineState]:
    """Highest score first, ties in random order."""
    shuffled = list(scored)
    rng.shuffle(shuffled)
    shuffled.sort(key=lambda s: s.score, reverse=True)  # list.sort is stable, even with reverse=True
    return [s.engine for s in shuffled]


class MaxScorePicker(RandomizedPicker):
    type_name: ClassVar[str] = "max-score-picker"

    def pick(
        self, request: SchedulingRequest, state: CycleState, scored: Sequence[ScoredEngine]
    ) -> list[EngineState]:
        return order_by_score(scored, self.rng)
